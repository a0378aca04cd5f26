"""Restore (docs/gym-protocol.md#restore), all or nothing across instances: checks that refuse
before any restore call, the fan-out, and the cleanup (retire every N+1, resume) after any
failure or a discard."""

from __future__ import annotations

import asyncio
import os
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any

from ..domain.vocabulary import GymOperation
from .channel import CallFailed, encode_body
from .context import Control
from .discovery import discover_all, recover_orphans
from .errors import (
    INSTANCE_WIDE,
    FailureClass,
    GymControlError,
    ServerFailure,
    parts_summary,
    sample,
    server_failure,
)
from .models import (
    Episode,
    InstanceSpec,
    InstanceTopology,
    Participant,
    RestoreReply,
    episodes_to_wire,
    instance_checkpoint_dir,
    is_valid_checkpoint_id,
)
from .results import RestoreCleanup, RestoreResult
from .resume import resume_all
from .retire import retire

__all__ = ["discard_restore", "finish_restore", "restore"]

# The cleanup gets at least this long, whatever control_timeout_s is.
CLEANUP_MIN_BUDGET_S = 30.0


@dataclass(frozen=True, slots=True)
class _InstancePlan:
    episodes: tuple[Episode, ...]
    restarts: tuple[Episode, ...]
    participants: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class _RestorePlan:
    source_id: str
    instances: Mapping[str, _InstancePlan]

    @classmethod
    def parse(cls, manifest: Mapping[str, Any]) -> _RestorePlan:
        """What restore needs from an already validated Gym manifest v2.

        The domain loader owns validation; this only refuses a shape it cannot use, so a caller
        that skipped the loader still cannot restore from nonsense.
        """
        try:
            if manifest.get("schema_version") != 2 or type(manifest.get("schema_version")) is not int:
                raise ValueError(f"schema_version {manifest.get('schema_version')!r} is not 2")
            source = manifest["checkpoint_id"]
            if not is_valid_checkpoint_id(source):
                raise ValueError(f"invalid checkpoint_id {source!r}")
            instances: dict[str, _InstancePlan] = {}
            for iid, body in manifest["instances"].items():
                instances[iid] = _InstancePlan(
                    episodes=tuple(sorted(Episode.from_wire(e) for e in body["episodes"])),
                    restarts=tuple(sorted(Episode.from_wire(e) for e in body["restarts"])),
                    participants=tuple(sorted(body["participants"])),
                )
                if not instances[iid].participants:
                    raise ValueError(f"instance {iid} has no participants")
            if not instances:
                raise ValueError("no instances")
        except (KeyError, TypeError, AttributeError, ValueError) as exc:
            raise GymControlError(
                FailureClass.CHECKPOINT_STATE, f"unusable Gym manifest: {type(exc).__name__}: {exc}"
            ) from None
        return cls(source, instances)

    def rollouts(self) -> dict[str, list[str]]:
        return {iid: sorted({e.rollout_id for e in p.episodes}) for iid, p in sorted(self.instances.items())}


async def restore(
    ctl: Control,
    manifest: Mapping[str, Any],
    topology: Mapping[str, InstanceSpec | InstanceTopology],
    snapshot_dir: str,
    *,
    resume: bool = True,
    instance_dirs: Mapping[str, str] | None = None,
) -> RestoreResult:
    plan = _RestorePlan.parse(manifest)
    specs = {iid: (t.spec if isinstance(t, InstanceTopology) else t) for iid, t in topology.items()}
    if not os.path.isabs(snapshot_dir):
        raise ValueError(f"snapshot_dir must be absolute, got {snapshot_dir!r}")
    everything = plan.rollouts()
    _require_instances(plan, specs, everything)
    try:
        live = await discover_all(ctl, (specs[iid] for iid in sorted(specs)), log_warnings=False)
    except GymControlError as exc:
        exc.extra.setdefault("rollouts_to_restart", everything)
        raise
    _require_participants(plan, live, everything)
    await _require_idle(ctl, live, everything)

    restore_id = ctl.book.new_restore_id(plan.source_id)
    ctl.book.hold(restore_id, live)
    parts = await _restore_everywhere(ctl, plan, live, snapshot_dir, restore_id, instance_dirs or {})
    result = RestoreResult(
        restore_id=restore_id,
        source_checkpoint_id=plan.source_id,
        continued={iid: tuple(ep.next_attempt() for ep in p.episodes) for iid, p in plan.instances.items()},
        restarts={iid: p.restarts for iid, p in plan.instances.items()},
        topology=live,
    )
    if parts:
        error = GymControlError.from_parts(parts, f"restore {restore_id} failed: " + parts_summary(parts))
        cleanup = await cleanup_restore(ctl, result)
        error.extra.update(
            restore_id=restore_id,
            rollouts_to_restart=everything,
            unretired=cleanup.unretired(),
            resume=cleanup.resume.summary(),
        )
        error.resume_failure = cleanup.failure
        raise error
    if resume:
        return await finish_restore(ctl, result)
    return result


