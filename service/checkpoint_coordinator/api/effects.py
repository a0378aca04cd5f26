"""Effect journal API (docs/effects.md): begin, complete and abandon an effect of a tool call
outside Gym; list a run's journal and its orphans. Run token."""

from __future__ import annotations

from fastapi import APIRouter, Depends, Query, Request, Response
from pydantic_core import to_json

from ..effects import store
from ..errors import CoordinatorError
from ..observability.metrics import record_effect_begin
from .auth import Caller, require_run_access
from .common import ROLLOUT_ID_PATTERN, DirectRoute, FastJSONRoute, as_built
from .effect_schemas import MAX_RESULT_BYTES, BeginIn, BeginOut, CompleteIn, EffectOut, EffectPage
from .problem_docs import RUN, WRITE, problems

router = APIRouter(prefix="/v1/runs/{run_id}/effects", tags=["effects"], route_class=FastJSONRoute)
# begin and complete come around every effectful tool call: they skip FastAPI's dependency solving.
hot = APIRouter(prefix="/v1/runs/{run_id}/effects", tags=["effects"], route_class=DirectRoute)


class ResultTooLarge(CoordinatorError):
    status = 413
    code = "effect_result_too_large"
    title = "Effect result too large"


@hot.post(
    "/begin", operation_id="begin_effect", response_model=BeginOut, response_model_exclude_unset=True,
    responses=problems(WRITE, "stale_attempt"),
)
async def begin_effect(body: BeginIn, request: Request, caller: Caller = Depends(require_run_access)) -> Response:
    """Before a tool acts on the world outside Gym: ``proceed`` (act, then complete), ``done``
    (it acted before with these arguments: return ``result``), ``unknown`` (begun, never
    completed: reconcile, then complete or abandon) or ``diverged`` (it acted before with other
    arguments: act anew; the earlier one is listed as an orphan). Refused ``stale_attempt`` for an
    attempt that is not its rollout's current one: the tool must not act."""
    call = store.BeginCall(body.rollout_id, body.gym_attempt, body.seq, body.effect, body.digest, body.call_id)
    answer = await store.begin(request.app.state.engine, str(caller.run_id), call)
    record_effect_begin(answer["answer"])
    return as_built(answer)


@hot.post("/{effect_id}/complete", operation_id="complete_effect", response_model=EffectOut, responses=problems(RUN, "effect_not_found", "effect_completed", "effect_abandoned", "effect_result_too_large"))
async def complete_effect(effect_id: int, body: CompleteIn, request: Request, caller: Caller = Depends(require_run_access)) -> Response:
    """After the tool acted: its result, recorded (also for an orphan, so the list says what to
    compensate). A repeat with the same result answers the same record."""
    if len(to_json(body.result)) > MAX_RESULT_BYTES:
        raise ResultTooLarge(f"an effect's result is at most {MAX_RESULT_BYTES} bytes of JSON; record a reference to it instead")
    return as_built(await store.complete(request.app.state.engine, str(caller.run_id), effect_id, body.result))


@router.post("/{effect_id}/abandon", operation_id="abandon_effect", response_model=EffectOut, responses=problems(RUN, "effect_not_found", "effect_completed"))
async def abandon_effect(effect_id: int, request: Request, caller: Caller = Depends(require_run_access)) -> Response:
    """The reconcile hook found that a begun effect did not happen: the record is abandoned and
    the next begin of its key proceeds."""
    return as_built(await store.abandon(request.app.state.engine, str(caller.run_id), effect_id))


@router.get("", operation_id="list_effects", response_model=EffectPage, responses=problems(RUN))
async def list_effects(
    request: Request,
    orphaned: bool | None = Query(None, description="true: only orphans; false: only records not orphaned (abandoned ones included)."),
    rollout_id: str | None = Query(None, pattern=ROLLOUT_ID_PATTERN, max_length=256),
    cursor: int = Query(0, ge=0, description="`next_cursor` of the previous page."),
    limit: int = Query(1000, ge=1, le=10_000),
    caller: Caller = Depends(require_run_access),
) -> Response:
    """The run's journal in order, a page at a time: every effect with its state, result and, for
    an orphan, when and why its timeline was discarded."""
    return as_built(await store.list_effects(
        request.app.state.engine, str(caller.run_id), orphaned=orphaned, rollout_id=rollout_id, after=cursor, limit=limit,
    ))
