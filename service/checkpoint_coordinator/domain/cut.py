"""The ledger cut a snapshot holds: groups and the current attempt of every sibling.

These mirror the ledger tables (docs/ledger.md#prompt-groups-siblings-and-attempts) closely enough for the restore plan and
the NeMo RL ledger import/export, and no further:

* :class:`CutGroup` is a prompt group row (a frozen dataclass; one per group).
* :class:`CutAttempt` is a sibling joined with its *current* attempt, one per
  ``(group_id, generation_index)``. It is an immutable ``NamedTuple`` rather than a dataclass
  because a cut can hold a million of them: a database row converts with ``CutAttempt(*row)``
  and the plan reads it by tuple unpacking. Field order is part of the API.

``status`` fields accept the enums of :mod:`.vocabulary` or their plain string values (the
members hash and compare like their values). ``attempt_id`` is the ledger's key of the attempt
row, opaque here (an ``int`` or a ``str``).

Invariants of a cut (checked by the restore plan, reported as :class:`~.errors.CutError` with
locations ``groups[i].<field>`` / ``attempts[j].<field>``):

* group ids are unique; ``expected_generations`` in ``[1, MAX_GENERATIONS)``;
  ``group_attempt >= 0``;
* every attempt names a known group and a generation index in ``[0, N)``; each sibling of each
  group has exactly one current attempt;
* rollout ids are unique across the cut;
* ``gym_attempt > 0`` (Gym turn state) only on turn-level groups, and only with a
  ``gym_instance_id`` (the instance that owns that state);
* ``returned`` only under ``prompt_group`` (a cohort seals atomically);
* a current attempt's ``group_attempt`` equals its group's.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple, Sequence, Union

from .levels import RestoreLevel
from .vocabulary import AttemptStatus, GroupStatus

__all__ = ["AttemptId", "PromptRef", "CutGroup", "CutAttempt", "Cut"]

AttemptId = Union[int, str]


class PromptRef(NamedTuple):
    """A locator of the prompt (never the prompt itself)."""

    sample_id: Union[int, str]
    task_name: str


@dataclass(frozen=True, slots=True)
class CutGroup:
    group_id: str
    restore_level: RestoreLevel
    expected_generations: int
    group_attempt: int
    status: GroupStatus
    task_digest: str
    prompt_ref: PromptRef
    agent_name: str | None = None
    task_source: str | None = None
    target_step: int | None = None
    weight_version: int | str | None = None


class CutAttempt(NamedTuple):
    group_id: str
    generation_index: int
    attempt_id: AttemptId
    rollout_id: str
    gym_instance_id: str | None
    gym_attempt: int
    group_attempt: int
    status: AttemptStatus
    staging_keys: tuple[str, ...] = ()
    row_attempts_used: int = 0
    reward: float | None = None
    mask_sample: bool = False


@dataclass(frozen=True, slots=True)
class Cut:
    """A snapshot's copy of the live ledger. ``attempts`` may be any sequence (a list of
    :class:`CutAttempt` or plain tuples of the same shape)."""

    groups: Sequence[CutGroup]
    attempts: Sequence[CutAttempt] = field(default_factory=tuple)
