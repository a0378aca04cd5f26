"""Prepare (docs/gym-protocol.md#prepare): every instance stage by stage, instances in parallel;
on any failure, everyone is resumed before the failure is raised."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from ..domain.vocabulary import GymOperation
from .channel import CallFailed, encode_body
from .context import Control
from .errors import (
    BLOCKED_EPISODES,
    INSTANCE_WIDE,
    SAMPLE,
    FailureClass,
    GymControlError,
    ServerFailure,
    parts_summary,
    server_failure,
)
from .models import (
    Episode,
    InstanceTopology,
    Participant,
    PrepareReply,
    PrepareReport,
    Topology,
)
from .results import PrepareResult
from .resume import resume_all

__all__ = ["prepare"]

log = logging.getLogger("checkpoint_coordinator.gym")


@dataclass(slots=True)
class _Outcome:
    restarts: set[Episode] = field(default_factory=set)
    failures: dict[str, ServerFailure] = field(default_factory=dict)
    # Every blocker a not-ready reply named (its part keeps a sample), for the snapshot's record.
    blockers: set[str] = field(default_factory=set)
    deadlines: dict[str, float] = field(default_factory=dict)


async def prepare(ctl: Control, checkpoint_id: str, topology: Topology) -> PrepareResult:
    held = ctl.book.held_by_others(checkpoint_id, topology)
    if held:
        # Published Gym (P7 of docs/gym-protocol.md#what-differs-rule-by-rule): this client's own
        # open checkpoint is no orphan. Refuse the second prepare instead of letting the participant's conflict resume the first.
        raise GymControlError.from_parts(
            {
                iid: {INSTANCE_WIDE: server_failure(FailureClass.CONFLICT, GymOperation.prepare, f"checkpoint {cid} of this coordinator is still open")}
                for iid, cid in held.items()
            },
            f"prepare of {checkpoint_id} refused: this coordinator still has "
            + ", ".join(f"{cid} open on {iid}" for iid, cid in sorted(held.items())),
        )
    ctl.book.claim_for_prepare(checkpoint_id)
    ctl.book.hold(checkpoint_id, topology)
    first_sent_at = ctl.clock.time()
    outcomes = await asyncio.gather(*(_prepare_instance(ctl, checkpoint_id, inst) for inst in topology.values()))
    failed = {iid: o.failures for iid, o in zip(topology, outcomes) if o.failures}
    if failed:
        # The blockers each instance named, all of them: the snapshot records the episodes that
        # kept it from its cut (docs/ledger.md#stragglers); its detail keeps only the sample.
        blocked = {iid: sorted(o.blockers) for iid, o in zip(topology, outcomes) if o.blockers}
        error = GymControlError.from_parts(failed, _message(checkpoint_id, failed), extra={BLOCKED_EPISODES: blocked} if blocked else None)
        report = await resume_all(ctl, checkpoint_id, topology)
        error.resume_failure = report.failure
        raise error
    restarts = {iid: frozenset(o.restarts) for iid, o in zip(topology, outcomes)}
    ctl.book.note_restarts(checkpoint_id, restarts)
    return PrepareResult(
        checkpoint_id=checkpoint_id,
        restarts=restarts,
        deadlines={iid: o.deadlines for iid, o in zip(topology, outcomes)},
        first_sent_at=first_sent_at,
        finished_at=ctl.clock.time(),
    )


async def _prepare_instance(ctl: Control, cid: str, inst: InstanceTopology) -> _Outcome:
    out = _Outcome()
    for stage in inst.stages():
        deadline = ctl.clock.time() + ctl.budgets.prepare_s
        body = encode_body({"checkpoint_id": cid, "deadline_ts": deadline})
        replies = await ctl.post_each([(inst, p) for p in stage], GymOperation.prepare, body, deadline, PrepareReply)
        for p, reply in zip(stage, replies):
            out.deadlines[p.server_name] = deadline
            if isinstance(reply, CallFailed):
                if reply.code == "checkpoint_conflict":
                    out.failures[p.server_name] = await _conflict(ctl, cid, inst, p, reply)
                else:
                    out.failures[p.server_name] = reply.part
                continue
            out.restarts.update(Episode.from_capture_key(k) for k in reply.report.restarts)
            failure = _not_prepared(reply)
            if failure is not None:
                out.failures[p.server_name] = failure
                if failure["class"] == FailureClass.NOT_READY:
                    out.blockers.update(reply.report.blockers)
        if out.failures:
            # Later stages never receive prepare for this checkpoint.
            break
    return out


def _not_prepared(reply: PrepareReply) -> ServerFailure | None:
    report: PrepareReport = reply.report
    if reply.phase == "prepared" and report.ready:
        return None
    if reply.phase == "idle":
        # The checkpoint ended under us (a resume or lease expiry): work moved on.
        return server_failure(
            FailureClass.LEASE_LOST,
            GymOperation.prepare,
            "prepare replied idle: the checkpoint was ended on the participant",
            http_status=200,
        )
    return server_failure(
        FailureClass.NOT_READY,
        GymOperation.prepare,
        f"not ready by the deadline: {report.blocker_count} blocker(s)",
        http_status=200,
        blocker_count=max(report.blocker_count, len(report.blockers)),
        blockers=sorted(report.blockers)[:SAMPLE],
    )


async def _conflict(ctl: Control, cid: str, inst: InstanceTopology, p: Participant, refusal: CallFailed) -> ServerFailure:
    """An orphan of ours is resumed and the prepare fails transiently; anything else is ``conflict``."""

    def part(cls: FailureClass, detail: str, **extra: Any) -> ServerFailure:
        return server_failure(
            cls, GymOperation.prepare, detail, http_status=refusal.part["http_status"], code="checkpoint_conflict", **extra
        )

    try:
        status = await ctl.read_status(ctl.target(inst, p))
    except CallFailed as exc:
        return part(FailureClass.CONFLICT, f"{refusal.part['detail']} (status unreadable: {exc.part['detail']})")
    held = status.checkpoint_id if status is not None else None
    if held and held != cid and ctl.book.is_orphan_of_ours(held):
        log.warning("%s/%s holds orphaned checkpoint %s; resuming it", inst.instance_id, p.server_name, held)
        report = await resume_all(ctl, held, {inst.instance_id: inst})
        outcome = "resumed" if report.ok else f"resume failed: {report.failure}"
        return part(
            FailureClass.UNAVAILABLE,
            f"held orphaned checkpoint {held!r} of this coordinator ({outcome}); try again",
            held_checkpoint_id=held,
        )
    return part(FailureClass.CONFLICT, f"instance held by checkpoint {held!r} of another controller", held_checkpoint_id=held)


def _message(cid: str, failed: Mapping[str, Mapping[str, ServerFailure]]) -> str:
    blocked = [
        f"{iid}/{server} ({part['blocker_count']} blocker(s), e.g. {', '.join(part['blockers']) or '-'})"
        for iid, servers in sorted(failed.items())
        for server, part in sorted(servers.items())
        if part["class"] == FailureClass.NOT_READY
    ]
    others = {
        iid: {s: p for s, p in servers.items() if p["class"] != FailureClass.NOT_READY}
        for iid, servers in failed.items()
    }
    text = f"prepare of {cid} failed"
    if blocked:
        text += "; not ready: " + "; ".join(blocked)
    if any(others.values()):
        text += "; " + parts_summary({i: s for i, s in others.items() if s})
    return text
