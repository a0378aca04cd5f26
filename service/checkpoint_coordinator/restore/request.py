"""A restore request as the API hands it over, and how a repeat of a restore id is answered from
its stored record: kept apart so that the execution, the Gym steps and the answer share one
definition of what a request is."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from ..domain.vocabulary import RestoreRecordState
from .errors import RestoreConflict, RestoreInProgress, RestoreRefusedEarlier
from .store import records


@dataclass(frozen=True)
class RestoreRequest:
    restore_id: str
    snapshot_id: str | None
    step: int | None
    with_gym_state: bool
    instance_map: Mapping[str, str] | None = None

    def stored(self) -> dict[str, Any]:
        return {
            "snapshot_id": self.snapshot_id,
            "step": self.step,
            "with_gym_state": self.with_gym_state,
            "instance_map": dict(self.instance_map) if self.instance_map is not None else None,
        }


def replay(rec: records.RestoreRecord, req: RestoreRequest) -> dict[str, Any]:
    """The answer a repeat of ``req`` gets from its stored record (or the refusal it got)."""
    stored = (rec.result or {}).get("request") or {}
    diff = sorted(k for k, v in req.stored().items() if stored.get(k) != v)
    if diff:
        raise RestoreConflict(
            f"restore {req.restore_id!r} was requested before with other {', '.join(diff)}; use a new restore_id",
            restore_id=req.restore_id,
            errors=[{"field": k, "message": f"was {stored.get(k)!r}"} for k in diff],
        )
    if rec.state == RestoreRecordState.applied:
        return dict((rec.result or {})["answer"])
    if rec.state == RestoreRecordState.running:
        raise RestoreInProgress(f"restore {req.restore_id!r} is still running; ask again later", restore_id=req.restore_id)
    problem = (rec.result or {}).get("problem")
    if problem:
        raise RestoreRefusedEarlier(problem)
    raise RestoreConflict(
        f"restore {req.restore_id!r} ended {rec.state} (its coordinator stopped mid-way); use a new restore_id",
        code="restore_abandoned",
        restore_id=req.restore_id,
    )
