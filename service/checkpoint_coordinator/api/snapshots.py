"""Snapshots (docs/ledger.md#snapshots) and train-step announcements."""

from __future__ import annotations

from typing import Literal

from fastapi import APIRouter, Depends, Path, Query, Request, Response
from pydantic import Field, StrictBool, model_validator

from ..domain.snapshot_state import SnapshotReason
from ..errors import BadRequest, Unavailable
from ..observability.http import LONG_POLL_SCOPE_KEY
from ..snapshots import service as snapshot_service
from ..snapshots import store as repo
from ..snapshots.watch import MAX_WAIT_S
from .auth import Caller, require_run_access
from .common import (
    BIGINT_MAX,
    SNAPSHOT_ID_PATTERN,
    FastJSONRoute,
    Strict,
    as_built,
    json_with_raw,
)
from .problem_docs import RUN, WRITE, problems
from .schemas import (
    AnnouncedTrainStep,
    BarrierOut,
    CutKeysOut,
    RunOut,
    SnapshotList,
    SnapshotOut,
    StagingKeysDelta,
    TrainStepList,
)

#: The reasons a trainer may give for aborting a snapshot (the values, so that a refusal names them).
AbortReason = Literal[tuple(r.value for r in (SnapshotReason.data_plane_failed, SnapshotReason.cancelled, SnapshotReason.superseded))]  # type: ignore[valid-type]

router = APIRouter(prefix="/v1/runs/{run_id}", tags=["snapshots"], route_class=FastJSONRoute)

SnapshotIdPath = Path(..., pattern=SNAPSHOT_ID_PATTERN, max_length=100)


MAX_STOP_DEADLINE_S = 3600.0


class SnapshotRequest(Strict):
    snapshot_id: str = Field(pattern=SNAPSHOT_ID_PATTERN, min_length=1, max_length=100)
    anchor_step: int = Field(ge=0, le=BIGINT_MAX, description="The trainer checkpoint (train step) this snapshot is anchored on.")
    stop: StrictBool = Field(
        default=False,
        description="A stopping snapshot (the allocation ends): Gym is left parked after the cut and dispatch is refused "
        "`run_stopped` until a restore or `POST .../reopen`; a train step announced meanwhile does not abort it.",
    )
    deadline_s: float | None = Field(
        default=None,
        gt=0,
        le=MAX_STOP_DEADLINE_S,
        description="Stopping snapshots only: seconds from the request by which it must have taken its cut; every phase "
        "timeout is clipped to what is left, and past it the snapshot is aborted (`deadline_exceeded`, Gym resumed).",
    )

    @model_validator(mode="after")
    def _deadline_only_when_stopping(self) -> SnapshotRequest:
        if self.deadline_s is not None and not self.stop:
            raise ValueError("deadline_s applies to stopping snapshots only (stop: true)")
        return self


class DataPlaneRef(Strict):
    path: str = Field(min_length=1, max_length=4096)
    digest: str = Field(min_length=1, max_length=256)


class CapturedIn(Strict):
    reference: DataPlaneRef


class AbortIn(Strict):
    reason: AbortReason = Field(
        description="data_plane_failed: the trainer could not save its data plane (outcome failed); cancelled: the trainer "
        "or an operator gives it up (aborted); superseded: a new trainer incarnation takes over from the one that "
        "requested it (aborted)."
    )
    detail: str | None = Field(default=None, max_length=4096)


class TrainStepIn(Strict):
    step: int = Field(ge=0, le=BIGINT_MAX)
    checkpoint_ref: str | None = Field(default=None, max_length=4096)


@router.post(
    "/snapshots",
    operation_id="request_snapshot",
    status_code=202,
    response_model=SnapshotOut,
    response_model_exclude_unset=True,
    responses={
        200: {"model": SnapshotOut, "description": "A snapshot of this id already exists: the request was a repeat, answered as stored."},
        **problems(
            WRITE, "replica_draining", "run_stopped", "snapshot_conflict", "snapshot_anchor_stale", "snapshot_in_progress",
            "restore_in_progress", "gym_not_registered",
        ),
    },
)
async def request_snapshot(body: SnapshotRequest, request: Request, response: Response, caller: Caller = Depends(require_run_access)) -> SnapshotOut:
    """Request a snapshot anchored on train step S. Idempotent by snapshot id; runs in the background."""
    app = request.app
    if getattr(app.state, "draining", False):
        # It would take the run's lease here, as this replica hands its runs back: the retry
        # reaches another replica.
        raise Unavailable("this replica is shutting down; retry the request (another replica takes it)",
                          code="replica_draining", retry_after_s=1)
    row, created = await snapshot_service.request_snapshot(
        app.state.engine, app.state.snapshots, caller.run_id, body.snapshot_id, body.anchor_step,
        stop=body.stop, deadline_s=body.deadline_s, lease_ttl_s=app.state.settings.ownership_lease_s,
    )
    if not created:
        response.status_code = 200
    return SnapshotOut.of(row)


