"""Commit (docs/gym-protocol.md#commit): one fan-out to every participant of every instance,
then the two second tries published Gym needs (docs/gym-protocol.md#the-published-profile), then
the validation of each instance's replies.

The caller resumes on failure; commit itself never does.
"""

from __future__ import annotations

import asyncio
import logging
import operator
import os
import re
from collections.abc import Callable, Iterable, Mapping
from dataclasses import replace
from typing import Any

from ..domain.vocabulary import GymOperation
from .channel import CallFailed, Target, encode_body
from .commit_check import validate_commit
from .context import Control, catch
from .errors import GymControlError, ServerFailure, parts_summary, sample
from .files import make_dirs
from .manifest import encode_instance_entry
from .models import (
    CommitReply,
    Episode,
    InstanceTopology,
    Participant,
    StatusReply,
    Topology,
)
from .results import CommitResult, InstanceCommit

__all__ = ["commit"]

log = logging.getLogger("checkpoint_coordinator.gym")


async def commit(
    ctl: Control,
    checkpoint_id: str,
    topology: Topology,
    checkpoint_dirs: Mapping[str, str],
    scopes: Mapping[str, Iterable[Episode]],
    stop: bool = False,
    restarts: Mapping[str, Iterable[Episode]] | None = None,
    on_instance: Callable[[str, InstanceCommit], None] | None = None,
    *,
    make_directories: bool = True,
) -> CommitResult:
    """``on_instance`` is told each instance whose first round of replies validated, as soon as
    they did (the others may still commit): its result is final, its manifest entry encoded.
    ``make_directories=False``: the caller made the checkpoint directories already."""
    deadline = ctl.deadline()
    dirs: dict[str, str] = {}
    scope_of: dict[str, list[Episode]] = {}
    restarts_of: dict[str, list[Episode]] = {}
    for iid in topology:
        directory = checkpoint_dirs[iid]
        if not os.path.isabs(directory):
            raise ValueError(f"checkpoint_dir of {iid} must be absolute, got {directory!r}")
        dirs[iid] = directory
        scope_of[iid] = _sorted_unique(scopes.get(iid, ()))
        restarts_of[iid] = _sorted_unique((restarts or {}).get(iid, ()))
    # Participants write into the directory; creating it is the coordinator's job.
    if make_directories:
        await asyncio.to_thread(make_dirs, dirs.values())
    fan = _Fanout(ctl, checkpoint_id, deadline, dirs, topology, scope_of, stop)

    def validate(iid: str) -> InstanceCommit | dict[str, ServerFailure]:
        replies, sent = fan.of_instance(iid, scope_of[iid])
        return validate_commit(checkpoint_id, topology[iid], dirs[iid], scope_of[iid], restarts_of[iid], replies, sent)

    async def first_round(iid: str) -> InstanceCommit | dict[str, ServerFailure] | None:
        # Each instance on its own: its body is encoded while the first instances' calls are on
        # the wire, and it is validated while the slower instances still commit. An instance
        # with a refusal waits for the second tries below.
        await fan.send([i for i, (pid, _, _) in enumerate(fan.pairs) if pid == iid])
        replies, _ = fan.of_instance(iid, scope_of[iid])
        if any(isinstance(r, CallFailed) for r in replies.values()):
            return None
        outcome = validate(iid)
        if isinstance(outcome, InstanceCommit):
            outcome = replace(outcome, manifest_entry=encode_instance_entry(outcome))
            if on_instance is not None:
                on_instance(iid, outcome)
        return outcome

    rounds = await asyncio.gather(*(first_round(iid) for iid in topology), return_exceptions=True)
    for r in rounds:  # raised only once every instance's calls are answered, as before
        if isinstance(r, BaseException):
            raise r
    early = dict(zip(topology, rounds))
    stop_refused = await _retry_without_stop(fan) if stop else {}
    await _recommit_grown_restarts(ctl, fan, scope_of, restarts_of)
    results: dict[str, InstanceCommit] = {}
    parts: dict[str, dict[str, ServerFailure]] = {}
    for iid in topology:
        outcome = early[iid]
        if outcome is None:
            outcome = validate(iid)
        if isinstance(outcome, InstanceCommit):
            if stop:
                outcome = replace(outcome, stop_supported=iid not in stop_refused)
            results[iid] = outcome
        else:
            parts[iid] = outcome
    if parts:
        raise GymControlError.from_parts(parts, f"commit of {checkpoint_id} failed: " + parts_summary(parts))
    return CommitResult(checkpoint_id, results)


def _sorted_unique(episodes: Iterable[Episode]) -> list[Episode]:
    """``sorted(set(episodes))``; a list already in that form (what ``compute_scope`` returns) is
    taken as it is: checking the order costs a tenth of sorting a set again while Gym waits."""
    if isinstance(episodes, list) and all(map(operator.lt, episodes, episodes[1:])):
        return episodes
    return sorted(set(episodes))


