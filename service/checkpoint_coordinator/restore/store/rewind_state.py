"""What a rewind is asked to do (:class:`Rewind`), what it reports (:class:`RewindReport`), and
what its steps share while they run (:class:`Rewinding`): the data the rewind's modules
(``rewind``, ``rewind_diff``, ``rewind_write``) pass between them."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from sqlalchemy.ext.asyncio import AsyncConnection

from ...accounting.summary import WorkItem
from ...domain.restore_plan import RetireItem
from ...domain.vocabulary import WorkReason


@dataclass
class Rewind:
    """What the plan asks of the live ledger, in columns (see :func:`apply_restore`)."""

    snapshot_id: str
    # continued rows: the cut attempt id and its rollout id
    continued_ids: list[int] = field(default_factory=list)
    continued_rollouts: list[str] = field(default_factory=list)
    # their groups (the cut is read by group key; empty: found by attempt id alone)
    continued_groups: list[str] = field(default_factory=list)
    # new attempts: the cut attempt they replace, sibling, new rollout id, group attempt
    new_old_ids: list[int] = field(default_factory=list)
    new_groups: list[str] = field(default_factory=list)
    new_indexes: list[int] = field(default_factory=list)
    new_rollouts: list[str] = field(default_factory=list)
    new_group_attempts: list[int] = field(default_factory=list)
    # prompt_group cohorts that rerun at group_attempt + 1
    bumped_groups: list[str] = field(default_factory=list)
    # retires owed on Gym (instance None: every registered instance)
    retire: list[RetireItem] = field(default_factory=list)
    # {saved instance: live instance}: continued rows move to the live instance
    # (docs/ledger.md#another-gym-topology)
    instance_map: dict[str, str] = field(default_factory=dict)
    # A restore with an instance map: retires go only to registered instances.
    into_other_topology: bool = False
    # Why each new attempt's predecessor's work is redone (a WorkReason, aligned with
    # new_old_ids; docs/accounting.md#rollout-seconds).
    new_reasons: list[str] = field(default_factory=list)
    # The restore whose record keeps what the rewind rewound (None: nothing is recorded).
    restore_id: str | None = None

    def add_new(self, old_id: int, group_id: str, index: int, rollout_id: str, group_attempt: int, reason: str = WorkReason.restarted.value) -> None:
        self.new_reasons.append(reason)
        self.new_old_ids.append(int(old_id))
        self.new_groups.append(group_id)
        self.new_indexes.append(index)
        self.new_rollouts.append(rollout_id)
        self.new_group_attempts.append(group_attempt)


@dataclass(frozen=True)
class AfterCut:
    """A row the plan would send under its old identity, though its attempt reached Gym after the
    cut: it is sent under a new rollout id instead (``disposition`` after the adjustment)."""

    attempt_id: int
    group_id: str
    generation_index: int
    disposition: str
    rollout_id: str
    replaces_rollout_id: str
    group_attempt: int


@dataclass
class RewindReport:
    epoch: int
    retires_queued: int = 0
    outbox_superseded: int = 0
    groups_removed: int = 0
    attempts_ended: int = 0
    attempts_rewritten: int = 0
    attempts_inserted: int = 0
    after_cut: list[AfterCut] = field(default_factory=list)
    bumped_after_cut: list[str] = field(default_factory=list)
    # Whether ``restore_diff`` compared only the rows written since the cut (``cut_xmin``).
    diff_by_xmin: bool = False
    # Train steps announced after the snapshot's anchor, retired with the lineage
    # (docs/ledger.md#the-discarded-lineage).
    train_steps_retired: list[int] = field(default_factory=list)
    # What the restore found, carried and threw away (docs/accounting.md#what-a-restore-kept).
    work: list[WorkItem] = field(default_factory=list)
    groups_rewound: int = 0
    # The effect journal (docs/effects.md#orphans): effects orphaned by reason, and those of the
    # continued episodes that wait to be made again.
    effects_orphaned: dict[str, int] = field(default_factory=dict)
    effects_pending: int = 0



Minter = Callable[[str, int], str]


@dataclass(frozen=True)
class SinceCut:
    """What ``rewind_diff._restore_diff_since_cut`` learnt about the run's groups: the live groups the
    cut lacks that had not ended before it (step 4 deletes exactly these), and the groups whose
    row was written at or after ``cut_xmin`` (any other live group row is the cut's, so step 6
    compares only these and the rerunning cohorts)."""

    absent: list[str]
    recent_groups: list[str]


@dataclass
class Rewinding:
    """What the steps of a rewind share: the transaction, the plan, and what earlier steps
    learnt (the groups touched since the cut, the cohorts that rerun, the retires owed)."""

    conn: AsyncConnection
    r: str
    s: str
    rw: Rewind
    report: RewindReport
    minter: Minter
    compare_every_row: bool
    bumped: set[str]
    retire: list[RetireItem]
    p: dict[str, Any] = field(default_factory=dict)
    touched: set[str] = field(default_factory=set)
    since: SinceCut | None = None
    everything: bool = False
    still: Any = None
    new_groups: Sequence[str] = ()
    # Live groups admitted after the cut, which the rewind removes (rewound).
    removed: list[str] = field(default_factory=list)
