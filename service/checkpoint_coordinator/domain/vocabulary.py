"""The ledger's vocabularies (docs/ledger.md#prompt-groups-siblings-and-attempts,
docs/ledger.md#live-rollouts, docs/ledger.md#restore), one enum each.

Metrics labels, the ORM models' check constraints, the SQL the ledger sends and the API all take
their words from here, so a word is added or renamed in one place.
"""

from __future__ import annotations

from collections.abc import Iterable
from enum import Enum

__all__ = [
    "StrEnum",
    "AttemptStatus",
    "GroupStatus",
    "RetirementState",
    "AttemptFailureClass",
    "Disposition",
    "GroupDisposition",
    "LedgerTransition",
    "RowReason",
    "SchemaState",
    "RunState",
    "OutboxState",
    "OutboxOp",
    "RestoreRecordState",
    "ParticipantKind",
    "GymOperation",
    "RETIRE_CHECKPOINT_ID",
    "FORGET_CHECKPOINT_ID",
    "REASON_DISPOSITIONS",
    "PromptBucket",
    "AbandonReason",
    "WorkFate",
    "WorkReason",
    "EffectState",
    "EffectAnswer",
    "OrphanReason",
    "sql_list",
]


class StrEnum(str, Enum):
    """A string enum whose members hash and compare like their values."""

    __hash__ = str.__hash__

    def __str__(self) -> str:
        return self.value


class AttemptStatus(StrEnum):
    reserved = "reserved"
    dispatched = "dispatched"
    returned = "returned"
    sealed = "sealed"
    failed = "failed"
    abandoned = "abandoned"


class RetirementState(StrEnum):
    none = "none"
    retire_pending = "retire_pending"
    retired = "retired"
    forget_pending = "forget_pending"
    forgotten = "forgotten"


class GroupStatus(StrEnum):
    generating = "generating"
    ready = "ready"
    finalized = "finalized"
    abandoned = "abandoned"


class AttemptFailureClass(StrEnum):
    """Why a trainer reported an attempt as failed (docs/ledger.md#failure): Gym answered with
    bad data, or the answer never came."""

    data = "data"
    transport = "transport"


class Disposition(StrEnum):
    """What a restore does with one sibling (docs/ledger.md#restore-plans-and-dispositions)."""

    reused = "reused"
    continued = "continued"
    restarted = "restarted"
    gym_restarted = "gym_restarted"
    rerun = "rerun"
    dispatch = "dispatch"

    @property
    def new_attempt(self) -> bool:
        """Whether the row is a new attempt under a new rollout id."""
        return self in _NEW_ATTEMPT


_NEW_ATTEMPT = frozenset({Disposition.restarted, Disposition.gym_restarted, Disposition.rerun})


class GroupDisposition(StrEnum):
    """What a restore does with a group as a whole."""

    reused = "reused"  # prompt_group: the whole cohort was sealed
    rerun = "rerun"  # prompt_group: the whole cohort reruns at group_attempt + 1
    dispatch = "dispatch"  # prompt_group: nothing of the cohort was sent yet
    per_row = "per_row"  # turn / sibling: each sibling on its own
    skipped = "skipped"  # finalized or abandoned: not part of the plan


class RowReason(StrEnum):
    """Why a restore plan row does what it does (docs/ledger.md#row-reasons)."""

    sealed_at_cut = "sealed_at_cut"  # the attempt was sealed when the cut was taken
    exported_by_gym = "exported_by_gym"  # Gym exported the episode: it continues at N+1
    restart_only_server = "restart_only_server"  # Gym listed the episode as one to restart (a server that cannot export)
    no_gym_state = "no_gym_state"  # in flight at the cut, and the snapshot holds no Gym state for it
    gym_not_restored = "gym_not_restored"  # a restore without Gym state: nothing is installed on Gym
    instance_not_mapped = "instance_not_mapped"  # exported by a saved instance the instance map leaves out
    gym_restore_failed = "gym_restore_failed"  # the Gym restore failed: its continuations restart
    in_flight_at_cut = "in_flight_at_cut"  # a sibling-level row in flight at the cut reruns
    failed_at_cut = "failed_at_cut"  # the row's attempt had failed or been abandoned at the cut
    cohort_incomplete = "cohort_incomplete"  # a prompt_group cohort not wholly sealed or unsent reruns whole
    never_sent = "never_sent"  # reserved and never sent: dispatched normally
    sent_after_cut = "sent_after_cut"  # never sent at the cut, but it reached Gym after it: a new attempt
    too_stale = "too_stale"  # exported by Gym, but sampled by a policy older than max_continue_staleness allows


