"""Running one instance under uvicorn: one process (or one thread, in tests) per instance."""

from __future__ import annotations

import asyncio
import socket
from typing import Callable

import uvicorn

from .app import create_app
from .config import InstanceConfig
from .instance import Instance


def bind_socket(host: str, port: int) -> socket.socket:
    """Bind before serving so that the port (even an ephemeral one) is known up front."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    # proto must be IPPROTO_TCP: asyncio only sets TCP_NODELAY on such sockets, and without it every
    # small reply waits out a delayed ACK (~40 ms).
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.listen(2048)
    sock.setblocking(False)
    return sock


class Server(uvicorn.Server):
    """uvicorn's server, but an in-process owner can wake it to exit at once instead of at its next
    0.1 s tick (tests start and stop many instances)."""

    _wake: asyncio.Event | None = None
    _loop: asyncio.AbstractEventLoop | None = None

    async def main_loop(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._wake = asyncio.Event()
        counter = 0
        while not await self.on_tick(counter):
            counter = (counter + 1) % 864000
            try:
                async with asyncio.timeout(0.1):
                    await self._wake.wait()
            except TimeoutError:
                pass

    def request_exit(self, *, force: bool = False) -> None:
        self.should_exit = True
        self.force_exit = self.force_exit or force
        if self._loop is not None and self._wake is not None:
            try:
                self._loop.call_soon_threadsafe(self._wake.set)
            except RuntimeError:  # the loop is already closed
                pass


def build_server(
    config: InstanceConfig, sock: socket.socket, *, on_ready: Callable[[Instance], None] | None = None
) -> tuple[Server, Instance]:
    host, port = sock.getsockname()[:2]
    instance = Instance(config, host=host, port=port)
    app = create_app(instance, on_ready=on_ready)
    uv_config = uvicorn.Config(
        app,
        http="h11",  # the fault layer drops connections through h11's transport
        lifespan="on",
        log_level="warning",
        access_log=False,
        timeout_graceful_shutdown=2,
        timeout_keep_alive=30,
    )
    return Server(uv_config), instance


def ready_line(instance: Instance) -> dict:
    return {"instance_id": instance.config.instance_id, "port": instance.port, "servers": instance.server_urls()}
