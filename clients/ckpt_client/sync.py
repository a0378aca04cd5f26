"""Blocking client: drives the shared flows with ``httpx.Client`` and ``time.sleep``."""

from __future__ import annotations

import inspect
import random
import time
from collections.abc import Callable, Iterable, Mapping
from types import TracebackType
from typing import Any, TypeVar, cast

import httpx

from ._api import HANDSHAKE_TIMEOUT_S, DEFAULT_BATCH_SIZE, Api
from ._core import Enter, Exit, Flow, Invoke, Now, RawResponse, RetryPolicy, Send, Sleep, TransportFailure
from .helpers import new_id
from .accounting import Accounting
from .effects import BeginAnswer, EffectRecord
from .models import (
    AdmitResult,
    BarrierResult,
    CutKeys,
    DataPlaneRef,
    DispatchResult,
    FailedRow,
    FailResult,
    GroupDetail,
    GroupSpec,
    GroupsResult,
    GymInstance,
    GymRegistration,
    LiveCounts,
    OutboxPage,
    PendingResult,
    RefusedResult,
    RestorePlan,
    RestoreResult,
    Run,
    SealedRow,
    SealResult,
    Snapshot,
    StreamEndedResult,
    TrainStep,
)

T = TypeVar("T")

__all__ = ["CoordinatorClient", "USER_AGENT"]

USER_AGENT = "ckpt-client/0.1"

#: httpx errors that prove the request never reached the server: safe to repeat anything.
UNSENT_ERRORS: tuple[type[Exception], ...] = (httpx.ConnectError, httpx.ConnectTimeout, httpx.PoolTimeout)
#: httpx errors after which the request may or may not have been processed.
MAYBE_SENT_ERRORS: tuple[type[Exception], ...] = (httpx.TimeoutException, httpx.NetworkError, httpx.RemoteProtocolError)


def client_headers(token: str, extra: Mapping[str, str] | None) -> dict[str, str]:
    headers = {"Authorization": f"Bearer {token}", "User-Agent": USER_AGENT, "Accept": "application/json, application/problem+json"}
    headers.update(extra or {})
    return headers


def _context_manager(barrier: Any) -> Any:
    # A context manager (a lock) is used as is; anything else is a factory of one.
    return barrier if hasattr(barrier, "__enter__") or hasattr(barrier, "__aenter__") else barrier()


