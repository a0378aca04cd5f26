"""Answers of a run's accounting (docs/accounting.md), and the accounting summary restore answers
and plan previews carry (docs/accounting.md#what-a-restore-kept)."""

from __future__ import annotations

from pydantic import Field

from ..domain.vocabulary import PromptBucket, WorkFate
from .schemas import Answer, Timestamp


class WorkSplitOut(Answer):
    attempts: int = Field(description="Attempts whose work the restore found.")
    found_seconds: float = Field(description="Rollout-seconds in flight (or sealed, not trained) when the restore came.")
    carried_seconds: float = Field(description="Of those, the part up to the cut of the episodes continued from Gym state.")
    redone_seconds: float = Field(description="Of those, the part that is done again.")
    carried_share: float | None = Field(description="carried / found; null when nothing was found.")
    redone_by_reason: dict[str, float] = Field(description="Redone seconds by reason (docs/accounting.md#rollout-seconds).")


class InstanceWorkOut(WorkSplitOut):
    instance_id: str | None = Field(description="The Gym instance the attempt ran on (null: never dispatched to one).")


class LevelWorkOut(WorkSplitOut):
    restore_level: str


class RestoreAccountingOut(WorkSplitOut):
    """What one restore found, carried and threw away."""

    groups_rewound: int = Field(description="Groups admitted after the cut, removed: the trainer's data loader owes them again.")
    already_redone_seconds: float = Field(description="Work of the rows it replaced that had been thrown away before it (failed, abandoned).")
    by_instance: list[InstanceWorkOut]
    by_level: list[LevelWorkOut]


class RunRestoreAccountingOut(RestoreAccountingOut):
    restore_id: str
    snapshot_id: str
    applied_at: Timestamp | None
    recorded: bool = Field(description="False for a restore applied before the coordinator kept accounting: its figures are zero.")


class PromptAccountingOut(Answer):
    admitted: int = Field(description="Groups admitted, a rewound group admitted again counting again.")
    buckets: dict[str, int] = Field(description=f"Groups per bucket: {', '.join(b.value for b in PromptBucket)}.")
    accounted: int = Field(description="The sum of the buckets.")
    missing: int = Field(description="admitted - accounted: nonzero only when groups left the ledger unrecorded.")
    conserved: bool = Field(description="Every admitted group is in exactly one bucket.")
    abandoned_by_reason: dict[str, int]
    live_by_status: dict[str, int]
    rewound_by_restore: dict[str, int]


class WorkAccountingOut(Answer):
    seconds_by_fate: dict[str, float] = Field(description=f"Rollout-seconds per fate: {', '.join(f.value for f in WorkFate)}.")
    attempts_by_fate: dict[str, int]
    redone_by_reason: dict[str, float]
    total_seconds: float
    kept_share: float | None = Field(description="(trained + in_flight + carried) / total; null before any work.")


class AccountingOut(Answer):
    """Every prompt group and every rollout-second of a run (``GET /v1/runs/{run}/accounting``)."""

    run_id: str
    as_of: Timestamp
    prompts: PromptAccountingOut
    work: WorkAccountingOut
    restores: list[RunRestoreAccountingOut]