def _require_instances(plan: _RestorePlan, specs: Mapping[str, InstanceSpec], everything: dict[str, list[str]]) -> None:
    missing = sorted(set(plan.instances) - set(specs))
    unknown = sorted(set(specs) - set(plan.instances))
    if not (missing or unknown):
        return
    parts = {
        iid: {INSTANCE_WIDE: server_failure(FailureClass.TOPOLOGY_MISMATCH, GymOperation.restore, why)}
        for ids, why in ((missing, "instance in the snapshot but not live"), (unknown, "live instance not in the snapshot"))
        for iid in ids
    }
    raise GymControlError.from_parts(
        parts,
        f"live Gym instances differ from the snapshot's: missing {missing}, unknown {unknown}",
        extra={"missing_instances": missing, "unknown_instances": unknown, "rollouts_to_restart": everything},
    )


def _require_participants(
    plan: _RestorePlan, live: Mapping[str, InstanceTopology], everything: dict[str, list[str]]
) -> None:
    """Every server that committed an instance is live again; extra live participants are fine."""
    absent: dict[str, dict[str, ServerFailure]] = {}
    for iid, inst_plan in plan.instances.items():
        names = {p.server_name for p in live[iid].participants}
        for server in inst_plan.participants:
            if server not in names:
                absent.setdefault(iid, {})[server] = server_failure(
                    FailureClass.TOPOLOGY_MISMATCH,
                    GymOperation.restore,
                    "committed this instance in the snapshot but is not a live participant",
                )
    if absent:
        raise GymControlError.from_parts(
            absent,
            "snapshot participants missing from the live deployment: "
            + ", ".join(f"{iid}/{s}" for iid, ss in sorted(absent.items()) for s in sorted(ss)),
            extra={
                "missing_participants": {iid: sorted(ss) for iid, ss in absent.items()},
                "rollouts_to_restart": everything,
            },
        )


async def _require_idle(ctl: Control, live: Mapping[str, InstanceTopology], everything: dict[str, list[str]]) -> None:
    busy = {iid: inst for iid, inst in live.items() if inst.active_ids}
    if not busy:
        return
    parts = {
        iid: {
            s: server_failure(
                FailureClass.UNAVAILABLE if ctl.book.is_orphan_of_ours(c) else FailureClass.CONFLICT,
                GymOperation.restore,
                f"not idle: holds checkpoint {c!r}",
            )
            for s, c in inst.active_ids.items()
        }
        for iid, inst in busy.items()
    }
    error = GymControlError.from_parts(parts, "restore needs every participant idle", extra={"rollouts_to_restart": everything})
    if error.transient:
        # Only our own orphans: resume them, so that a retried restore finds them idle.
        try:
            await recover_orphans(ctl, busy)
        except GymControlError as exc:
            error.resume_failure = exc
    raise error


