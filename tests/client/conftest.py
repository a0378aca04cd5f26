"""A live coordinator on a loopback port for the client's tests.

The real app (``create_app`` on the per-test database of tests/conftest.py) runs under uvicorn
in a thread, so the client talks real HTTP over TCP: connection errors, keep-alive reuse after a
restart and timeouts are the real ones. ``restart`` brings a fresh app up on the same port and
the same database, as a crashed-and-restarted coordinator would.
"""

from __future__ import annotations

import asyncio
import socket
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import uvicorn

from checkpoint_coordinator.server import server_config

from ckpt_client import AsyncCoordinatorClient, CoordinatorClient, GroupSpec, SealedRow, SendRow
from tests.conftest import ADMIN_TOKEN
from tests.gym_placeholders import register_placeholders_sync

AppWrapper = Callable[[Any], Any]


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class LiveServer:
    """One ASGI app served by uvicorn in a background thread on 127.0.0.1:``port``."""

    def __init__(
        self, app_factory: Callable[[], Any], checkpoint_root: Path, port: int | None = None, database_url: str = "", settings: Any = None
    ) -> None:
        from checkpoint_coordinator.config import Settings

        self.app_factory = app_factory
        self.database_url = database_url
        self.settings = settings if settings is not None else Settings(_env_file=None)
        # Per test: Gym writes snapshot manifests under the run's checkpoint root, and a
        # directory left by another test would belong to another checkpoint.
        self.checkpoint_root = checkpoint_root
        self.port = port or free_port()
        self.wrap: AppWrapper | None = None
        self._server: uvicorn.Server | None = None
        self._thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, wrap: AppWrapper | None = None) -> None:
        app = self.app_factory()
        if wrap is not None:
            app = wrap(app)
        # The server configuration `serve` runs under (its connection and time limits).
        config = server_config(
            app, self.settings, host="127.0.0.1", port=self.port, lifespan="on", loop="asyncio", log_level="warning",
            # A request held open on purpose must not block the stop forever.
            timeout_graceful_shutdown=1,
        )
        server = uvicorn.Server(config)
        thread = threading.Thread(target=server.run, name=f"coordinator-{self.port}", daemon=True)
        thread.start()
        deadline = time.monotonic() + 30
        while not server.started:
            if not thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("coordinator did not start")
            time.sleep(0.02)
        self._server, self._thread = server, thread

    def stop(self) -> None:
        if self._server is None or self._thread is None:
            return
        self._server.should_exit = True
        self._thread.join(timeout=30)
        assert not self._thread.is_alive(), "coordinator did not stop"
        self._server = self._thread = None

    def restart(self, wrap: AppWrapper | None = None, down_for: float = 0.0) -> None:
        self.stop()
        time.sleep(down_for)
        self.start(wrap)


@pytest.fixture
def coordinator(settings: Any, database_url: str, tmp_path: Path) -> Iterator[LiveServer]:
    from checkpoint_coordinator.app import create_app

    # The gate's retry hint is lowered so gate tests wait fractions of a second, not seconds.
    fast = settings.model_copy(update={"gate_retry_after_s": 0.2})
    server = LiveServer(lambda: create_app(fast, database_url=database_url), tmp_path / "checkpoints", database_url=database_url, settings=fast)
    server.start()
    try:
        yield server
    finally:
        server.stop()


def set_gate(database_url: str, run_id: str, snapshot_id: str | None) -> None:
    """Close (or reopen) a run's dispatch gate the way a snapshot does, straight in the ledger."""
    from checkpoint_coordinator.ledger.db import make_async_engine
    from checkpoint_coordinator.ledger.runs import close_gate, open_gate

    async def go() -> None:
        engine = make_async_engine(database_url, pool_size=1)
        try:
            async with engine.begin() as conn:
                if snapshot_id is not None:
                    await close_gate(conn, run_id, snapshot_id)
                else:
                    current = (await conn.exec_driver_sql("SELECT gate_snapshot_id FROM runs WHERE run_id = %s", (run_id,))).scalar()
                    if current is not None:
                        await open_gate(conn, run_id, current)
        finally:
            await engine.dispose()

    asyncio.run(go())


@pytest.fixture
def gym() -> Iterator[Any]:
    """One gymsim instance, ``math/replica-0`` with control token ``tok-gym``."""
    from gymsim.testing import GymsimInstance, default_instance_config

    g = GymsimInstance.start(default_instance_config("math/replica-0", token="tok-gym", turn_seconds=0.05))
    try:
        yield g
    finally:
        g.stop()


@pytest.fixture
def admin_token() -> str:
    return ADMIN_TOKEN


class Facade:
    """Either flavour behind one awaitable interface, so each test body runs against both.

    Calls on the sync client run in a worker thread (as a trainer's reporting thread would),
    which also keeps the test's event loop free.
    """

    def __init__(self, client: Any, token: str) -> None:
        self.client = client
        self.token = token
        self.is_async = not isinstance(client, CoordinatorClient)

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self.client, name)
        if not callable(attr) or self.is_async:
            return attr

        async def in_thread(*args: Any, **kwargs: Any) -> Any:
            return await asyncio.to_thread(attr, *args, **kwargs)

        return in_thread

    async def aclose(self) -> None:
        if self.is_async:
            await self.client.close()
        else:
            self.client.close()


MakeClient = Callable[..., Facade]


@pytest.fixture(params=["sync", "async"])
async def make_client(request: pytest.FixtureRequest) -> Any:
    """``make_client(base_url, token, **options)`` in the flavour of this test's parameter."""
    made: list[Facade] = []
    cls = CoordinatorClient if request.param == "sync" else AsyncCoordinatorClient

    def make(base_url: str, token: str, **options: Any) -> Facade:
        options.setdefault("retries", 3)
        options.setdefault("backoff", 0.05)
        options.setdefault("max_backoff", 0.5)
        facade = Facade(cls(base_url, token, **options), token)
        made.append(facade)
        return facade

    yield make
    for f in made:
        await f.aclose()


async def open_run(
    server: LiveServer, make: MakeClient, run_id: str = "run-1", *, placeholders: tuple[str, ...] = ("math/replica-0",), **recovery: Any
) -> Facade:
    """Create a run with the admin token and answer a client bound to it with its run token.
    ``placeholders``: Gym instances registered as placeholders, so that rows can be dispatched
    to them without a Gym deployment (a registration of a real one replaces its placeholder)."""
    admin = make(server.url, ADMIN_TOKEN)
    run = await admin.create_run(run_id, str(server.checkpoint_root), {"target_level": "sibling", **recovery})
    assert run.run_token and run.state == "open"
    if placeholders:
        await asyncio.to_thread(register_placeholders_sync, server.database_url, run_id, *placeholders)
    return make(server.url, run.run_token, run_id=run_id)


def group(gid: str, n: int = 2, **kw: Any) -> GroupSpec:
    return GroupSpec(gid, sample_id=gid, task_name="math", task_digest=f"sha256:{gid}", expected_generations=n, **kw)


def sealed(row: SendRow, reward: float = 1.0) -> SealedRow:
    # Gym's receipt names the capture key (the episode id), which differs from the rollout id
    # for a continued episode.
    return SealedRow(row.rollout_id, {"rollout_id": row.capture_key}, [f"tq/{row.capture_key}/0"], reward)
