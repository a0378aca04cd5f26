"""Asyncio client: drives the shared flows with ``httpx.AsyncClient`` and ``asyncio.sleep``."""

from __future__ import annotations

import asyncio
import inspect
import random
import time
from collections.abc import Awaitable, Callable, Iterable, Mapping
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
from .sync import MAYBE_SENT_ERRORS, UNSENT_ERRORS, client_headers

T = TypeVar("T")

__all__ = ["AsyncCoordinatorClient"]


class AsyncCoordinatorClient:
    """Thin trainer client of the checkpoint coordinator (asyncio flavour).

    Same constructor, methods and behaviour as :class:`~ckpt_client.CoordinatorClient`, with
    every call awaitable; both drive the same flows. ``transport`` may be an
    ``httpx.ASGITransport`` to talk to an in-process app. Callbacks given to :meth:`snapshot`
    may be sync or async; ``barrier`` may be a sync or an async context manager.
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
        transport: httpx.AsyncBaseTransport | None = None,
        headers: Mapping[str, str] | None = None,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
        rng: random.Random | None = None,
        handshake_timeout: float = HANDSHAKE_TIMEOUT_S,
    ) -> None:
        self._api = Api(run_id, RetryPolicy(retries, backoff, max_backoff, rng or random.Random()), batch_size, handshake_timeout)
        self._transport = transport
        self._http = httpx.AsyncClient(base_url=base_url, timeout=timeout, transport=transport, headers=client_headers(token, headers))
        self._clock = clock
        self._sleep = sleep

    # ---------------------------------------------------------------------------- lifecycle

    @property
    def run_id(self) -> str | None:
        return self._api.run_id

    @property
    def retry_policy(self) -> RetryPolicy:
        return self._api.policy

    async def close(self) -> None:
        await self._http.aclose()

    async def __aenter__(self) -> AsyncCoordinatorClient:
        return self

    async def __aexit__(self, et: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None) -> None:
        await self.close()

    # ---------------------------------------------------------------------------- driver

    async def _drive(self, flow: Flow[T]) -> T:
        value: Any = None
        error: BaseException | None = None
        while True:
            try:
                effect = flow.throw(error) if error is not None else flow.send(value)
            except StopIteration as stop:
                return cast(T, stop.value)
            value, error = None, None
            try:
                value = await self._perform(effect)
            except BaseException as e:  # incl. cancellation: the flow releases a held barrier first
                error = e

    async def _perform(self, effect: Any) -> Any:
        if isinstance(effect, Send):
            req = effect.request
            # A fresh connection for a retry after no answer: a new client with its own pool (a
            # transport given at construction is the caller's to manage, and is reused).
            fresh = httpx.AsyncClient(base_url=self._http.base_url, headers=self._http.headers, timeout=self._http.timeout) \
                if req.fresh_connection and self._transport is None else None
            try:
                r = await (fresh or self._http).request(
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
                    await fresh.aclose()
            return RawResponse(r.status_code, r.headers, r.content)
        if isinstance(effect, Sleep):
            await self._sleep(max(0.0, effect.seconds))
            return None
        if isinstance(effect, Now):
            return self._clock()
        if isinstance(effect, Invoke):
            result = effect.fn(*effect.args)
            return (await result) if inspect.isawaitable(result) else result
        if isinstance(effect, Enter):
            f = effect.factory
            cm = f if hasattr(f, "__aenter__") or hasattr(f, "__enter__") else f()
            if hasattr(cm, "__aenter__"):
                await cm.__aenter__()
            else:
                cm.__enter__()
            return cm
        if isinstance(effect, Exit):
            e = effect.error
            args = (type(e) if e else None, e, e.__traceback__ if e else None)
            if hasattr(effect.handle, "__aexit__"):
                await effect.handle.__aexit__(*args)
            else:
                effect.handle.__exit__(*args)
            return None
        raise TypeError(f"unknown effect {effect!r}")

    # ---------------------------------------------------------------------------- runs

    async def create_run(self, run_id: str, checkpoint_root: str, recovery: Mapping[str, Any] | None = None) -> Run:
        """Create a run (admin token). The answer's ``run_token`` is shown only this once, so
        this call is retried only when the request provably never reached the server."""
        return await self._drive(self._api.create_run(run_id, checkpoint_root, recovery))

    async def get_run(self) -> Run:
        return await self._drive(self._api.get_run())

    async def close_run(self) -> Run:
        return await self._drive(self._api.close_run())

    # ------------------------------------------------- live rollouts (docs/ledger.md#live-rollouts)

    async def admit_groups(self, groups: Iterable[GroupSpec | Mapping[str, Any]], *, batch_size: int | None = None) -> AdmitResult:
        """Admit prompt groups; answers each group's rows to send (repeats answer the same ids)."""
        return await self._drive(self._api.admit_groups(groups, batch_size))

    async def dispatch(
        self, rollout_ids: Iterable[str], *, dispatch_id: str | None = None, instance_id: str | None = None, batch_size: int | None = None
    ) -> DispatchResult:
        """Record rows as sent to Gym. Raises :class:`GateClosed` while a snapshot holds the gate."""
        return await self._drive(self._api.dispatch(rollout_ids, dispatch_id, instance_id, batch_size))

    async def dispatch_when_open(
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
        return await self._drive(self._api.dispatch_when_open(rollout_ids, dispatch_id, instance_id, timeout, max_wait, batch_size))

    async def report_refused(self, rollout_ids: Iterable[str], *, batch_size: int | None = None) -> RefusedResult:
        """Gym refused these rows at admission (parked): same ids, re-send after the gate reopens."""
        return await self._drive(self._api.report_refused(rollout_ids, batch_size))

    async def report_sealed(self, rows: Iterable[SealedRow | Mapping[str, Any]], *, batch_size: int | None = None) -> SealResult:
        return await self._drive(self._api.report_sealed(rows, batch_size))

    async def report_failed(self, rows: Iterable[FailedRow | Mapping[str, Any]], *, batch_size: int | None = None) -> FailResult:
        """Failed rows; the answer's ``rows_to_send`` are their replacements (new rollout ids)."""
        return await self._drive(self._api.report_failed(rows, batch_size))

    async def report_stream_ended(self, dispatch_id: str, returned: Iterable[str]) -> StreamEndedResult:
        """A dispatch's /run stream ended; ``returned`` names every row whose result came back
        (reported or about to be). One request: the list cannot be split."""
        return await self._drive(self._api.report_stream_ended(dispatch_id, returned))

    async def finalize_groups(self, group_ids: Iterable[str], *, batch_size: int | None = None) -> GroupsResult:
        return await self._drive(self._api.finalize_groups(group_ids, batch_size))

    async def abandon_groups(self, group_ids: Iterable[str], *, batch_size: int | None = None) -> GroupsResult:
        return await self._drive(self._api.abandon_groups(group_ids, batch_size))

    async def begin_effect(
        self, rollout_id: str, gym_attempt: int, seq: int, effect: str, digest: str, *, call_id: str | None = None
    ) -> BeginAnswer:
        """Ask before a tool acts outside Gym (docs/effects.md); usually through an effect journal
        (``ckpt_client.effects``) rather than directly."""
        return await self._drive(self._api.begin_effect(rollout_id, gym_attempt, seq, effect, digest, call_id))

    async def complete_effect(self, effect_id: int, result: Any) -> EffectRecord:
        return await self._drive(self._api.complete_effect(effect_id, result))

    async def abandon_effect(self, effect_id: int) -> EffectRecord:
        return await self._drive(self._api.abandon_effect(effect_id))

    async def effects(self, *, orphaned: bool | None = None, rollout_id: str | None = None, page_size: int = 1000) -> list[EffectRecord]:
        """The run's journal (``orphaned=True``: the effects of discarded timelines), every page."""
        return await self._drive(self._api.effects(orphaned, rollout_id, page_size))

    async def accounting(self) -> Accounting:
        """The run's groups by bucket (``conserved``: they add up to its admissions), its
        rollout-seconds by fate, and what each restore kept."""
        return await self._drive(self._api.accounting())

    async def counts(self) -> LiveCounts:
        return await self._drive(self._api.counts())

    async def group(self, group_id: str) -> GroupDetail:
        return await self._drive(self._api.group(group_id))

    async def pending(self, rollout_ids: Iterable[str], *, batch_size: int | None = None) -> list[str]:
        """Which of these rows are still dispatched without a result."""
        return await self._drive(self._api.pending(rollout_ids, batch_size))

    async def pending_detail(self, rollout_ids: Iterable[str], *, batch_size: int | None = None) -> PendingResult:
        """Like :meth:`pending`, and which of these rows the coordinator gave up as stragglers,
        with their groups' rows to send instead (``PendingResult.rows_to_send``)."""
        return await self._drive(self._api.pending_detail(rollout_ids, batch_size))

    async def outbox(self, *, limit: int = 100, after: int | None = None) -> OutboxPage:
        return await self._drive(self._api.outbox(limit, after))

    # --------------------------------------------------------- snapshots (docs/ledger.md#snapshots)

    async def announce_train_step(self, step: int, checkpoint_ref: str | None = None) -> TrainStep:
        """A trainer checkpoint for ``step`` committed (create-or-return). A snapshot anchored
        on an older step that has not cut its ledger yet is aborted (the train step wins)."""
        return await self._drive(self._api.announce_train_step(step, checkpoint_ref))

    async def request_snapshot(
        self, anchor_step: int, *, snapshot_id: str | None = None, stop: bool = False, deadline_s: float | None = None
    ) -> Snapshot:
        return await self._drive(self._api.request_snapshot(anchor_step, snapshot_id or new_id("snap"), stop, deadline_s))

    async def reopen(self) -> Run:
        """Reopen dispatch after a stopping snapshot when the run goes on without a restore
        (the stop turned out not to be needed)."""
        return await self._drive(self._api.reopen())

    async def get_snapshot(self, snapshot_id: str, *, wait_s: float | None = None, watch_token: str | None = None) -> Snapshot:
        """The snapshot; with ``wait_s`` and a document's ``watch_token``, once it moved on from that document (at most ``wait_s``)."""
        return await self._drive(self._api.get_snapshot(snapshot_id, wait_s, watch_token))

    async def list_snapshots(self) -> list[Snapshot]:
        return await self._drive(self._api.list_snapshots())

    async def snapshot_history(self, *, limit: int | None = None, page_size: int = 0) -> list[Snapshot]:
        """The run's snapshots, newest first, with their phase timings, outcome, reason and
        per-instance Gym figures (docs/ledger.md#snapshot-history): ``limit`` of them, or all; the server's
        pages (``page_size`` snapshots each, 0: the largest it gives) are joined."""
        return await self._drive(self._api.snapshot_history(limit, page_size))

    async def abort_snapshot(
        self,
        snapshot_id: str,
        reason: str = "superseded",
        *,
        detail: str | None = None,
        wait: bool = True,
        timeout: float = 120.0,
        poll_interval: float = 0.2,
    ) -> Snapshot:
        """:meth:`CoordinatorClient.abort_snapshot`, awaited."""
        return await self._drive(self._api.abort_snapshot(snapshot_id, reason, detail, wait, timeout, poll_interval))

    async def snapshot_barrier(self, snapshot_id: str, delta: bool = False) -> BarrierResult:
        """``delta``: the caller holds the pre-cut's keys (:meth:`snapshot_staging_keys`); see
        :meth:`BarrierResult.with_base`."""
        return await self._drive(self._api.snapshot_barrier(snapshot_id, delta))

    async def snapshot_staging_keys(self, snapshot_id: str) -> CutKeys:
        return await self._drive(self._api.snapshot_staging_keys(snapshot_id))

    async def snapshot_captured(self, snapshot_id: str, reference: DataPlaneRef | Mapping[str, str] | tuple[str, str]) -> Snapshot | None:
        return await self._drive(self._api.snapshot_captured(snapshot_id, reference))

    async def snapshot(
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
        return await self._drive(self._api.snapshot(step, capture, snapshot_id, barrier, poll_interval, timeout))

    async def stop_snapshot(
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
        return await self._drive(self._api.stop_snapshot(step, capture, snapshot_id, barrier, poll_interval, deadline_s))

    # ------------------------------------------------------------- restore (docs/ledger.md#restore)

    async def register_gym_instances(self, instances: Iterable[GymInstance | Mapping[str, Any]]) -> GymRegistration:
        return await self._drive(self._api.register_gym_instances(instances))

    async def unregister_gym_instance(self, instance_id: str) -> None:
        """Forget an instance of the run's Gym topology (one of an allocation that ended, before
        the next allocation's instances are registered). Refused while a snapshot runs."""
        await self._drive(self._api.unregister_gym_instance(instance_id))

    async def restore_plan(
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
        return await self._drive(self._api.restore_plan(step, snapshot_id, with_gym_state, include_reused, instance_map))

    async def restore(
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
        return await self._drive(self._api.restore(restore_id, snapshot_id, step, with_gym_state, timeout, poll_interval, instance_map))
