"""Trainer reports of live rollouts (batch calls, docs/ledger.md#live-rollouts) and the operator
reads of the live ledger."""

from __future__ import annotations

import re
from typing import Any, Literal

from fastapi import APIRouter, Depends, Path, Query, Request, Response
from pydantic import Field, field_validator, model_validator

from ..errors import BadRequest
from ..rollouts import store as repo
from ..rollouts import stragglers as straggler_rows
from ..rollouts import views
from .auth import Caller, require_run_access
from .common import (
    BIGINT_MAX,
    GROUP_ID_PATTERN,
    INSTANCE_ID_PATTERN,
    NAME_PATTERN,
    ROLLOUT_ID_PATTERN,
    FastJSON,
    FastJSONRoute,
    Strict,
    as_built,
)
from .problem_docs import RUN, WRITE, problems
from .rollout_schemas import (
    AdmitOut,
    DispatchOut,
    FailOut,
    GroupDetailOut,
    GroupsOut,
    LiveCountsOut,
    OutboxPageOut,
    PendingOut,
    RefusedOut,
    SealOut,
    StreamEndedOut,
)

router = APIRouter(prefix="/v1/runs/{run_id}", tags=["rollouts"], route_class=FastJSONRoute)

# The refusals of one row (or group) of a batch: one refuses the batch, with that row's code, or
# ``batch_refused`` when the rows were refused for several reasons.
_ROW_REFUSED = ("batch_refused", "unknown_rollout", "attempt_not_current")
_GROUP_REFUSED = ("batch_refused", "unknown_group")

MAX_ROWS = 20_000
_CAPTURE_SUFFIX = re.compile(r"-a[0-9]+\Z").search
RolloutId = str


class PromptRefIn(Strict):
    sample_id: str | int = Field(description="Locator of the prompt in the trainer's dataset (never the prompt itself).")
    task_name: str = Field(min_length=1, max_length=256)


class AdmitGroupIn(Strict):
    group_id: str = Field(pattern=GROUP_ID_PATTERN, min_length=1, max_length=160)
    prompt_ref: PromptRefIn
    task_digest: str = Field(min_length=1, max_length=128)
    task_source: str | None = Field(default=None, pattern=NAME_PATTERN, max_length=128)
    agent_name: str | None = Field(default=None, pattern=NAME_PATTERN, max_length=128)
    expected_generations: int = Field(ge=1, le=1024)
    target_step: int | None = Field(default=None, ge=0, le=BIGINT_MAX)
    weight_version: str | None = Field(default=None, max_length=128)

    @field_validator("group_id")
    @classmethod
    def _no_capture_suffix(cls, v: str) -> str:
        if _CAPTURE_SUFFIX(v):
            raise ValueError("must not end in -a<digits> (reserved for capture keys)")
        return v


class AdmitIn(Strict):
    groups: list[AdmitGroupIn] = Field(min_length=1, max_length=5000)

    @model_validator(mode="after")
    def _rows(self) -> "AdmitIn":
        # Rows, not groups, are what an admit writes and answers: bounded like every other batch.
        n = sum(g.expected_generations for g in self.groups)
        if n > MAX_ROWS:
            raise ValueError(f"{n} rows in one admit (groups x expected_generations); at most {MAX_ROWS}: admit fewer groups per call")
        return self


class DispatchIn(Strict):
    dispatch_id: str = Field(pattern=NAME_PATTERN, min_length=1, max_length=128, description="Trainer-chosen id of this /run stream.")
    instance_id: str | None = Field(default=None, pattern=INSTANCE_ID_PATTERN, max_length=256)
    rollout_ids: list[str] = Field(min_length=1, max_length=MAX_ROWS)


class RolloutIdsIn(Strict):
    rollout_ids: list[str] = Field(min_length=1, max_length=MAX_ROWS)


class SealRowIn(Strict):
    rollout_id: str = Field(pattern=ROLLOUT_ID_PATTERN, max_length=256)
    receipt: dict[str, Any] = Field(description="Gym's receipt; its rollout_id must be the attempt's capture key.")
    staging_keys: list[str] = Field(default_factory=list, max_length=100_000)
    reward: float | None = Field(default=None, allow_inf_nan=False)
    mask_sample: bool | None = None


class SealIn(Strict):
    rows: list[SealRowIn] = Field(min_length=1, max_length=MAX_ROWS)


class FailRowIn(Strict):
    rollout_id: str = Field(pattern=ROLLOUT_ID_PATTERN, max_length=256)
    failure_class: Literal["data", "transport"]
    detail: str | None = Field(default=None, max_length=4096)


