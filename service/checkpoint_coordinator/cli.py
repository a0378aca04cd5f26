"""The coordinator's commands: serve it, migrate a database, import a ledger.

The console script ``ckpt-coordinator`` is ``ckpt_launcher``, outside this package: it hands the
tools that are not the service (the demo, gymsim) to :func:`main` as :class:`Delegated`
commands, so they are listed and dispatched here without the service importing them.
"""

from __future__ import annotations

import argparse
import logging
import os
import secrets
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

from pydantic import SecretStr

from .config import ADMIN_TOKEN_FILE, MIN_ADMIN_TOKEN_CHARS, Settings

log = logging.getLogger("checkpoint_coordinator")


@dataclass(frozen=True)
class Delegated:
    """A command that owns its arguments: everything after its name goes to ``run`` untouched."""

    help: str
    run: Callable[[list[str]], int | None]
    description: str | None = None


def _import_ledger(argv: list[str]) -> int:
    from .restore.import_cli import main

    return main(argv)


# The service's own delegated command; the launcher adds the others.
OWN_COMMANDS: dict[str, Delegated] = {
    "import-ledger": Delegated("import a NeMo RL rollout-recovery ledger into a run", _import_ledger),
}


def _parser(commands: Mapping[str, Delegated]) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="ckpt-coordinator",
        description="Checkpoint coordinator: crash recovery for long multi-turn RL rollouts "
        "(Postgres recovery ledger + NeMo Gym checkpoint control).",
        epilog="Settings come from CKPTC_* environment variables; see docs/configuration.md#settings.",
    )
    sub = p.add_subparsers(dest="command", metavar="COMMAND", required=True)

    s = sub.add_parser(
        "serve", help="run the HTTP service", description="Run the coordinator's HTTP API. Without CKPTC_DATABASE_URL an embedded PostgreSQL "
        "is started in the data directory, migrated to head, and stopped again on exit.",
    )
    s.add_argument("--host", help="listen address (CKPTC_HOST, default 127.0.0.1)")
    s.add_argument("--port", type=int, help="listen port (CKPTC_PORT, default 8080)")
    s.add_argument("--data-dir", type=Path, help="embedded PostgreSQL data directory parent (CKPTC_DATA_DIR)")
    s.add_argument("--no-migrate", action="store_true", help="do not upgrade the database to head before serving")

    t = sub.add_parser(
        "admin-token",
        help="print the admin token serve made for the embedded database",
        description="Print the admin token `serve` generated in the data directory (with the embedded database and "
        "CKPTC_ADMIN_TOKEN unset), e.g. CKPTC_ADMIN_TOKEN=$(ckpt-coordinator admin-token).",
    )
    t.add_argument("--data-dir", type=Path, help="the data directory (CKPTC_DATA_DIR)")

    m = sub.add_parser(
        "migrate", help="upgrade (or downgrade) a database schema", description="Apply the ledger migrations to CKPTC_DATABASE_URL (or --database-url); without either, "
        "to the embedded database in the data directory.",
    )
    m.add_argument("--database-url", help="PostgreSQL URL; overrides CKPTC_DATABASE_URL")
    m.add_argument("--data-dir", type=Path, help="embedded PostgreSQL data directory parent (CKPTC_DATA_DIR)")
    m.add_argument("--revision", default="head", help="target revision (default: head)")
    m.add_argument("--downgrade", action="store_true", help="downgrade to --revision instead of upgrading")
    m.add_argument("--lock-timeout", type=float, default=None, metavar="SECONDS",
                   help="how long one schema change waits for a table lock before the run is rolled back and tried again (default 10)")
    m.add_argument("--lock-wait", type=float, default=None, metavar="SECONDS",
                   help="how long to wait for another migration to finish (default 300)")
    m.add_argument("--attempts", type=int, default=5, metavar="N",
                   help="runs before giving up when table locks stay taken (default 5)")

    for name, cmd in commands.items():
        e = sub.add_parser(name, help=cmd.help, add_help=False, description=cmd.description or cmd.help)
        e.add_argument("args", nargs=argparse.REMAINDER)
    return p


def _configure_logging(settings: Settings) -> None:
    from .observability.logging import configure_logging

    configure_logging(format=settings.log_format, level=settings.log_level)


