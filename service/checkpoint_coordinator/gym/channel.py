"""One control call on the wire: deadline, timeout, bounded retries, reply cap, error parsing.

Everything above this module works with parsed replies or with :class:`CallFailed`, whose
``part`` is already the plain-data failure part of section 9.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import time
from dataclasses import dataclass
from typing import Any, TypeVar

import httpx
from pydantic import SecretStr, ValidationError
from pydantic_core import to_json

from .clock import Clock
from .errors import FailureClass, ServerFailure, classify, normalize_code, server_failure
from ..observability.metrics import observe_gym_control
from .models import _Reply
from .timings import record_call

__all__ = [
    "CONTROL_PREFIX",
    "CallFailed",
    "ControlChannel",
    "Target",
    "encode_body",
    "error_part",
    "parse_reply",
]


log = logging.getLogger("checkpoint_coordinator.gym")

CONTROL_PREFIX = "/ng-control/v1/checkpoint/"
MAX_TRIES = 3
# Pause between tries after a refused connection: long enough for a listener that is
# restarting, short enough to stay well inside any control budget.
RETRY_BACKOFF_S = (0.05, 0.2)

R = TypeVar("R", bound=_Reply)

# Errors raised before any byte of a reply arrived: the call may be sent again (section 2).
_NO_REPLY_ERRORS = (
    httpx.ConnectError,
    httpx.ConnectTimeout,
    httpx.RemoteProtocolError,
    httpx.ReadError,
    httpx.WriteError,
    httpx.PoolTimeout,
)


@dataclass(frozen=True, slots=True)
class Target:
    instance_id: str
    server_name: str
    base_url: str
    token: SecretStr
    # The participant's kind, for the latency metric; unknown until discovery has seen it.
    kind: str = "unknown"

    def __repr__(self) -> str:
        return f"Target({self.instance_id}/{self.server_name} at {self.base_url})"


class CallFailed(Exception):
    """A control call that ended without a usable reply; ``part`` says why, as plain data."""

    def __init__(self, target: Target, part: ServerFailure) -> None:
        super().__init__(f"{target.instance_id}/{target.server_name}: {part['op']}: {part['detail']}")
        self.target = target
        self.part = part

    @property
    def failure_class(self) -> FailureClass:
        return FailureClass(self.part["class"])

    @property
    def code(self) -> str | None:
        return self.part["code"]


class _TooLarge(Exception):
    pass


class ControlChannel:
    def __init__(
        self,
        http: httpx.AsyncClient,
        clock: Clock,
        *,
        control_timeout_s: float,
        max_reply_bytes: int,
    ) -> None:
        self.http = http
        self.clock = clock
        # Section 2: the grace only covers the reply's trip back after the participant's deadline.
        self.reply_grace_s = min(control_timeout_s, 5.0)
        self.max_reply_bytes = max_reply_bytes

    async def post(
        self,
        target: Target,
        op: str,
        body: dict[str, Any] | bytes,
        deadline_ts: float,
        reply_model: type[R],
    ) -> R:
        """POST ``op`` and parse a 200 reply; any other outcome raises :class:`CallFailed`.

        ``body`` may come pre-encoded, so one large scope is encoded once per instance rather
        than once per participant; ``deadline_ts`` must then be the one inside it.
        """
        payload = body if isinstance(body, bytes) else encode_body(body)
        budget = max(deadline_ts - self.clock.time(), 0.0) + self.reply_grace_s
        started = time.perf_counter()
        outcome = "ok"
        try:
            status, content = await self._exchange(target, op, "POST", payload, budget)
            return parse_reply(target, op, status, content, reply_model)
        except CallFailed as exc:
            outcome = exc.part["class"]
            raise
        finally:
            elapsed = time.perf_counter() - started
            observe_gym_control(op, target.kind, outcome, elapsed)
            record_call(target.instance_id, op, target.server_name, elapsed)

    async def get_status(self, target: Target, timeout_s: float) -> tuple[int, bytes]:
        """GET status with the discovery budget; the caller interprets 404 and the body."""
        started = time.perf_counter()
        outcome = "ok"
        try:
            return await self._exchange(target, "status", "GET", None, timeout_s)
        except CallFailed as exc:
            outcome = exc.part["class"]
            raise
        finally:
            observe_gym_control("status", target.kind, outcome, time.perf_counter() - started)

    async def _exchange(
        self, target: Target, op: str, method: str, payload: bytes | None, budget_s: float
    ) -> tuple[int, bytes]:
        loop = asyncio.get_running_loop()
        # Two clocks bound the call: the injectable one that set deadline_ts, and the loop's,
        # because a frozen test clock must not turn one timeout into three.
        give_up_at = self.clock.time() + budget_s
        real_give_up_at = loop.time() + budget_s
        url = target.base_url.rstrip("/") + CONTROL_PREFIX + op
        headers = {"authorization": "Bearer " + target.token.get_secret_value()}
        if payload is not None:
            headers["content-type"] = "application/json"
        last_error = "no try made"
        for attempt in range(MAX_TRIES):
            remaining = min(give_up_at - self.clock.time(), real_give_up_at - loop.time())
            if remaining <= 0 and attempt > 0:
                break
            remaining = max(remaining, 0.001)
            try:
                async with asyncio.timeout(remaining):
                    return await self._once(method, url, headers, payload, remaining)
            except (TimeoutError, httpx.ReadTimeout, httpx.WriteTimeout):
                # Connected (or still connecting) and no reply within the budget: re-sending
                # could only start after the give-up instant, so stop here.
                raise CallFailed(
                    target,
                    server_failure(
                        FailureClass.UNAVAILABLE,
                        op,
                        f"no reply within {budget_s:.3f}s (deadline plus reply grace)",
                    ),
                ) from None
            except _TooLarge as exc:
                raise CallFailed(
                    target,
                    server_failure(
                        FailureClass.PROTOCOL_ERROR, op, str(exc), code="response_too_large"
                    ),
                ) from None
            except _NO_REPLY_ERRORS as exc:
                last_error = f"{type(exc).__name__}: {exc}"
                log.info(
                    "gym control %s to %s/%s got no reply (try %d of %d): %s",
                    op, target.instance_id, target.server_name, attempt + 1, MAX_TRIES, last_error,
                )
                if attempt + 1 < MAX_TRIES:
                    await self.clock.sleep(RETRY_BACKOFF_S[min(attempt, len(RETRY_BACKOFF_S) - 1)])
            except httpx.HTTPError as exc:
                last_error = f"{type(exc).__name__}: {exc}"
                break
        raise CallFailed(
            target,
            server_failure(FailureClass.UNAVAILABLE, op, f"no reply: {last_error}"),
        )

    async def _once(
        self,
        method: str,
        url: str,
        headers: dict[str, str],
        payload: bytes | None,
        timeout_s: float,
    ) -> tuple[int, bytes]:
        request = self.http.build_request(
            # httpx's own timers are only a backstop behind the caller's asyncio.timeout, which
            # measures the whole exchange rather than each socket operation.
            method, url, headers=headers, content=payload, timeout=httpx.Timeout(timeout_s + 1.0)
        )
        response = await self.http.send(request, stream=True)
        try:
            declared = response.headers.get("content-length")
            if declared is not None and declared.isdigit():
                if int(declared) > self.max_reply_bytes:
                    raise _TooLarge(
                        f"reply of {declared} bytes exceeds max_control_reply_bytes={self.max_reply_bytes}"
                    )
                content = await response.aread()
            else:
                # Chunked reply: count while reading so an endless body cannot exhaust memory.
                chunks: list[bytes] = []
                total = 0
                async for chunk in response.aiter_bytes():
                    total += len(chunk)
                    if total > self.max_reply_bytes:
                        raise _TooLarge(
                            f"reply exceeds max_control_reply_bytes={self.max_reply_bytes}"
                        )
                    chunks.append(chunk)
                content = b"".join(chunks)
        finally:
            await response.aclose()
        if len(content) > self.max_reply_bytes:
            # A compressed reply can decode to more than its declared length.
            raise _TooLarge(f"reply exceeds max_control_reply_bytes={self.max_reply_bytes}")
        return response.status_code, content


def parse_reply(target: Target, op: str, status: int, content: bytes, reply_model: type[R]) -> R:
    """The parsed 200 reply; anything else raises :class:`CallFailed`."""
    if status == 200:
        try:
            return reply_model.model_validate_json(content)
        except ValidationError as exc:
            raise CallFailed(
                target,
                server_failure(
                    FailureClass.PROTOCOL_ERROR,
                    op,
                    f"malformed {op} reply: {_validation_summary(exc)}",
                    http_status=status,
                ),
            ) from None
    raise CallFailed(target, error_part(op, status, content))


def encode_body(body: dict[str, Any]) -> bytes:
    """Compact JSON by pydantic-core's encoder: a commit's scope of thousands of episodes is
    encoded while Gym is parked, in a quarter of the standard library's time. A non-finite
    float is a coordinator bug, refused here rather than by a participant's 422; the bodies'
    only floats are top-level (``deadline_ts``)."""
    for key, value in body.items():
        if isinstance(value, float) and not math.isfinite(value):
            raise ValueError(f"control body field {key!r} is not a finite number: {value!r}")
    return to_json(body)


def error_part(op: str, status: int, content: bytes) -> ServerFailure:
    """Failure part of a non-200 reply, from the section-2 envelope when there is one."""
    wire_code: str | None = None
    detail: object = ""
    try:
        body = json.loads(content) if content else None
    except ValueError:
        body = None
    if isinstance(body, dict) and isinstance(body.get("error"), dict):
        err = body["error"]
        if isinstance(err.get("code"), str):
            wire_code = err["code"]
        detail = err.get("detail", "")
    elif body is not None:
        # The framework's own validation shape ({"detail": [...]}) on a 422, or a proxy page.
        detail = body.get("detail", body) if isinstance(body, dict) else body
    else:
        detail = content[:4096].decode("utf-8", "replace")
    code = normalize_code(wire_code) if wire_code is not None else None
    if not isinstance(detail, str):
        detail = json.dumps(detail, default=str)[:8192]
    extra: dict[str, Any] = {}
    if wire_code is not None and wire_code != code:
        extra["wire_code"] = wire_code
    return server_failure(
        classify(code, status), op, detail or f"HTTP {status}", http_status=status, code=code, **extra
    )


def _validation_summary(exc: ValidationError) -> str:
    errors = exc.errors(include_url=False, include_input=False)
    shown = "; ".join(
        f"{'.'.join(str(p) for p in e['loc']) or '<body>'}: {e['msg']}" for e in errors[:5]
    )
    return f"{len(errors)} error(s): {shown}"
