"""One control call on the wire: deadline, timeout, bounded retries, reply cap, error parsing.

Everything above this module works with parsed replies or with :class:`CallFailed`, whose
``part`` is already the plain-data failure part (docs/gym-protocol.md#failure-classes).
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import math
import re
import threading
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any, TypeVar

import httpx
from pydantic import SecretStr, ValidationError
from pydantic_core import to_json

from .clock import Clock
from .egress import EgressRefused
from .errors import LEGACY_CODES, FailureClass, ServerFailure, classify, normalize_code, server_failure
from ..observability.metrics import observe_gym_control
from .models import _Reply
from .timings import record_call

__all__ = [
    "CONTROL_PREFIX",
    "PROCESS_REPLY_MEMORY",
    "ReplyMemory",
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
# How much of a reply is read (docs/configuration.md#limits): a reply is read into one buffer, never past
# its cap, so the memory a Gym server can make the coordinator hold is the sum of the caps of the
# calls in flight. Status, renew and resume replies are small; prepare lists restarts (never
# capped by Gym), retire and forget name at most 1 024 ids; a commit or restore reply lists the
# episodes its request named, so it may grow with them.
SMALL_REPLY_BYTES = 64 * 1024
REPLY_BASE_BYTES = {"prepare": 4 << 20, "commit": 1 << 20, "restore": 1 << 20, "retire": 1 << 20, "forget": 1 << 20}
REPLY_PER_EPISODE_BYTES = 8 * 1024
# A refusal is read for its envelope only.
ERROR_REPLY_BYTES = 4 * 1024


class ReplyMemory:
    """The bytes of Gym replies being read at once, across every client of the process, against
    one limit: a reply that would take more fails its call (``unavailable``, try again) rather
    than grow the process. Each call reads at most its own cap (``ControlChannel.reply_cap``)."""

    def __init__(self, limit_bytes: int) -> None:
        self.limit_bytes = limit_bytes
        self.in_use = 0
        self._lock = threading.Lock()  # clients of several event loops (threads) may share it

    def take(self, n: int) -> bool:
        with self._lock:
            if self.in_use + n > self.limit_bytes:
                return False
            self.in_use += n
            return True

    def give_back(self, n: int) -> None:
        with self._lock:
            self.in_use -= n


DEFAULT_REPLY_MEMORY_BYTES = 256 << 20
#: The process's budget, shared by every client that is given no other.
PROCESS_REPLY_MEMORY = ReplyMemory(DEFAULT_REPLY_MEMORY_BYTES)


class _OutOfReplyMemory(Exception):
    pass
# Pause between tries after a refused connection: long enough for a listener that is
# restarting, short enough to stay well inside any control budget.
RETRY_BACKOFF_S = (0.05, 0.2)

R = TypeVar("R", bound=_Reply)

# Errors raised before any byte of a reply arrived: the call may be sent again
# (docs/gym-protocol.md#transport).
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
        reply_memory: ReplyMemory | None = None,
        run_id: str | None = None,
    ) -> None:
        self.http = http
        self.run_id = run_id
        self.clock = clock
        # The grace only covers the reply's trip back after the participant's deadline
        # (docs/gym-protocol.md#transport).
        self.reply_grace_s = min(control_timeout_s, 5.0)
        self.max_reply_bytes = max_reply_bytes
        self.reply_memory = reply_memory or PROCESS_REPLY_MEMORY

    def reply_cap(self, op: str, items: int = 0) -> int:
        """The most bytes a reply of ``op`` may have: its base, and as much again per episode
        the call names (``items``: a commit's scope, a restore's episodes), within the client's
        ceiling (``max_reply_bytes``)."""
        return min(self.max_reply_bytes, REPLY_BASE_BYTES.get(op, SMALL_REPLY_BYTES) + REPLY_PER_EPISODE_BYTES * max(items, 0))

    async def post(
        self,
        target: Target,
        op: str,
        body: dict[str, Any] | bytes,
        deadline_ts: float,
        reply_model: type[R],
        items: int = 0,
    ) -> R:
        """POST ``op`` and parse a 200 reply; any other outcome raises :class:`CallFailed`.

        ``body`` may come pre-encoded, so one large scope is encoded once per instance rather
        than once per participant; ``deadline_ts`` must then be the one inside it. ``items``:
        the episodes the call names, which its reply may list (``reply_cap``).
        """
        payload = body if isinstance(body, bytes) else encode_body(body)
        budget = max(deadline_ts - self.clock.time(), 0.0) + self.reply_grace_s
        started = time.perf_counter()
        outcome = "ok"
        try:
            status, content = await self._exchange(target, op, "POST", payload, budget, items)
            return parse_reply(target, op, status, content, reply_model)
        except CallFailed as exc:
            outcome = exc.part["class"]
            raise
        finally:
            elapsed = time.perf_counter() - started
            observe_gym_control(op, target.kind, outcome, elapsed, self.run_id)
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
            observe_gym_control("status", target.kind, outcome, time.perf_counter() - started, self.run_id)

    async def _exchange(
        self, target: Target, op: str, method: str, payload: bytes | None, budget_s: float, items: int = 0
    ) -> tuple[int, bytes]:
        cap = self.reply_cap(op, items)
        loop = asyncio.get_running_loop()
        # Two clocks bound the call: the injectable one that set deadline_ts, and the loop's,
        # because a frozen test clock must not turn one timeout into three.
        give_up_at = self.clock.time() + budget_s
        real_give_up_at = loop.time() + budget_s
        url = target.base_url.rstrip("/") + CONTROL_PREFIX + op
        headers = {"authorization": "Bearer " + target.token.get_secret_value(), "accept-encoding": "identity"}
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
                    return await self._once(method, url, headers, payload, remaining, cap)
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
            except _OutOfReplyMemory as exc:
                raise CallFailed(target, server_failure(FailureClass.UNAVAILABLE, op, str(exc))) from None
            except _NO_REPLY_ERRORS as exc:
                if isinstance(exc.__cause__, EgressRefused):
                    # Not a network fault: the address is not one Gym may be at. Never re-sent.
                    raise CallFailed(target, server_failure(FailureClass.CONFIG_ERROR, op, str(exc.__cause__))) from None
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
        cap: int,
    ) -> tuple[int, bytes]:
        request = self.http.build_request(
            # httpx's own timers are only a backstop behind the caller's asyncio.timeout, which
            # measures the whole exchange rather than each socket operation.
            method, url, headers=headers, content=payload, timeout=httpx.Timeout(timeout_s + 1.0)
        )
        response = await self.http.send(request, stream=True)
        try:
            if response.status_code != 200:
                # A refusal is read for its envelope only: a short code and a short detail.
                cap = min(cap, ERROR_REPLY_BYTES)
            encoding = response.headers.get("content-encoding", "identity").strip().lower()
            if encoding not in ("", "identity"):
                # Asked for identity: a compressed body could inflate past any cap in one chunk.
                raise _TooLarge(f"reply is {encoding}-encoded; control replies are read uncompressed")
            declared = response.headers.get("content-length")
            if declared is not None and declared.isdigit() and int(declared) > cap:
                if response.status_code != 200:
                    return response.status_code, b""  # judged by its status alone
                raise _TooLarge(f"reply of {declared} bytes exceeds the {cap}-byte limit of this call")
            content = bytearray()
            taken = 0
            # A response built with its content (a test transport's) has no stream left to read.
            chunks = _one(response.content) if response.is_stream_consumed else response.aiter_raw()
            try:
                async for chunk in chunks:
                    if len(content) + len(chunk) > cap:
                        if response.status_code != 200:
                            return response.status_code, content  # the envelope's start, if any
                        raise _TooLarge(f"reply exceeds the {cap}-byte limit of this call")
                    if len(content) + len(chunk) > taken:
                        # Reserved in steps of at least 64 KiB: one lock per step, not per chunk.
                        step = min(max(len(chunk), SMALL_REPLY_BYTES), cap - taken)
                        if not self.reply_memory.take(step):
                            raise _OutOfReplyMemory(
                                f"the coordinator's memory for Gym replies ({self.reply_memory.limit_bytes} bytes) is in use by other calls"
                            )
                        taken += step
                    content += chunk
                return response.status_code, content  # no second copy: parsed as it is
            finally:
                self.reply_memory.give_back(taken)
        finally:
            await response.aclose()


async def _one(content: bytes) -> AsyncIterator[bytes]:
    yield content


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


_TOKEN = re.compile(r"^[a-z][a-z0-9_]{0,63}$")
_FIELD = re.compile(r"^[A-Za-z_][A-Za-z0-9_]{0,63}$|^[0-9]{1,6}$")
_DETAIL_CHARS = 200


def error_part(op: str, status: int, content: bytes) -> ServerFailure:
    """Failure part of a non-200 reply. Only what a Gym participant says in the protocol's own
    words is kept: the envelope's code (docs/gym-protocol.md#transport) and, for a code of
    docs/gym-protocol.md#error-codes, its detail (short, printable); the field names of a
    framework validation refusal. Any other body is named by its size alone, never echoed: the
    URL may have reached a service that is not Gym, and its answer must not travel back to
    whoever registered it (its digest goes to the log)."""
    try:
        body = json.loads(content) if content else None
    except ValueError:
        body = None
    wire_code: str | None = None
    code: str | None = None
    extra: dict[str, Any] = {}
    detail = ""
    if isinstance(body, dict) and isinstance(body.get("error"), dict):
        err = body["error"]
        raw = err.get("code")
        if isinstance(raw, str) and _TOKEN.fullmatch(raw):
            wire_code, code = raw, normalize_code(raw)
            if code in LEGACY_CODES and isinstance(err.get("detail"), str):
                detail = _printable(err["detail"])
            else:
                detail = f"HTTP {status} {raw}"
    elif isinstance(body, dict) and isinstance(body.get("detail"), list):
        # The framework's own validation shape (``{"detail": [{"loc": [...], "type": ...}]}``).
        fields = []
        for e in body["detail"][:10]:
            loc = e.get("loc") if isinstance(e, dict) else None
            if isinstance(loc, list) and loc and all(isinstance(x, (str, int)) and _FIELD.fullmatch(str(x)) for x in loc):
                fields.append(".".join(str(x) for x in loc))
        if fields:
            extra["fields"] = fields
            detail = "request refused as invalid: " + ", ".join(fields)
    if not detail:
        if content:
            log.info("gym control %s answered HTTP %d with a body that is no Gym answer (%d bytes, sha256 %s)",
                     op, status, len(content), hashlib.sha256(content).hexdigest()[:16])
        detail = f"HTTP {status}" + (f", {len(content)} bytes that are no Gym answer" if content else "")
    if wire_code is not None and wire_code != code:
        extra["wire_code"] = wire_code
    return server_failure(classify(code, status), op, detail, http_status=status, code=code, **extra)


def _printable(text: str) -> str:
    return "".join(c if c.isprintable() else " " for c in text)[:_DETAIL_CHARS]


def _validation_summary(exc: ValidationError) -> str:
    errors = exc.errors(include_url=False, include_input=False)
    shown = "; ".join(
        f"{'.'.join(str(p) for p in e['loc']) or '<body>'}: {e['msg']}" for e in errors[:5]
    )
    return f"{len(errors)} error(s): {shown}"
