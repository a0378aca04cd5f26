"""Discovery (docs/gym-protocol.md#discover): who takes part in an instance, all or nothing, and
the resume of checkpoints this coordinator left open (its orphans)."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from ..domain.vocabulary import ParticipantKind
from .channel import CallFailed, Target
from .context import Control, catch
from .errors import (
    INSTANCE_WIDE,
    FailureClass,
    GymControlError,
    ServerFailure,
    server_failure,
)
from .models import (
    ENVIRONMENT,
    KINDS,
    MODE_ALIASES,
    MODEL,
    MODES,
    PHASES,
    STAGE_OF_KIND,
    InstanceSpec,
    InstanceTopology,
    Participant,
    StatusReply,
    Topology,
    is_valid_name,
)
from .resume import resume_all

__all__ = ["build_topology", "discover_all", "discover_instance", "recover_orphans"]

log = logging.getLogger("checkpoint_coordinator.gym")


# Status probes in flight at once, across every instance of one discovery (docs/configuration.md#limits): a
# registration of many servers neither opens a connection to each at once nor reads each reply
# at once.
DISCOVERY_CONCURRENCY = 32


async def discover_all(ctl: Control, specs: Iterable[InstanceSpec], *, log_warnings: bool = True) -> dict[str, InstanceTopology]:
    specs = list(specs)
    gate = asyncio.Semaphore(DISCOVERY_CONCURRENCY)
    outcomes = await asyncio.gather(*(catch(discover_instance(ctl, s, log_warnings=log_warnings, gate=gate)) for s in specs))
    errors = [o for o in outcomes if isinstance(o, GymControlError)]
    if errors:
        # All or nothing across instances too: a restore or setup needs every one of them.
        raise GymControlError.combine(errors)
    return {s.instance_id: o for s, o in zip(specs, outcomes) if isinstance(o, InstanceTopology)}


async def discover_instance(
    ctl: Control, spec: InstanceSpec, *, log_warnings: bool = True, gate: asyncio.Semaphore | None = None
) -> InstanceTopology:
    iid = spec.instance_id
    targets = [Target(iid, name, url, spec.token) for name, url in spec.servers.items()]
    gate = gate or asyncio.Semaphore(DISCOVERY_CONCURRENCY)

    async def probe(t: Target) -> StatusReply | None:
        async with gate:
            return await ctl.read_status(t)

    probes = await asyncio.gather(*(catch(probe(t)) for t in targets))
    failures: dict[str, ServerFailure] = {}
    statuses: dict[str, StatusReply] = {}
    skipped: list[str] = []
    for target, outcome in zip(targets, probes):
        if isinstance(outcome, CallFailed):
            failures[target.server_name] = outcome.part
        elif outcome is None:
            skipped.append(target.server_name)
        else:
            statuses[target.server_name] = outcome
    if failures:
        # Never a partial participant set: an unreachable participant would make every later
        # checkpoint unsafe.
        raise GymControlError.from_parts({iid: failures}, f"discovery of {iid} failed on {', '.join(sorted(failures))}")
    topology = build_topology(spec, statuses, skipped)
    if log_warnings:
        for text in topology.warnings:
            log.warning("%s", text)
    return topology


@dataclass(slots=True)
class _Findings:
    """What discovery noticed about an instance's statuses, before it decides."""

    refusals: dict[str, list[str]] = field(default_factory=dict)
    protocol: dict[str, ServerFailure] = field(default_factory=dict)
    warnings: list[str] = field(default_factory=list)

    def refuse(self, server: str, why: str) -> None:
        self.refusals.setdefault(server, []).append(why)


def build_topology(spec: InstanceSpec, statuses: Mapping[str, StatusReply], skipped: Sequence[str]) -> InstanceTopology:
    """The instance's topology from its status replies, or ``config_error`` naming every server
    that discovery refuses (docs/gym-protocol.md#discover; ``protocol_error`` for a status no
    participant may send)."""
    iid = spec.instance_id
    found = _Findings()
    participants = [_participant(spec, name, st, found) for name, st in statuses.items()]
    _refuse_shared_names(participants, found)
    parts: dict[str, ServerFailure] = {
        server: server_failure(FailureClass.CONFIG_ERROR, "discover", "; ".join(whys))
        for server, whys in found.refusals.items()
    }
    if not any(p.kind == MODEL for p in participants):
        parts[INSTANCE_WIDE] = server_failure(
            FailureClass.CONFIG_ERROR, "discover", f"no policy model takes part (no participant of kind '{ParticipantKind.model}')"
        )
    for name, part in found.protocol.items():
        parts.setdefault(name, part)
    if parts:
        raise GymControlError.from_parts(
            {iid: parts},
            f"instance {iid} refused at discovery: {', '.join(sorted(parts))}: "
            + " | ".join(f"{s}: {p['detail']}" for s, p in sorted(parts.items())),
        )
    participants.sort(key=lambda p: p.sort_key)
    return InstanceTopology(
        spec=spec,
        participants=tuple(participants),
        non_participants=tuple(sorted(skipped)),
        warnings=tuple(found.warnings),
        active_ids={p.server_name: p.checkpoint_id for p in participants if p.phase != "idle" and p.checkpoint_id},
    )