async def _restore_everywhere(
    ctl: Control, plan: _RestorePlan, live: Mapping[str, InstanceTopology], snapshot_dir: str, restore_id: str,
    instance_dirs: Mapping[str, str],
) -> dict[str, dict[str, ServerFailure]]:
    """One restore call per named participant of every instance, concurrently; the failure parts
    of the instances whose replies do not hold up."""
    deadline = ctl.deadline()
    calls: list[tuple[str, InstanceTopology, Participant, bytes, int]] = []
    for iid, inst in live.items():
        inst_plan = plan.instances[iid]
        body = encode_body(
            {
                "checkpoint_id": restore_id,
                "deadline_ts": deadline,
                "checkpoint_dir": instance_checkpoint_dir(snapshot_dir, instance_dirs.get(iid, iid)),
                "episode_ids": episodes_to_wire(inst_plan.episodes),
            }
        )
        named = set(inst_plan.participants)
        # Extra live participants have no directory: they get no restore, only the resume.
        calls.extend((iid, inst, p, body, len(inst_plan.episodes)) for p in inst.participants if p.server_name in named)
    replies = await asyncio.gather(*(ctl.call(inst, p, GymOperation.restore, body, deadline, RestoreReply, n) for _, inst, p, body, n in calls))
    per_instance: dict[str, dict[str, RestoreReply | CallFailed]] = {iid: {} for iid in live}
    for (iid, _, p, _, _), reply in zip(calls, replies):
        per_instance[iid][p.server_name] = reply
    parts: dict[str, dict[str, ServerFailure]] = {}
    for iid in live:
        bad = _validate_replies(plan, iid, per_instance[iid])
        if bad:
            parts[iid] = bad
    return parts


def _validate_replies(
    plan: _RestorePlan, iid: str, replies: Mapping[str, RestoreReply | CallFailed]
) -> dict[str, ServerFailure]:
    parts: dict[str, ServerFailure] = {}
    expected = {ep.next_attempt().capture_key for ep in plan.instances[iid].episodes}
    seen: set[str] = set()
    for server, reply in replies.items():
        if isinstance(reply, CallFailed):
            parts[server] = reply.part
            continue
        problems: list[str] = []
        if reply.source_checkpoint_id != plan.source_id:
            problems.append(f"state from the wrong checkpoint: {reply.source_checkpoint_id!r}, expected {plan.source_id!r}")
        got = set(reply.restored)
        unexpected = got - expected
        if unexpected:
            problems.append(f"{len(unexpected)} restored key(s) are not the N+1 of a saved episode, e.g. {sample(unexpected)}")
        seen |= got
        if problems:
            parts[server] = server_failure(FailureClass.PROTOCOL_ERROR, GymOperation.restore, "; ".join(problems), http_status=200)
    if not parts:
        never = expected - seen
        if never:
            parts[INSTANCE_WIDE] = server_failure(
                FailureClass.PROTOCOL_ERROR,
                GymOperation.restore,
                f"{len(never)} saved episode(s) restored by no participant",
                samples=sample(never),
            )
    return parts


async def finish_restore(ctl: Control, result: RestoreResult) -> RestoreResult:
    """Resume with the restore id. A resume failure is reported, not raised: the restore itself
    succeeded and the lease reopens the participants."""
    return replace(result, resume=await resume_all(ctl, result.restore_id, result.topology))


async def discard_restore(ctl: Control, result: RestoreResult) -> RestoreCleanup:
    return await cleanup_restore(ctl, result)


async def cleanup_restore(ctl: Control, result: RestoreResult) -> RestoreCleanup:
    """Retire the N+1 of every saved episode on every instance, then resume everyone, so that
    none of those continuations can run; the caller restarts the rollouts."""
    deadline = ctl.clock.time() + max(ctl.budgets.control_s, CLEANUP_MIN_BUDGET_S)
    retires = await asyncio.gather(
        *(
            retire(ctl, result.topology[iid], eps, checkpoint_id=result.restore_id, deadline_ts=deadline)
            for iid, eps in result.continued.items()
            if eps
        )
    )
    report = await resume_all(ctl, result.restore_id, result.topology)
    return RestoreCleanup(
        restore_id=result.restore_id,
        batches=tuple(b for batches in retires for b in batches),
        resume=report,
        rollouts_to_restart={iid: tuple(sorted({e.rollout_id for e in eps})) for iid, eps in result.continued.items()},
    )
