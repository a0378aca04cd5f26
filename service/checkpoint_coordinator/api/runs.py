"""Runs API: create (admin), get, list (admin), close."""

from __future__ import annotations

from typing import Any, Literal

from fastapi import APIRouter, Depends, Query, Request
from pydantic import Field

from ..errors import Forbidden
from ..ledger import runs as runs_repo
from ..observability import metrics
from ..recovery_config import validate_recovery_config
from .auth import Caller, require_admin, require_run_access
from .common import RUN_ID_PATTERN, V1_ERRORS, FastJSONRoute, Strict, problem_responses

router = APIRouter(prefix="/v1/runs", tags=["runs"], route_class=FastJSONRoute, responses=problem_responses(*V1_ERRORS))


class CreateRun(Strict):
    run_id: str = Field(pattern=RUN_ID_PATTERN, min_length=1, max_length=128)
    checkpoint_root: str = Field(
        min_length=1, max_length=4096, pattern=r"^/", description="Absolute path of the run's checkpoint root on the shared filesystem."
    )
    recovery: dict[str, Any] = Field(default_factory=dict, description="Recovery config (spec section 3).")


class RunOut(Strict):
    run_id: str
    state: Literal["open", "closed"]
    checkpoint_root: str
    recovery: dict[str, Any]
    epoch: int
    restored_from_rollout_snapshot: str | None
    consecutive_snapshot_losses: int
    consecutive_snapshot_failures: int
    dispatch_gate: dict[str, Any]
    created_at: str
    closed_at: str | None


class CreatedRun(RunOut):
    run_token: str = Field(description="Shown once. Stored hashed; it cannot be read back.")
    warnings: list[str] = Field(default_factory=list)


class RunList(Strict):
    runs: list[RunOut]
    next_after: str | None


@router.post("", status_code=201, operation_id="create_run", response_model=CreatedRun)
async def create_run(body: CreateRun, request: Request, _: Caller = Depends(require_admin)) -> dict[str, Any]:
    config, warnings = validate_recovery_config(body.recovery)
    settings = request.app.state.settings
    run, token = await runs_repo.create_run(
        request.app.state.engine, body.run_id, body.checkpoint_root, config, max_open_runs=settings.max_open_runs
    )
    return {**run.public(), "run_token": token, "warnings": warnings}


@router.get("", operation_id="list_runs", response_model=RunList)
async def list_runs(
    request: Request,
    limit: int = Query(100, ge=1, le=1000),
    after: str | None = Query(None, pattern=RUN_ID_PATTERN, max_length=128),
    state: Literal["open", "closed"] | None = None,
    _: Caller = Depends(require_admin),
) -> dict[str, Any]:
    rows = await runs_repo.list_runs(request.app.state.engine, limit=limit, after=after, state=state)
    return {"runs": [r.public() for r in rows], "next_after": rows[-1].run_id if len(rows) == limit else None}


@router.get("/{run_id}", operation_id="get_run", response_model=RunOut)
async def get_run(request: Request, caller: Caller = Depends(require_run_access)) -> dict[str, Any]:
    async with request.app.state.engine.connect() as conn:
        return (await runs_repo.get_run(conn, caller.run_id)).public()


class RotatedToken(Strict):
    run_id: str
    run_token: str = Field(description="Shown once. The previous token of this run stops working.")


@router.post("/{run_id}/token", operation_id="rotate_run_token", response_model=RotatedToken)
async def rotate_run_token(request: Request, caller: Caller = Depends(require_run_access)) -> dict[str, Any]:
    """Admin only: issue a new run token (a lost creation answer, or a leaked token)."""
    if not caller.admin:
        raise Forbidden("rotating a run token needs the admin token")
    return {"run_id": caller.run_id, "run_token": await runs_repo.rotate_token(request.app.state.engine, caller.run_id)}


@router.post("/{run_id}/close", operation_id="close_run", response_model=RunOut)
async def close_run(request: Request, caller: Caller = Depends(require_run_access)) -> dict[str, Any]:
    if caller.run_id is None:
        raise Forbidden("no run")
    closed = (await runs_repo.close_run(request.app.state.engine, caller.run_id)).public()
    metrics.forget_run(caller.run_id)  # other replicas drop theirs at their next sweep
    return closed
