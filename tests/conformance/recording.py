"""A transport that records the Gym control calls a client sends and can tamper with replies.

Wrapped around a real transport (for example one talking to gymsim), it lets a test observe
what the client sent, in which order and when, and rewrite a participant's reply to one that
no valid participant produces (wrong manifest, exports outside the scope, oversized bodies).
"""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

import httpx

# The protocol's path, written here rather than taken from the client under test: a client with a
# wrong prefix must not be observed through that same mistake.
CONTROL_PREFIX = "/ng-control/v1/checkpoint/"

__all__ = ["RecordedCall", "RecordingTransport", "Rewrite"]

Rewrite = Callable[[int, Any], tuple[int, Any] | bytes | list[bytes]]
"""(status, parsed JSON reply) -> a new (status, JSON) pair, raw bytes sent with status 200, or a
list of byte chunks sent with status 200 as a chunked body (no content-length)."""


@dataclass(frozen=True, slots=True)
class RecordedCall:
    sent_at: float
    answered_at: float | None
    url: str
    op: str
    body: Any
    status: int | None
    # Whether an `Authorization: Bearer <non-empty>` header was sent; the token itself is
    # deliberately not recorded.
    bearer: bool = False


class RecordingTransport(httpx.AsyncBaseTransport):
    def __init__(self, inner: httpx.AsyncBaseTransport | None = None) -> None:
        self.inner = inner or httpx.AsyncHTTPTransport()
        self.calls: list[RecordedCall] = []
        # (url substring, op) -> rewrite of the reply; consulted in insertion order.
        self.rewrites: list[tuple[str, str, Rewrite]] = []

    def rewrite(self, url_part: str, op: str, fn: Rewrite) -> None:
        self.rewrites.append((url_part, op, fn))

    def ops(self, op: str | None = None) -> list[RecordedCall]:
        return [c for c in self.calls if op is None or c.op == op]

    def clear(self) -> None:
        self.calls.clear()

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        url = str(request.url)
        op = url.rsplit(CONTROL_PREFIX, 1)[1] if CONTROL_PREFIX in url else url
        raw = request.content if request.method == "POST" else b""
        body = json.loads(raw) if raw else None
        sent_at = time.time()
        auth = request.headers.get("authorization", "")
        bearer = auth.startswith("Bearer ") and len(auth) > len("Bearer ")
        try:
            response = await self.inner.handle_async_request(request)
        except BaseException:  # cancellation too: a timed-out try is still a try
            self.calls.append(RecordedCall(sent_at, None, url, op, body, None, bearer))
            raise
        rewrite = next((fn for part, o, fn in self.rewrites if part in url and o == op), None)
        if rewrite is None:
            self.calls.append(RecordedCall(sent_at, time.time(), url, op, body, response.status_code, bearer))
            return response
        content = await response.aread()
        await response.aclose()
        result = rewrite(response.status_code, json.loads(content) if content else None)
        if isinstance(result, list):
            chunks = list(result)

            async def stream() -> AsyncIterator[bytes]:
                for chunk in chunks:
                    yield chunk

            self.calls.append(RecordedCall(sent_at, time.time(), url, op, body, 200, bearer))
            return httpx.Response(200, content=stream(), headers={"content-type": "application/json"})
        if isinstance(result, bytes):
            status, data = 200, result
        else:
            status, data = result[0], json.dumps(result[1]).encode()
        self.calls.append(RecordedCall(sent_at, time.time(), url, op, body, status, bearer))
        return httpx.Response(status, content=data, headers={"content-type": "application/json"})

    async def aclose(self) -> None:
        await self.inner.aclose()