#: The dispositions each reason goes with (the property tests check every plan row against it).
REASON_DISPOSITIONS = {
    RowReason.sealed_at_cut: frozenset({Disposition.reused}),
    RowReason.exported_by_gym: frozenset({Disposition.continued}),
    RowReason.restart_only_server: frozenset({Disposition.gym_restarted}),
    RowReason.no_gym_state: frozenset({Disposition.restarted}),
    RowReason.gym_not_restored: frozenset({Disposition.restarted}),
    RowReason.instance_not_mapped: frozenset({Disposition.restarted}),
    RowReason.gym_restore_failed: frozenset({Disposition.restarted}),
    RowReason.in_flight_at_cut: frozenset({Disposition.rerun}),
    RowReason.failed_at_cut: frozenset({Disposition.rerun, Disposition.restarted}),
    RowReason.cohort_incomplete: frozenset({Disposition.rerun}),
    RowReason.never_sent: frozenset({Disposition.dispatch}),
    RowReason.sent_after_cut: frozenset({Disposition.restarted, Disposition.rerun}),
    RowReason.too_stale: frozenset({Disposition.restarted, Disposition.rerun}),
}


# Target states of ledger transitions as counted by metrics: every attempt status, every group
# status (a group's ``abandoned`` as ``group_abandoned``, apart from the attempt's) and every
# retirement state a row can move to.
LedgerTransition = StrEnum(  # type: ignore[misc]
    "LedgerTransition",
    [(s.name, s.value) for s in AttemptStatus]
    + [(s.name if s is not GroupStatus.abandoned else "group_abandoned", s.value if s is not GroupStatus.abandoned else "group_abandoned") for s in GroupStatus]
    + [(s.name, s.value) for s in RetirementState if s is not RetirementState.none],
)

class PromptBucket(StrEnum):
    """Where every group ever admitted to a run is (docs/accounting.md#prompt-conservation)."""

    trained = "trained"  # finalized
    abandoned = "abandoned"  # given up, with an AbandonReason
    live = "live"  # generating or ready
    rewound = "rewound"  # admitted after the cut of a snapshot a restore applied: owed again


class AbandonReason(StrEnum):
    """Why a group was abandoned (``prompt_groups.abandon_reason``)."""

    trainer = "trainer"  # the trainer gave it up (POST .../groups:abandon)
    data_attempts_exhausted = "data_attempts_exhausted"  # max_data_attempts spent on data failures
    group_attempts_exhausted = "group_attempts_exhausted"  # max_group_attempts spent on replacements
    unrecorded = "unrecorded"  # abandoned before the ledger kept reasons, or as a restored cut said


class WorkFate(StrEnum):
    """What became of an attempt's rollout-seconds (docs/accounting.md#rollout-seconds)."""

    trained = "trained"  # sealed: trained, or waiting to be
    in_flight = "in_flight"  # dispatched and not ended yet (counted to now)
    carried = "carried"  # up to the cut of an episode a restore continued from Gym state
    redone = "redone"  # thrown away: the work is done again (a WorkReason says why)


class WorkReason(StrEnum):
    """Why work was redone."""

    failed = "failed"  # the attempt failed (bad data, or the answer never came)
    abandoned = "abandoned"  # its group or cohort was given up
    retired_by_restore = "retired_by_restore"  # a restore discarded it (after the cut, or its group rewound)
    rerun = "rerun"  # a restore reruns its row or cohort
    restarted = "restarted"  # a restore restarts it (no Gym state to continue from)
    after_cut = "after_cut"  # the turns after the cut of an episode a restore continued
    straggler = "straggler"  # it blocked max_blocking_snapshots snapshots in a row
    too_stale = "too_stale"  # a restore restarted it: its policy was too old to continue


