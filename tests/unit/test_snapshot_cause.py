"""A snapshot that did not publish says why and what to do, and whether trying again helps."""

from __future__ import annotations

from checkpoint_coordinator.domain.snapshot_state import REASON_OUTCOME, TRANSIENT_REASONS, SnapshotReason, snapshot_cause


def test_every_reason_but_ok_has_a_cause_and_a_verdict() -> None:
    for reason in REASON_OUTCOME:
        cause, retryable = snapshot_cause(reason.value, {})
        if reason is SnapshotReason.ok:
            assert (cause, retryable) == (None, None)
        else:
            assert cause and retryable is (reason in TRANSIENT_REASONS), reason
    assert snapshot_cause(None, None) == (None, None)  # still pending


def test_the_detail_says_what_happened_first() -> None:
    cause, retryable = snapshot_cause("gym_unavailable", {"message": "unavailable: math/replica-0/policy_model: no answer", "transient": True})
    assert cause.startswith("unavailable: math/replica-0/policy_model: no answer: a Gym participant could not be reached")
    assert retryable is True
    # A Gym failure knows whether it is transient; a detail may say so outright.
    assert snapshot_cause("gym_unavailable", {"message": "x", "transient": False})[1] is False
    assert snapshot_cause("gym_invariant", {"why": "no Gym instance is registered", "retryable": False}) == (
        "no Gym instance is registered: " + snapshot_cause("gym_invariant", {})[0], False)
    waited = snapshot_cause("data_plane_timeout", {"awaiting": "barrier", "timeout_s": 20})[0]
    assert waited.startswith("awaiting the trainer's barrier after 20s: the trainer did not take its barrier")
    assert snapshot_cause("data_plane_failed", {"abort_detail": "disk full"})[0].startswith("disk full: ")
    assert snapshot_cause("no_such_reason", {}) == ("ended for an unknown reason 'no_such_reason'", False)