@router.get("/snapshots", operation_id="list_snapshots", response_model=SnapshotList, response_model_exclude_unset=True, responses=problems(RUN, "snapshot_not_found"))
async def list_snapshots(
    request: Request,
    limit: int = Query(50, ge=1, le=500),
    before: str | None = Query(None, pattern=SNAPSHOT_ID_PATTERN, max_length=100),
    caller: Caller = Depends(require_run_access),
) -> SnapshotList:
    """The run's snapshot history, newest first: phase timings, outcome, reason, counts."""
    rows = await repo.list_snapshots(request.app.state.engine, caller.run_id, limit=limit, before=before)
    return SnapshotList.model_construct(
        snapshots=[SnapshotOut.of(r) for r in rows], next_before=rows[-1].snapshot_id if len(rows) == limit else None
    )


@router.get(
    "/snapshots/{snapshot_id}", operation_id="get_snapshot", response_model=SnapshotOut, response_model_exclude_unset=True,
    responses=problems(RUN, "snapshot_not_found"),
)
async def get_snapshot(
    request: Request,
    snapshot_id: str = SnapshotIdPath,
    manifest: bool = Query(False, description="include the Gym manifest"),
    wait_s: float | None = Query(
        None, gt=0, le=MAX_WAIT_S,
        description="Wait up to this long for the snapshot to move on from `watch_token` (required with it), then answer it as it "
        "stands: a trainer learns of the barrier within moments instead of one poll interval later, while Gym is parked.",
    ),
    watch_token: str | None = Query(None, min_length=1, max_length=200, description="The `watch_token` of the document last read."),
    caller: Caller = Depends(require_run_access),
) -> SnapshotOut:
    """The snapshot record. With `wait_s` and `watch_token`: answered as soon as its `watch_token`
    differs (phase, outcome, awaited handshake, pre-cut keys available), at most after `wait_s`."""
    if (wait_s is None) != (watch_token is None):
        missing = "watch_token" if watch_token is None else "wait_s"
        raise BadRequest("wait_s and watch_token go together", errors=[{"field": missing, "message": "required with the other"}])
    engine = request.app.state.engine

    async def read() -> repo.SnapshotRow:
        async with engine.connect() as conn:
            return await repo.get(conn, caller.run_id, snapshot_id, with_manifest=manifest)

    if wait_s is None:
        row = await read()
    else:
        request.scope[LONG_POLL_SCOPE_KEY] = True  # its latency is the wait: a route label of its own
        row = await request.app.state.snapshots.watch.until(caller.run_id, snapshot_id, read, lambda r: r.watch_token != watch_token, wait_s)
    return SnapshotOut.of(row, with_manifest=manifest)


@router.post(
    "/snapshots/{snapshot_id}/barrier", operation_id="snapshot_barrier_held", response_model=BarrierOut, response_model_exclude_unset=True,
    responses=problems(WRITE, "snapshot_not_found", "snapshot_not_awaiting"),
)
async def barrier_held(
    request: Request,
    snapshot_id: str = SnapshotIdPath,
    staging_keys: Literal["full", "delta"] = Query(
        "full",
        description="full: answer every staging key that must exist (`staging_keys`). delta: the trainer holds the "
        "pre-cut's keys (`GET .../staging-keys` answered `as_of: pre_cut`): answer `staging_keys_delta` "
        "(`added`, `removed` against them) when the cut was taken on that pre-cut, else `staging_keys` as for full.",
    ),
    caller: Caller = Depends(require_run_access),
) -> BarrierOut | Response:
    """The trainer holds its data-plane barrier: the coordinator takes the ledger cut and answers
    the staging keys that must exist in the capture. 409 `snapshot_not_awaiting` when too early or aborted."""
    engine = request.app.state.engine
    row = await repo.take_cut(engine, caller.run_id, snapshot_id, full_keys=staging_keys == "full")
    # Tens of thousands of keys: serialized once natively from the model (FastAPI does not
    # validate a model instance again), or spliced in as the database wrote them.
    if staging_keys == "delta" and row.cut_keys_added is not None and row.cut_keys_removed is not None:
        delta = StagingKeysDelta.model_construct(base="pre_cut", added=row.cut_keys_added, removed=row.cut_keys_removed)
        return BarrierOut.of(row, staging_keys_delta=delta)
    if row.cut_staging_keys is not None:
        return BarrierOut.of(row, staging_keys=row.cut_staging_keys)
    return json_with_raw(BarrierOut.of(row), "staging_keys", (await repo.cut_keys(engine, caller.run_id, snapshot_id))[1])


