"""What every control operation shares: the wire, the clock, the budgets, and the client's book
of the checkpoints it drives.

The operation modules (discovery, prepare, renew, commit, resume, restore, retire) are functions
of a :class:`Control`; :class:`~.client.GymControlClient` owns exactly one and delegates to them.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import TypeVar

from .channel import CallFailed, ControlChannel, Target, error_part, parse_reply
from .clock import Clock
from .errors import FailureClass, GymControlError, classify_status
from .models import Episode, InstanceTopology, Participant, StatusReply, _Reply, is_valid_checkpoint_id

__all__ = ["ControlBudgets", "CheckpointBook", "Control", "catch"]

log = logging.getLogger("checkpoint_coordinator.gym")

T = TypeVar("T")
R = TypeVar("R", bound=_Reply)


@dataclass(frozen=True, slots=True)
class ControlBudgets:
    control_s: float
    # Prepare falls back to the control budget when its own is unset.
    prepare_s: float
    discovery_s: float

    @property
    def renew_interval_s(self) -> float:
        """Renew cadence (docs/gym-protocol.md#leases-and-renewals): ``max(0.01, min(T/3, 10))``."""
        return max(0.01, min(self.control_s / 3.0, 10.0))


def checkpoint_id_for(snapshot_id: str | int | None = None) -> str:
    """A fresh save id, ``snap-<snapshot_id>-<8 hex>`` (random, so never one issued before in
    practice; a prepare refuses an id it already used). A caller that must record the id before
    it has a client (a snapshot writes it with its gate) draws it here; the prepare that uses it
    books it as issued."""
    cid = f"snap-{snapshot_id}-{secrets.token_hex(4)}" if snapshot_id is not None else f"snap-{secrets.token_hex(8)}"
    if not is_valid_checkpoint_id(cid):
        raise ValueError(f"snapshot id {snapshot_id!r} does not make a valid checkpoint id")
    return cid


class CheckpointBook:
    """The ids this client issued and the checkpoints it has open.

    It is what tells an orphan of this coordinator (issued, no longer driven) from a checkpoint
    it still drives or one another controller issued.
    """

    def __init__(self, owns_checkpoint_id: Callable[[str], bool] | None = None) -> None:
        self._owns = owns_checkpoint_id
        self._issued: set[str] = set()
        self._prepared: set[str] = set()
        # instance id -> the checkpoint or restore id this client has open on it.
        self._open: dict[str, str] = {}
        # checkpoint id -> the restarts its prepare replies reported, per instance.
        self._restarts: dict[str, Mapping[str, frozenset[Episode]]] = {}

    def new_checkpoint_id(self, snapshot_id: str | int | None = None) -> str:
        while True:
            cid = checkpoint_id_for(snapshot_id)
            if cid not in self._issued:
                self._issued.add(cid)
                return cid

    def new_restore_id(self, source_checkpoint_id: str) -> str:
        while True:
            rid = f"restore-{secrets.token_hex(16)}"
            if rid != source_checkpoint_id and rid not in self._issued:
                self._issued.add(rid)
                return rid

    def issued(self, checkpoint_id: str) -> bool:
        return checkpoint_id in self._issued or bool(self._owns and self._owns(checkpoint_id))

    def is_orphan_of_ours(self, checkpoint_id: str) -> bool:
        return self.issued(checkpoint_id) and checkpoint_id not in self._open.values()

    def claim_for_prepare(self, checkpoint_id: str) -> None:
        if not is_valid_checkpoint_id(checkpoint_id):
            raise ValueError(f"invalid checkpoint id {checkpoint_id!r}")
        if checkpoint_id in self._prepared:
            # Participants remember ended ids and would answer stale_checkpoint; a reused id
            # could also replay another checkpoint's stored replies.
            raise ValueError(f"checkpoint id {checkpoint_id!r} was already used; ids are never reused")
        self._prepared.add(checkpoint_id)
        self._issued.add(checkpoint_id)

    def open_on(self, instance_id: str) -> str | None:
        return self._open.get(instance_id)

    def held_by_others(self, checkpoint_id: str, instance_ids: Iterable[str]) -> dict[str, str]:
        """Instances on which this client has another checkpoint open."""
        return {iid: self._open[iid] for iid in instance_ids if self._open.get(iid, checkpoint_id) != checkpoint_id}

    def hold(self, checkpoint_id: str, instance_ids: Iterable[str]) -> None:
        for iid in instance_ids:
            self._open[iid] = checkpoint_id

    def release(self, checkpoint_id: str, instance_ids: Iterable[str]) -> None:
        for iid in instance_ids:
            if self._open.get(iid) == checkpoint_id:
                del self._open[iid]
        if checkpoint_id not in self._open.values():
            self._restarts.pop(checkpoint_id, None)

    def note_restarts(self, checkpoint_id: str, restarts: Mapping[str, frozenset[Episode]]) -> None:
        self._restarts[checkpoint_id] = restarts

    def prepare_restarts(self, checkpoint_id: str) -> Mapping[str, frozenset[Episode]]:
        return self._restarts.get(checkpoint_id, {})


@dataclass(frozen=True, slots=True)
class Control:
    channel: ControlChannel
    clock: Clock
    budgets: ControlBudgets
    book: CheckpointBook

    def deadline(self) -> float:
        return self.clock.time() + self.budgets.control_s

    @staticmethod
    def target(inst: InstanceTopology, p: Participant) -> Target:
        return Target(inst.instance_id, p.server_name, p.base_url, inst.spec.token, p.kind)

    async def call(
        self, inst: InstanceTopology, p: Participant, op: str, body: bytes, deadline_ts: float, reply_model: type[R],
        items: int = 0,
    ) -> R | CallFailed:
        """One control call whose failure is a value, so that it never cancels its siblings.
        ``items``: the episodes the call names (its reply may list as many: ``reply_cap``)."""
        try:
            return await self.channel.post(self.target(inst, p), op, body, deadline_ts, reply_model, items)
        except CallFailed as exc:
            return exc

    async def post_each(
        self,
        calls: Sequence[tuple[InstanceTopology, Participant]],
        op: str,
        body: bytes,
        deadline_ts: float,
        reply_model: type[R],
    ) -> list[R | CallFailed]:
        """The same call to several participants at once."""
        return await asyncio.gather(*(self.call(inst, p, op, body, deadline_ts, reply_model) for inst, p in calls))

    async def read_status(self, target: Target) -> StatusReply | None:
        """Status with the discovery budget: the reply, ``None`` for a non-participant (404), or
        :class:`CallFailed` classified as docs/gym-protocol.md#discover says."""
        status, content = await self.channel.get_status(target, self.budgets.discovery_s)
        if status == 404:
            return None
        if status == 200:
            return parse_reply(target, "status", status, content, StatusReply)
        part = error_part("status", status, content)
        # Only 401, 408, 429 and 5xx have a class of their own at discovery.
        cls = classify_status(status)
        part["class"] = str(cls)
        part["transient"] = cls is FailureClass.UNAVAILABLE
        raise CallFailed(target, part)


async def catch(aw: Awaitable[T]) -> T | CallFailed | GymControlError:
    """Fan-out helper: a failed call becomes a value, so one failure never cancels its siblings."""
    try:
        return await aw
    except (CallFailed, GymControlError) as exc:
        return exc