def resolve_database(settings: Settings, data_dir: Path | None = None):  # type: ignore[no-untyped-def]
    """Return (url, embedded handle or None)."""
    url = settings.database_url_value()
    if url:
        return url, None
    from .ledger.db import start_embedded

    target = data_dir or settings.data_dir
    log.info("starting embedded PostgreSQL in %s", target / "pgdata")
    emb = start_embedded(target, settings=settings.embedded_pg_settings_dict())
    return emb.url, emb


def admin_token_file(settings: Settings, data_dir: Path | None = None) -> Path:
    return (data_dir or settings.data_dir) / ADMIN_TOKEN_FILE


def local_admin_token(settings: Settings, data_dir: Path | None = None) -> str:
    """The admin token of a coordinator on the embedded database when none is configured: made
    once (mode 0600) in the data directory and kept there, so a restart keeps it and
    ``ckpt-coordinator admin-token`` can print it for the tools beside it."""
    path = admin_token_file(settings, data_dir)
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        token = path.read_text().strip()
        if len(token) < MIN_ADMIN_TOKEN_CHARS:
            raise ValueError(f"{path} holds no admin token of {MIN_ADMIN_TOKEN_CHARS} characters or more; delete it to get a new one")
        return token
    token = secrets.token_hex(32)
    with os.fdopen(fd, "w") as f:
        f.write(token + "\n")
    return token


def cmd_admin_token(args: argparse.Namespace, settings: Settings) -> int:
    path = admin_token_file(settings, args.data_dir)
    if not path.exists():
        print(f"ckpt-coordinator: no admin token in {path}: `ckpt-coordinator serve` makes one on its first start "
              "(with the embedded database and CKPTC_ADMIN_TOKEN unset)", file=sys.stderr)
        return 1
    print(path.read_text().strip())
    return 0


def cmd_serve(args: argparse.Namespace, settings: Settings) -> int:
    import signal

    from .app import create_app
    from .ledger.db import migrate
    from .background import begin_drain
    from .server import CoordinatorServer, server_config

    # uvicorn re-raises SIGTERM/SIGINT after its graceful shutdown; with the default SIGTERM
    # action that would end the process before the embedded PostgreSQL is stopped below.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    if args.port is not None:
        settings = settings.model_copy(update={"port": args.port})  # its own port is no Gym's (gym.egress)
    if settings.admin_token is None and not settings.database_url_value():
        try:
            token = local_admin_token(settings, args.data_dir)
        except ValueError as e:
            print(f"ckpt-coordinator: {e}", file=sys.stderr)
            return 2
        settings = settings.model_copy(update={"admin_token": SecretStr(token)})
        log.info("admin token in %s (`ckpt-coordinator admin-token` prints it)", admin_token_file(settings, args.data_dir))
    url, emb = resolve_database(settings, args.data_dir)
    try:
        if not args.no_migrate:
            migrate(url)
        # The app reads the schema at its start and logs what it found (not ready when it is not
        # one this release runs on): serve --no-migrate migrates nothing.
        app = create_app(settings, database_url=url)
        config = server_config(app, settings, host=args.host or settings.host, port=settings.port)
        CoordinatorServer(config, on_exit=lambda: begin_drain(app)).run()
    except (KeyboardInterrupt, SystemExit):
        pass
    finally:
        if emb is not None:
            log.info("stopping embedded PostgreSQL")
            emb.stop()
    return 0


def _lock_timed_out(error: BaseException) -> bool:
    """A DDL statement waited for a table lock past the lock timeout (worth another run)."""
    import psycopg

    from .ledger.db import error_chain

    return any(isinstance(e, psycopg.errors.LockNotAvailable) for e in error_chain(error))


