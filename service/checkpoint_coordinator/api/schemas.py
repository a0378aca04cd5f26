"""Answers of the runs, probes, snapshots and train steps, typed once: the OpenAPI document
describes them from these models, and the JSON of a run, a snapshot or the schema's state is
built here from the ledger's rows (``RunOut.of``, ``SnapshotOut.of``, ``SchemaOut.of``), not in
the store.

Every answer model lists exactly its members (``additionalProperties: false``). A member that
is always sent, possibly null, is required; one that only some answers carry is ``sometimes()``:
not required, and sent only when set (those routes answer with ``response_model_exclude_unset``).
"""

from __future__ import annotations

from datetime import datetime
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from ..domain.snapshot_state import SnapshotOutcome, SnapshotPhase, snapshot_cause
from ..domain.vocabulary import RunState, SchemaState
from ..ledger.runs import RunRow
from ..ledger.schema import SchemaStatus
from ..snapshots.store import SnapshotRow


class Answer(BaseModel):
    """Base of the answer models: exactly the members listed."""

    model_config = ConfigDict(extra="forbid")


Timestamp = Annotated[str, Field(description="ISO 8601 date and time with its UTC offset.")]
Phase = Literal[tuple(p.value for p in SnapshotPhase)]  # type: ignore[valid-type]
Outcome = Literal[tuple(o.value for o in SnapshotOutcome)]  # type: ignore[valid-type]


def sometimes(description: str | None = None) -> Any:
    """A member only some answers carry: not required, and no default in the document; left unset
    when absent, and so not sent (``exclude_unset``)."""
    return Field(default=None, description=description, json_schema_extra=_no_default)


def _no_default(schema: dict[str, Any]) -> None:
    schema.pop("default", None)


def iso(t: datetime | None) -> str | None:
    return t.isoformat() if t else None


# ------------------------------------------------------------------------------------- runs


class DispatchGate(Answer):
    open: bool
    snapshot_id: str | None = Field(description="The snapshot that holds the gate closed (or that stopped the run).")


class RunOut(Answer):
    run_id: str
    state: RunState
    checkpoint_root: str
    recovery: dict[str, Any] = Field(description="The run's recovery config (docs/ledger.md#recovery-configuration), every key present.")
    epoch: int
    restored_from_rollout_snapshot: str | None
    consecutive_snapshot_losses: int
    consecutive_snapshot_failures: int
    dispatch_gate: DispatchGate
    created_at: Timestamp
    closed_at: Timestamp | None

    @classmethod
    def of(cls, run: RunRow) -> RunOut:
        return cls(
            run_id=run.run_id,
            state=run.state,
            checkpoint_root=run.checkpoint_root,
            recovery=run.config,
            epoch=run.epoch,
            restored_from_rollout_snapshot=run.restored_from_rollout_snapshot,
            consecutive_snapshot_losses=run.consecutive_snapshot_losses,
            consecutive_snapshot_failures=run.consecutive_snapshot_failures,
            dispatch_gate=DispatchGate(open=run.gate_snapshot_id is None, snapshot_id=run.gate_snapshot_id),
            created_at=run.created_at.isoformat(),
            closed_at=iso(run.closed_at),
        )


class CreatedRun(RunOut):
    run_token: str = Field(description="Shown once. Stored hashed; it cannot be read back.")
    warnings: list[str]

    @classmethod
    def created(cls, run: RunRow, token: str, warnings: list[str]) -> CreatedRun:
        return cls(**dict(RunOut.of(run)), run_token=token, warnings=warnings)


class RunList(Answer):
    runs: list[RunOut]
    next_after: str | None = Field(description="The `after` of the next page; null on the last.")


class RotatedToken(Answer):
    run_id: str
    run_token: str = Field(description="Shown once. The previous token of this run stops working.")


# ----------------------------------------------------------------------------------- probes


class Healthy(Answer):
    status: Literal["ok"]


class SchemaOut(Answer):
    """The database schema as this release sees it."""

    state: Literal[tuple(s.value for s in SchemaState)]  # type: ignore[valid-type]
    revision: str | None
    head: str
    runs_on_from: str | None

    @classmethod
    def of(cls, s: SchemaStatus) -> SchemaOut:
        return cls(state=s.state.value, revision=s.revision, head=s.head, runs_on_from=s.runs_on_from)


class Ready(Answer):
    database: Literal["ok", "unreachable"]
    migration: str | None = Field(description="The schema's revision (null: no ledger schema).")
    head: str = Field(description="This release's head revision.")
    schema_: SchemaOut = Field(alias="schema")
    status: Literal["ready"]
    reason: str = sometimes("Why the database does not answer (sent only then).")


class NotReady(Answer):
    """Draining for shutdown (``status`` alone), or the schema is one this release does not run on."""

    database: Literal["ok", "unreachable"] = sometimes()
    migration: str | None = sometimes()
    head: str = sometimes()
    schema_: SchemaOut = Field(default=None, alias="schema", json_schema_extra=_no_default)
    status: Literal["draining", "not_ready"]
    reason: str = sometimes()


# -------------------------------------------------------------------------------- snapshots


class DataPlaneRefOut(Answer):
    path: str
    digest: str