@router.get(
    "/snapshots/{snapshot_id}/staging-keys", operation_id="snapshot_staging_keys", response_model=CutKeysOut,
    responses=problems(RUN, "snapshot_not_found"),
)
async def snapshot_staging_keys(request: Request, snapshot_id: str = SnapshotIdPath, caller: Caller = Depends(require_run_access)) -> Response:
    """The cut's staging keys as they stand: `as_of` `pre_cut` once the pre-cut was taken (the
    record's `counts.cut_pre_cut_keys`) and until the barrier, `cut` after it, `none` before
    either. A trainer fetches the pre-cut's keys while Gym commits and asks its barrier for the
    delta only, so the barrier's answer grows with what changed, not with the run."""
    held = request.app.state.snapshots.pre_cut_keys_json(caller.run_id, snapshot_id)
    as_of, keys = await repo.cut_keys(request.app.state.engine, caller.run_id, snapshot_id, pre_cut_keys=held)
    return json_with_raw(CutKeysOut.model_construct(snapshot_id=snapshot_id, as_of=as_of), "staging_keys", keys)


@router.post(
    "/snapshots/{snapshot_id}/captured", operation_id="snapshot_data_plane_captured", response_model=SnapshotOut,
    response_model_exclude_unset=True, responses=problems(WRITE, "snapshot_not_found", "snapshot_not_awaiting", "capture_conflict"),
)
async def data_plane_captured(body: CapturedIn, request: Request, snapshot_id: str = SnapshotIdPath, caller: Caller = Depends(require_run_access)) -> SnapshotOut:
    """The trainer saved its data plane; the snapshot resumes Gym, reopens the gate and publishes."""
    return SnapshotOut.of(await repo.captured(request.app.state.engine, caller.run_id, snapshot_id, body.reference.model_dump()))


@router.post(
    "/snapshots/{snapshot_id}/abort", operation_id="abort_snapshot", response_model=SnapshotOut, response_model_exclude_unset=True,
    responses=problems(WRITE, "snapshot_not_found", "snapshot_not_awaiting"),
)
async def abort_snapshot(body: AbortIn, request: Request, snapshot_id: str = SnapshotIdPath, caller: Caller = Depends(require_run_access)) -> SnapshotOut:
    """Give up on a snapshot before its capture is reported: Gym is resumed at once, the gate
    reopens, and the previous published snapshot stays authoritative."""
    row = await repo.request_abort(request.app.state.engine, caller.run_id, snapshot_id, body.reason, body.detail)
    request.app.state.snapshots.abort_local(caller.run_id, [snapshot_id], body.reason)
    return SnapshotOut.of(row)


@router.post("/reopen", operation_id="reopen_run", response_model=RunOut, responses=problems(WRITE))
async def reopen_run(request: Request, caller: Caller = Depends(require_run_access)) -> RunOut:
    """Lift the stop of a stopping snapshot when the run goes on without a restore: dispatch is
    accepted again and Gym is resumed (best effort; its leases reopen it anyway). Idempotent: a
    run that is not stopped is answered as it is. Answers the run."""
    engine = request.app.state.engine
    return RunOut.of(await snapshot_service.reopen(engine, request.app.state.snapshots, caller.run_id))


@router.get("/train-steps", operation_id="list_train_steps", response_model=TrainStepList, responses=problems(RUN))
async def list_train_steps(
    request: Request,
    include_retired: bool = Query(False, description="also the announces a restore retired (their lineage was discarded)"),
    caller: Caller = Depends(require_run_access),
) -> Response:
    """The run's announced train steps, oldest first."""
    return as_built({"train_steps": await repo.list_train_steps(request.app.state.engine, caller.run_id, include_retired=include_retired)})


@router.post("/train-steps", operation_id="announce_train_step", response_model=AnnouncedTrainStep, responses=problems(WRITE, "train_step_conflict"))
async def announce_train_step(body: TrainStepIn, request: Request, caller: Caller = Depends(require_run_access)) -> Response:
    """Announce a committed trainer checkpoint (create-or-return). A snapshot anchored on an older
    step that has not taken its ledger cut yet is aborted (train step wins)."""
    step, aborted = await repo.announce_train_step(request.app.state.engine, caller.run_id, body.step, body.checkpoint_ref)
    request.app.state.snapshots.abort_local(caller.run_id, aborted, "train_step_committed")
    return as_built({**step, "aborted_snapshots": aborted})


