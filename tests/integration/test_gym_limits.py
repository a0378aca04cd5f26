"""Gym replies are read within a cap per call: servers that stream far more than that cannot grow
the coordinator, and the registration that names them is refused, typed (docs/configuration.md#limits)."""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections.abc import AsyncIterator

import psutil
import pytest

from .ledger_helpers import new_run

pytestmark = pytest.mark.timeout(120)

STREAM_BYTES = 200 << 20  # what each server would send: 200 MiB


@contextlib.asynccontextmanager
async def streaming_servers(n: int, *, declared: bool) -> AsyncIterator[list[str]]:
    """``n`` HTTP servers that answer every request 200 with a 200 MiB body, chunked or with its
    length declared, and count the bytes they got out."""
    sent = [0]

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            await reader.readuntil(b"\r\n\r\n")
            head = f"Content-Length: {STREAM_BYTES}" if declared else "Transfer-Encoding: chunked"
            writer.write(f"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n{head}\r\n\r\n".encode())
            chunk = b"[" + b"0," * 32767 + b"0"
            frame = chunk if declared else f"{len(chunk):x}\r\n".encode() + chunk + b"\r\n"
            while sent[0] < STREAM_BYTES:
                writer.write(frame)
                await writer.drain()
                sent[0] += len(chunk)
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        finally:
            writer.close()

    servers = [await asyncio.start_server(handle, "127.0.0.1", 0) for _ in range(n)]
    try:
        yield [f"http://127.0.0.1:{s.sockets[0].getsockname()[1]}" for s in servers]
    finally:
        for s in servers:
            s.close()
        assert sent[0] < STREAM_BYTES, "a server sent its whole body: the reply was read to the end"


class PeakRss:
    """The process's resident memory, sampled every 5 ms while the block runs."""

    def __enter__(self) -> "PeakRss":
        self.proc = psutil.Process()
        self.before = self.peak = self.proc.memory_info().rss
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def _sample(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, self.proc.memory_info().rss)
            time.sleep(0.005)

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    @property
    def growth_mib(self) -> float:
        return (self.peak - self.before) / (1 << 20)


@pytest.mark.parametrize("declared", [False, True], ids=["chunked", "content-length"])
async def test_servers_streaming_huge_replies_are_refused_typed_within_a_memory_bound(client, admin, declared: bool) -> None:  # type: ignore[no-untyped-def]
    api = await new_run(client, admin)
    async with streaming_servers(3, declared=declared) as urls:
        body = {"instances": [{"instance_id": "math/replica-0", "control_token": "tok", "servers": {f"s{i}": u for i, u in enumerate(urls)}}]}
        with PeakRss() as rss:
            refused = await api.post("/gym-instances", body, 502)
    assert refused["code"] == "gym_protocol_error"
    assert sorted(refused["servers"]) == [f"math/replica-0/s{i}" for i in range(3)]
    assert "exceeds the 65536-byte limit" in refused["detail"], refused["detail"]
    # Three status replies of at most 64 KiB each: the bound in docs/configuration.md#limits is tens of
    # MiB for the whole process; a few MiB is what the request itself costs.
    assert rss.growth_mib < 32, f"RSS grew {rss.growth_mib:.1f} MiB"
    assert (await api.get("/gym-instances"))["instances"] == []