class CoordinatorClient:
    """Thin trainer client of the checkpoint coordinator (blocking flavour).

    ``token`` is the run's token (or the admin token for :meth:`create_run`); ``run_id`` names
    the run every run-scoped call addresses. Every state-changing call is retried on connection
    errors and 502/503/504 (``retries`` times, exponential ``backoff`` doubling up to
    ``max_backoff``, with jitter), which is safe because the coordinator answers identical
    repeats identically. Row reports are split into ``batch_size`` rows per request.
    ``transport`` replaces httpx's network transport (tests, proxies); ``clock``/``sleep``
    make the waiting helpers testable without real time passing. Each call of a snapshot's
    handshake (request, polls, barrier, captured) that gets no answer within
    ``handshake_timeout`` seconds is sent again on a fresh connection, until the snapshot's own
    deadline: a replica that stopped answering holds the trainer's barrier seconds, not the
    whole ``timeout``.

    Thread-safe: one instance may be shared by the threads of a trainer process.
    """

    def __init__(
        self,
        base_url: str,
        token: str,
        *,
        run_id: str | None = None,
        timeout: float = 30.0,
        retries: int = 5,
        backoff: float = 0.25,
        max_backoff: float = 10.0,
        batch_size: int = DEFAULT_BATCH_SIZE,
        transport: httpx.BaseTransport | None = None,
        headers: Mapping[str, str] | None = None,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], None] = time.sleep,
        rng: random.Random | None = None,
        handshake_timeout: float = HANDSHAKE_TIMEOUT_S,
    ) -> None:
        self._api = Api(run_id, RetryPolicy(retries, backoff, max_backoff, rng or random.Random()), batch_size, handshake_timeout)
        self._transport = transport
        self._http = httpx.Client(base_url=base_url, timeout=timeout, transport=transport, headers=client_headers(token, headers))
        self._clock = clock
        self._sleep = sleep

    # ---------------------------------------------------------------------------- lifecycle

    @property
    def run_id(self) -> str | None:
        return self._api.run_id

    @property
    def retry_policy(self) -> RetryPolicy:
        return self._api.policy

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> CoordinatorClient:
        return self

    def __exit__(self, et: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None) -> None:
        self.close()

    # ---------------------------------------------------------------------------- driver

    def _drive(self, flow: Flow[T]) -> T:
        value: Any = None
        error: BaseException | None = None
        while True:
            try:
                effect = flow.throw(error) if error is not None else flow.send(value)
            except StopIteration as stop:
                return cast(T, stop.value)
            value, error = None, None
            try:
                value = self._perform(effect)
            except BaseException as e:  # handed to the flow, which re-raises what it does not handle
                error = e

    def _perform(self, effect: Any) -> Any:
        if isinstance(effect, Send):
            req = effect.request
            # A fresh connection for a retry after no answer: a new client with its own pool (a
            # transport given at construction is the caller's to manage, and is reused).
            fresh = httpx.Client(base_url=self._http.base_url, headers=self._http.headers, timeout=self._http.timeout) \
                if req.fresh_connection and self._transport is None else None
            try:
                r = (fresh or self._http).request(
                    req.method,
                    req.path,
                    json=req.json,
                    params=req.params,
                    timeout=req.timeout if req.timeout is not None else httpx.USE_CLIENT_DEFAULT,
                )
            except UNSENT_ERRORS as e:
                raise TransportFailure(e, unsent=True) from e
            except MAYBE_SENT_ERRORS as e:
                raise TransportFailure(e, unsent=False) from e
            finally:
                if fresh is not None:
                    fresh.close()
            return RawResponse(r.status_code, r.headers, r.content)
        if isinstance(effect, Sleep):
            self._sleep(max(0.0, effect.seconds))
            return None
        if isinstance(effect, Now):
            return self._clock()
        if isinstance(effect, Invoke):
            result = effect.fn(*effect.args)
            if inspect.isawaitable(result):
                raise TypeError("callback returned an awaitable; use AsyncCoordinatorClient for async callbacks")
            return result
        if isinstance(effect, Enter):
            cm = _context_manager(effect.factory)
            cm.__enter__()
            return cm
        if isinstance(effect, Exit):
            e = effect.error
            effect.handle.__exit__(type(e) if e else None, e, e.__traceback__ if e else None)
            return None
        raise TypeError(f"unknown effect {effect!r}")

    # ---------------------------------------------------------------------------- runs

    def create_run(self, run_id: str, checkpoint_root: str, recovery: Mapping[str, Any] | None = None) -> Run:
        """Create a run (admin token). The answer's ``run_token`` is shown only this once, so
        this call is retried only when the request provably never reached the server."""
        return self._drive(self._api.create_run(run_id, checkpoint_root, recovery))

    def get_run(self) -> Run:
        return self._drive(self._api.get_run())

    def close_run(self) -> Run:
        return self._drive(self._api.close_run())

    # ------------------------------------------------- live rollouts (docs/ledger.md#live-rollouts)

    def admit_groups(self, groups: Iterable[GroupSpec | Mapping[str, Any]], *, batch_size: int | None = None) -> AdmitResult:
        """Admit prompt groups; answers each group's rows to send (repeats answer the same ids)."""
        return self._drive(self._api.admit_groups(groups, batch_size))

    def dispatch(
        self, rollout_ids: Iterable[str], *, dispatch_id: str | None = None, instance_id: str | None = None, batch_size: int | None = None
    ) -> DispatchResult:
        """Record rows as sent to Gym. Raises :class:`GateClosed` while a snapshot holds the gate."""
        return self._drive(self._api.dispatch(rollout_ids, dispatch_id, instance_id, batch_size))

    def dispatch_when_open(
        self,
        rollout_ids: Iterable[str],
        *,
        dispatch_id: str | None = None,
        instance_id: str | None = None,
        timeout: float = 600.0,
        max_wait: float = 5.0,
        batch_size: int | None = None,
    ) -> DispatchResult:
        """:meth:`dispatch`, waiting (never sooner than Retry-After, doubling up to ``max_wait``)
        while the gate is closed; raises the last :class:`GateClosed` after ``timeout`` seconds."""
        return self._drive(self._api.dispatch_when_open(rollout_ids, dispatch_id, instance_id, timeout, max_wait, batch_size))

    def report_refused(self, rollout_ids: Iterable[str], *, batch_size: int | None = None) -> RefusedResult:
        """Gym refused these rows at admission (parked): same ids, re-send after the gate reopens."""
        return self._drive(self._api.report_refused(rollout_ids, batch_size))

    def report_sealed(self, rows: Iterable[SealedRow | Mapping[str, Any]], *, batch_size: int | None = None) -> SealResult:
        return self._drive(self._api.report_sealed(rows, batch_size))

    def report_failed(self, rows: Iterable[FailedRow | Mapping[str, Any]], *, batch_size: int | None = None) -> FailResult:
        """Failed rows; the answer's ``rows_to_send`` are their replacements (new rollout ids)."""
        return self._drive(self._api.report_failed(rows, batch_size))

    def report_stream_ended(self, dispatch_id: str, returned: Iterable[str]) -> StreamEndedResult:
        """A dispatch's /run stream ended; ``returned`` names every row whose result came back
        (reported or about to be). One request: the list cannot be split."""
        return self._drive(self._api.report_stream_ended(dispatch_id, returned))

    def finalize_groups(self, group_ids: Iterable[str], *, batch_size: int | None = None) -> GroupsResult:
        return self._drive(self._api.finalize_groups(group_ids, batch_size))

    def abandon_groups(self, group_ids: Iterable[str], *, batch_size: int | None = None) -> GroupsResult:
        return self._drive(self._api.abandon_groups(group_ids, batch_size))

    def begin_effect(
        self, rollout_id: str, gym_attempt: int, seq: int, effect: str, digest: str, *, call_id: str | None = None
    ) -> BeginAnswer:
        """Ask before a tool acts outside Gym (docs/effects.md); usually through an effect journal
        (``ckpt_client.effects``) rather than directly."""
        return self._drive(self._api.begin_effect(rollout_id, gym_attempt, seq, effect, digest, call_id))

    def complete_effect(self, effect_id: int, result: Any) -> EffectRecord:
        return self._drive(self._api.complete_effect(effect_id, result))

    def abandon_effect(self, effect_id: int) -> EffectRecord:
        return self._drive(self._api.abandon_effect(effect_id))

    def effects(self, *, orphaned: bool | None = None, rollout_id: str | None = None, page_size: int = 1000) -> list[EffectRecord]:
        """The run's journal (``orphaned=True``: the effects of discarded timelines), every page."""
        return self._drive(self._api.effects(orphaned, rollout_id, page_size))

    def accounting(self) -> Accounting:
        """The run's groups by bucket (``conserved``: they add up to its admissions), its
        rollout-seconds by fate, and what each restore kept."""
        return self._drive(self._api.accounting())

    def counts(self) -> LiveCounts:
        return self._drive(self._api.counts())

    def group(self, group_id: str) -> GroupDetail:
        return self._drive(self._api.group(group_id))

    def pending(self, rollout_ids: Iterable[str], *, batch_size: int | None = None) -> list[str]:
        """Which of these rows are still dispatched without a result."""
        return self._drive(self._api.pending(rollout_ids, batch_size))

    def pending_detail(self, rollout_ids: Iterable[str], *, batch_size: int | None = None) -> PendingResult:
        """Like :meth:`pending`, and which of these rows the coordinator gave up as stragglers,
        with their groups' rows to send instead (``PendingResult.rows_to_send``)."""
        return self._drive(self._api.pending_detail(rollout_ids, batch_size))

    def outbox(self, *, limit: int = 100, after: int | None = None) -> OutboxPage:
        return self._drive(self._api.outbox(limit, after))

    # --------------------------------------------------------- snapshots (docs/ledger.md#snapshots)

    def announce_train_step(self, step: int, checkpoint_ref: str | None = None) -> TrainStep:
        """A trainer checkpoint for ``step`` committed (create-or-return). A snapshot anchored
        on an older step that has not cut its ledger yet is aborted (the train step wins)."""
        return self._drive(self._api.announce_train_step(step, checkpoint_ref))

    def request_snapshot(
        self, anchor_step: int, *, snapshot_id: str | None = None, stop: bool = False, deadline_s: float | None = None
    ) -> Snapshot:
        return self._drive(self._api.request_snapshot(anchor_step, snapshot_id or new_id("snap"), stop, deadline_s))

    def reopen(self) -> Run:
        """Reopen dispatch after a stopping snapshot when the run goes on without a restore
        (the stop turned out not to be needed)."""
        return self._drive(self._api.reopen())

    def get_snapshot(self, snapshot_id: str, *, wait_s: float | None = None, watch_token: str | None = None) -> Snapshot:
        """The snapshot; with ``wait_s`` and a document's ``watch_token``, once it moved on from that document (at most ``wait_s``)."""
        return self._drive(self._api.get_snapshot(snapshot_id, wait_s, watch_token))

    def list_snapshots(self) -> list[Snapshot]:
        return self._drive(self._api.list_snapshots())

    def snapshot_history(self, *, limit: int | None = None, page_size: int = 0) -> list[Snapshot]:
        """The run's snapshots, newest first, with their phase timings, outcome, reason and
        per-instance Gym figures (docs/ledger.md#snapshot-history): ``limit`` of them, or all; the server's
        pages (``page_size`` snapshots each, 0: the largest it gives) are joined."""
        return self._drive(self._api.snapshot_history(limit, page_size))

    def abort_snapshot(
        self,
        snapshot_id: str,
        reason: str = "superseded",
        *,
        detail: str | None = None,
        wait: bool = True,
        timeout: float = 120.0,
        poll_interval: float = 0.2,
    ) -> Snapshot:
        """Abort a snapshot that has not had its capture reported: Gym is resumed, the gate
        reopens, the previous published snapshot stays authoritative. ``reason``:
        ``superseded`` (a new trainer incarnation takes over; the default), ``cancelled`` or
        ``data_plane_failed``. With ``wait`` (the default) returns once it has ended; raises
        :class:`SnapshotTimeout` after ``timeout`` seconds."""
        return self._drive(self._api.abort_snapshot(snapshot_id, reason, detail, wait, timeout, poll_interval))

    def snapshot_barrier(self, snapshot_id: str, delta: bool = False) -> BarrierResult:
        """``delta``: the caller holds the pre-cut's keys (:meth:`snapshot_staging_keys`); see
        :meth:`BarrierResult.with_base`."""
        return self._drive(self._api.snapshot_barrier(snapshot_id, delta))

    def snapshot_staging_keys(self, snapshot_id: str) -> CutKeys:
        return self._drive(self._api.snapshot_staging_keys(snapshot_id))

    def snapshot_captured(self, snapshot_id: str, reference: DataPlaneRef | Mapping[str, str] | tuple[str, str]) -> Snapshot | None:
        return self._drive(self._api.snapshot_captured(snapshot_id, reference))

    def snapshot(
        self,
        step: int,
        capture: Callable[[list[str]], DataPlaneRef | Mapping[str, str] | tuple[str, str]],
        *,
        snapshot_id: str | None = None,
        barrier: Any = None,
        poll_interval: float = 0.5,
        timeout: float = 1800.0,
    ) -> Snapshot:
        """Run the trainer's side of a snapshot anchored on train step ``step``.

        ``barrier`` (a context manager, or a zero-argument callable returning one) is held from
        just before the coordinator cuts its ledger until ``capture`` returned: take the
        trainer's data-plane barrier there. ``capture(staging_keys)`` saves the data plane and
        returns ``{path, digest}``. Returns the published snapshot; raises
        :class:`SnapshotFailed` (failed/aborted) or :class:`SnapshotTimeout`. The helper waits
        on the coordinator (a long poll) and hears of each step as it happens; ``poll_interval``
        applies only to a coordinator that offers no long poll.
        """
        return self._drive(self._api.snapshot(step, capture, snapshot_id, barrier, poll_interval, timeout))

    def stop_snapshot(
        self,
        step: int,
        capture: Callable[[list[str]], DataPlaneRef | Mapping[str, str] | tuple[str, str]],
        *,
        deadline_s: float,
        snapshot_id: str | None = None,
        barrier: Any = None,
        poll_interval: float = 0.1,
    ) -> Snapshot:
        """A stopping snapshot, for the signal handler of a trainer whose allocation ends
        (docs/ledger.md#stopping-snapshots): taken like :meth:`snapshot` but within ``deadline_s`` seconds,
        with Gym left parked after the cut and dispatch refused (``run_stopped``) until a
        restore or :meth:`reopen`. Anchor it on the newest announced step. Returns the published
        snapshot; raises :class:`SnapshotFailed` (``deadline_exceeded`` when it could not make
        it: the previous snapshot stays authoritative)."""
        return self._drive(self._api.stop_snapshot(step, capture, snapshot_id, barrier, poll_interval, deadline_s))

    # ------------------------------------------------------------- restore (docs/ledger.md#restore)

    def register_gym_instances(self, instances: Iterable[GymInstance | Mapping[str, Any]]) -> GymRegistration:
        return self._drive(self._api.register_gym_instances(instances))

    def unregister_gym_instance(self, instance_id: str) -> None:
        """Forget an instance of the run's Gym topology (one of an allocation that ended, before
        the next allocation's instances are registered). Refused while a snapshot runs."""
        self._drive(self._api.unregister_gym_instance(instance_id))

    def restore_plan(
        self,
        step: int | None = None,
        snapshot_id: str | None = None,
        *,
        with_gym_state: bool = True,
        include_reused: bool = False,
        instance_map: Mapping[str, str] | None = None,
    ) -> RestorePlan:
        """The plan for the newest published snapshot anchored at or before ``step`` (or the
        named one), every page joined. A preview: :meth:`restore` applies it. ``instance_map``
        ``{saved instance: live instance}`` restores into a deployment of another shape
        (docs/ledger.md#another-gym-topology)."""
        return self._drive(self._api.restore_plan(step, snapshot_id, with_gym_state, include_reused, instance_map))

    def restore(
        self,
        restore_id: str | None = None,
        *,
        snapshot_id: str | None = None,
        step: int | None = None,
        with_gym_state: bool = True,
        timeout: float = 1800.0,
        poll_interval: float = 2.0,
        instance_map: Mapping[str, str] | None = None,
    ) -> RestoreResult:
        """Apply a restore (idempotent per ``restore_id``, minted here if not given) and answer
        what to send next (every page of the answer's rows joined). ``with_gym_state=False``
        when the Gym instances survived the crash (they are not fresh): continuations become
        restarts. Waits while the same restore id
        is still running elsewhere, up to ``timeout`` seconds in all. ``instance_map`` as for
        :meth:`restore_plan`."""
        return self._drive(self._api.restore(restore_id, snapshot_id, step, with_gym_state, timeout, poll_interval, instance_map))
