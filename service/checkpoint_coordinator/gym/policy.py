"""The commit scope rule (pure; docs/gym-protocol.md#commit-scopes)."""

from __future__ import annotations

import logging
from collections.abc import Iterable

from ..domain.vocabulary import GymOperation
from .errors import INSTANCE_WIDE, FailureClass, GymControlError, server_failure
from .models import Episode

__all__ = ["compute_scope"]

log = logging.getLogger("checkpoint_coordinator.gym")


def compute_scope(
    instance_id: str, candidates: Iterable[Episode], restarts: Iterable[Episode]
) -> tuple[list[Episode], list[Episode]]:
    """Commit scope of one instance: candidates minus every rollout named in its restarts.

    Returns ``(scope, restarted_candidates)``, both sorted. A restart naming another attempt
    than the candidate's is a ``protocol_error`` (docs/gym-protocol.md#commit-scopes); restarts that are not candidates
    are logged and ignored.
    """
    by_rollout: dict[str, Episode] = {}
    for ep in candidates:
        previous = by_rollout.setdefault(ep.rollout_id, ep)
        if previous != ep:
            raise ValueError(
                f"instance {instance_id}: rollout {ep.rollout_id!r} is a candidate at two attempts "
                f"({previous.attempt} and {ep.attempt})"
            )
    restarted: list[Episode] = []
    mismatched: list[str] = []
    ignored = 0
    for ep in sorted(set(restarts)):
        cand = by_rollout.get(ep.rollout_id)
        if cand is None:
            ignored += 1
        elif cand.attempt != ep.attempt:
            mismatched.append(f"{ep.capture_key} (candidate {cand.capture_key})")
        else:
            restarted.append(cand)
    if mismatched:
        raise GymControlError(
            FailureClass.PROTOCOL_ERROR,
            f"instance {instance_id}: restarts name attempts other than the candidates': "
            f"{len(mismatched)} e.g. {', '.join(mismatched[:10])}",
            instances={
                instance_id: {
                    INSTANCE_WIDE: server_failure(
                        FailureClass.PROTOCOL_ERROR,
                        GymOperation.prepare,
                        f"{len(mismatched)} restart(s) at a non-candidate attempt",
                        samples=mismatched[:10],
                    )
                }
            },
        )
    if ignored:
        log.info("instance %s: %d restart(s) are not commit candidates; ignored", instance_id, ignored)
    restarted_ids = {ep.rollout_id for ep in restarted}
    scope = sorted(ep for rid, ep in by_rollout.items() if rid not in restarted_ids)
    return scope, restarted
