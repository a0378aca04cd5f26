"""Pure rules the choreographies apply around the control calls (no I/O)."""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping

from .errors import INSTANCE_WIDE, FailureClass, GymControlError, ServerFailure, server_failure
from .models import Episode, Participant

__all__ = ["TARGET_LEVELS", "check_restart_only", "compute_scope"]

log = logging.getLogger("checkpoint_coordinator.gym")

# recovery-ledger.md section 3, finest first. `prefix` needs generation cuts and is refused.
TARGET_LEVELS = ("turn", "sibling", "prompt_group")


def check_restart_only(
    participants_by_instance: Mapping[str, Iterable[Participant]],
    target_level: str,
    allow_restart_only_gym_servers: bool,
) -> list[str]:
    """Apply the run policy ``allow_restart_only_gym_servers`` after discovery.

    Returns the warnings to log; raises a non-transient ``config_error`` naming every offending
    server. A participant without a reported mode (Gym before #4957) is never restart-only.
    """
    if target_level not in TARGET_LEVELS:
        raise GymControlError(
            FailureClass.CONFIG_ERROR,
            f"unknown target_level {target_level!r}; expected one of {', '.join(TARGET_LEVELS)}",
        )
    if allow_restart_only_gym_servers and target_level != "turn":
        raise GymControlError(
            FailureClass.CONFIG_ERROR,
            f"allow_restart_only_gym_servers is only meaningful with target_level 'turn', "
            f"not {target_level!r}: remove the flag",
        )
    offenders: dict[str, list[str]] = {}
    for instance_id, participants in participants_by_instance.items():
        names = sorted(p.server_name for p in participants if p.mode == "restart_only")
        if names:
            offenders[instance_id] = names
    named = ", ".join(f"{iid}/{name}" for iid, names in sorted(offenders.items()) for name in names)
    if target_level != "turn":
        # Nothing continues a turn at coarser levels, so restart-only servers lose nothing.
        return []
    if offenders and not allow_restart_only_gym_servers:
        parts: dict[str, dict[str, ServerFailure]] = {
            iid: {
                name: server_failure(
                    FailureClass.CONFIG_ERROR,
                    "setup",
                    "restart_only participant: its in-flight rollouts start over after a crash",
                )
                for name in names
            }
            for iid, names in offenders.items()
        }
        raise GymControlError.from_parts(
            parts,
            f"restart-only Gym servers under target_level 'turn': {named}; their in-flight rollouts "
            f"would silently start over from their tasks after a crash. Set "
            f"allow_restart_only_gym_servers to accept this",
        )
    warnings: list[str] = []
    if offenders:
        warnings.append(
            f"restart-only Gym servers accepted by allow_restart_only_gym_servers: {named}; their "
            f"in-flight rollouts start over from their tasks after a crash"
        )
    elif allow_restart_only_gym_servers:
        warnings.append(
            "allow_restart_only_gym_servers is set but no Gym participant is restart-only: "
            "the flag has no effect"
        )
    for text in warnings:
        log.warning("%s", text)
    return warnings


def compute_scope(
    instance_id: str, candidates: Iterable[Episode], restarts: Iterable[Episode]
) -> tuple[list[Episode], list[Episode]]:
    """Commit scope of one instance: candidates minus every rollout named in its restarts.

    Returns ``(scope, restarted_candidates)``, both sorted. A restart naming another attempt
    than the candidate's is a ``protocol_error`` (spec 5.4); restarts that are not candidates
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
                        "prepare",
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