class FailIn(Strict):
    rows: list[FailRowIn] = Field(min_length=1, max_length=MAX_ROWS)


class StreamEndedIn(Strict):
    returned: list[str] | None = Field(default=None, max_length=MAX_ROWS, description="Rollout ids whose rows came back (every other row of the dispatch is lost).")
    missing: list[str] | None = Field(
        default=None, max_length=MAX_ROWS, description="Or: the rollout ids that never came back (lets a large dispatch be reported in several calls)."
    )

    @model_validator(mode="after")
    def _one_of(self) -> "StreamEndedIn":
        if (self.returned is None) == (self.missing is None):
            raise ValueError("give exactly one of 'returned' and 'missing'")
        return self


class GroupIdsIn(Strict):
    group_ids: list[str] = Field(min_length=1, max_length=MAX_ROWS)


_ID_OK = re.compile(ROLLOUT_ID_PATTERN).fullmatch


def _check_ids(ids: list[str], what: str = "rollout_ids", *, validated: bool = False) -> None:
    """400 on an invalid or repeated id. ``validated``: the request model already checked each
    id's pattern and length (seal and failure rows), so only repeats are looked for."""
    if not validated:
        bad = [i for i, x in enumerate(ids) if len(x) > 256 or not _ID_OK(x)]
        if bad:
            raise BadRequest(f"{what}[{bad[0]}] is not a valid id", errors=[{"field": f"{what}.{i}", "message": "invalid id"} for i in bad[:100]])
    if len(set(ids)) != len(ids):
        raise BadRequest(f"{what} names an id twice", errors=[{"field": what, "message": "duplicate id"}])


@router.post(
    "/groups/admit", operation_id="admit_groups", response_model=AdmitOut,
    responses=problems(WRITE, "batch_refused", "duplicate_in_batch", "group_conflict", "run_row_quota"),
)
async def admit_groups(body: AdmitIn, request: Request, caller: Caller = Depends(require_run_access)) -> Response:
    """Create groups, siblings and one reserved attempt per sibling; answers the rows to send."""
    groups = [
        repo.AdmitGroup(
            group_id=g.group_id, prompt_ref=g.prompt_ref.model_dump(), task_digest=g.task_digest, task_source=g.task_source,
            agent_name=g.agent_name, expected_generations=g.expected_generations, target_step=g.target_step,
            weight_version=g.weight_version,
        )
        for g in body.groups
    ]
    max_rows = request.app.state.settings.max_run_rows
    return FastJSON({"groups": await repo.admit(request.app.state.engine, caller.run_id, groups, max_run_rows=max_rows)})


@router.post(
    "/attempts/dispatch", operation_id="dispatch_attempts", response_model=DispatchOut,
    responses=problems(
        WRITE, _ROW_REFUSED, "gate_closed", "run_stopped", "unknown_instance", "already_dispatched", "group_not_generating",
        "instance_required", "wrong_instance",
    ),
)
async def dispatch_attempts(body: DispatchIn, request: Request, caller: Caller = Depends(require_run_access)) -> Response:
    """Record that reserved attempts are being sent to Gym. 409 `gate_closed` while a snapshot holds the gate."""
    _check_ids(body.rollout_ids)
    return FastJSON(await repo.dispatch(
        request.app.state.engine,
        caller.run_id,
        body.dispatch_id,
        body.instance_id,
        body.rollout_ids,
        retry_after_s=request.app.state.settings.gate_retry_after_s,
    ))


@router.post("/attempts/refused", operation_id="report_refused", response_model=RefusedOut, responses=problems(WRITE, _ROW_REFUSED))
async def report_refused(body: RolloutIdsIn, request: Request, caller: Caller = Depends(require_run_access)) -> Response:
    """Gym refused these rows at admission: same rollout id, no attempt spent; re-send after the gate reopens."""
    _check_ids(body.rollout_ids)
    return FastJSON(await repo.refused(request.app.state.engine, caller.run_id, body.rollout_ids))


@router.post(
    "/attempts/sealed", operation_id="report_sealed", response_model=SealOut,
    responses=problems(WRITE, _ROW_REFUSED, "receipt_mismatch", "seal_conflict", "attempt_replaced", "retired_straggler", "attempt_not_dispatched"),
)
async def report_sealed(body: SealIn, request: Request, caller: Caller = Depends(require_run_access)) -> Response:
    _check_ids([r.rollout_id for r in body.rows], validated=True)
    # The validated rows are handed on as they are (they have SealRow's fields): no copy per row.
    return FastJSON(await repo.seal(request.app.state.engine, caller.run_id, body.rows))


