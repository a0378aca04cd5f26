"""Accounting API (docs/accounting.md): every prompt group and every rollout-second of a run."""

from __future__ import annotations

from fastapi import APIRouter, Depends, Request, Response

from ..accounting.store import run_accounting
from .accounting_schemas import AccountingOut
from .auth import Caller, require_run_access
from .common import FastJSONRoute, as_built
from .problem_docs import RUN, problems

router = APIRouter(prefix="/v1/runs/{run_id}", tags=["accounting"], route_class=FastJSONRoute)


@router.get("/accounting", operation_id="get_accounting", response_model=AccountingOut, responses=problems(RUN))
async def get_accounting(request: Request, caller: Caller = Depends(require_run_access)) -> Response:
    """The run's groups by bucket (trained, abandoned, live, rewound) and whether they add up to
    its admissions; its rollout-seconds by fate and reason; and what each restore found in
    flight, carried and threw away, per instance and per level. Read from the ledger, so it
    holds right after any crash."""
    return as_built(await run_accounting(request.app.state.engine, str(caller.run_id)))