class EffectState(StrEnum):
    """A journalled effect (docs/effects.md): begun, completed with its result, or abandoned by
    the participant's reconcile hook (it did not happen; the key is free again)."""

    in_progress = "in_progress"
    completed = "completed"
    abandoned = "abandoned"


class EffectAnswer(StrEnum):
    """What ``begin`` tells the tool (docs/effects.md#begin-and-complete)."""

    proceed = "proceed"  # first time: act, then complete
    done = "done"  # completed before with the same arguments: return its result, do not act
    unknown = "unknown"  # begun before and never completed: reconcile with the outside system
    diverged = "diverged"  # completed before with other arguments: act anew; the old one is an orphan


class OrphanReason(StrEnum):
    """Why an effect belongs to a discarded timeline (docs/effects.md#orphans)."""

    restarted = "restarted"  # a restore restarted its row under a new rollout id
    rerun = "rerun"  # a restore reran its row or cohort
    too_stale = "too_stale"  # a restore restarted its continuation: its policy was too old
    retired_by_restore = "retired_by_restore"  # a restore discarded its attempt (after the cut) or rewound its group
    diverged = "diverged"  # the continuation asked for another effect at its place
    not_repeated = "not_repeated"  # made after the cut; the continuation sealed without making it again


class RunState(StrEnum):
    """A run accepts work while ``open``; ``closed`` is final."""

    open = "open"
    closed = "closed"


class OutboxState(StrEnum):
    """An outbox item waits (``pending``), was acknowledged by Gym (``delivered``), or was made
    moot by a restore or a later item (``superseded``)."""

    pending = "pending"
    delivered = "delivered"
    superseded = "superseded"


class OutboxOp(StrEnum):
    """What an outbox item asks of Gym's participants for one rollout attempt."""

    retire = "retire"
    forget = "forget"


class RestoreRecordState(StrEnum):
    """A restore's record: in progress, applied, refused before any change, failed (its Gym
    side undone), or abandoned by its caller."""

    running = "running"
    applied = "applied"
    refused = "refused"
    failed = "failed"
    abandoned = "abandoned"


class ParticipantKind(StrEnum):
    """The kind of a Gym participant server (``unknown``: a status probe before it said)."""

    environment = "environment"
    model = "model"
    agent = "agent"
    resources = "resources"
    unknown = "unknown"


class GymOperation(StrEnum):
    """The Gym control operations the coordinator calls (docs/gym-protocol.md)."""

    discover = "discover"
    status = "status"
    prepare = "prepare"
    renew = "renew"
    commit = "commit"
    resume = "resume"
    restore = "restore"
    retire = "retire"
    forget = "forget"


#: The checkpoint id a retire or forget names when it belongs to no checkpoint: the operation's
#: own name (docs/gym-protocol.md#retire).
RETIRE_CHECKPOINT_ID: str = GymOperation.retire.value
FORGET_CHECKPOINT_ID: str = GymOperation.forget.value


class SchemaState(StrEnum):
    """What the database's schema is to a release (its readiness, its metric, its log)."""

    at_head = "at_head"  # the revision the release was built for
    ahead = "ahead"  # a newer release's schema that says this release runs on it
    behind = "behind"  # an older schema (or none): a migration has to run first
    incompatible = "incompatible"  # a newer schema this release must not run on
    unknown = "unknown"  # not read yet (the database has not answered since the start)


#: Attempts that may still be in flight: ended (abandoned) when their group gives up.
LIVE_ATTEMPT_STATUSES = (AttemptStatus.dispatched, AttemptStatus.reserved, AttemptStatus.returned)
#: Groups a restore plans (the others are history).
LIVE_GROUP_STATUSES = (GroupStatus.generating, GroupStatus.ready)
#: Attempt statuses that end an attempt (its ``ended_at`` is set).
ENDED_ATTEMPT_STATUSES = (AttemptStatus.sealed, AttemptStatus.failed, AttemptStatus.abandoned)
#: Group statuses that end a group.
ENDED_GROUP_STATUSES = (GroupStatus.finalized, GroupStatus.abandoned)


def sql_list(values: Iterable[StrEnum]) -> str:
    """``'a', 'b'`` for an SQL ``IN (...)`` built from enum members (their values are fixed
    words, never user input)."""
    return ", ".join(f"'{v.value}'" for v in values)