class SnapshotBlockersOut(Answer):
    """The episodes that kept a snapshot from its cut (docs/ledger.md#stragglers)."""

    count: int
    rollout_ids: list[str] = Field(description="At most 10 of them, sorted.")


class SnapshotOut(Answer):
    """A snapshot record (docs/ledger.md#snapshots)."""

    snapshot_id: str
    anchor_step: int
    stop: bool
    deadline_at: Timestamp | None
    phase: Phase
    outcome: Outcome | None
    reason: str | None
    cause: str | None = Field(description="For a snapshot that did not publish: why it ended and what to do, in one line.")
    retryable: bool | None = Field(description="For a snapshot that did not publish: whether a new snapshot later is expected to work.")
    detail: dict[str, Any] | None
    awaiting: Literal["barrier", "capture"] | None = Field(description="The trainer handshake the snapshot waits for.")
    watch_token: str = Field(description="Changes when the snapshot moves on (`GET ...?wait_s=&watch_token=`).")
    gym_checkpoint_id: str | None
    snapshot_dir: str | None
    phase_timings: dict[str, Any]
    counts: dict[str, Any]
    gym_parked_seconds: float | None
    gym_restarted_episodes: int | None
    resume_failure: dict[str, Any] | None
    data_plane_ref: DataPlaneRefOut | None
    cut_at: Timestamp | None
    created_at: Timestamp
    published_at: Timestamp | None
    ended_at: Timestamp | None
    blockers: SnapshotBlockersOut | None = Field(
        description="Once it ended: the episodes Gym's prepare named as blockers, or still pending when the drain gave up "
        "(count 0 when none); null while it runs."
    )
    staging_keys: list[str] = sometimes(
        "The staging keys that must exist in the capture: sent while the snapshot awaits its capture, and with `manifest=true`."
    )
    gym_manifest: dict[str, Any] | None = sometimes("The Gym manifest: sent with `manifest=true`.")

    @classmethod
    def of(cls, row: SnapshotRow, *, with_manifest: bool = False, **more: Any) -> Any:
        """The record of ``row``. Built without validation (``model_construct``): its members come
        typed from the row, and a capture's staging keys are hundreds of thousands of strings on
        the trainer's handshake path. ``more``: members of a subclass (the barrier's)."""
        cause, retryable = snapshot_cause(row.reason, row.detail)
        ref = row.data_plane_ref
        members: dict[str, Any] = {
            "snapshot_id": row.snapshot_id,
            "anchor_step": row.anchor_step,
            "stop": row.stop,
            "deadline_at": iso(row.deadline_at),
            "phase": row.phase,
            "outcome": row.outcome,
            "reason": row.reason,
            "cause": cause,
            "retryable": retryable,
            "detail": row.detail,
            "awaiting": row.awaiting,
            "watch_token": row.watch_token,
            "gym_checkpoint_id": row.gym_checkpoint_id,
            "snapshot_dir": row.snapshot_dir,
            "phase_timings": row.phase_timings,
            "counts": row.counts,
            "gym_parked_seconds": row.gym_parked_seconds,
            "gym_restarted_episodes": row.gym_restarted_episodes,
            "resume_failure": row.resume_failure,
            "data_plane_ref": None if ref is None else DataPlaneRefOut.model_construct(**ref),
            "cut_at": iso(row.cut_at),
            "created_at": iso(row.created_at),
            "published_at": iso(row.published_at),
            "ended_at": iso(row.ended_at),
            "blockers": None if row.blocker_count is None else SnapshotBlockersOut.model_construct(
                count=row.blocker_count, rollout_ids=row.blocker_sample or []
            ),
        }
        if row.awaiting == "capture" or with_manifest:
            members["staging_keys"] = row.cut_staging_keys or []
        if with_manifest:
            members["gym_manifest"] = row.gym_manifest
        members.update(more)
        return cls.model_construct(**members)


class SnapshotList(Answer):
    snapshots: list[SnapshotOut]
    next_before: str | None = Field(description="The `before` of the next page; null on the last.")


class StagingKeysDelta(Answer):
    base: Literal["pre_cut"]
    added: list[str]
    removed: list[str]


class BarrierOut(SnapshotOut):
    """The snapshot record after its ledger cut, with the staging keys that must exist in the
    capture (``staging_keys``) or, asked for the delta, what changed against the pre-cut's keys."""

    staging_keys_delta: StagingKeysDelta = sometimes("With `staging_keys=delta`, when the cut was taken on the pre-cut.")


class CutKeysOut(Answer):
    snapshot_id: str
    as_of: Literal["pre_cut", "cut", "none"]
    staging_keys: list[str]


class TrainStepOut(Answer):
    step: int
    checkpoint_ref: str | None
    announced_at: Timestamp
    retired_at: Timestamp | None = Field(description="Set when a restore discarded this step's lineage.")
    retired_by_restore: str | None


class TrainStepList(Answer):
    train_steps: list[TrainStepOut]


class AnnouncedTrainStep(Answer):
    step: int
    checkpoint_ref: str | None
    announced_at: Timestamp
    created: bool = Field(description="False for a repeat of an announced step.")
    aborted_snapshots: list[str] = Field(description="Snapshots this announce made lose (anchored older, no ledger cut yet).")