@router.post(
    "/attempts/failed", operation_id="report_failed", response_model=FailOut,
    responses=problems(WRITE, _ROW_REFUSED, "attempt_sealed", "attempt_not_dispatched"),
)
async def report_failed(body: FailIn, request: Request, caller: Caller = Depends(require_run_access)) -> Response:
    _check_ids([r.rollout_id for r in body.rows], validated=True)
    rows = [repo.FailRow(r.rollout_id, r.failure_class, r.detail) for r in body.rows]
    return FastJSON(await repo.fail(request.app.state.engine, caller.run_id, rows))


@router.post(
    "/dispatches/{dispatch_id}/ended", operation_id="report_stream_ended", response_model=StreamEndedOut,
    responses=problems(WRITE, "unknown_dispatch"),
)
async def report_stream_ended(
    body: StreamEndedIn,
    request: Request,
    dispatch_id: str = Path(..., pattern=NAME_PATTERN, max_length=128),
    caller: Caller = Depends(require_run_access),
) -> Response:
    """The /run stream of a dispatch ended; rows that never came back become transport failures."""
    for name in ("returned", "missing"):
        ids = getattr(body, name)
        if ids:
            _check_ids(ids, name)
    return FastJSON(await repo.stream_ended(request.app.state.engine, caller.run_id, dispatch_id, body.returned, missing=body.missing))


@router.post(
    "/groups/finalize", operation_id="finalize_groups", response_model=GroupsOut, responses=problems(WRITE, _GROUP_REFUSED, "group_not_ready")
)
async def finalize_groups(body: GroupIdsIn, request: Request, caller: Caller = Depends(require_run_access)) -> Response:
    _check_ids(body.group_ids, "group_ids")
    return FastJSON(await repo.finalize(request.app.state.engine, caller.run_id, body.group_ids))


@router.post(
    "/groups/abandon", operation_id="abandon_groups", response_model=GroupsOut, responses=problems(WRITE, _GROUP_REFUSED, "group_finalized")
)
async def abandon_groups(body: GroupIdsIn, request: Request, caller: Caller = Depends(require_run_access)) -> Response:
    _check_ids(body.group_ids, "group_ids")
    return FastJSON(await repo.abandon(request.app.state.engine, caller.run_id, body.group_ids))


@router.get("/counts", operation_id="live_counts", response_model=LiveCountsOut, responses=problems(RUN))
async def live_counts(request: Request, caller: Caller = Depends(require_run_access)) -> Response:
    """Live groups and attempts by status, and the pending outbox by op."""
    return as_built(await views.live_counts(request.app.state.engine, caller.run_id))


@router.get("/groups/{group_id}", operation_id="get_group", response_model=GroupDetailOut, responses=problems(RUN, "group_not_found"))
async def get_group(
    request: Request,
    group_id: str = Path(..., pattern=GROUP_ID_PATTERN, max_length=160),
    caller: Caller = Depends(require_run_access),
) -> Response:
    """One group with its siblings and their attempt history."""
    return as_built(await views.group_detail(request.app.state.engine, caller.run_id, group_id))


@router.post("/attempts/pending", operation_id="pending_attempts", response_model=PendingOut, responses=problems(RUN))
async def pending_attempts(body: RolloutIdsIn, request: Request, caller: Caller = Depends(require_run_access)) -> Response:
    """Which of these rollouts are still dispatched without a result (index lookups only); those
    the coordinator gave up as stragglers, with their group's rows to send."""
    _check_ids(body.rollout_ids)
    engine = request.app.state.engine
    pending = await views.pending_attempts(engine, caller.run_id, body.rollout_ids)
    answer: dict[str, Any] = {"pending": pending}
    if len(pending) < len(body.rollout_ids):  # only then can one be a straggler: one more lookup
        ended = set(body.rollout_ids).difference(pending)
        stragglers = await straggler_rows.stragglers_among(engine, caller.run_id, [r for r in body.rollout_ids if r in ended])
        if stragglers:
            answer["stragglers"] = stragglers
    return FastJSON(answer)


@router.get("/outbox", operation_id="list_outbox", response_model=OutboxPageOut, responses=problems(RUN))
async def list_outbox(
    request: Request,
    limit: int = Query(100, ge=1, le=1000),
    after: int | None = Query(None, ge=0, le=BIGINT_MAX),
    caller: Caller = Depends(require_run_access),
) -> Response:
    """Pending retire/forget items owed to Gym instances."""
    return as_built(await views.pending_outbox(request.app.state.engine, caller.run_id, limit=limit, after=after))