def _participant(spec: InstanceSpec, name: str, st: StatusReply, found: _Findings) -> Participant:
    iid = spec.instance_id
    kind = st.kind
    if kind not in KINDS:
        found.refuse(name, f"unknown kind {kind!r}")
    elif kind == ENVIRONMENT:
        found.refuse(
            name,
            "environment participants are not supported yet: their episodes cannot be attributed "
            "(only the legacy_agent relay, which is no participant, is)",
        )
    mode = MODE_ALIASES.get(st.mode, st.mode) if st.mode is not None else None
    if mode is not None and mode not in MODES:
        found.refuse(name, f"unknown mode {st.mode!r}")
    if not is_valid_name(st.instance):
        found.refuse(name, f"participant name {st.instance!r} is not a valid NAME")
    if st.phase not in PHASES:
        found.protocol[name] = server_failure(
            FailureClass.PROTOCOL_ERROR, "status", f"unknown phase {st.phase!r}", http_status=200
        )
    elif st.phase != "idle" and not st.checkpoint_id:
        found.protocol[name] = server_failure(
            FailureClass.PROTOCOL_ERROR, "status", f"phase {st.phase!r} without a checkpoint_id", http_status=200
        )
    if mode is None:
        found.warnings.append(
            f"{iid}/{name} reports no checkpoint mode (published Gym reports one for resources only); it is not "
            f"treated as restart-only"
        )
    if st.instance != name:
        found.warnings.append(f"{iid}/{name} reports participant name {st.instance!r}")
    return Participant(
        server_name=name,
        base_url=spec.servers[name],
        kind=kind,
        participant_name=st.instance,
        mode=mode,
        phase=st.phase,
        stage=STAGE_OF_KIND.get(kind, len(STAGE_OF_KIND)),
        checkpoint_id=st.checkpoint_id,
        lease_expires_at=st.lease_expires_at,
    )


def _refuse_shared_names(participants: Sequence[Participant], found: _Findings) -> None:
    """Two participants with one ``(kind, participant name)`` would write the same directory."""
    seen: dict[tuple[str, str], list[str]] = {}
    for p in participants:
        seen.setdefault((p.kind, p.participant_name), []).append(p.server_name)
    for (kind, pname), names in seen.items():
        if len(names) > 1:
            for name in names:
                others = ", ".join(n for n in sorted(names) if n != name)
                found.refuse(
                    name, f"shares (kind {kind!r}, participant name {pname!r}) with {others}: they would collide on disk"
                )


async def recover_orphans(ctl: Control, topology: Topology) -> list[str]:
    """Resume checkpoints this coordinator left open, on every participant of their instances.

    A foreign id raises ``conflict`` naming its holders, before anything is resumed.
    """
    foreign: dict[str, dict[str, ServerFailure]] = {}
    orphans: dict[str, set[str]] = {}
    for iid, inst in topology.items():
        for server, cid in inst.active_ids.items():
            if ctl.book.is_orphan_of_ours(cid):
                orphans.setdefault(cid, set()).add(iid)
            elif not ctl.book.issued(cid):
                foreign.setdefault(iid, {})[server] = server_failure(
                    FailureClass.CONFLICT, "status", f"holds checkpoint {cid!r}, which another controller issued"
                )
    if foreign:
        raise GymControlError.from_parts(foreign, "instances held by another controller")
    resumed: list[str] = []
    errors: list[GymControlError] = []
    for cid, iids in sorted(orphans.items()):
        log.warning("resuming orphaned checkpoint %s on %s", cid, ", ".join(sorted(iids)))
        report = await resume_all(ctl, cid, {i: topology[i] for i in iids})
        if report.failure is not None:
            errors.append(report.failure)
        else:
            resumed.append(cid)
    if errors:
        raise GymControlError.combine(errors)
    return resumed
