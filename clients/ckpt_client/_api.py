"""Every client operation as a sans-IO flow (see :mod:`._core`).

One :class:`Api` builds the requests of one run, splits large reports into batches, and runs the
multi-step helpers (waiting on a closed gate, the trainer side of a snapshot). The sync and
async clients drive these flows; they hold no logic of their own.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import replace
from typing import Any, TypeVar
from urllib.parse import quote

from ._core import Enter, Exit, Flow, Invoke, Now, RequestSpec, RetryPolicy, Sleep, call
from .errors import Conflict, CoordinatorError, GateClosed, SnapshotFailed, SnapshotNotAwaiting, SnapshotTimeout
from .helpers import batched, batched_by_weight, new_id

#: The rows (groups x expected_generations) one admit may carry (the coordinator's limit).
MAX_ADMIT_ROWS = 20_000

#: Why a trainer gives a snapshot up: its data-plane capture failed (the snapshot ends failed),
#: it cancels it, or it is a new incarnation taking over from the one that asked for it.
ABORT_REASONS = ("data_plane_failed", "cancelled", "superseded")
from .accounting import Accounting
from .effects import BeginAnswer, EffectPage, EffectRecord
from .models import (
    AdmitResult,
    BarrierResult,
    CutKeys,
    DataPlaneRef,
    DispatchResult,
    FailResult,
    GroupDetail,
    GroupsResult,
    GymRegistration,
    LiveCounts,
    OutboxPage,
    PendingResult,
    RefusedResult,
    RestorePlan,
    RestoreResult,
    Run,
    SealResult,
    Snapshot,
    StreamEndedResult,
    TrainStep,
    row_json,
)

R = TypeVar("R")

#: Rows per request of the batching helpers. The server accepts up to 20 000 rows (5 000 groups
#: for admit) and 8 MiB per body; 1 000 keeps each transaction short, so a trainer's report
#: never holds group locks long enough to stall a concurrent snapshot drain.
DEFAULT_BATCH_SIZE = 1000
# How long one long poll of a snapshot waits (the coordinator's bound is 20 s), and how much longer
# its HTTP request may take than that.
LONG_POLL_S = 10.0
WAIT_MARGIN_S = 10.0
#: How long one call of a snapshot's handshake may go unanswered before it is sent again.
HANDSHAKE_TIMEOUT_S = 5.0
# The phases in which Gym is still at work, so fetching the pre-cut's keys costs the park nothing.
PRE_CUT_FETCH_PHASES = ("prepare", "commit")
#: Server caps, checked client-side only where splitting is impossible (stream ended).
MAX_STREAM_RETURNED = 20_000


def _seg(value: str) -> str:
    return quote(str(value), safe="")


class Api:
    """Requests and flows of one client. ``run_id`` may be None for admin-only use."""

    def __init__(
        self, run_id: str | None, policy: RetryPolicy, batch_size: int = DEFAULT_BATCH_SIZE, handshake_timeout: float = HANDSHAKE_TIMEOUT_S
    ) -> None:
        if batch_size < 1:
            raise ValueError("batch_size must be >= 1")
        if not handshake_timeout > 0:
            raise ValueError("handshake_timeout must be > 0")
        self.run_id = run_id
        self.policy = policy
        self.batch_size = batch_size
        self.handshake_timeout = handshake_timeout

    def _handshake(self, spec: RequestSpec, give_up_at: float | None, *, waits: float = 0.0) -> RequestSpec:
        """``spec`` as a call of a snapshot's handshake: answered within ``handshake_timeout`` (plus
        ``waits``, a long poll's own wait), else sent again on a fresh connection until the
        snapshot's deadline. A replica that stopped answering (a pause, a stalled node) holds the
        trainer, and its data-plane barrier, seconds rather than a whole client timeout."""
        if give_up_at is None:
            return spec
        return replace(spec, timeout=self.handshake_timeout + waits, give_up_at=give_up_at)

    # ---------------------------------------------------------------------------- plumbing

    def _run_path(self, suffix: str = "") -> str:
        if not self.run_id:
            raise ValueError("this call needs a run: construct the client with run_id=...")
        return f"/v1/runs/{_seg(self.run_id)}{suffix}"

    def _call(self, req: RequestSpec) -> Flow[Any]:
        return call(req, self.policy)

    def _batched(
        self,
        path: str,
        key: str,
        items: Iterable[Any],
        parse: Callable[[Any], R],
        *,
        extra: Mapping[str, Any] | None = None,
        batch_size: int | None = None,
    ) -> Flow[list[R]]:
        """POST ``items`` in batches; each batch is atomic on the server, the sequence is not.

        On a refusal the error carries ``batch_index``; every earlier batch was written, and
        since identical repeats answer ``unchanged`` the caller may fix and re-send everything.
        """
        parts: list[R] = []
        for i, chunk in enumerate(batched(items, batch_size or self.batch_size)):
            try:
                doc = yield from self._call(RequestSpec("POST", path, {**(extra or {}), key: chunk}))
            except CoordinatorError as e:
                e.batch_index = i
                raise
            parts.append(parse(doc))
        return parts

    # ---------------------------------------------------------------------------- runs

    def create_run(self, run_id: str, checkpoint_root: str, recovery: Mapping[str, Any] | None) -> Flow[Run]:
        body = {"run_id": run_id, "checkpoint_root": checkpoint_root, "recovery": dict(recovery or {})}
        doc = yield from self._call(RequestSpec("POST", "/v1/runs", body, retry="unsent"))
        return Run.parse(doc)

    def get_run(self) -> Flow[Run]:
        return Run.parse((yield from self._call(RequestSpec("GET", self._run_path()))))

    def close_run(self) -> Flow[Run]:
        return Run.parse((yield from self._call(RequestSpec("POST", self._run_path("/close")))))

    # ------------------------------------------------- live rollouts (docs/ledger.md#live-rollouts)

    def admit_groups(self, groups: Iterable[Any], batch_size: int | None) -> Flow[AdmitResult]:
        docs = [row_json(g, "GroupSpec") for g in groups]
        # An admit also carries at most MAX_ADMIT_ROWS rows (groups times their generations).
        chunks = batched_by_weight(docs, batch_size or self.batch_size, lambda g: int(g.get("expected_generations") or 1), MAX_ADMIT_ROWS)
        parts: list[AdmitResult] = []
        for i, chunk in enumerate(chunks):
            try:
                doc = yield from self._call(RequestSpec("POST", self._run_path("/groups/admit"), {"groups": chunk}))
            except CoordinatorError as e:
                e.batch_index = i
                raise
            parts.append(AdmitResult.parse(doc))
        return AdmitResult.merge(parts)

    def _dispatch_spec(self, dispatch_id: str, instance_id: str | None, ids: Sequence[str]) -> RequestSpec:
        body: dict[str, Any] = {"dispatch_id": dispatch_id, "rollout_ids": list(ids)}
        if instance_id is not None:
            body["instance_id"] = instance_id
        return RequestSpec("POST", self._run_path("/attempts/dispatch"), body)

    def dispatch(self, rollout_ids: Iterable[str], dispatch_id: str | None, instance_id: str | None, batch_size: int | None) -> Flow[DispatchResult]:
        # The id is fixed here, once, so retries and later batches belong to the same dispatch.
        did = dispatch_id or new_id("dispatch")
        parts: list[DispatchResult] = []
        for i, chunk in enumerate(batched(list(rollout_ids), batch_size or self.batch_size)):
            try:
                doc = yield from self._call(self._dispatch_spec(did, instance_id, chunk))
            except CoordinatorError as e:
                e.batch_index = i
                raise
            parts.append(DispatchResult.parse(doc))
        return DispatchResult.merge(parts) if parts else DispatchResult(did, instance_id, [])

    def dispatch_when_open(
        self,
        rollout_ids: Iterable[str],
        dispatch_id: str | None,
        instance_id: str | None,
        timeout: float,
        max_wait: float,
        batch_size: int | None,
    ) -> Flow[DispatchResult]:
        """Dispatch, waiting while a snapshot holds the gate, up to ``timeout`` seconds in all.

        Raises the last :class:`GateClosed` when the gate is still closed at the deadline.
        """
        did = dispatch_id or new_id("dispatch")
        deadline = (yield Now()) + timeout
        parts: list[DispatchResult] = []
        for i, chunk in enumerate(batched(list(rollout_ids), batch_size or self.batch_size)):
            waits = 0
            while True:
                try:
                    doc = yield from self._call(self._dispatch_spec(did, instance_id, chunk))
                    break
                except GateClosed as e:
                    remaining = deadline - (yield Now())
                    if remaining <= 0:
                        e.batch_index = i
                        raise
                    wait = self.policy.gate_delay(waits, e.retry_after_s, max_wait)
                    waits += 1
                    yield Sleep(min(wait, remaining))
                except CoordinatorError as e:
                    e.batch_index = i
                    raise
            parts.append(DispatchResult.parse(doc))
        return DispatchResult.merge(parts) if parts else DispatchResult(did, instance_id, [])

    def report_refused(self, rollout_ids: Iterable[str], batch_size: int | None) -> Flow[RefusedResult]:
        parts = yield from self._batched(self._run_path("/attempts/refused"), "rollout_ids", list(rollout_ids), RefusedResult.parse, batch_size=batch_size)
        return RefusedResult.merge(parts)

    def report_sealed(self, rows: Iterable[Any], batch_size: int | None) -> Flow[SealResult]:
        body = [row_json(r, "SealedRow") for r in rows]
        parts = yield from self._batched(self._run_path("/attempts/sealed"), "rows", body, SealResult.parse, batch_size=batch_size)
        return SealResult.merge(parts)

    def report_failed(self, rows: Iterable[Any], batch_size: int | None) -> Flow[FailResult]:
        body = [row_json(r, "FailedRow") for r in rows]
        parts = yield from self._batched(self._run_path("/attempts/failed"), "rows", body, FailResult.parse, batch_size=batch_size)
        return FailResult.merge(parts)

    def report_stream_ended(self, dispatch_id: str, returned: Iterable[str]) -> Flow[StreamEndedResult]:
        back = list(dict.fromkeys(returned))  # the server refuses duplicates; order kept
        if len(back) > MAX_STREAM_RETURNED:
            # Not splittable: every call treats rows absent from *its* list as lost.
            raise ValueError(f"a stream-ended report names at most {MAX_STREAM_RETURNED} returned rows; use smaller dispatches")
        path = self._run_path(f"/dispatches/{_seg(dispatch_id)}/ended")
        return StreamEndedResult.parse((yield from self._call(RequestSpec("POST", path, {"returned": back}))))

    def finalize_groups(self, group_ids: Iterable[str], batch_size: int | None) -> Flow[GroupsResult]:
        parts = yield from self._batched(self._run_path("/groups/finalize"), "group_ids", list(group_ids), GroupsResult.parse, batch_size=batch_size)
        return GroupsResult.merge(parts)

    def abandon_groups(self, group_ids: Iterable[str], batch_size: int | None) -> Flow[GroupsResult]:
        parts = yield from self._batched(self._run_path("/groups/abandon"), "group_ids", list(group_ids), GroupsResult.parse, batch_size=batch_size)
        return GroupsResult.merge(parts)

    def begin_effect(self, rollout_id: str, gym_attempt: int, seq: int, effect: str, digest: str, call_id: str | None) -> Flow[BeginAnswer]:
        body = {"rollout_id": rollout_id, "gym_attempt": gym_attempt, "seq": seq, "effect": effect, "digest": digest, "call_id": call_id}
        return BeginAnswer.parse((yield from self._call(RequestSpec("POST", self._run_path("/effects/begin"), body))))

    def complete_effect(self, effect_id: int, result: Any) -> Flow[EffectRecord]:
        spec = RequestSpec("POST", self._run_path(f"/effects/{int(effect_id)}/complete"), {"result": result})
        return EffectRecord.parse((yield from self._call(spec)))

    def abandon_effect(self, effect_id: int) -> Flow[EffectRecord]:
        return EffectRecord.parse((yield from self._call(RequestSpec("POST", self._run_path(f"/effects/{int(effect_id)}/abandon"), {}))))

    def effects_page(self, orphaned: bool | None, rollout_id: str | None, cursor: int, limit: int) -> Flow[EffectPage]:
        params: dict[str, Any] = {"cursor": cursor, "limit": limit}
        if orphaned is not None:
            params["orphaned"] = "true" if orphaned else "false"
        if rollout_id is not None:
            params["rollout_id"] = rollout_id
        return EffectPage.parse((yield from self._call(RequestSpec("GET", self._run_path("/effects"), params=params))))

    def effects(self, orphaned: bool | None, rollout_id: str | None, page_size: int) -> Flow[list[EffectRecord]]:
        """Every page of the run's journal, in order."""
        out: list[EffectRecord] = []
        cursor = 0
        while True:
            page = yield from self.effects_page(orphaned, rollout_id, cursor, page_size)
            out.extend(page.effects)
            if page.next_cursor is None:
                return out
            cursor = page.next_cursor

    def accounting(self) -> Flow[Accounting]:
        return Accounting.parse((yield from self._call(RequestSpec("GET", self._run_path("/accounting")))))

    def counts(self) -> Flow[LiveCounts]:
        return LiveCounts.parse((yield from self._call(RequestSpec("GET", self._run_path("/counts")))))

    def group(self, group_id: str) -> Flow[GroupDetail]:
        return GroupDetail.parse((yield from self._call(RequestSpec("GET", self._run_path(f"/groups/{_seg(group_id)}")))))

    def pending(self, rollout_ids: Iterable[str], batch_size: int | None) -> Flow[list[str]]:
        def parse(doc: Any) -> list[str]:
            return [str(x) for x in (doc or {}).get("pending", [])]

        parts = yield from self._batched(self._run_path("/attempts/pending"), "rollout_ids", list(rollout_ids), parse, batch_size=batch_size)
        return sorted(x for p in parts for x in p)

    def pending_detail(self, rollout_ids: Iterable[str], batch_size: int | None) -> Flow[PendingResult]:
        parts = yield from self._batched(self._run_path("/attempts/pending"), "rollout_ids", list(rollout_ids), PendingResult.parse, batch_size=batch_size)
        return PendingResult.merge(parts)

    def outbox(self, limit: int, after: int | None) -> Flow[OutboxPage]:
        params: dict[str, Any] = {"limit": limit}
        if after is not None:
            params["after"] = after
        return OutboxPage.parse((yield from self._call(RequestSpec("GET", self._run_path("/outbox"), params=params))))

    # --------------------------------------------------------- snapshots (docs/ledger.md#snapshots)

    def announce_train_step(self, step: int, checkpoint_ref: str | None) -> Flow[TrainStep]:
        body: dict[str, Any] = {"step": step}
        if checkpoint_ref is not None:
            body["checkpoint_ref"] = checkpoint_ref
        return TrainStep.parse((yield from self._call(RequestSpec("POST", self._run_path("/train-steps"), body))), step)

    def request_snapshot(
        self, anchor_step: int, snapshot_id: str, stop: bool = False, deadline_s: float | None = None, give_up_at: float | None = None
    ) -> Flow[Snapshot]:
        body: dict[str, Any] = {"snapshot_id": snapshot_id, "anchor_step": anchor_step}
        # Sent only when used, so a coordinator that predates stopping snapshots sees the contract.
        if stop:
            body["stop"] = True
        if deadline_s is not None:
            body["deadline_s"] = deadline_s
        spec = self._handshake(RequestSpec("POST", self._run_path("/snapshots"), body), give_up_at)
        return Snapshot.parse((yield from self._call(spec)))

    def reopen(self) -> Flow[Run]:
        return Run.parse((yield from self._call(RequestSpec("POST", self._run_path("/reopen")))))

    def get_snapshot(
        self, snapshot_id: str, wait_s: float | None = None, watch_token: str | None = None, give_up_at: float | None = None
    ) -> Flow[Snapshot]:
        """The snapshot document; with ``wait_s`` and ``watch_token`` (the last document's), answered
        as soon as the snapshot moves on from it, at most after ``wait_s``."""
        path = self._run_path(f"/snapshots/{_seg(snapshot_id)}")
        if wait_s is None or watch_token is None:
            spec = self._handshake(RequestSpec("GET", path), give_up_at)
        else:
            params = {"wait_s": f"{wait_s:.3f}", "watch_token": watch_token}
            spec = self._handshake(RequestSpec("GET", path, params=params, timeout=wait_s + WAIT_MARGIN_S), give_up_at, waits=wait_s)
        return Snapshot.parse((yield from self._call(spec)))

    def _next_snapshot(self, snap: Snapshot, poll_interval: float, remaining: float, give_up_at: float | None = None) -> Flow[Snapshot]:
        """The snapshot once it moved on: a long poll when the coordinator offers one (the trainer
        sees the barrier at once, not up to ``poll_interval`` late, and Gym is parked all that
        time), else a sleep of ``poll_interval`` and a read."""
        if snap.watch_token is not None:
            # The server takes 0 < wait_s: a sliver of time left still waits a millisecond.
            wait = max(0.001, min(LONG_POLL_S, remaining))
            return (yield from self.get_snapshot(snap.snapshot_id, wait_s=wait, watch_token=snap.watch_token, give_up_at=give_up_at))
        yield Sleep(min(poll_interval, remaining))
        return (yield from self.get_snapshot(snap.snapshot_id, give_up_at=give_up_at))

    def list_snapshots(self) -> Flow[list[Snapshot]]:
        doc = yield from self._call(RequestSpec("GET", self._run_path("/snapshots")))
        items = doc.get("snapshots", doc.get("items", [])) if isinstance(doc, Mapping) else doc
        return [Snapshot.parse(s) for s in (items if isinstance(items, list) else [])]

    def snapshot_history(self, limit: int | None, page_size: int = 0) -> Flow[list[Snapshot]]:
        """The run's snapshots newest first, ``limit`` of them (None: all), pages of
        ``page_size`` (0: the server's largest) joined."""
        if (limit is not None and limit < 1) or page_size < 0:
            raise ValueError("limit must be >= 1 and page_size >= 0")
        page = min(page_size or SNAPSHOT_PAGE_ROWS, SNAPSHOT_PAGE_ROWS)
        out: list[Snapshot] = []
        before: str | None = None
        while limit is None or len(out) < limit:
            params: dict[str, Any] = {"limit": min(page, limit - len(out)) if limit is not None else page}
            if before is not None:
                params["before"] = before
            doc = yield from self._call(RequestSpec("GET", self._run_path("/snapshots"), params=params))
            items = doc.get("snapshots") if isinstance(doc, Mapping) else None
            out.extend(Snapshot.parse(s) for s in (items if isinstance(items, list) else []))
            before = _str_or_none(doc.get("next_before")) if isinstance(doc, Mapping) else None
            if before is None or not items:
                break
        return out

    def abort_snapshot(self, snapshot_id: str, reason: str, detail: str | None, wait: bool, timeout: float, poll_interval: float) -> Flow[Snapshot]:
        """Give up a snapshot that has not had its capture reported; with ``wait``, until it has
        ended (its owner resumes Gym and reopens the gate first). A snapshot whose capture was
        already reported publishes instead; that is waited for too."""
        if reason not in ABORT_REASONS:
            raise ValueError(f"reason must be one of {', '.join(ABORT_REASONS)}, not {reason!r}")
        if timeout <= 0 or poll_interval <= 0:
            raise ValueError("timeout and poll_interval must be > 0")
        body: dict[str, Any] = {"reason": reason}
        if detail is not None:
            body["detail"] = detail
        deadline = (yield Now()) + timeout
        try:
            snap = Snapshot.parse((yield from self._call(RequestSpec("POST", self._run_path(f"/snapshots/{_seg(snapshot_id)}/abort"), body))))
        except SnapshotNotAwaiting:
            snap = yield from self.get_snapshot(snapshot_id)
        while wait and not snap.terminal:
            remaining = deadline - (yield Now())
            if remaining <= 0:
                raise SnapshotTimeout(f"snapshot {snapshot_id} not ended {timeout:.0f}s after its abort (in phase {snap.phase})", snap)
            yield Sleep(min(poll_interval, remaining))
            snap = yield from self.get_snapshot(snapshot_id)
        return snap

    def snapshot_barrier(self, snapshot_id: str, delta: bool = False, give_up_at: float | None = None) -> Flow[BarrierResult]:
        path = self._run_path(f"/snapshots/{_seg(snapshot_id)}/barrier")
        params = {"staging_keys": "delta"} if delta else None
        return BarrierResult.parse((yield from self._call(self._handshake(RequestSpec("POST", path, {}, params=params), give_up_at))))

    def snapshot_staging_keys(self, snapshot_id: str, give_up_at: float | None = None) -> Flow[CutKeys]:
        path = self._run_path(f"/snapshots/{_seg(snapshot_id)}/staging-keys")
        return CutKeys.parse((yield from self._call(self._handshake(RequestSpec("GET", path), give_up_at))))

    def snapshot_captured(self, snapshot_id: str, reference: Any, give_up_at: float | None = None) -> Flow[Snapshot | None]:
        ref = DataPlaneRef.coerce(reference)
        path = self._run_path(f"/snapshots/{_seg(snapshot_id)}/captured")
        doc = yield from self._call(self._handshake(RequestSpec("POST", path, {"reference": ref.to_json()}), give_up_at))
        # The answer's shape is not pinned down by the contract; a snapshot document if it is one.
        return Snapshot.parse(doc) if isinstance(doc, Mapping) and doc.get("snapshot_id") else None

    def stop_snapshot(
        self, step: int, capture: Callable[[list[str]], Any], snapshot_id: str | None, barrier: Callable[[], Any] | None, poll_interval: float, deadline_s: float
    ) -> Flow[Snapshot]:
        """A stopping snapshot (docs/ledger.md#stopping-snapshots) within ``deadline_s`` seconds."""
        if not deadline_s > 0:
            raise ValueError(f"deadline_s must be > 0, got {deadline_s!r}")
        # The client waits a moment longer than the coordinator's deadline, to read its verdict.
        return self.snapshot(step, capture, snapshot_id, barrier, poll_interval, deadline_s + 10.0, True, deadline_s)

    def snapshot(
        self,
        step: int,
        capture: Callable[[list[str]], Any],
        snapshot_id: str | None,
        barrier: Callable[[], Any] | None,
        poll_interval: float,
        timeout: float,
        stop: bool = False,
        deadline_s: float | None = None,
    ) -> Flow[Snapshot]:
        """The trainer's side of a snapshot (docs/ledger.md#phases), from request to a terminal
        outcome.

        request -> poll until the coordinator awaits the barrier (or the snapshot ended) ->
        [enter ``barrier``] POST barrier -> ``capture(staging_keys)`` [exit ``barrier``] ->
        POST captured -> poll to the end. Published: the snapshot. Failed or aborted:
        :class:`SnapshotFailed`. Client deadline: :class:`SnapshotTimeout`.
        """
        if poll_interval <= 0 or timeout <= 0:
            raise ValueError("poll_interval and timeout must be > 0")
        sid = snapshot_id or new_id("snap")
        deadline = (yield Now()) + timeout
        snap = yield from self.request_snapshot(step, sid, stop, deadline_s, give_up_at=deadline)
        captured = False
        # Set once the coordinator refused the barrier because the snapshot is being aborted:
        # it will never ask again, and taking the trainer's barrier each poll would stall it.
        barrier_refused = False
        # The pre-cut's keys, fetched while Gym prepares or commits: the barrier (while the
        # trainer and Gym wait) then answers only what changed since. Not fetched later: from the
        # drain on, the barrier may be awaited any moment, and the fetch would delay it.
        base: list[str] | None = None
        while not snap.terminal:
            if base is None and snap.phase in PRE_CUT_FETCH_PHASES and snap.counts.get("cut_pre_cut_keys") is not None:
                keys = yield from self.snapshot_staging_keys(sid, give_up_at=deadline)
                if keys.as_of == "pre_cut":
                    base = keys.staging_keys
            if not captured and not barrier_refused and _wants_barrier(snap):
                try:
                    after = yield from self._barrier_and_capture(snap, capture, barrier, base, deadline)
                except SnapshotNotAwaiting as e:
                    barrier_refused = e.reason is not None
                    after = None
                if after is not None:
                    captured = True
                    snap = after
                    continue
            remaining = deadline - (yield Now())
            if remaining <= 0:
                state = "after the capture" if captured else f"in phase {snap.phase}, awaiting {snap.awaiting}"
                raise SnapshotTimeout(f"snapshot {sid} not finished after {timeout:.0f}s ({state})", snap)
            snap = yield from self._next_snapshot(snap, poll_interval, remaining, give_up_at=deadline)
        if snap.published:
            return snap
        raise SnapshotFailed(snap)

    def _barrier_and_capture(
        self, snap: Snapshot, capture: Callable[[list[str]], Any], barrier: Callable[[], Any] | None, base: list[str] | None = None,
        give_up_at: float | None = None,
    ) -> Flow[Snapshot]:
        """Barrier, capture, captured; answers the snapshot after the captured report.

        Raises :class:`SnapshotNotAwaiting` (barrier released, nothing captured) when the
        coordinator turns the barrier down: too early, or the snapshot is being aborted.
        """
        handle = (yield Enter(barrier)) if barrier is not None else None
        try:
            if snap.awaiting == "capture" and snap.staging_keys is not None:
                # The cut was already taken (an earlier run of this helper for the same
                # snapshot id died after the barrier); only the capture is owed.
                keys = snap.staging_keys
            else:
                keys = (yield from self.snapshot_barrier(snap.snapshot_id, delta=base is not None, give_up_at=give_up_at)).with_base(base or [])
            ref = DataPlaneRef.coerce((yield Invoke(capture, (keys,))))
        except BaseException as e:
            if barrier is not None:
                yield Exit(handle, e)
            raise
        if barrier is not None:
            # Released before reporting: the capture is saved, the trainer may move on while
            # the coordinator resumes Gym and publishes.
            yield Exit(handle, None)
        after = yield from self.snapshot_captured(snap.snapshot_id, ref, give_up_at=give_up_at)
        if after is None:
            after = yield from self.get_snapshot(snap.snapshot_id, give_up_at=give_up_at)
        return after

    # ------------------------------------------------------------- restore (docs/ledger.md#restore)

    def register_gym_instances(self, instances: Iterable[Any]) -> Flow[GymRegistration]:
        body = {"instances": [row_json(i, "GymInstance") for i in instances]}
        return GymRegistration.parse((yield from self._call(RequestSpec("POST", self._run_path("/gym-instances"), body))))

    def unregister_gym_instance(self, instance_id: str) -> Flow[None]:
        # Instance ids hold '/' as a separator: the route takes the rest of the path.
        path = self._run_path("/gym-instances/" + "/".join(_seg(p) for p in instance_id.split("/")))
        yield from self._call(RequestSpec("DELETE", path))

    def restore_plan(
        self, step: int | None, snapshot_id: str | None, with_gym_state: bool, include_reused: bool, instance_map: Mapping[str, str] | None = None
    ) -> Flow[RestorePlan]:
        params: dict[str, Any] = {}
        if instance_map:
            params["instance_map"] = [f"{saved}={live}" for saved, live in sorted(instance_map.items())]
        if step is not None:
            params["step"] = step
        if snapshot_id is not None:
            params["snapshot_id"] = snapshot_id
        # Sent only when not the default, so a server that does not know them sees the contract.
        if not with_gym_state:
            params["with_gym_state"] = "false"
        if include_reused:
            params["include_reused"] = "true"
        # The largest page the server gives: every page recomputes the plan, so fewer, larger
        # pages are what make a big plan cheap to fetch (docs/api.md#pages).
        params["limit"] = PLAN_PAGE_ROWS
        path = self._run_path("/restore-plan")
        doc = yield from self._call(RequestSpec("GET", path, params=params))
        plan = RestorePlan.parse(doc)
        # Large plans come in pages; join them so the caller holds the whole plan. Later pages
        # are pinned to the first page's snapshot so a snapshot published meanwhile cannot mix in.
        cursor = doc.get("next_cursor") if isinstance(doc, Mapping) else None
        while cursor is not None:
            page_params = {**params, "snapshot_id": plan.snapshot_id, "cursor": cursor}
            page_params.pop("step", None)
            doc = yield from self._call(RequestSpec("GET", path, params=page_params))
            plan = plan.with_more_rows(RestorePlan.parse(doc))
            cursor = doc.get("next_cursor") if isinstance(doc, Mapping) else None
        return plan

    def restore(
        self,
        restore_id: str | None,
        snapshot_id: str | None,
        step: int | None,
        with_gym_state: bool,
        timeout: float,
        poll_interval: float,
        instance_map: Mapping[str, str] | None = None,
    ) -> Flow[RestoreResult]:
        """Apply a restore, waiting out ``restore_in_progress`` (our own earlier try whose answer
        was lost is still running) by asking again with the same id until it answers."""
        # Minted once: a retried restore (e.g. the answer was lost) is the same restore.
        rid = restore_id or new_id("restore")
        body: dict[str, Any] = {"restore_id": rid, "with_gym_state": with_gym_state}
        if snapshot_id is not None:
            body["snapshot_id"] = snapshot_id
        if step is not None:
            body["step"] = step
        if instance_map:
            body["instance_map"] = dict(instance_map)
        deadline = (yield Now()) + timeout
        # One request may legitimately take minutes (Gym restore fan-out), so it gets the whole
        # budget rather than the client's per-call timeout; the server bounds it on its side.
        req = RequestSpec("POST", self._run_path("/restores"), body, timeout=timeout)
        while True:
            try:
                doc = yield from self._call(req)
                result = RestoreResult.parse(doc, rid)
                # A large answer comes in pages (the first with the POST); join them so the caller
                # holds every row. Pages of an applied restore never change.
                cursor = doc.get("next_cursor") if isinstance(doc, Mapping) else None
                path = self._run_path(f"/restores/{_seg(result.restore_id)}/rows")
                while cursor is not None:
                    page = yield from self._call(RequestSpec("GET", path, params={"cursor": cursor}))
                    result = result.with_more_rows(page)
                    cursor = page.get("next_cursor") if isinstance(page, Mapping) else None
                return result
            except Conflict as e:
                if e.code != "restore_in_progress":
                    raise
                remaining = deadline - (yield Now())
                if remaining <= 0:
                    raise
                yield Sleep(min(poll_interval, remaining))


#: Rows per page of a joined restore plan (the server's maximum).
PLAN_PAGE_ROWS = 100_000
#: Snapshots per page of the history (the server's maximum).
SNAPSHOT_PAGE_ROWS = 500


def _str_or_none(value: Any) -> str | None:
    return None if value is None else str(value)


def _wants_barrier(snap: Snapshot) -> bool:
    if snap.awaiting in ("barrier", "capture"):
        return True
    # A server that does not report ``awaiting`` at all: the data-plane phase is the barrier's.
    return "awaiting" not in snap.raw and snap.phase == "data_plane"


__all__ = ["Api", "DEFAULT_BATCH_SIZE"]
