"""Sans-IO core shared by the sync and async clients.

Everything with a decision in it (what to send, whether and how long to wait before a retry, how
to read an answer, the multi-step helpers) is written once, as generators that *yield effects*
(send this request, sleep this long, read the clock, call the user's callback) and receive their
results. The two clients are thin drivers that perform those effects with ``httpx.Client`` /
``time.sleep`` or ``httpx.AsyncClient`` / ``asyncio.sleep``. Nothing here does I/O, so the
retry and polling logic cannot drift between the two flavours.
"""

from __future__ import annotations

import email.utils
import json
import logging
import random
import time
from collections.abc import Callable, Generator, Mapping
from dataclasses import dataclass, field, replace
from typing import Any, Literal, TypeVar

from .errors import CoordinatorError, ProtocolError, Unreachable, error_from_problem

log = logging.getLogger("ckpt_client")

T = TypeVar("T")

#: Server answers after which the same request may simply be sent again: a proxy or load
#: balancer without a healthy backend (502/504) or the coordinator saying it is not serving (503).
RETRY_STATUSES = frozenset({502, 503, 504})


# --------------------------------------------------------------------------------------------
# Effects


@dataclass(frozen=True)
class RequestSpec:
    """One HTTP request, before any I/O.

    ``retry`` says when repeating it is safe: ``"always"`` for every route the server handles
    idempotently (identical repeats answer the same), ``"unsent"`` when only a request that
    provably never reached the server may be repeated (creating a run: a repeat answers
    ``run_exists`` and the token, shown once, would be lost).
    """

    method: Literal["GET", "POST", "DELETE"]
    path: str
    json: Any = None
    params: Mapping[str, Any] | None = None
    retry: Literal["always", "unsent"] = "always"
    #: Per-request timeout overriding the client's (a restore may legitimately take minutes).
    timeout: float | None = None
    #: A call of a snapshot's handshake: after no answer it is sent again until this instant (on
    #: the ``Now`` clock), however many tries that takes, each on a fresh connection.
    give_up_at: float | None = None
    #: Send on a new connection (not one from the pool): a retry after no answer, which a load
    #: balancer may route to another replica than the one that did not answer.
    fresh_connection: bool = False


@dataclass(frozen=True)
class RawResponse:
    status: int
    headers: Mapping[str, str]
    body: bytes


@dataclass(frozen=True)
class Send:
    request: RequestSpec


@dataclass(frozen=True)
class Sleep:
    seconds: float


@dataclass(frozen=True)
class Now:
    pass


@dataclass(frozen=True)
class Invoke:
    """Call a user callback (its result is awaited by the async driver if awaitable)."""

    fn: Callable[..., Any]
    args: tuple[Any, ...] = ()


@dataclass(frozen=True)
class Enter:
    """Enter a user context manager (sync, or async under the async driver)."""

    factory: Callable[[], Any]


@dataclass(frozen=True)
class Exit:
    handle: Any
    error: BaseException | None


Effect = Send | Sleep | Now | Invoke | Enter | Exit
Flow = Generator[Effect, Any, T]


class TransportFailure(Exception):
    """A request got no HTTP answer. Raised *into* flows by the drivers.

    ``unsent`` is True when the request provably never reached the server (the connection
    could not be opened), which makes even a non-idempotent request safe to repeat.
    """

    def __init__(self, cause: BaseException, *, unsent: bool) -> None:
        super().__init__(f"{type(cause).__name__}: {cause}")
        self.cause = cause
        self.unsent = unsent


# --------------------------------------------------------------------------------------------
# Retry policy


@dataclass
class RetryPolicy:
    """Bounded exponential backoff with jitter.

    Retry ``n`` (0-based) waits ``d/2 + U(0, d/2)`` with ``d = min(max_backoff, backoff * 2**n)``:
    half of the wait is guaranteed (a restarting server gets time to come back), half is random
    (many trainer workers retrying after the same outage do not arrive in lockstep). A server
    ``Retry-After`` raises the wait to at least that value, still capped by ``max_backoff``.
    """

    retries: int = 5
    backoff: float = 0.25
    max_backoff: float = 10.0
    rng: random.Random = field(default_factory=random.Random, repr=False)

    def __post_init__(self) -> None:
        if self.retries < 0 or self.backoff < 0 or self.max_backoff < 0:
            raise ValueError("retries, backoff and max_backoff must be >= 0")

    def delay(self, retry_index: int, retry_after: float | None = None) -> float:
        d = min(self.max_backoff, self.backoff * (2 ** min(retry_index, 30)))
        wait = d / 2 + self.rng.uniform(0, d / 2)
        if retry_after is not None:
            wait = max(wait, min(retry_after, self.max_backoff))
        return wait

    def gate_delay(self, wait_index: int, retry_after: float | None, max_wait: float) -> float:
        """Wait before re-trying a dispatch refused by a closed gate.

        Never sooner than the server's Retry-After (it knows its own cadence), doubling from
        there on repeated refusals up to ``max_wait`` (a snapshot may hold the gate for
        minutes; thousands of workers need not ask every second), plus up to 10% jitter.
        """
        first = retry_after if retry_after is not None and retry_after > 0 else 1.0
        d = min(max_wait, first * (2 ** min(wait_index, 30)))
        return d * (1 + self.rng.uniform(0, 0.1))


