"""Runs API: create (admin), get, list (admin), close."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Depends, Query, Request
from pydantic import Field

from ..errors import Forbidden
from ..ledger import runs as runs_repo
from ..observability import metrics
from ..recovery_config import validate_recovery_config
from .auth import Caller, require_admin, require_run_access
from .common import RUN_ID_PATTERN, FastJSONRoute, Strict
from .problem_docs import RUN, problems
from .schemas import CreatedRun, RotatedToken, RunList, RunOut
from ..domain.vocabulary import RunState

router = APIRouter(prefix="/v1/runs", tags=["runs"], route_class=FastJSONRoute)


class CreateRun(Strict):
    run_id: str = Field(pattern=RUN_ID_PATTERN, min_length=1, max_length=128)
    checkpoint_root: str = Field(
        min_length=1, max_length=4096, pattern=r"^/", description="Absolute path of the run's checkpoint root on the shared filesystem."
    )
    recovery: dict[str, Any] = Field(default_factory=dict, description="Recovery config (docs/ledger.md#recovery-configuration).")


@router.post(
    "", status_code=201, operation_id="create_run", response_model=CreatedRun,
    responses=problems("run_exists", "run_quota", "invalid_config"),
)
async def create_run(body: CreateRun, request: Request, _: Caller = Depends(require_admin)) -> CreatedRun:
    config, warnings = validate_recovery_config(body.recovery)
    settings = request.app.state.settings
    run, token = await runs_repo.create_run(
        request.app.state.engine, body.run_id, body.checkpoint_root, config, max_open_runs=settings.max_open_runs
    )
    return CreatedRun.created(run, token, warnings)


@router.get("", operation_id="list_runs", response_model=RunList, responses=problems())
async def list_runs(
    request: Request,
    limit: int = Query(100, ge=1, le=1000),
    after: str | None = Query(None, pattern=RUN_ID_PATTERN, max_length=128),
    state: RunState | None = None,
    _: Caller = Depends(require_admin),
) -> RunList:
    rows = await runs_repo.list_runs(request.app.state.engine, limit=limit, after=after, state=state)
    return RunList(runs=[RunOut.of(r) for r in rows], next_after=rows[-1].run_id if len(rows) == limit else None)


@router.get("/{run_id}", operation_id="get_run", response_model=RunOut, responses=problems(RUN))
async def get_run(request: Request, caller: Caller = Depends(require_run_access)) -> RunOut:
    async with request.app.state.engine.connect() as conn:
        return RunOut.of(await runs_repo.get_run(conn, caller.run_id))


@router.post("/{run_id}/token", operation_id="rotate_run_token", response_model=RotatedToken, responses=problems(RUN))
async def rotate_run_token(request: Request, caller: Caller = Depends(require_run_access)) -> RotatedToken:
    """Admin only: issue a new run token (a lost creation answer, or a leaked token)."""
    if not caller.admin:
        raise Forbidden("rotating a run token needs the admin token")
    return RotatedToken(run_id=caller.run_id, run_token=await runs_repo.rotate_token(request.app.state.engine, caller.run_id))


@router.post("/{run_id}/close", operation_id="close_run", response_model=RunOut, responses=problems(RUN))
async def close_run(request: Request, caller: Caller = Depends(require_run_access)) -> RunOut:
    if caller.run_id is None:
        raise Forbidden("no run")
    closed = RunOut.of(await runs_repo.close_run(request.app.state.engine, caller.run_id))
    metrics.forget_run(caller.run_id)  # other replicas drop theirs at their next sweep
    return closed
