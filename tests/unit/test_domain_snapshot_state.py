"""State machines: snapshot phases and reasons, attempt status, retirement, group status."""

from __future__ import annotations

import pickle

import pytest
from hypothesis import given
from hypothesis import strategies as st

from checkpoint_coordinator.domain.errors import TransitionError
from checkpoint_coordinator.domain.snapshot_state import (
    ATTEMPT_STATUS,
    GROUP_STATUS,
    REASON_OUTCOME,
    RETIREMENT,
    SNAPSHOT_PHASES,
    AttemptStatus,
    GroupStatus,
    RetirementState,
    SnapshotOutcome,
    SnapshotPhase,
    SnapshotReason,
    check_snapshot_transition,
    check_transition,
    reason_for_gym_failure,
)

HAPPY_PATH = [
    "requested",
    "gate",
    "retire",
    "prepare",
    "commit",
    "drain",
    "data_plane",
    "resume",
    "publish",
    "published",
]


def test_the_happy_path_is_allowed_step_by_step() -> None:
    for cur, nxt in zip(HAPPY_PATH, HAPPY_PATH[1:]):
        check_snapshot_transition(cur, nxt, cut_taken=True, reason="ok")


def test_phases_cannot_be_skipped_or_reversed() -> None:
    with pytest.raises(TransitionError):
        check_transition(SNAPSHOT_PHASES, "gate", "commit")
    with pytest.raises(TransitionError):
        check_transition(SNAPSHOT_PHASES, "drain", "prepare")
    with pytest.raises(TransitionError):
        check_transition(SNAPSHOT_PHASES, "requested", "published")


@pytest.mark.parametrize("phase", ["gate", "retire", "prepare", "commit", "drain", "data_plane"])
def test_any_gym_phase_can_abort_through_resume(phase: str) -> None:
    check_transition(SNAPSHOT_PHASES, phase, "resume")
    check_snapshot_transition("resume", "failed", reason="drain_timeout")
    check_snapshot_transition("resume", "aborted", reason="train_step_committed")


def test_publish_needs_the_cut() -> None:
    with pytest.raises(TransitionError):
        check_snapshot_transition("resume", "publish", cut_taken=False)
    check_snapshot_transition("resume", "publish", cut_taken=True)


def test_terminal_phases_need_a_reason_of_their_outcome() -> None:
    with pytest.raises(TransitionError) as info:
        check_snapshot_transition("resume", "failed")
    assert info.value.issues[0].path == "reason"
    with pytest.raises(TransitionError):
        check_snapshot_transition("resume", "failed", reason="train_step_committed")
    with pytest.raises(TransitionError):
        check_snapshot_transition("publish", "published", reason="drain_timeout")
    check_snapshot_transition("drain", "aborted", reason="coordinator_restart")


@pytest.mark.parametrize("phase", ["published", "failed", "aborted"])
def test_terminal_phases_are_final(phase: str) -> None:
    assert SnapshotPhase(phase).terminal
    assert SNAPSHOT_PHASES.terminal(phase)
    for target in SnapshotPhase:
        assert not SNAPSHOT_PHASES.can(phase, target)


def test_every_non_terminal_phase_can_fail_or_abort() -> None:
    for phase in SnapshotPhase:
        if not phase.terminal:
            assert SNAPSHOT_PHASES.can(phase, "failed")
            assert SNAPSHOT_PHASES.can(phase, "aborted")


def test_reason_enum_is_closed_and_mapped() -> None:
    assert set(REASON_OUTCOME) == set(SnapshotReason)
    for name in (
        "gym_not_ready",
        "gym_unavailable",
        "gym_invariant",
        "lease_lost",
        "drain_timeout",
        "data_plane_timeout",
        "train_step_committed",
        "coordinator_restart",
        "superseded",
    ):
        assert SnapshotReason(name) in REASON_OUTCOME
    assert REASON_OUTCOME[SnapshotReason.train_step_committed] is SnapshotOutcome.aborted
    assert REASON_OUTCOME[SnapshotReason.drain_timeout] is SnapshotOutcome.failed
    assert reason_for_gym_failure("not_ready") is SnapshotReason.gym_not_ready
    assert reason_for_gym_failure("protocol_error") is SnapshotReason.gym_invariant
    assert reason_for_gym_failure("something_new") is SnapshotReason.gym_invariant


def test_attempt_status_machine() -> None:
    ok = [
        ("reserved", "dispatched"),
        ("dispatched", "sealed"),
        ("dispatched", "failed"),
        ("dispatched", "abandoned"),
        ("dispatched", "reserved"),  # refused at admission
        ("dispatched", "returned"),
        ("returned", "sealed"),
        ("returned", "abandoned"),
        ("reserved", "abandoned"),
    ]
    for cur, nxt in ok:
        assert check_transition(ATTEMPT_STATUS, cur, nxt) == AttemptStatus(nxt)
    for cur, nxt in [("sealed", "dispatched"), ("reserved", "sealed"), ("failed", "reserved"), ("abandoned", "dispatched"), ("reserved", "returned")]:
        with pytest.raises(TransitionError) as info:
            check_transition(ATTEMPT_STATUS, cur, nxt)
        assert info.value.current == cur and info.value.target == nxt


def test_retirement_machine() -> None:
    path = ["none", "retire_pending", "retired", "forget_pending", "forgotten"]
    for cur, nxt in zip(path, path[1:]):
        check_transition(RETIREMENT, cur, nxt)
    check_transition(RETIREMENT, "none", "forget_pending")  # restored rollout
    check_transition(RETIREMENT, "forget_pending", "retire_pending")  # refused forget
    with pytest.raises(TransitionError) as info:
        check_transition(RETIREMENT, "forgotten", "retire_pending")
    assert info.value.issues[0].path == "retirement"
    assert "terminal" in info.value.message


def test_group_machine() -> None:
    check_transition(GROUP_STATUS, "generating", "ready")
    check_transition(GROUP_STATUS, "ready", "finalized")
    check_transition(GROUP_STATUS, "generating", "abandoned")
    with pytest.raises(TransitionError):
        check_transition(GROUP_STATUS, "ready", "generating")


@given(
    st.sampled_from(
        [(SNAPSHOT_PHASES, SnapshotPhase), (ATTEMPT_STATUS, AttemptStatus), (RETIREMENT, RetirementState), (GROUP_STATUS, GroupStatus)]
    ),
    st.data(),
)
def test_check_agrees_with_the_table(machine, data) -> None:  # type: ignore[no-untyped-def]
    table, states = machine
    cur = data.draw(st.sampled_from(list(states)))
    nxt = data.draw(st.sampled_from(list(states)))
    assert cur != nxt or not table.can(cur, nxt)  # self-moves are never listed
    if table.can(cur, nxt):
        assert table.check(cur, nxt) is nxt
    else:
        with pytest.raises(TransitionError):
            table.check(cur.value, nxt.value)


def test_unknown_state_is_refused() -> None:
    with pytest.raises(ValueError):
        check_transition(ATTEMPT_STATUS, "reserved", "running")


def test_transition_error_pickles() -> None:
    try:
        check_transition(ATTEMPT_STATUS, "sealed", "reserved")
    except TransitionError as err:
        again = pickle.loads(pickle.dumps(err))
        assert again.issues == err.issues and again.allowed == err.allowed