def cmd_migrate(args: argparse.Namespace, settings: Settings) -> int:
    import time

    from .ledger.db import classify_database_error, downgrade, migrate, redact_url
    from .ledger.schema import MigrationLockBusy, SchemaState, read_status_sync

    if args.database_url is not None and not args.database_url.strip():
        print("ckpt-coordinator: --database-url is empty: give a postgresql:// URL, or leave the option out", file=sys.stderr)
        return 2
    url, emb = (args.database_url, None) if args.database_url else resolve_database(settings, args.data_dir)
    try:
        try:
            before = read_status_sync(url)
        except Exception as e:
            verdict = classify_database_error(e)
            if verdict is None or verdict[0] != "unavailable":
                raise
            print(f"ckpt-coordinator: database {redact_url(url)}: {verdict[1]}; nothing was changed", file=sys.stderr)
            return 1
        if before.state in (SchemaState.ahead, SchemaState.incompatible):
            # A newer release migrated it: this release has no script of that revision. Applying
            # this release's Job again (a rollback of the Deployment) must not fail when the newer
            # schema runs this release.
            if before.state is SchemaState.ahead and not args.downgrade:
                print(f"database {redact_url(url)}: {before.message()}; nothing to do")
                return 0
            print(f"ckpt-coordinator: database {redact_url(url)}: {before.message()}; this release cannot "
                  f"{'downgrade' if args.downgrade else 'migrate'} it: use the newer release's image", file=sys.stderr)
            return 1
        for attempt in range(1, max(1, args.attempts) + 1):
            try:
                (downgrade if args.downgrade else migrate)(url, args.revision, lock_timeout_s=args.lock_timeout, lock_wait_s=args.lock_wait)
                break
            except MigrationLockBusy as e:
                print(f"ckpt-coordinator: migration of {redact_url(url)}: {e}. Let the other one finish, then run again.", file=sys.stderr)
                return 1
            except Exception as e:
                if not _lock_timed_out(e):
                    verdict = classify_database_error(e)
                    if verdict is not None and verdict[0] == "unavailable":
                        print(f"ckpt-coordinator: database {redact_url(url)}: {verdict[1]}; nothing was changed", file=sys.stderr)
                        return 1
                    raise
                if attempt >= max(1, args.attempts):
                    print(f"ckpt-coordinator: migration of {redact_url(url)} rolled back {attempt} times: {_LOCK_TIMEOUT}; "
                          "nothing was changed. Find the long transaction (pg_stat_activity) or run again later.", file=sys.stderr)
                    return 1
                log.warning("migration rolled back (%s); trying again (%d of %d)", _LOCK_TIMEOUT, attempt + 1, args.attempts)
                time.sleep(min(30.0, 2.0 * attempt))
        after = read_status_sync(url)
        print(f"database {redact_url(url)}: revision {before.revision or 'none'} -> {after.revision} ({after.message()})")
    finally:
        if emb is not None:
            emb.stop()
    return 0


_LOCK_TIMEOUT = "a schema change waited for a table lock longer than its lock timeout (a long transaction holds the table)"


def _config_problems(error: Exception) -> str:
    """Which variables are wrong and why, never their values (a token or URL would be printed)."""
    errors = getattr(error, "errors", None)
    if not callable(errors):
        return type(error).__name__
    lines = []
    for item in errors():
        name = "CKPTC_" + "_".join(str(p) for p in item.get("loc", ())).upper()
        lines.append(f"{name}: {str(item.get('msg', '')).removeprefix('Value error, ')}")
    return "; ".join(lines) or type(error).__name__


def main(argv: list[str] | None = None, *, commands: Mapping[str, Delegated] | None = None) -> int:
    """Run one command; ``commands`` adds delegated commands (the launcher's tools) to the service's own."""
    argv = list(sys.argv[1:] if argv is None else argv)
    delegated = {**OWN_COMMANDS, **(commands or {})}
    # Commands that own their arguments get them untouched: argparse's REMAINDER would drop an
    # option such as --steps or --help that comes first.
    if argv and argv[0] in delegated:
        return int(delegated[argv[0]].run(argv[1:]) or 0)
    parser = _parser(delegated)
    args = parser.parse_args(argv)
    try:
        settings = Settings()
    except Exception as e:  # pydantic ValidationError: say which variable, never a traceback
        print(f"ckpt-coordinator: invalid configuration: {_config_problems(e)}", file=sys.stderr)
        return 2
    _configure_logging(settings)
    from .ledger.db import EmbeddedStartError

    try:
        if args.command == "serve":
            return cmd_serve(args, settings)
        if args.command == "migrate":
            return cmd_migrate(args, settings)
        if args.command == "admin-token":
            return cmd_admin_token(args, settings)
    except EmbeddedStartError as e:
        print(f"ckpt-coordinator: {e}", file=sys.stderr)
        return 1
    parser.error(f"unknown command {args.command}")
    return 2


if __name__ == "__main__":
    raise SystemExit(main())
