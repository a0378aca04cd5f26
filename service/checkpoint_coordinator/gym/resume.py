"""Resume (docs/gym-protocol.md#resume): reverse stage order on every instance, transient
failures retried on the failed instances only. Resume is also the abort, so every other operation
ends here on failure."""

from __future__ import annotations

import asyncio
import logging

from ..domain.vocabulary import GymOperation
from .channel import CallFailed, encode_body
from .context import Control
from .errors import GymControlError, ServerFailure, parts_summary
from .models import InstanceTopology, ResumeReply, Topology
from .results import ResumeReport

__all__ = ["resume_all"]

log = logging.getLogger("checkpoint_coordinator.gym")

RESUME_ROUNDS = 3
RESUME_BACKOFF_S = 0.2


async def resume_all(ctl: Control, cid: str, topology: Topology) -> ResumeReport:
    """Never raises for a participant failure: the report carries it."""
    pending: dict[str, InstanceTopology] = dict(topology)
    idempotent: dict[str, dict[str, bool]] = {iid: {} for iid in topology}
    failures: dict[str, dict[str, ServerFailure]] = {}
    rounds = 0
    try:
        while pending:
            rounds += 1
            outcomes = await asyncio.gather(*(_resume_instance(ctl, cid, inst) for inst in pending.values()))
            retry: dict[str, InstanceTopology] = {}
            for (iid, inst), (flags, parts) in zip(pending.items(), outcomes):
                for server, flag in flags.items():
                    # The first answer counts: a retry after a lost reply finds the checkpoint
                    # already ended by the try whose reply was lost.
                    idempotent[iid].setdefault(server, flag)
                if parts:
                    failures[iid] = parts
                    if all(part["transient"] for part in parts.values()):
                        retry[iid] = inst
                else:
                    failures.pop(iid, None)
            if not retry or rounds >= RESUME_ROUNDS:
                break
            pending = retry
            await ctl.clock.sleep(RESUME_BACKOFF_S * rounds)
    finally:
        # Even a cancelled resume ends this client's hold: an id still held on Gym is then an
        # orphan of ours, which the next prepare's conflict rule resumes.
        ctl.book.release(cid, topology)
    failure = GymControlError.from_parts(failures, f"resume of {cid} failed: " + parts_summary(failures)) if failures else None
    if failure is not None:
        log.warning("resume of %s failed after %d round(s): %s", cid, rounds, failure)
    return ResumeReport(cid, failure, ctl.clock.time(), idempotent, rounds)


async def _resume_instance(
    ctl: Control, cid: str, inst: InstanceTopology
) -> tuple[dict[str, bool], dict[str, ServerFailure]]:
    flags: dict[str, bool] = {}
    parts: dict[str, ServerFailure] = {}
    for stage in inst.stages(reverse=True):
        deadline = ctl.deadline()
        body = encode_body({"checkpoint_id": cid, "deadline_ts": deadline})
        replies = await ctl.post_each([(inst, p) for p in stage], GymOperation.resume, body, deadline, ResumeReply)
        # Keep going through every stage: a participant left parked blocks its callers.
        for p, reply in zip(stage, replies):
            if isinstance(reply, CallFailed):
                parts[p.server_name] = reply.part
            else:
                flags[p.server_name] = reply.idempotent
    return flags, parts