class _Fanout:
    """Every (instance, participant) commit call, what each was last sent and answered."""

    def __init__(
        self,
        ctl: Control,
        cid: str,
        deadline: float,
        dirs: Mapping[str, str],
        topology: Topology,
        scope_of: Mapping[str, list[Episode]],
        stop: bool,
    ) -> None:
        self.ctl = ctl
        self.cid = cid
        self.deadline = deadline
        self.dirs = dirs
        self.pairs: list[tuple[str, InstanceTopology, Participant]] = [
            (iid, inst, p) for iid, inst in topology.items() for p in inst.participants
        ]
        self.with_stop = [stop] * len(self.pairs)
        self.sent_scope: list[list[Episode]] = [scope_of[iid] for iid, _, _ in self.pairs]
        self.replies: list[CommitReply | CallFailed] = [None] * len(self.pairs)  # type: ignore[list-item]
        self._bodies: dict[tuple[str, int, bool], bytes] = {}

    def body(self, i: int) -> bytes:
        # One encoding per instance, scope and stop flag: a large scope is encoded once.
        iid = self.pairs[i][0]
        key = (iid, id(self.sent_scope[i]), self.with_stop[i])
        if key not in self._bodies:
            wire: dict[str, Any] = {
                "checkpoint_id": self.cid,
                "deadline_ts": self.deadline,
                "checkpoint_dir": self.dirs[iid],
                # Always sent, even empty: participants need the scope to know what to export.
                "episode_ids": [ep.to_wire() for ep in self.sent_scope[i]],
            }
            if self.with_stop[i]:
                # Omitted otherwise: Gym versions that predate `stop` refuse unknown fields.
                wire["stop"] = True
            self._bodies[key] = encode_body(wire)
        return self._bodies[key]

    async def send(self, indices: Iterable[int]) -> None:
        indices = list(indices)

        async def one(i: int) -> CommitReply | CallFailed:
            # Encoded in the call's own task: the first calls go on the wire while later bodies
            # are still being encoded.
            return await self.ctl.call(
                self.pairs[i][1], self.pairs[i][2], GymOperation.commit, self.body(i), self.deadline, CommitReply, len(self.sent_scope[i])
            )

        answers = await asyncio.gather(*(one(i) for i in indices))
        for i, answer in zip(indices, answers):
            self.replies[i] = answer

    def target(self, i: int) -> Target:
        _, inst, p = self.pairs[i]
        return self.ctl.target(inst, p)

    def refused(self, code: str) -> list[int]:
        return [i for i, r in enumerate(self.replies) if isinstance(r, CallFailed) and r.code == code]

    def of_instance(self, iid: str, scope: list[Episode]) -> tuple[dict[str, CommitReply | CallFailed], dict[str, set[str]]]:
        """The instance's replies, and the scope each participant was sent where it is not
        ``scope`` (the instance's scope now; a second try may have narrowed it)."""
        replies: dict[str, CommitReply | CallFailed] = {}
        sent: dict[str, set[str]] = {}
        for i, (pid, _, p) in enumerate(self.pairs):
            if pid == iid:
                replies[p.server_name] = self.replies[i]
                if self.sent_scope[i] is not scope:
                    sent[p.server_name] = {ep.capture_key for ep in self.sent_scope[i]}
        return replies, sent


async def _retry_without_stop(fan: _Fanout) -> dict[str, list[str]]:
    """Published Gym (P4 of docs/gym-protocol.md#what-differs-rule-by-rule): a version that
    predates `stop` refuses it as an unknown field. That participant gets the same commit without
    it, once; its instance then resumes as usual. Returns the refusing servers per instance."""
    retry = [i for i, r in enumerate(fan.replies) if isinstance(r, CallFailed) and _refuses_stop(r.part)]
    refused: dict[str, list[str]] = {}
    for i in retry:
        fan.with_stop[i] = False
        refused.setdefault(fan.pairs[i][0], []).append(fan.pairs[i][2].server_name)
    await fan.send(retry)
    for iid, servers in sorted(refused.items()):
        log.warning(
            "%s: %s refused `stop` on commit %s (a Gym that predates it); committed without it, so this "
            "instance will be resumed", iid, ", ".join(sorted(servers)), fan.cid,
        )
    return refused


_STOP_WORD = re.compile(r"\bstop\b")


def _refuses_stop(part: ServerFailure) -> bool:
    """A 422 whose validation refusal names the field ``stop``."""
    if part.get("http_status") != 422:
        return False
    fields = part.get("fields") or ()
    return any(f == "stop" or f.endswith(".stop") for f in fields) or bool(_STOP_WORD.search(part.get("detail") or ""))


async def _recommit_grown_restarts(
    ctl: Control, fan: _Fanout, scope_of: dict[str, list[Episode]], restarts_of: dict[str, list[Episode]]
) -> None:
    """Published Gym's restart-only agents admit new ``/run``s while parked and recompute their
    restarts at commit, so a candidate that arrived after prepare is refused as
    ``restart_in_scope``. Such an episode cannot be saved: it moves to the instance's restarts
    and the refusing participants commit again, once, with the smaller scope. The others keep
    what they committed; their exports of it fall outside the scope and are not saved."""
    refused = fan.refused("restart_in_scope")
    if not refused:
        return
    statuses = await asyncio.gather(*(catch(ctl.read_status(fan.target(i))) for i in refused))
    grown: dict[str, set[str]] = {}
    for i, status in zip(refused, statuses):
        if isinstance(status, StatusReply) and status.report is not None:
            grown.setdefault(fan.pairs[i][0], set()).update(status.report.restarts)
    known = ctl.book.prepare_restarts(fan.cid)
    again: list[int] = []
    for iid, keys in grown.items():
        # A restart prepare already reported stays a refusal: putting it in scope is a bug.
        earlier = known.get(iid, frozenset())
        moved = [ep for ep in scope_of[iid] if ep.capture_key in keys and ep not in earlier]
        if not moved:
            continue
        log.warning(
            "%s: %d candidate(s) became restarts after prepare on commit %s (a restart-only participant "
            "that keeps admitting work); committing without them, e.g. %s",
            iid, len(moved), fan.cid, ", ".join(sample(ep.capture_key for ep in moved)),
        )
        gone = set(moved)
        scope_of[iid] = [ep for ep in scope_of[iid] if ep not in gone]
        restarts_of[iid] = sorted(set(restarts_of[iid]) | set(moved))
        for i in refused:
            if fan.pairs[i][0] == iid:
                fan.sent_scope[i] = scope_of[iid]
                again.append(i)
    if again:
        await fan.send(again)
