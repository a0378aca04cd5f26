"""Renew (docs/gym-protocol.md#renew, docs/gym-protocol.md#leases-and-renewals): one round over
every participant of a prepared checkpoint."""

from __future__ import annotations

from ..domain.vocabulary import GymOperation
from .channel import CallFailed, encode_body
from .context import Control
from .errors import FailureClass, GymControlError, ServerFailure
from .models import RenewReply, Topology
from .results import RenewResult

__all__ = ["lease_lost_if_stale", "renew_round"]


async def renew_round(ctl: Control, checkpoint_id: str, topology: Topology) -> RenewResult:
    """The leases renewed and, beside them, the failure of those that were not."""
    deadline = ctl.deadline()
    body = encode_body({"checkpoint_id": checkpoint_id, "deadline_ts": deadline})
    calls = [(iid, inst, p) for iid, inst in topology.items() for p in inst.participants]
    replies = await ctl.post_each([(inst, p) for _, inst, p in calls], GymOperation.renew, body, deadline, RenewReply)
    leases: dict[str, dict[str, float]] = {iid: {} for iid in topology}
    parts: dict[str, dict[str, ServerFailure]] = {}
    for (iid, _, p), reply in zip(calls, replies):
        if isinstance(reply, CallFailed):
            parts.setdefault(iid, {})[p.server_name] = lease_lost_if_stale(reply.part)
        else:
            leases[iid][p.server_name] = reply.lease_expires_at
    failure = GymControlError.from_parts(parts, f"renew of {checkpoint_id} failed") if parts else None
    return RenewResult(checkpoint_id, deadline, leases, failure)


def lease_lost_if_stale(part: ServerFailure) -> ServerFailure:
    if part.get("code") == "stale_checkpoint":
        # The participant already ended this checkpoint, so work moved past the cut
        # (docs/gym-protocol.md#leases-and-renewals).
        return {**part, "class": str(FailureClass.LEASE_LOST), "transient": True}
    return part
