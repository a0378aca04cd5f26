"""Answers of the trainer's live-rollout reports (docs/ledger.md#live-rollouts) and of the live
ledger's reads.

The batch reports are the ingest hot path: the store answers them as plain JSON, sent by one
native call (``FastJSON``); these models document that JSON and are not run on it
(tests/api/test_answer_schemas.py checks real answers against them).
"""

from __future__ import annotations

from typing import Any

from pydantic import Field

from .schemas import Answer, Timestamp, sometimes


class SendRowOut(Answer):
    """A row the trainer sends to Gym: under ``rollout_id``, Gym episode id ``capture_key``."""

    group_id: str
    generation_index: int
    rollout_id: str
    capture_key: str = Field(description="The rollout id at Gym attempt 0, `<rollout id>-a<N>` at attempt N.")
    gym_attempt: int
    group_attempt: int
    status: str
    restore_level: str
    instance_id: str | None = Field(description="The instance a restored continuation must go back to.")


class AdmittedGroupOut(Answer):
    group_id: str
    restore_level: str
    granularity: str
    status: str
    group_attempt: int
    admitted: bool = Field(description="False for a group admitted before (an identical repeat).")
    rows: list[SendRowOut]


class AdmitOut(Answer):
    groups: list[AdmittedGroupOut]


class DispatchOut(Answer):
    dispatch_id: str
    instance_id: str | None
    rows: list[SendRowOut]


class RefusedOut(Answer):
    rows: list[SendRowOut]


class RowResultOut(Answer):
    rollout_id: str
    result: str = Field(description="sealed, returned, failed, abandoned... or `unchanged` for a repeat.")
    status: str = sometimes("Seal reports: the attempt's status now.")
    end_reason: str = sometimes("Failure reports of a row the coordinator ended itself: why (`straggler`).")
    replaced_by: str = sometimes("Failure reports of a row replaced before: the rollout id of its sibling's current attempt.")


class SealOut(Answer):
    rows: list[RowResultOut]
    ready_groups: list[str]
    cohorts_sealed: list[str]


class GroupNextOut(Answer):
    group_id: str
    status: str
    group_attempt: int
    rows_to_send: list[SendRowOut]


class FailOut(Answer):
    rows: list[RowResultOut]
    groups: list[GroupNextOut]


class StreamEndedOut(Answer):
    dispatch_id: str
    missing: list[str]
    groups: list[GroupNextOut]


class GroupResultOut(Answer):
    group_id: str
    result: str


class GroupsOut(Answer):
    groups: list[GroupResultOut]


class StragglerOut(Answer):
    """An asked row the coordinator gave up as a straggler (docs/ledger.md#stragglers), and its
    group now: what to send instead."""

    rollout_id: str
    group: GroupNextOut


class PendingOut(Answer):
    pending: list[str]
    stragglers: list[StragglerOut] = sometimes("The asked rows given up as stragglers; sent when there are any.")


class LiveCountsOut(Answer):
    groups: dict[str, int]
    live_attempts: dict[str, int]
    outbox_pending: dict[str, int]


class AttemptOut(Answer):
    attempt_id: int
    rollout_id: str
    capture_key: str
    status: str
    is_current: bool
    gym_instance_id: str | None
    gym_attempt: int
    group_attempt: int
    refusals: int
    reward: float | None
    mask_sample: bool | None
    staging_keys: list[str] | None
    failure_class: str | None
    retirement: str
    gym_owned: bool
    dispatch_id: str | None
    # The newest train step announced when it was dispatched; None before any, or never dispatched
    # (docs/ledger.md#stale-continuations).
    policy_version: int | None
    created_at: Timestamp
    dispatched_at: Timestamp | None
    ended_at: Timestamp | None


class SiblingOut(Answer):
    generation_index: int
    row_attempts_used: int
    attempts: list[AttemptOut]


class GroupDetailOut(Answer):
    group_id: str
    status: str
    restore_level: str
    granularity: str
    expected_generations: int
    group_attempt: int
    data_attempts_used: int
    prompt_ref: dict[str, Any]
    task_digest: str
    task_source: str | None
    agent_name: str | None
    target_step: int | None
    weight_version: str | None
    siblings: list[SiblingOut]


class OutboxItemOut(Answer):
    item_id: int
    instance_id: str
    op: str
    rollout_id: str
    gym_attempt: int | None
    checkpoint_id: str
    tries: int
    last_error: str | None
    next_attempt_at: Timestamp
    created_at: Timestamp


class OutboxPageOut(Answer):
    items: list[OutboxItemOut]
    oldest_created_at: Timestamp | None
    next_after: int | None = Field(description="The `after` of the next page; null on the last.")
