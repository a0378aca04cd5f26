"""Answers of restore (docs/ledger.md#restore), the Gym manifest export
(docs/ledger.md#the-gym-manifest) and the NeMo RL ledger import and export
(docs/ledger.md#importing-a-nemo-rl-ledger).

The restore service stores its answers and answers them again as stored (a repeat, a later
page), so these models document that JSON and are not run on it: an answer stored by an older
release is answered as it was (tests/api/test_answer_schemas.py checks real answers against them).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field

from ..domain.vocabulary import Disposition, RestoreRecordState
from .accounting_schemas import RestoreAccountingOut
from .schemas import Answer, DataPlaneRefOut, Timestamp, sometimes

Disp = Literal[tuple(d.value for d in Disposition)]  # type: ignore[valid-type]


class PlanRowOut(Answer):
    """One sibling of a restore: what to send, under which rollout id and capture key, to which
    instance, and why (``reason``, docs/ledger.md#row-reasons)."""

    group_id: str
    generation_index: int
    disposition: Disp
    rollout_id: str
    capture_key: str
    gym_attempt: int
    group_attempt: int
    instance_id: str | None
    replaces_rollout_id: str | None = Field(description="The attempt a fresh rollout id replaces.")
    reason: str | None
    staging_keys: list[str] = sometimes("Reused rows, with `include_reused`.")


class SnapshotFields(Answer):
    """The restored snapshot, as a plan and a restore name it."""

    snapshot_id: str
    anchor_step: int = Field(description="The trainer checkpoint (train step) to load.")
    data_plane_ref: DataPlaneRefOut | None
    gym_checkpoint_id: str | None
    snapshot_dir: str | None


class GymStateOut(Answer):
    installs: bool
    reason: str | None = Field(description="Why no Gym state is installed, if none is.")


class RestorePlanOut(SnapshotFields):
    run_id: str
    with_gym_state: bool
    gym_state: GymStateOut
    epoch: int
    total: int
    counts: dict[str, int] = Field(description="Rows per disposition, over the whole plan.")
    reasons: dict[str, dict[str, int]] = Field(description="Rows per disposition and reason, over the whole plan.")
    instance_map: dict[str, str] | None
    cohort_reruns: list[str]
    skipped_groups: int
    retires: int
    continued_by_instance: dict[str, int]
    accounting: RestoreAccountingOut = Field(
        description="What this restore would find, carry and redo now (docs/accounting.md#what-a-restore-kept); the attempts "
        "minted after the cut in groups the cut knows are counted only when it is applied."
    )
    rows: list[PlanRowOut]
    next_cursor: int | None = Field(description="The `cursor` of the next page; null on the last.")


class GymRestoreOut(Answer):
    installed: bool
    reason: str | None
    restore_id: str | None
    source_checkpoint_id: str | None
    failure: dict[str, Any] | None
    continuations_retired: bool
    resume: dict[str, Any] | None


class RestoreEffectsOut(Answer):
    orphaned: dict[str, int] = Field(description="Journalled effects of the discarded timelines, by reason: they may need compensating.")
    pending: int = Field(description="Effects the continued episodes made after the cut: each is kept if the continuation makes it again.")


class RestoreOut(SnapshotFields):
    """An applied restore: its summary and the first page of the rows to send."""

    restore_id: str
    run_id: str
    state: Literal["applied"]
    with_gym_state: bool
    epoch: int = Field(description="The run's new fencing epoch.")
    gym: GymRestoreOut
    total: int
    counts: dict[str, int]
    reasons: dict[str, dict[str, int]]
    instance_map: dict[str, str] | None
    cohort_reruns: list[str]
    dispatched_after_cut: int
    retires_queued: int
    groups_removed: int
    train_steps_retired: list[int]
    aborted_snapshots: list[str]
    accounting: RestoreAccountingOut = sometimes(
        "What the restore found in flight, carried and must redo (docs/accounting.md#what-a-restore-kept); absent from "
        "restores applied before the coordinator kept accounting."
    )
    effects: RestoreEffectsOut = sometimes(
        "The effect journal (docs/effects.md#orphans); absent from restores applied before the journal existed."
    )
    rows_total: int
    rows: list[PlanRowOut]
    next_cursor: int | None = Field(description="The `cursor` of `GET /restores/{restore_id}/rows` for the next page.")


class RestoreRequestOut(Answer):
    snapshot_id: str | None
    step: int | None
    with_gym_state: bool
    instance_map: dict[str, str] | None


class RestoreRecordOut(Answer):
    restore_id: str
    snapshot_id: str
    state: RestoreRecordState
    with_gym_state: bool
    gym_restore_id: str | None
    request: RestoreRequestOut | None
    answer: RestoreOut | None = Field(description="The stored answer of an applied restore, with its first page of rows.")
    problem: dict[str, Any] | None = Field(description="The problem document a refused or failed restore answered.")
    created_at: Timestamp


class RestoreRowsOut(Answer):
    restore_id: str
    rows_total: int
    cursor: int
    rows: list[PlanRowOut]
    next_cursor: int | None


class EpisodeOut(Answer):
    attempt: int
    rollout_id: str


class ManifestInstanceOut(Answer):
    episodes: list[EpisodeOut]
    participants: list[str]
    restarts: list[EpisodeOut]
    staging_keys: list[str]


class GymManifestOut(Answer):
    """``gym_checkpoint.json`` (Gym manifest, schema 2, lists sorted)."""

    schema_version: int
    checkpoint_id: str
    instances: dict[str, ManifestInstanceOut]


class LedgerImportOut(Answer):
    run_id: str
    snapshot_id: str
    created: bool = Field(description="False for a repeat of the same document.")
    outcome: str
    anchor_step: int
    source_schema_version: int | None
    document_sha256: str | None
    groups: int
    siblings: int
    notes: list[str]


class ExportAttemptOut(Answer):
    generation_index: int
    rollout_id: str
    status: str
    row_attempts_used: int
    reward: float | None
    mask_sample: bool
    staging_keys: list[str]
    gym_instance_id: str | None
    gym_attempt: int


class ExportGroupOut(Answer):
    group_id: str
    prompt_ref: dict[str, Any]
    task_digest: str
    task_source: str | None
    agent_name: str | None
    restore_level: str
    expected_generations: int
    group_attempt: int
    data_attempts_used: int
    status: str
    target_step: int | None
    weight_version: str | None
    attempts: list[ExportAttemptOut]


class LedgerExportOut(Answer):
    """A NeMo RL rollout-recovery ledger, schema 4."""

    schema_version: int
    groups: list[ExportGroupOut]
    batch_shortfall: int
    sampler_stamps_target_steps: list[Any] | dict[str, Any]
