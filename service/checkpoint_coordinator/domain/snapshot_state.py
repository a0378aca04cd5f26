"""State machines: snapshot phases and outcomes, attempt status, retirement, group status.

Each machine is a :class:`TransitionTable`; :func:`check_transition` raises
:class:`~.errors.TransitionError` for a move the table does not list. Self-moves are never
listed: an idempotent repeat (the same seal twice) is recognised by the ledger before it asks
for a transition.

Snapshot phases (docs/ledger.md#phases). Each phase is persisted before its side effects::

    requested -> gate -> retire -> prepare -> commit -> drain -> data_plane -> resume -> publish
              -> published

* ``gate`` closes the dispatch gate; ``retire`` delivers queued retires and forgets (Gym refuses
  them while a checkpoint is open); ``resume`` resumes Gym and reopens the gate, before
  ``publish``.
* A phase with nothing to do is not entered: ``gate -> prepare`` when the run owes Gym no retire
  or forget for a registered instance (in the gate's own transaction when it owes none at all),
  ``commit -> data_plane`` when every candidate was exported (nothing to drain). Each skipped
  write is one flushed commit and one wake of every waiter less while Gym is parked.
* A failure or abort once Gym's prepare was sent first moves to ``resume`` (resume is also the
  abort) and then to ``failed``/``aborted``; a snapshot that never sent it (``requested``,
  ``gate``, ``retire``, or ``prepare`` reached by the gate's close) may end directly. ``resume`` may end in ``publish`` only when the ledger cut
  was taken: that fact is held by the snapshot record, and :func:`check_snapshot_transition`
  takes it as ``cut_taken``.
* Any non-terminal phase may go straight to ``aborted`` with reason ``coordinator_restart``
  once the restarted coordinator has resumed the Gym phase (docs/ledger.md#outcomes-and-reasons),
  or to ``failed`` when the failure happened after the resume was sent.

Reasons form a closed enum; each belongs to one outcome (:data:`REASON_OUTCOME`).

Attempt status (docs/ledger.md#attempt-status)::

    reserved -> dispatched -> sealed | failed | abandoned
    dispatched -> reserved              (refused at admission: same rollout id, no attempt spent)
    dispatched -> returned -> sealed    (prompt_group: the cohort seals atomically)
    returned -> failed | abandoned      (the cohort fails or is replaced)
    reserved -> abandoned | failed      (the cohort or group is given up before it was sent)

``sealed``, ``failed`` and ``abandoned`` are terminal.

Retirement (kept apart from status)::

    none -> retire_pending -> retired -> forget_pending -> forgotten
    none -> forget_pending              (a restored rollout: its restore left the mark)
    forget_pending -> retire_pending    (a refused forget gets the retire again, then the forget)

Group status: ``generating -> ready -> finalized``; ``generating | ready -> abandoned``. A
ready group (every sibling sealed) is the trainer's to finalize or abandon; nothing sends it
back to ``generating``.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import MappingProxyType
from typing import Generic, Iterable, Mapping, TypeVar

from .errors import TransitionError
from .vocabulary import AttemptStatus, GroupStatus, RetirementState
from .vocabulary import StrEnum as _StrEnum

__all__ = [
    "SnapshotPhase",
    "SnapshotOutcome",
    "SnapshotReason",
    "SnapshotTiming",
    "FailureClass",
    "REASON_OUTCOME",
    "TRANSIENT_REASONS",
    "GYM_FAILURE_CLASS_REASON",
    "reason_for_gym_failure",
    "snapshot_cause",
    "AttemptStatus",
    "RetirementState",
    "GroupStatus",
    "TransitionTable",
    "SNAPSHOT_PHASES",
    "ATTEMPT_STATUS",
    "RETIREMENT",
    "GROUP_STATUS",
    "check_transition",
    "check_snapshot_transition",
    "outcome_of_phase",
    "METRIC_PHASES",
]




class SnapshotPhase(_StrEnum):
    requested = "requested"
    gate = "gate"
    retire = "retire"
    prepare = "prepare"
    commit = "commit"
    drain = "drain"
    data_plane = "data_plane"
    resume = "resume"
    publish = "publish"
    published = "published"
    failed = "failed"
    aborted = "aborted"

    @property
    def terminal(self) -> bool:
        return self in _TERMINAL_PHASES

    @property
    def gym_touched(self) -> bool:
        """Whether Gym may be parked in this phase (a restarted coordinator must resume it)."""
        return self in _GYM_PHASES


_TERMINAL_PHASES = frozenset({SnapshotPhase.published, SnapshotPhase.failed, SnapshotPhase.aborted})
_GYM_PHASES = frozenset(
    {
        SnapshotPhase.prepare,
        SnapshotPhase.commit,
        SnapshotPhase.drain,
        SnapshotPhase.data_plane,
        SnapshotPhase.resume,
    }
)

# Moves into these phases need not reach the disk before the owner goes on (PostgreSQL's
# asynchronous commit: visible to every session at once, flushed by the WAL writer soon after).
# Recovery treats a row in ``commit`` as one in ``prepare`` (Gym resumed, snapshot aborted), and
# the next move, flushed, flushes it too; a database crash that loses it leaves the row one phase
# behind its owner, whose next fenced move then finds ``prepare`` and ends the snapshot as
# ``database_unavailable`` (Gym resumed). Flushing it made the owner wait for the pre-cut's log
# writes while Gym stood parked. ``drain`` and ``data_plane`` stay flushed: the trainer acts on
# ``data_plane``, and a lost one would leave the owner waiting for a barrier that is refused.
UNFLUSHED_MOVES = frozenset({SnapshotPhase.commit})


class SnapshotTiming(_StrEnum):
    """The durations a snapshot records (``phase_timings`` and ``ckptc_snapshot_phase_seconds{phase}``):
    phases, plus ``total`` and ``gym_parked`` (first prepare sent until resume answered), which
    span several phases."""

    gate = "gate"
    prepare = "prepare"
    commit = "commit"
    drain = "drain"
    data_plane = "data_plane"
    resume = "resume"
    total = "total"
    gym_parked = "gym_parked"


METRIC_PHASES = tuple(t.value for t in SnapshotTiming)


class SnapshotOutcome(_StrEnum):
    published = "published"
    failed = "failed"
    aborted = "aborted"


class SnapshotReason(_StrEnum):
    """Why a snapshot ended (``ok`` for a published one)."""

    ok = "ok"
    # failed
    gym_not_ready = "gym_not_ready"  # prepare not ready by its deadline; carries blockers
    gym_unavailable = "gym_unavailable"  # connection errors, timeouts, 5xx, an orphan resumed
    gym_invariant = "gym_invariant"  # protocol_error, topology, config, conflict, state
    lease_lost = "lease_lost"  # a participant reopened before the cut
    drain_timeout = "drain_timeout"
    data_plane_timeout = "data_plane_timeout"
    data_plane_failed = "data_plane_failed"  # the trainer reported its capture failed
    database_unavailable = "database_unavailable"  # a phase write failed: the ledger database was away
    # aborted
    train_step_committed = "train_step_committed"  # a newer train step won the race
    coordinator_restart = "coordinator_restart"  # found non-terminal on start
    superseded = "superseded"  # the run moved on (restored, closed, or a newer request)
    cancelled = "cancelled"  # the trainer or an operator cancelled it
    restored = "restored"  # a restore ended the lineage this snapshot belonged to
    deadline_exceeded = "deadline_exceeded"  # a stopping snapshot could not make its deadline


REASON_OUTCOME: Mapping[SnapshotReason, SnapshotOutcome] = MappingProxyType(
    {
        SnapshotReason.ok: SnapshotOutcome.published,
        SnapshotReason.gym_not_ready: SnapshotOutcome.failed,
        SnapshotReason.gym_unavailable: SnapshotOutcome.failed,
        SnapshotReason.gym_invariant: SnapshotOutcome.failed,
        SnapshotReason.lease_lost: SnapshotOutcome.failed,
        SnapshotReason.drain_timeout: SnapshotOutcome.failed,
        SnapshotReason.data_plane_timeout: SnapshotOutcome.failed,
        SnapshotReason.data_plane_failed: SnapshotOutcome.failed,
        SnapshotReason.database_unavailable: SnapshotOutcome.failed,
        SnapshotReason.train_step_committed: SnapshotOutcome.aborted,
        SnapshotReason.coordinator_restart: SnapshotOutcome.aborted,
        SnapshotReason.superseded: SnapshotOutcome.aborted,
        SnapshotReason.cancelled: SnapshotOutcome.aborted,
        SnapshotReason.restored: SnapshotOutcome.aborted,
        SnapshotReason.deadline_exceeded: SnapshotOutcome.aborted,
    }
)

#: Reasons after which simply trying a new snapshot later is expected to work.
TRANSIENT_REASONS = frozenset(
    {
        SnapshotReason.gym_not_ready,
        SnapshotReason.gym_unavailable,
        SnapshotReason.lease_lost,
        SnapshotReason.drain_timeout,
        SnapshotReason.data_plane_timeout,
        SnapshotReason.database_unavailable,
        SnapshotReason.train_step_committed,
        SnapshotReason.coordinator_restart,
        SnapshotReason.superseded,
        SnapshotReason.cancelled,
        SnapshotReason.deadline_exceeded,
    }
)

class FailureClass(_StrEnum):
    """The control failure class of a Gym call (docs/gym-protocol.md#failure-classes)."""

    NOT_READY = "not_ready"
    UNAVAILABLE = "unavailable"
    LEASE_LOST = "lease_lost"
    DRAIN_TIMEOUT = "drain_timeout"
    PROTOCOL_ERROR = "protocol_error"
    TOPOLOGY_MISMATCH = "topology_mismatch"
    CONFIG_ERROR = "config_error"
    CONFLICT = "conflict"
    CHECKPOINT_STATE = "checkpoint_state"


#: Control failure class of the protocol (docs/gym-protocol.md#failure-classes) -> snapshot reason.
GYM_FAILURE_CLASS_REASON: Mapping[FailureClass, SnapshotReason] = MappingProxyType(
    {
        FailureClass.NOT_READY: SnapshotReason.gym_not_ready,
        FailureClass.UNAVAILABLE: SnapshotReason.gym_unavailable,
        FailureClass.LEASE_LOST: SnapshotReason.lease_lost,
        FailureClass.DRAIN_TIMEOUT: SnapshotReason.drain_timeout,
        FailureClass.PROTOCOL_ERROR: SnapshotReason.gym_invariant,
        FailureClass.TOPOLOGY_MISMATCH: SnapshotReason.gym_invariant,
        FailureClass.CONFIG_ERROR: SnapshotReason.gym_invariant,
        FailureClass.CONFLICT: SnapshotReason.gym_invariant,
        FailureClass.CHECKPOINT_STATE: SnapshotReason.gym_invariant,
    }
)


# What each reason means to the trainer, and what to do about it (``snapshot_cause``).
_CAUSES: Mapping[SnapshotReason, str] = MappingProxyType(
    {
        SnapshotReason.gym_not_ready: "Gym was not ready by its prepare deadline (rollouts kept working between turn "
        "boundaries); try again later, and raise prepare_timeout_s if it keeps happening",
        SnapshotReason.gym_unavailable: "a Gym participant could not be reached or failed; try again once Gym answers",
        SnapshotReason.gym_invariant: "Gym answered against the protocol, or the run's Gym registration is wrong; "
        "waiting will not help: fix the deployment (or register its instances again)",
        SnapshotReason.lease_lost: "Gym reopened on its own before its state was saved (a lapsed lease); try again, and "
        "configure Gym's lease_grace_seconds = control_timeout_s",
        SnapshotReason.drain_timeout: "/run replies on the wire were not reported by the trainer within drain_timeout_s; "
        "report every /run outcome (sealed, failed, refused) as it arrives, then try again",
        SnapshotReason.data_plane_timeout: "the trainer did not take its barrier and report its capture within "
        "data_plane_timeout_s; the trainer must be driving the snapshot (client.snapshot) while it runs",
        SnapshotReason.data_plane_failed: "the trainer reported that its data-plane capture failed",
        SnapshotReason.database_unavailable: "the coordinator's database was away during the snapshot; try again once it answers",
        SnapshotReason.train_step_committed: "a newer train step was announced before the cut (the train step wins); "
        "snapshot earlier in the step if this keeps happening",
        SnapshotReason.coordinator_restart: "the coordinator restarted while the snapshot ran; try again",
        SnapshotReason.superseded: "a newer trainer incarnation or request took over the run",
        SnapshotReason.cancelled: "cancelled by the trainer or an operator, or the coordinator shut down",
        SnapshotReason.restored: "a restore ended the lineage this snapshot belonged to",
        SnapshotReason.deadline_exceeded: "the stopping snapshot could not take its cut before its deadline; the previous "
        "published snapshot stays the one a restore uses",
    }
)
# Detail fields that say what happened, in the order they are looked for.
_DETAIL_TEXT = ("why", "message", "abort_detail", "error")


def snapshot_cause(reason: str | None, detail: Mapping[str, object] | None) -> tuple[str | None, bool | None]:
    """Why a snapshot that did not publish ended, in one line, and whether simply trying a new
    snapshot later is expected to work: ``(None, None)`` for a published or pending one. The
    specifics of ``detail`` (what failed, what the trainer did not do) come first."""
    if reason is None or reason == SnapshotReason.ok:
        return None, None
    try:
        r = SnapshotReason(reason)
    except ValueError:
        return f"ended for an unknown reason {reason!r}", False
    d = detail or {}
    retryable = r in TRANSIENT_REASONS
    if isinstance(d.get("retryable"), bool):
        retryable = bool(d["retryable"])
    elif isinstance(d.get("transient"), bool):  # a Gym control failure knows whether it is
        retryable = bool(d["transient"])
    specific = next((str(d[k]) for k in _DETAIL_TEXT if isinstance(d.get(k), str) and d[k]), "")
    if r is SnapshotReason.data_plane_timeout and d.get("awaiting"):
        specific = f"awaiting the trainer's {d['awaiting']} after {d.get('timeout_s', '?')}s"
    text = _CAUSES[r]
    return (f"{specific[:1000]}: {text}" if specific else text), retryable


def reason_for_gym_failure(failure_class: str) -> SnapshotReason:
    """The snapshot reason for a Gym control failure class; an unknown class is an invariant
    violation (the closed enum must not grow silently)."""
    return GYM_FAILURE_CLASS_REASON.get(failure_class, SnapshotReason.gym_invariant)


def outcome_of_phase(phase: SnapshotPhase) -> SnapshotOutcome | None:
    return {
        SnapshotPhase.published: SnapshotOutcome.published,
        SnapshotPhase.failed: SnapshotOutcome.failed,
        SnapshotPhase.aborted: SnapshotOutcome.aborted,
    }.get(phase)


S = TypeVar("S", bound=_StrEnum)


@dataclass(frozen=True)
class TransitionTable(Generic[S]):
    """Allowed moves of one state machine."""

    name: str
    states: type[S]
    allowed: Mapping[S, frozenset[S]]
    field: str = "status"

    def targets(self, current: S | str) -> frozenset[S]:
        return self.allowed.get(self.states(current), frozenset())

    def can(self, current: S | str, target: S | str) -> bool:
        return self.states(target) in self.targets(current)

    def terminal(self, state: S | str) -> bool:
        return not self.targets(state)

    def check(self, current: S | str, target: S | str) -> S:
        """``target`` as a member if ``current -> target`` is allowed, else TransitionError."""
        cur = self.states(current)
        tgt = self.states(target)
        allowed = self.allowed.get(cur, frozenset())
        if tgt not in allowed:
            raise TransitionError(
                self.name, cur.value, tgt.value, (a.value for a in allowed), self.field
            )
        return tgt


def _table(pairs: Iterable[tuple[S, Iterable[S]]]) -> Mapping[S, frozenset[S]]:
    return MappingProxyType({k: frozenset(v) for k, v in pairs})


P = SnapshotPhase
_ENDS = (P.failed, P.aborted)
SNAPSHOT_PHASES: TransitionTable[SnapshotPhase] = TransitionTable(
    "snapshot phase",
    SnapshotPhase,
    _table(
        [
            (P.requested, (P.gate, *_ENDS)),
            (P.gate, (P.retire, P.prepare, P.resume, *_ENDS)),
            (P.retire, (P.prepare, P.resume, *_ENDS)),
            (P.prepare, (P.commit, P.resume, *_ENDS)),
            (P.commit, (P.drain, P.data_plane, P.resume, *_ENDS)),
            (P.drain, (P.data_plane, P.resume, *_ENDS)),
            (P.data_plane, (P.resume, *_ENDS)),
            (P.resume, (P.publish, *_ENDS)),
            (P.publish, (P.published, *_ENDS)),
            (P.published, ()),
            (P.failed, ()),
            (P.aborted, ()),
        ]
    ),
    field="phase",
)

A = AttemptStatus
ATTEMPT_STATUS: TransitionTable[AttemptStatus] = TransitionTable(
    "attempt status",
    AttemptStatus,
    _table(
        [
            (A.reserved, (A.dispatched, A.abandoned, A.failed)),
            (A.dispatched, (A.reserved, A.returned, A.sealed, A.failed, A.abandoned)),
            (A.returned, (A.sealed, A.failed, A.abandoned)),
            (A.sealed, ()),
            (A.failed, ()),
            (A.abandoned, ()),
        ]
    ),
)

R = RetirementState
RETIREMENT: TransitionTable[RetirementState] = TransitionTable(
    "retirement",
    RetirementState,
    _table(
        [
            (R.none, (R.retire_pending, R.forget_pending)),
            # A delivered retire queues the forget in the same transaction (outbox worker):
            # ``retired`` is passed through without being written.
            (R.retire_pending, (R.retired, R.forget_pending)),
            (R.retired, (R.forget_pending,)),
            (R.forget_pending, (R.forgotten, R.retire_pending)),
            (R.forgotten, ()),
        ]
    ),
    field="retirement",
)

G = GroupStatus
GROUP_STATUS: TransitionTable[GroupStatus] = TransitionTable(
    "group status",
    GroupStatus,
    _table(
        [
            (G.generating, (G.ready, G.abandoned)),
            (G.ready, (G.finalized, G.abandoned)),
            (G.finalized, ()),
            (G.abandoned, ()),
        ]
    ),
)


def check_transition(table: TransitionTable[S], current: S | str, target: S | str) -> S:
    """Raise :class:`TransitionError` unless ``current -> target`` is in ``table``."""
    return table.check(current, target)


def check_snapshot_transition(
    current: SnapshotPhase | str,
    target: SnapshotPhase | str,
    *,
    cut_taken: bool = False,
    reason: SnapshotReason | str | None = None,
) -> SnapshotPhase:
    """Check a snapshot phase move with its guards.

    * ``resume -> publish`` needs ``cut_taken`` (the ledger copy exists);
    * a move to ``failed``/``aborted``/``published`` needs a ``reason`` of that outcome
      (``ok`` for published), and ``requested -> published`` is impossible anyway.
    """
    tgt = SNAPSHOT_PHASES.check(current, target)
    cur = SnapshotPhase(current)
    if cur is SnapshotPhase.resume and tgt is SnapshotPhase.publish and not cut_taken:
        raise TransitionError(
            SNAPSHOT_PHASES.name, cur.value, tgt.value, ("failed", "aborted"), "phase"
        )
    outcome = outcome_of_phase(tgt)
    if outcome is not None:
        if reason is None:
            raise TransitionError(
                SNAPSHOT_PHASES.name,
                cur.value,
                f"{tgt.value} without a reason",
                (f"{tgt.value} with a {outcome.value} reason",),
                "reason",
            )
        r = SnapshotReason(reason)
        if REASON_OUTCOME[r] is not outcome:
            raise TransitionError(
                SNAPSHOT_PHASES.name,
                cur.value,
                f"{tgt.value} with reason {r.value}",
                sorted(x.value for x, o in REASON_OUTCOME.items() if o is outcome),
                "reason",
            )
    return tgt