def parse_retry_after(value: str | None, now: Callable[[], float] = time.time) -> float | None:
    """Seconds from a ``Retry-After`` header (delta-seconds or an HTTP date)."""
    if not value:
        return None
    value = value.strip()
    try:
        return max(0.0, float(value))
    except ValueError:
        pass
    try:
        when = email.utils.parsedate_to_datetime(value)
    except (TypeError, ValueError):
        return None
    return max(0.0, when.timestamp() - now())


# --------------------------------------------------------------------------------------------
# Decoding


def _header(headers: Mapping[str, str], name: str) -> str | None:
    for k, v in headers.items():
        if k.lower() == name:
            return v
    return None


def decode(resp: RawResponse) -> Any:
    """The JSON body of a 2xx answer, or raise the typed error of any other."""
    if 200 <= resp.status < 300:
        if not resp.body:
            return None
        try:
            return json.loads(resp.body)
        except ValueError as e:
            raise ProtocolError(f"HTTP {resp.status} answer is not JSON: {resp.body[:200]!r}", status=resp.status) from e
    raise error_of(resp)


def error_of(resp: RawResponse) -> CoordinatorError:
    problem: dict[str, Any]
    try:
        parsed = json.loads(resp.body) if resp.body else {}
        problem = dict(parsed) if isinstance(parsed, Mapping) else {}
    except ValueError:
        problem = {}
    if not problem:
        # Not a problem document (an HTML page from a proxy, an empty 502...): keep a snippet.
        snippet = resp.body[:200].decode("utf-8", "replace").strip()
        problem = {"status": resp.status, "detail": snippet or f"HTTP {resp.status} without a body"}
    return error_from_problem(resp.status, problem, retry_after_s=parse_retry_after(_header(resp.headers, "retry-after")))


# --------------------------------------------------------------------------------------------
# The one request loop


def call(req: RequestSpec, policy: RetryPolicy) -> Flow[Any]:
    """Send ``req``, retrying on no answer and on 502/503/504; decode the final answer.

    Any other 4xx/5xx is raised at once: repeating a refused request gets the same refusal.
    """
    attempt = 0
    while True:
        retry_after: float | None = None
        try:
            resp: RawResponse = yield Send(req)
        except TransportFailure as failure:
            may_retry = req.retry == "always" or failure.unsent
            if req.give_up_at is not None and may_retry:
                left = req.give_up_at - (yield Now())
                if left > 0:
                    wait = min(policy.delay(attempt), left)
                    attempt += 1
                    log.warning("%s %s: %s; again on a fresh connection in %.2fs", req.method, req.path, failure, wait)
                    yield Sleep(wait)
                    req = replace(req, fresh_connection=True)
                    continue
            if attempt >= policy.retries or not may_retry or req.give_up_at is not None:
                why = "retries exhausted" if may_retry else "not safe to repeat (the request may have been processed)"
                raise Unreachable(f"{req.method} {req.path}: no answer ({failure}); {why}") from failure.cause
            reason = str(failure)
        else:
            if resp.status not in RETRY_STATUSES or attempt >= policy.retries or req.retry != "always":
                return decode(resp)
            retry_after = parse_retry_after(_header(resp.headers, "retry-after"))
            reason = f"HTTP {resp.status}"
        wait = policy.delay(attempt, retry_after)
        attempt += 1
        log.warning("%s %s: %s; retry %d/%d in %.2fs", req.method, req.path, reason, attempt, policy.retries, wait)
        yield Sleep(wait)


__all__ = [
    "RETRY_STATUSES",
    "RequestSpec",
    "RawResponse",
    "Send",
    "Sleep",
    "Now",
    "Invoke",
    "Enter",
    "Exit",
    "Effect",
    "Flow",
    "TransportFailure",
    "RetryPolicy",
    "parse_retry_after",
    "decode",
    "error_of",
    "call",
]
