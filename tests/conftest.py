"""Shared fixtures: a real PostgreSQL for every test that needs one.

Embedded by default (one server per test session, in a temporary directory), or the server named
by CKPTC_TEST_DATABASE_URL. Each test gets its own database cloned from a migrated template, so
tests are isolated even though the app under test opens its own connections.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
from sqlalchemy import create_engine, text
from sqlalchemy.engine import make_url

from checkpoint_coordinator.ledger.db import ensure_runtime_dir  # noqa: E402

from .ci_policy import pytest_runtest_makereport  # noqa: F401 - a hook: missing tools fail in CI

ensure_runtime_dir()

ADMIN_TOKEN = "test-admin-token-0123456789abcdef0123456789"


def _with_db(url: str, name: str) -> str:
    return make_url(url).set(database=name).render_as_string(hide_password=False)


@pytest.fixture(scope="session")
def pg_server_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """URL of a maintenance database on a PostgreSQL server this session may create databases on."""
    external = os.environ.get("CKPTC_TEST_DATABASE_URL")
    if external:
        yield external
        return
    from checkpoint_coordinator.ledger.db import start_embedded

    base = Path(os.environ.get("CKPTC_TEST_PGDATA_PARENT", "/tmp")) / f"ckptc-test-pg-{os.getpid()}-{uuid.uuid4().hex[:6]}"
    emb = start_embedded(base, database="postgres")
    try:
        yield emb.url
    finally:
        emb.stop()
        import shutil

        shutil.rmtree(base, ignore_errors=True)


@pytest.fixture(scope="session")
def template_db(pg_server_url: str) -> str:
    from checkpoint_coordinator.ledger.db import ensure_database, migrate, sqlalchemy_url

    name = f"ckptc_tmpl_{os.getpid()}_{uuid.uuid4().hex[:6]}"
    ensure_database(pg_server_url, name)
    migrate(_with_db(pg_server_url, name))
    # No connection may stay open on a template database, or CREATE DATABASE ... TEMPLATE fails.
    eng = create_engine(sqlalchemy_url(pg_server_url), isolation_level="AUTOCOMMIT")
    with eng.connect() as c:
        c.execute(text("SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE datname = :d AND pid <> pg_backend_pid()"), {"d": name})
    eng.dispose()
    return name


def _new_database(pg_server_url: str, template: str | None) -> str:
    from checkpoint_coordinator.ledger.db import ensure_database

    name = f"ckptc_t_{uuid.uuid4().hex[:12]}"
    ensure_database(pg_server_url, name, template=template)
    return name


def _drop_database(pg_server_url: str, name: str) -> None:
    from checkpoint_coordinator.ledger.db import sqlalchemy_url

    eng = create_engine(sqlalchemy_url(pg_server_url), isolation_level="AUTOCOMMIT")
    with eng.connect() as c:
        c.execute(text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
    eng.dispose()


@pytest.fixture
def database_url(pg_server_url: str, template_db: str) -> Iterator[str]:
    """A fresh database at migration head, dropped after the test."""
    name = _new_database(pg_server_url, template_db)
    try:
        yield _with_db(pg_server_url, name)
    finally:
        _drop_database(pg_server_url, name)


@pytest.fixture
def empty_database_url(pg_server_url: str) -> Iterator[str]:
    """A fresh database with no schema at all."""
    name = _new_database(pg_server_url, None)
    try:
        yield _with_db(pg_server_url, name)
    finally:
        _drop_database(pg_server_url, name)


@pytest.fixture
def settings(tmp_path: Path):  # type: ignore[no-untyped-def]
    from checkpoint_coordinator.config import Settings

    return Settings(
        admin_token=ADMIN_TOKEN,
        data_dir=tmp_path / "data",
        coordinator_id=f"test-{uuid.uuid4().hex[:8]}",
        outbox_poll_s=0.05,
        _env_file=None,
    )


@pytest.fixture
async def app(settings, database_url: str) -> AsyncIterator[object]:  # type: ignore[no-untyped-def]
    from checkpoint_coordinator.app import create_app

    application = create_app(settings, database_url=database_url)
    async with application.router.lifespan_context(application):
        yield application


@pytest.fixture
async def client(app) -> AsyncIterator[object]:  # type: ignore[no-untyped-def]
    import httpx

    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://coordinator") as c:
        yield c


@pytest.fixture(autouse=True)
def _remove_checkpoint_roots() -> Iterator[None]:
    """The checkpoint roots a test's runs were given go with the test (autouse: torn down after
    the app that wrote into them)."""
    yield
    from .integration.ledger_helpers import remove_checkpoint_roots

    remove_checkpoint_roots()


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The image tests first, the order otherwise kept. Under ``-n 3 --dist worksteal`` the first
    worker takes the first third of the collection and others steal only from the end of a
    queue: the three image tests run together at its start (their session fixture builds the
    image once), and the longest work does not start last."""
    items.sort(key=lambda item: 0 if item.get_closest_marker("image") else 1)


# Lines a test adds to the terminal summary (the image test's build report). They travel as
# user properties of its reports, so that they reach the summary also from an xdist worker.
_SUMMARY_PROPERTY = "ckptc_summary_line"
_summary: dict[str, list[str]] = {}


def summary_line(item: pytest.Item, section: str, line: str) -> None:
    item.user_properties.append((_SUMMARY_PROPERTY, (section, line)))


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    if report.when != "teardown":
        return  # every phase's report carries the properties added so far: take them once
    for name, value in report.user_properties:
        if name == _SUMMARY_PROPERTY:
            section, line = value
            _summary.setdefault(section, []).append(line)


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    for section, lines in _summary.items():
        terminalreporter.write_sep("-", section)
        for line in lines:
            terminalreporter.write_line(line)


def admin_headers() -> dict[str, str]:
    return {"Authorization": f"Bearer {ADMIN_TOKEN}"}


@pytest.fixture
def admin() -> dict[str, str]:
    return admin_headers()


# --- gymsim harness (participant conformance and gymsim's own tests) ----------------------------


@pytest.fixture(scope="session")
def instance_cache():  # type: ignore[no-untyped-def]
    from gymsim.conformance import InstanceCache

    cache = InstanceCache()
    yield cache
    cache.close()


@pytest.fixture
async def start(instance_cache):  # type: ignore[no-untyped-def]
    """Factory: `await start(**config_overrides)` or `await start(config=dict)` gives a Harness.

    Instances are reused across tests (reset between them), so a test never sees another's state."""
    from gymsim.conformance import HarnessPool

    pool = HarnessPool(instance_cache)
    yield pool.start
    await pool.close()


@pytest.fixture
def ckdir(tmp_path: Path):  # type: ignore[no-untyped-def]
    from gymsim.conformance import checkpoint_dirs

    return checkpoint_dirs(tmp_path)
