"""The coordinator's Gym control client (spec sections 3 to 7).

One :class:`GymControlClient` owns one httpx connection pool used for nothing but control
calls, so a control call never queues behind a long data-plane ``/run``. Every operation takes
the topology (what discovery returned) explicitly; the client keeps only the ids it issued and
the checkpoints it has open, which it needs to recognise its own orphans and to refuse a
retire while a checkpoint of its own is open.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import re
import secrets
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, TypeVar

import httpx
from pydantic import ValidationError

from .channel import CallFailed, ControlChannel, Target, encode_body, error_part
from .clock import Clock, SystemClock
from .errors import (
    INSTANCE_WIDE,
    FailureClass,
    GymControlError,
    ServerFailure,
    classify_status,
    server_failure,
)
from .models import (
    AGENT,
    ENVIRONMENT,
    KINDS,
    MODE_ALIASES,
    MODEL,
    MODES,
    PHASES,
    RESOURCES,
    STAGE_OF_KIND,
    CommitReply,
    Episode,
    ForgetReply,
    InstanceSpec,
    InstanceTopology,
    Participant,
    PrepareReply,
    RenewReply,
    RestoreReply,
    ResumeReply,
    RetireReply,
    StatusReply,
    episodes_to_wire,
    instance_checkpoint_dir,
    is_valid_checkpoint_id,
    is_valid_name,
    is_valid_rollout_id,
)
from .policy import check_restart_only
from .results import (
    BatchResult,
    CommitResult,
    ForgetSettlement,
    InstanceCommit,
    PrepareResult,
    RenewResult,
    RestoreResult,
    ResumeReport,
)

__all__ = ["GymControlClient", "RestoreCleanup", "Topology", "callers_first"]

log = logging.getLogger("checkpoint_coordinator.gym")

Topology = Mapping[str, InstanceTopology]
T = TypeVar("T")

DEFAULT_MAX_CONTROL_REPLY_BYTES = 256 * 1024 * 1024
MAX_BATCH = 1024
SAMPLE = 10
RESUME_ROUNDS = 3
RESUME_BACKOFF_S = 0.2
# Spec 5.6 step 9: the restore cleanup gets at least this long, whatever control_timeout_s is.
CLEANUP_MIN_BUDGET_S = 30.0


@dataclass(frozen=True, slots=True)
class RestoreCleanup:
    """What the all-or-nothing restore cleanup (retire N+1, then resume) achieved."""

    restore_id: str
    batches: tuple[BatchResult, ...]
    resume: ResumeReport
    # Per instance, the rollouts whose continuations are abandoned: restart them from their task.
    rollouts_to_restart: Mapping[str, tuple[str, ...]] = field(default_factory=dict)

    @property
    def failure(self) -> GymControlError | None:
        errors = [b.failure for b in self.batches if b.failure is not None]
        if self.resume.failure is not None:
            errors.append(self.resume.failure)
        return GymControlError.combine(errors) if errors else None

    def unretired(self) -> dict[str, list[str]]:
        """Capture keys whose retire failed, per instance: the caller's outbox keeps them."""
        owed: dict[str, list[str]] = {}
        for batch in self.batches:
            if batch.failure is not None:
                owed.setdefault(batch.instance_id, []).extend(e.capture_key for e in batch.episodes)
        return owed


class GymControlClient:
    def __init__(
        self,
        *,
        control_timeout_s: float = 60.0,
        prepare_timeout_s: float | None = 300.0,
        discovery_timeout_s: float = 60.0,
        max_control_reply_bytes: int = DEFAULT_MAX_CONTROL_REPLY_BYTES,
        clock: Clock | None = None,
        transport: httpx.AsyncBaseTransport | None = None,
        owns_checkpoint_id: Callable[[str], bool] | None = None,
        max_connections: int = 256,
    ) -> None:
        """
        ``owns_checkpoint_id`` tells whether an id found on a participant was issued by this
        coordinator (for example, by looking it up in the ledger after a restart); ids this
        client issued itself are always recognised. ``transport`` replaces the network layer in
        tests.
        """
        for name, value in (
            ("control_timeout_s", control_timeout_s),
            ("discovery_timeout_s", discovery_timeout_s),
        ):
            if not value > 0:
                raise ValueError(f"{name} must be positive, got {value!r}")
        if prepare_timeout_s is not None and not prepare_timeout_s > 0:
            raise ValueError(f"prepare_timeout_s must be positive, got {prepare_timeout_s!r}")
        if max_control_reply_bytes < 1:
            raise ValueError("max_control_reply_bytes must be positive")
        self.control_timeout_s = float(control_timeout_s)
        # Spec 5.2: prepare falls back to the control budget when its own is unset.
        self.prepare_timeout_s = float(prepare_timeout_s or control_timeout_s)
        self.discovery_timeout_s = float(discovery_timeout_s)
        self.max_control_reply_bytes = max_control_reply_bytes
        self.clock: Clock = clock or SystemClock()
        self._http = httpx.AsyncClient(
            transport=transport,
            timeout=None,
            follow_redirects=False,
            # Control calls go straight to the registered base URLs, never through a proxy
            # picked up from the environment.
            trust_env=False,
            limits=httpx.Limits(
                max_connections=max_connections,
                max_keepalive_connections=max_connections,
            ),
        )
        self._channel = ControlChannel(
            self._http,
            self.clock,
            control_timeout_s=self.control_timeout_s,
            max_reply_bytes=max_control_reply_bytes,
        )
        self._owns = owns_checkpoint_id
        self._issued: set[str] = set()
        self._prepared_ids: set[str] = set()
        # instance id -> the checkpoint or restore id this client has open on it.
        self._open: dict[str, str] = {}
        # checkpoint id -> the restarts its prepare replies reported, per instance.
        self._prepare_restarts: dict[str, Mapping[str, frozenset[Episode]]] = {}

    # --- lifecycle -----------------------------------------------------------------------------

    async def __aenter__(self) -> GymControlClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        await self._http.aclose()

    @property
    def lease_renew_interval_s(self) -> float:
        """Section 6 cadence: ``max(0.01, min(T/3, 10))``."""
        return max(0.01, min(self.control_timeout_s / 3.0, 10.0))

    # --- ids -----------------------------------------------------------------------------------

    def new_checkpoint_id(self, snapshot_id: str | int | None = None) -> str:
        """A fresh save id, ``snap-<snapshot_id>-<8 hex>``; never one this client issued before."""
        while True:
            suffix = secrets.token_hex(4)
            cid = f"snap-{snapshot_id}-{suffix}" if snapshot_id is not None else f"snap-{secrets.token_hex(8)}"
            if not is_valid_checkpoint_id(cid):
                raise ValueError(f"snapshot id {snapshot_id!r} does not make a valid checkpoint id")
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

    def open_checkpoint(self, instance_id: str) -> str | None:
        """The id this client has open on an instance (prepared or restored, not yet resumed)."""
        return self._open.get(instance_id)

    def release(self, checkpoint_id: str, topology: Iterable[str]) -> None:
        """Stop driving ``checkpoint_id`` on these instances without resuming it (a stopping
        snapshot leaves Gym parked); from now on it counts as an orphan of this coordinator."""
        for iid in topology:
            if self._open.get(iid) == checkpoint_id:
                del self._open[iid]
        if checkpoint_id not in self._open.values():
            self._prepare_restarts.pop(checkpoint_id, None)

    def _is_orphan_of_ours(self, checkpoint_id: str) -> bool:
        return self.issued(checkpoint_id) and checkpoint_id not in self._open.values()

    # --- discovery (section 3) -----------------------------------------------------------------

    async def discover(self, spec: InstanceSpec) -> list[Participant]:
        """The participants of one instance, sorted by ``(stage, server_name)``; all or nothing."""
        return list((await self.discover_instance(spec)).participants)

    async def discover_all(
        self, specs: Iterable[InstanceSpec], *, log_warnings: bool = True
    ) -> dict[str, InstanceTopology]:
        """``log_warnings=False`` leaves the topology's warnings to the caller: registration logs
        them once per run, and the discovery before a restore does not repeat them."""
        specs = list(specs)
        outcomes = await asyncio.gather(*(_catch(self.discover_instance(s, log_warnings=log_warnings)) for s in specs))
        errors = [o for o in outcomes if isinstance(o, GymControlError)]
        if errors:
            # All or nothing across instances too: a restore or setup needs every one of them.
            raise GymControlError.combine(errors)
        return {s.instance_id: o for s, o in zip(specs, outcomes) if isinstance(o, InstanceTopology)}

    async def discover_instance(self, spec: InstanceSpec, *, log_warnings: bool = True) -> InstanceTopology:
        iid = spec.instance_id
        targets = [Target(iid, name, url, spec.token) for name, url in spec.servers.items()]
        probes = await asyncio.gather(*(_catch(self._probe(t)) for t in targets))
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
            # Never a partial participant set: an unreachable participant would make every
            # later checkpoint unsafe.
            raise GymControlError.from_parts(
                {iid: failures},
                f"discovery of {iid} failed on {', '.join(sorted(failures))}",
            )
        topology = self._build_topology(spec, statuses, skipped)
        if log_warnings:
            for text in topology.warnings:
                log.warning("%s", text)
        return topology

    async def _probe(self, target: Target) -> StatusReply | None:
        status, content = await self._channel.get_status(target, self.discovery_timeout_s)
        if status == 404:
            return None
        if status == 200:
            try:
                return StatusReply.model_validate_json(content)
            except ValidationError as exc:
                raise CallFailed(
                    target,
                    server_failure(
                        FailureClass.PROTOCOL_ERROR,
                        "status",
                        f"malformed status reply: {exc.error_count()} error(s): "
                        + "; ".join(
                            f"{'.'.join(map(str, e['loc']))}: {e['msg']}"
                            for e in exc.errors(include_url=False, include_input=False)[:5]
                        ),
                        http_status=200,
                    ),
                ) from None
        part = error_part("status", status, content)
        # Section 3's table: only 401, 408, 429 and 5xx have a class of their own here.
        cls = classify_status(status)
        part["class"] = str(cls)
        part["transient"] = cls is FailureClass.UNAVAILABLE
        raise CallFailed(target, part)

    def _build_topology(
        self, spec: InstanceSpec, statuses: Mapping[str, StatusReply], skipped: Sequence[str]
    ) -> InstanceTopology:
        iid = spec.instance_id
        problems: dict[str, list[str]] = {}
        protocol: dict[str, ServerFailure] = {}
        warnings: list[str] = []
        participants: list[Participant] = []
        seen: dict[tuple[str, str], list[str]] = {}
        active: dict[str, str] = {}

        def refuse(server: str, why: str) -> None:
            problems.setdefault(server, []).append(why)

        for name, st in statuses.items():
            kind = st.kind
            if kind not in KINDS:
                refuse(name, f"unknown kind {kind!r}")
            elif kind == ENVIRONMENT:
                refuse(
                    name,
                    "environment participants are not supported yet: their episodes cannot be "
                    "attributed (only the legacy_agent relay, which is no participant, is)",
                )
            mode = MODE_ALIASES.get(st.mode, st.mode) if st.mode is not None else None
            if mode is not None and mode not in MODES:
                refuse(name, f"unknown mode {st.mode!r}")
            if not is_valid_name(st.instance):
                refuse(name, f"participant name {st.instance!r} is not a valid NAME")
            if st.phase not in PHASES:
                protocol[name] = server_failure(
                    FailureClass.PROTOCOL_ERROR, "status", f"unknown phase {st.phase!r}", http_status=200
                )
            elif st.phase != "idle" and not st.checkpoint_id:
                protocol[name] = server_failure(
                    FailureClass.PROTOCOL_ERROR,
                    "status",
                    f"phase {st.phase!r} without a checkpoint_id",
                    http_status=200,
                )
            seen.setdefault((kind, st.instance), []).append(name)
            if mode is None:
                warnings.append(
                    f"{iid}/{name} reports no checkpoint mode (published Gym reports one for resources only); it is not "
                    f"treated as restart-only"
                )
            if st.instance != name:
                warnings.append(f"{iid}/{name} reports participant name {st.instance!r}")
            if st.phase != "idle" and st.checkpoint_id:
                active[name] = st.checkpoint_id
            participants.append(
                Participant(
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
            )
        for (kind, pname), names in seen.items():
            if len(names) > 1:
                for name in names:
                    refuse(
                        name,
                        f"shares (kind {kind!r}, participant name {pname!r}) with "
                        f"{', '.join(n for n in sorted(names) if n != name)}: they would collide on disk",
                    )
        parts: dict[str, ServerFailure] = {
            server: server_failure(FailureClass.CONFIG_ERROR, "discover", "; ".join(whys))
            for server, whys in problems.items()
        }
        if not any(p.kind == MODEL for p in participants):
            parts[INSTANCE_WIDE] = server_failure(
                FailureClass.CONFIG_ERROR,
                "discover",
                "no policy model takes part (no participant of kind 'model')",
            )
        for name, part in protocol.items():
            parts.setdefault(name, part)
        if parts:
            named = ", ".join(sorted(parts))
            raise GymControlError.from_parts(
                {iid: parts}, f"instance {iid} refused at discovery: {named}: " + " | ".join(
                    f"{s}: {p['detail']}" for s, p in sorted(parts.items())
                )
            )
        participants.sort(key=lambda p: p.sort_key)
        return InstanceTopology(
            spec=spec,
            participants=tuple(participants),
            non_participants=tuple(sorted(skipped)),
            warnings=tuple(warnings),
            active_ids=active,
        )

    @staticmethod
    def check_restart_only(
        participants_by_instance: Mapping[str, Iterable[Participant]],
        target_level: str,
        allow_restart_only_gym_servers: bool,
    ) -> list[str]:
        return check_restart_only(participants_by_instance, target_level, allow_restart_only_gym_servers)

    async def recover_orphans(self, topology: Topology) -> list[str]:
        """Section 3, phase at discovery: resume checkpoints this coordinator left open.

        Every participant of an instance gets the resume, not only the one holding the id.
        A foreign id raises ``conflict`` naming its holders, before anything is resumed.
        """
        foreign: dict[str, dict[str, ServerFailure]] = {}
        orphans: dict[str, set[str]] = {}
        for iid, inst in topology.items():
            for server, cid in inst.active_ids.items():
                if self._is_orphan_of_ours(cid):
                    orphans.setdefault(cid, set()).add(iid)
                elif not self.issued(cid):
                    foreign.setdefault(iid, {})[server] = server_failure(
                        FailureClass.CONFLICT,
                        "status",
                        f"holds checkpoint {cid!r}, which another controller issued",
                    )
        if foreign:
            raise GymControlError.from_parts(foreign, "instances held by another controller")
        resumed: list[str] = []
        errors: list[GymControlError] = []
        for cid, iids in sorted(orphans.items()):
            log.warning("resuming orphaned checkpoint %s on %s", cid, ", ".join(sorted(iids)))
            report = await self._resume_all(cid, {i: topology[i] for i in iids})
            if report.failure is not None:
                errors.append(report.failure)
            else:
                resumed.append(cid)
        if errors:
            raise GymControlError.combine(errors)
        return resumed

    # --- prepare (5.2) -------------------------------------------------------------------------

    def _claim_id(self, checkpoint_id: str) -> None:
        if not is_valid_checkpoint_id(checkpoint_id):
            raise ValueError(f"invalid checkpoint id {checkpoint_id!r}")
        if checkpoint_id in self._prepared_ids:
            # Participants remember ended ids and would answer stale_checkpoint; a reused id
            # could also replay another checkpoint's stored replies.
            raise ValueError(f"checkpoint id {checkpoint_id!r} was already used; ids are never reused")
        self._prepared_ids.add(checkpoint_id)
        self._issued.add(checkpoint_id)

    async def prepare(self, checkpoint_id: str, topology: Topology) -> PrepareResult:
        """Prepare every instance stage by stage, instances in parallel.

        On any failure (not ready, a reply saying ``idle``, an error) every participant of every
        instance gets resume before the failure is raised, with any resume failure attached.
        """
        held = {iid: self._open[iid] for iid in topology if self._open.get(iid, checkpoint_id) != checkpoint_id}
        if held:
            # Section 13 P7: this client's own open checkpoint is no orphan. Refuse the second
            # prepare instead of letting the participant's conflict lead to resuming the first.
            raise GymControlError.from_parts(
                {
                    iid: {INSTANCE_WIDE: server_failure(FailureClass.CONFLICT, "prepare", f"checkpoint {cid} of this coordinator is still open")}
                    for iid, cid in held.items()
                },
                f"prepare of {checkpoint_id} refused: this coordinator still has "
                + ", ".join(f"{cid} open on {iid}" for iid, cid in sorted(held.items())),
            )
        self._claim_id(checkpoint_id)
        for iid in topology:
            self._open[iid] = checkpoint_id
        first_sent_at = self.clock.time()
        outcomes = await asyncio.gather(
            *(self._prepare_instance(checkpoint_id, inst) for inst in topology.values())
        )
        failed = {iid: o.failures for iid, o in zip(topology, outcomes) if o.failures}
        if failed:
            error = GymControlError.from_parts(failed, _prepare_message(checkpoint_id, failed))
            report = await self._resume_all(checkpoint_id, topology)
            error.resume_failure = report.failure
            raise error
        restarts = {iid: frozenset(o.restarts) for iid, o in zip(topology, outcomes)}
        self._prepare_restarts[checkpoint_id] = restarts
        return PrepareResult(
            checkpoint_id=checkpoint_id,
            restarts=restarts,
            deadlines={iid: o.deadlines for iid, o in zip(topology, outcomes)},
            first_sent_at=first_sent_at,
            finished_at=self.clock.time(),
        )

    async def _prepare_instance(self, cid: str, inst: InstanceTopology) -> _PrepareOutcome:
        out = _PrepareOutcome()
        for stage in inst.stages():
            deadline = self.clock.time() + self.prepare_timeout_s
            body = encode_body({"checkpoint_id": cid, "deadline_ts": deadline})
            replies = await asyncio.gather(
                *(
                    _catch(self._channel.post(self._target(inst, p), "prepare", body, deadline, PrepareReply))
                    for p in stage
                )
            )
            for p, reply in zip(stage, replies):
                out.deadlines[p.server_name] = deadline
                if isinstance(reply, CallFailed):
                    if reply.code == "checkpoint_conflict":
                        out.failures[p.server_name] = await self._prepare_conflict(cid, inst, p, reply)
                    else:
                        out.failures[p.server_name] = reply.part
                    continue
                report = reply.report
                out.restarts.update(Episode.from_capture_key(k) for k in report.restarts)
                if reply.phase == "prepared" and report.ready:
                    continue
                if reply.phase == "idle":
                    # The checkpoint ended under us (a resume or lease expiry): work moved on.
                    out.failures[p.server_name] = server_failure(
                        FailureClass.LEASE_LOST,
                        "prepare",
                        "prepare replied idle: the checkpoint was ended on the participant",
                        http_status=200,
                    )
                    continue
                out.failures[p.server_name] = server_failure(
                    FailureClass.NOT_READY,
                    "prepare",
                    f"not ready by the deadline: {report.blocker_count} blocker(s)",
                    http_status=200,
                    blocker_count=max(report.blocker_count, len(report.blockers)),
                    blockers=sorted(report.blockers)[:SAMPLE],
                )
            if out.failures:
                # Later stages never receive prepare for this checkpoint.
                break
        return out

    async def _prepare_conflict(
        self, cid: str, inst: InstanceTopology, p: Participant, refusal: CallFailed
    ) -> ServerFailure:
        """Section 5.2 conflict rule: resume an orphan of ours (transient), else ``conflict``."""
        try:
            status = await self._probe(self._target(inst, p))
        except CallFailed as exc:
            return server_failure(
                FailureClass.CONFLICT,
                "prepare",
                f"{refusal.part['detail']} (status unreadable: {exc.part['detail']})",
                http_status=refusal.part["http_status"],
                code="checkpoint_conflict",
            )
        held = status.checkpoint_id if status is not None else None
        if held and held != cid and self._is_orphan_of_ours(held):
            log.warning("%s/%s holds orphaned checkpoint %s; resuming it", inst.instance_id, p.server_name, held)
            report = await self._resume_all(held, {inst.instance_id: inst})
            outcome = "resumed" if report.ok else f"resume failed: {report.failure}"
            return server_failure(
                FailureClass.UNAVAILABLE,
                "prepare",
                f"held orphaned checkpoint {held!r} of this coordinator ({outcome}); try again",
                http_status=refusal.part["http_status"],
                code="checkpoint_conflict",
                held_checkpoint_id=held,
            )
        return server_failure(
            FailureClass.CONFLICT,
            "prepare",
            f"instance held by checkpoint {held!r} of another controller",
            http_status=refusal.part["http_status"],
            code="checkpoint_conflict",
            held_checkpoint_id=held,
        )

    # --- renew (5.3, 6) ------------------------------------------------------------------------

    async def renew(self, checkpoint_id: str, topology: Topology) -> RenewResult:
        """Renew every participant's lease once; raises on any failure.

        ``stale_checkpoint`` becomes ``lease_lost``: the participant already reopened.
        """
        result = await self.renew_round(checkpoint_id, topology)
        if result.failure is not None:
            raise result.failure
        return result

    async def renew_round(self, checkpoint_id: str, topology: Topology) -> RenewResult:
        """Like :meth:`renew`, but reports the failure alongside the leases that were renewed."""
        deadline = self.clock.time() + self.control_timeout_s
        body = encode_body({"checkpoint_id": checkpoint_id, "deadline_ts": deadline})
        pairs = [(iid, inst, p) for iid, inst in topology.items() for p in inst.participants]
        replies = await asyncio.gather(
            *(
                _catch(self._channel.post(self._target(inst, p), "renew", body, deadline, RenewReply))
                for _, inst, p in pairs
            )
        )
        leases: dict[str, dict[str, float]] = {iid: {} for iid in topology}
        parts: dict[str, dict[str, ServerFailure]] = {}
        for (iid, _, p), reply in zip(pairs, replies):
            if isinstance(reply, CallFailed):
                parts.setdefault(iid, {})[p.server_name] = _lease_lost_if_stale(reply.part)
            else:
                leases[iid][p.server_name] = reply.lease_expires_at
        failure = (
            GymControlError.from_parts(parts, f"renew of {checkpoint_id} failed") if parts else None
        )
        return RenewResult(checkpoint_id, deadline, leases, failure)

    # --- commit (5.4) --------------------------------------------------------------------------

    async def commit(
        self,
        checkpoint_id: str,
        topology: Topology,
        checkpoint_dirs: Mapping[str, str],
        scopes: Mapping[str, Iterable[Episode]],
        stop: bool = False,
        restarts: Mapping[str, Iterable[Episode]] | None = None,
    ) -> CommitResult:
        """Commit every participant of every instance and validate the replies (5.4).

        ``scopes`` must already exclude every restart (see :func:`policy.compute_scope`);
        ``restarts`` only travels into the result. The caller resumes on failure.
        """
        deadline = self.clock.time() + self.control_timeout_s
        dirs: dict[str, str] = {}
        scope_of: dict[str, list[Episode]] = {}
        restarts_of: dict[str, list[Episode]] = {}
        for iid in topology:
            directory = checkpoint_dirs[iid]
            if not os.path.isabs(directory):
                raise ValueError(f"checkpoint_dir of {iid} must be absolute, got {directory!r}")
            dirs[iid] = directory
            scope_of[iid] = sorted(set(scopes.get(iid, ())))
            restarts_of[iid] = sorted(set((restarts or {}).get(iid, ())))
        # Participants write into the directory; creating it is the coordinator's job (5.4).
        await asyncio.to_thread(_make_dirs, dirs.values())
        pairs = [(iid, inst, p) for iid, inst in topology.items() for p in inst.participants]
        with_stop = [stop] * len(pairs)
        sent_scope: list[list[Episode]] = [scope_of[iid] for iid, _, _ in pairs]
        bodies: dict[tuple[str, int, bool], bytes] = {}

        def body(i: int) -> bytes:
            # One encoding per instance, scope and stop flag: large scopes are encoded once.
            iid = pairs[i][0]
            key = (iid, id(sent_scope[i]), with_stop[i])
            if key not in bodies:
                wire: dict[str, Any] = {
                    "checkpoint_id": checkpoint_id,
                    "deadline_ts": deadline,
                    "checkpoint_dir": dirs[iid],
                    # Always sent, even empty: participants need the scope to know what to export.
                    "episode_ids": [ep.to_wire() for ep in sent_scope[i]],
                }
                if with_stop[i]:
                    # Omitted otherwise: Gym versions that predate `stop` refuse unknown fields.
                    wire["stop"] = True
                bodies[key] = encode_body(wire)
            return bodies[key]

        async def send(indices: Sequence[int]) -> None:
            answers = await asyncio.gather(
                *(
                    _catch(self._channel.post(self._target(pairs[i][1], pairs[i][2]), "commit", body(i), deadline, CommitReply))
                    for i in indices
                )
            )
            for i, answer in zip(indices, answers):
                replies[i] = answer

        replies: list[CommitReply | CallFailed] = [None] * len(pairs)  # type: ignore[list-item]
        await send(range(len(pairs)))
        stop_refused: dict[str, list[str]] = {}
        if stop:
            # Section 13 P4: a Gym that predates `stop` refuses it as an unknown field. Send that
            # participant the same commit without it, once; the snapshot then resumes as usual.
            retry = [i for i, r in enumerate(replies) if isinstance(r, CallFailed) and _refuses_stop(r.part)]
            for i in retry:
                with_stop[i] = False
                stop_refused.setdefault(pairs[i][0], []).append(pairs[i][2].server_name)
            await send(retry)
            for iid, servers in sorted(stop_refused.items()):
                log.warning(
                    "%s: %s refused `stop` on commit %s (a Gym that predates it); committed without "
                    "it, so this instance will be resumed", iid, ", ".join(sorted(servers)), checkpoint_id,
                )
        await self._recommit_grown_restarts(checkpoint_id, pairs, replies, scope_of, restarts_of, sent_scope, send)
        by_instance: dict[str, dict[str, CommitReply | CallFailed]] = {iid: {} for iid in topology}
        sent: dict[str, dict[str, set[str]]] = {iid: {} for iid in topology}
        for i, (iid, _, p) in enumerate(pairs):
            by_instance[iid][p.server_name] = replies[i]
            sent[iid][p.server_name] = {ep.capture_key for ep in sent_scope[i]}
        results: dict[str, InstanceCommit] = {}
        parts: dict[str, dict[str, ServerFailure]] = {}
        for iid, inst in topology.items():
            outcome = _validate_commit(
                checkpoint_id, inst, dirs[iid], scope_of[iid], restarts_of[iid], by_instance[iid], sent[iid]
            )
            if isinstance(outcome, InstanceCommit):
                if stop:
                    outcome = replace(outcome, stop_supported=iid not in stop_refused)
                results[iid] = outcome
            else:
                parts[iid] = outcome
        if parts:
            raise GymControlError.from_parts(parts, f"commit of {checkpoint_id} failed: " + _summary(parts))
        return CommitResult(checkpoint_id, results)

    async def _recommit_grown_restarts(
        self,
        cid: str,
        pairs: Sequence[tuple[str, InstanceTopology, Participant]],
        replies: list[CommitReply | CallFailed],
        scope_of: dict[str, list[Episode]],
        restarts_of: dict[str, list[Episode]],
        sent_scope: list[list[Episode]],
        send: Callable[[Sequence[int]], Awaitable[None]],
    ) -> None:
        """Published Gym's restart-only agents admit new ``/run``s while parked and recompute their
        restarts at commit, so a candidate that arrived after prepare is refused as
        ``restart_in_scope``. Such an episode cannot be saved: move it to the instance's restarts
        and commit the refusing participants again, once, with the smaller scope. The others
        keep what they committed; their exports of it fall outside the scope and are not saved."""
        refused = [i for i, r in enumerate(replies) if isinstance(r, CallFailed) and r.code == "restart_in_scope"]
        if not refused:
            return
        statuses = await asyncio.gather(*(_catch(self._probe(self._target(pairs[i][1], pairs[i][2]))) for i in refused))
        grown: dict[str, set[str]] = {}
        for i, status in zip(refused, statuses):
            if isinstance(status, StatusReply) and status.report is not None:
                grown.setdefault(pairs[i][0], set()).update(status.report.restarts)
        known = self._prepare_restarts.get(cid, {})
        again: list[int] = []
        for iid, keys in grown.items():
            # A restart prepare already reported stays a refusal: putting it in scope is a bug.
            earlier = known.get(iid, frozenset())
            moved = [ep for ep in scope_of[iid] if ep.capture_key in keys and ep not in earlier]
            if not moved:
                continue
            log.warning(
                "%s: %d candidate(s) became restarts after prepare on commit %s (a restart-only "
                "participant that keeps admitting work); committing without them, e.g. %s",
                iid, len(moved), cid, ", ".join(_sample(ep.capture_key for ep in moved)),
            )
            gone = set(moved)
            scope_of[iid] = [ep for ep in scope_of[iid] if ep not in gone]
            restarts_of[iid] = sorted(set(restarts_of[iid]) | set(moved))
            for i in refused:
                if pairs[i][0] == iid:
                    sent_scope[i] = scope_of[iid]
                    again.append(i)
        if again:
            await send(again)

    # --- resume (5.5) --------------------------------------------------------------------------

    async def resume(
        self, checkpoint_id: str, topology: Topology, *, raise_on_failure: bool = True
    ) -> ResumeReport:
        """Resume in reverse stage order on every instance, retrying transient failures on the
        failed instances only.

        Before the snapshot cut a final failure is raised (``raise_on_failure=True``); after a
        successful cut it is reported, not raised, since the lease reopens the participant.
        """
        report = await self._resume_all(checkpoint_id, topology)
        if raise_on_failure:
            report.raise_for_failure()
        return report

    async def _resume_all(self, cid: str, topology: Topology) -> ResumeReport:
        pending: dict[str, InstanceTopology] = dict(topology)
        idempotent: dict[str, dict[str, bool]] = {iid: {} for iid in topology}
        failures: dict[str, dict[str, ServerFailure]] = {}
        rounds = 0
        try:
            while pending:
                rounds += 1
                outcomes = await asyncio.gather(
                    *(self._resume_instance(cid, inst) for inst in pending.values())
                )
                retry: dict[str, InstanceTopology] = {}
                for (iid, inst), (flags, parts) in zip(pending.items(), outcomes):
                    idempotent[iid].update(flags)
                    if parts:
                        failures[iid] = parts
                        if all(part["transient"] for part in parts.values()):
                            retry[iid] = inst
                    else:
                        failures.pop(iid, None)
                if not retry or rounds >= RESUME_ROUNDS:
                    break
                pending = retry
                await self.clock.sleep(RESUME_BACKOFF_S * rounds)
        finally:
            # Even a cancelled resume ends this client's hold: an id still held on Gym is then an
            # orphan of ours, which the next prepare's conflict rule resumes.
            self.release(cid, topology)
        failure = (
            GymControlError.from_parts(failures, f"resume of {cid} failed: " + _summary(failures))
            if failures
            else None
        )
        if failure is not None:
            log.warning("resume of %s failed after %d round(s): %s", cid, rounds, failure)
        return ResumeReport(cid, failure, self.clock.time(), idempotent, rounds)

    async def _resume_instance(
        self, cid: str, inst: InstanceTopology
    ) -> tuple[dict[str, bool], dict[str, ServerFailure]]:
        flags: dict[str, bool] = {}
        parts: dict[str, ServerFailure] = {}
        for stage in inst.stages(reverse=True):
            deadline = self.clock.time() + self.control_timeout_s
            body = encode_body({"checkpoint_id": cid, "deadline_ts": deadline})
            replies = await asyncio.gather(
                *(
                    _catch(self._channel.post(self._target(inst, p), "resume", body, deadline, ResumeReply))
                    for p in stage
                )
            )
            # Keep going through every stage: a participant left parked blocks its callers.
            for p, reply in zip(stage, replies):
                if isinstance(reply, CallFailed):
                    parts[p.server_name] = reply.part
                else:
                    flags[p.server_name] = reply.idempotent
        return flags, parts

    # --- restore (5.6) -------------------------------------------------------------------------

    async def restore(
        self,
        manifest: Mapping[str, Any],
        topology: Mapping[str, InstanceSpec | InstanceTopology],
        snapshot_dir: str,
        *,
        resume: bool = True,
    ) -> RestoreResult:
        """Restore a snapshot's Gym state into fresh instances, all or nothing (5.6 steps 2-10).

        ``manifest`` is the validated Gym manifest v2 (a plain dict). With ``resume=False`` the
        participants stay ``restored`` (admission closed) until :meth:`finish_restore` or
        :meth:`discard_restore`. Any failure after the first restore call runs the cleanup and
        raises, naming in ``extra["rollouts_to_restart"]`` the rollouts that must start over.
        """
        plan = _RestorePlan.parse(manifest)
        specs = {iid: (t.spec if isinstance(t, InstanceTopology) else t) for iid, t in topology.items()}
        if not os.path.isabs(snapshot_dir):
            raise ValueError(f"snapshot_dir must be absolute, got {snapshot_dir!r}")
        everything = plan.rollouts()
        missing = sorted(set(plan.instances) - set(specs))
        unknown = sorted(set(specs) - set(plan.instances))
        if missing or unknown:
            parts = {
                iid: {INSTANCE_WIDE: server_failure(FailureClass.TOPOLOGY_MISMATCH, "restore", why)}
                for ids, why in ((missing, "instance in the snapshot but not live"), (unknown, "live instance not in the snapshot"))
                for iid in ids
            }
            raise GymControlError.from_parts(
                parts,
                f"live Gym instances differ from the snapshot's: missing {missing}, unknown {unknown}",
                extra={"missing_instances": missing, "unknown_instances": unknown, "rollouts_to_restart": everything},
            )
        try:
            live = await self.discover_all((specs[iid] for iid in sorted(specs)), log_warnings=False)
        except GymControlError as exc:
            exc.extra.setdefault("rollouts_to_restart", everything)
            raise
        absent: dict[str, dict[str, ServerFailure]] = {}
        for iid, inst_plan in plan.instances.items():
            names = {p.server_name for p in live[iid].participants}
            for server in inst_plan.participants:
                if server not in names:
                    absent.setdefault(iid, {})[server] = server_failure(
                        FailureClass.TOPOLOGY_MISMATCH,
                        "restore",
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
        busy = {iid: inst for iid, inst in live.items() if inst.active_ids}
        if busy:
            parts = {
                iid: {
                    s: server_failure(
                        FailureClass.UNAVAILABLE if self._is_orphan_of_ours(c) else FailureClass.CONFLICT,
                        "restore",
                        f"not idle: holds checkpoint {c!r}",
                    )
                    for s, c in inst.active_ids.items()
                }
                for iid, inst in busy.items()
            }
            error = GymControlError.from_parts(
                parts, "restore needs every participant idle", extra={"rollouts_to_restart": everything}
            )
            if error.transient:
                # Only our own orphans: resume them, so that a retried restore finds them idle.
                try:
                    await self.recover_orphans(busy)
                except GymControlError as exc:
                    error.resume_failure = exc
            raise error

        restore_id = self.new_restore_id(plan.source_id)
        for iid in live:
            self._open[iid] = restore_id
        deadline = self.clock.time() + self.control_timeout_s
        calls: list[tuple[str, InstanceTopology, Participant, bytes]] = []
        for iid, inst in live.items():
            inst_plan = plan.instances[iid]
            body = encode_body(
                {
                    "checkpoint_id": restore_id,
                    "deadline_ts": deadline,
                    "checkpoint_dir": instance_checkpoint_dir(snapshot_dir, iid),
                    "episode_ids": episodes_to_wire(inst_plan.episodes),
                }
            )
            named = set(inst_plan.participants)
            # Extra live participants have no directory: they get no restore, only the resume.
            calls.extend((iid, inst, p, body) for p in inst.participants if p.server_name in named)
        replies = await asyncio.gather(
            *(
                _catch(self._channel.post(self._target(inst, p), "restore", body, deadline, RestoreReply))
                for _, inst, p, body in calls
            )
        )
        per_instance: dict[str, dict[str, RestoreReply | CallFailed]] = {iid: {} for iid in live}
        for (iid, _, p, _), reply in zip(calls, replies):
            per_instance[iid][p.server_name] = reply
        parts = {}
        for iid in live:
            bad = _validate_restore(plan, iid, per_instance[iid])
            if bad:
                parts[iid] = bad
        continued = {
            iid: tuple(ep.next_attempt() for ep in inst_plan.episodes)
            for iid, inst_plan in plan.instances.items()
        }
        result = RestoreResult(
            restore_id=restore_id,
            source_checkpoint_id=plan.source_id,
            continued=continued,
            restarts={iid: inst_plan.restarts for iid, inst_plan in plan.instances.items()},
            topology=live,
        )
        if parts:
            error = GymControlError.from_parts(parts, f"restore {restore_id} failed: " + _summary(parts))
            cleanup = await self._restore_cleanup(result)
            error.extra.update(
                restore_id=restore_id,
                rollouts_to_restart=everything,
                unretired=cleanup.unretired(),
                resume=cleanup.resume.summary(),
            )
            error.resume_failure = cleanup.failure
            raise error
        if resume:
            return await self.finish_restore(result)
        return result

    async def finish_restore(self, result: RestoreResult) -> RestoreResult:
        """Resume with the restore id (5.6 step 10). A resume failure is reported, not raised:
        the restore itself succeeded and the lease reopens the participants."""
        report = await self._resume_all(result.restore_id, result.topology)
        return RestoreResult(
            restore_id=result.restore_id,
            source_checkpoint_id=result.source_checkpoint_id,
            continued=result.continued,
            restarts=result.restarts,
            topology=result.topology,
            resume=report,
        )

    async def discard_restore(self, result: RestoreResult) -> RestoreCleanup:
        """Give up a successful restore (for example, the ledger disagrees): retire every N+1 and
        resume, so none of those continuations can run. The caller restarts the rollouts."""
        return await self._restore_cleanup(result)

    async def _restore_cleanup(self, result: RestoreResult) -> RestoreCleanup:
        deadline = self.clock.time() + max(self.control_timeout_s, CLEANUP_MIN_BUDGET_S)
        retires = await asyncio.gather(
            *(
                self.retire(
                    result.topology[iid], eps, checkpoint_id=result.restore_id, deadline_ts=deadline
                )
                for iid, eps in result.continued.items()
                if eps
            )
        )
        report = await self._resume_all(result.restore_id, result.topology)
        return RestoreCleanup(
            restore_id=result.restore_id,
            batches=tuple(b for batches in retires for b in batches),
            resume=report,
            rollouts_to_restart={
                iid: tuple(sorted({e.rollout_id for e in eps})) for iid, eps in result.continued.items()
            },
        )

    # --- retire and forget (5.7, 5.8, 7) -------------------------------------------------------

    async def retire(
        self,
        instance: InstanceTopology,
        episodes: Iterable[Episode],
        checkpoint_id: str = "retire",
        *,
        deadline_ts: float | None = None,
    ) -> list[BatchResult]:
        """Retire episodes on every participant, callers before callees, in batches of 1024.

        Never raises for a participant failure: each batch reports its own, so a durable outbox
        keeps exactly the failed batches queued.
        """
        eps = sorted(set(episodes))
        for ep in eps:
            Episode.checked(ep.rollout_id, ep.attempt)
        return await self._batched(
            instance,
            "retire",
            checkpoint_id,
            eps,
            lambda batch: {"episode_ids": [e.to_wire() for e in batch]},
            RetireReply,
            _check_retired,
            deadline_ts,
        )

    async def forget(
        self,
        instance: InstanceTopology,
        rollout_ids: Iterable[str],
        checkpoint_id: str = "forget",
        *,
        deadline_ts: float | None = None,
    ) -> list[BatchResult]:
        """Drop the marks of rollouts that can no longer send anything; same order as retire."""
        ids = sorted(set(rollout_ids))
        for rid in ids:
            if not is_valid_rollout_id(rid):
                raise ValueError(f"invalid rollout id {rid!r}")
        return await self._batched(
            instance,
            "forget",
            checkpoint_id,
            ids,
            lambda batch: {"rollout_ids": list(batch)},
            ForgetReply,
            _check_forgotten,
            deadline_ts,
        )

    async def retire_then_forget(
        self, instance: InstanceTopology, episodes: Iterable[Episode]
    ) -> tuple[list[BatchResult], list[BatchResult]]:
        """For rollouts that will never be dispatched again: forget each right after its retire
        succeeded on every participant (section 7). Returns (retire batches, forget batches)."""
        retired = await self.retire(instance, episodes)
        done = sorted({e.rollout_id for b in retired if b.ok for e in b.episodes})
        forgotten = await self.forget(instance, done) if done else []
        return retired, forgotten

    async def forget_settling_refusals(
        self, instance: InstanceTopology, last_retired: Mapping[str, Episode]
    ) -> ForgetSettlement:
        """Forget the given rollouts; if a participant refuses, re-send the retire of each
        rollout's last retired attempt and forget again. What still fails stays owed."""
        first = await self.forget(instance, last_retired)
        batches: list[BatchResult] = list(first)
        forgotten = [r for b in first if b.ok for r in b.rollout_ids]
        owed_forgets: list[str] = []
        owed_retires: list[Episode] = []
        refused = [r for b in first if not b.ok and _refused(b.failure) for r in b.rollout_ids]
        owed_forgets.extend(r for b in first if not b.ok and not _refused(b.failure) for r in b.rollout_ids)
        if refused:
            retired = await self.retire(instance, (last_retired[r] for r in refused))
            batches.extend(retired)
            owed_retires.extend(e for b in retired if not b.ok for e in b.episodes)
            again = await self.forget(instance, refused)
            batches.extend(again)
            forgotten.extend(r for b in again if b.ok for r in b.rollout_ids)
            still = [r for b in again if not b.ok for r in b.rollout_ids]
            owed_forgets.extend(still)
            # A forget refused twice keeps its retire queued too (section 7).
            owed_retires.extend(last_retired[r] for r in still)
        return ForgetSettlement(
            instance_id=instance.instance_id,
            forgotten=tuple(sorted(set(forgotten))),
            owed_retires=tuple(sorted(set(owed_retires))),
            owed_forgets=tuple(sorted(set(owed_forgets))),
            batches=tuple(batches),
        )

    async def _batched(
        self,
        inst: InstanceTopology,
        op: str,
        checkpoint_id: str,
        items: Sequence[Any],
        make_body: Callable[[Sequence[Any]], dict[str, Any]],
        reply_model: type[Any],
        check: Callable[[Sequence[Any], Any], str | None],
        deadline_ts: float | None,
    ) -> list[BatchResult]:
        if not is_valid_checkpoint_id(checkpoint_id):
            raise ValueError(f"invalid checkpoint id {checkpoint_id!r}")
        iid = inst.instance_id
        results: list[BatchResult] = []
        open_id = self._open.get(iid)
        for start in range(0, len(items), MAX_BATCH):
            batch = items[start : start + MAX_BATCH]
            failure: GymControlError | None = None
            ok: list[str] = []
            if open_id is not None and open_id != checkpoint_id:
                # Participants refuse retire and forget while a checkpoint is open; sending would
                # only earn invalid_phase. The batch stays queued for after the resume.
                failure = GymControlError(
                    FailureClass.UNAVAILABLE,
                    f"{op} on {iid} deferred: checkpoint {open_id} is open",
                    instances={iid: {INSTANCE_WIDE: server_failure(FailureClass.UNAVAILABLE, op, f"checkpoint {open_id} open")}},
                )
            else:
                parts: dict[str, ServerFailure] = {}
                for stage in callers_first(inst):
                    deadline = deadline_ts if deadline_ts is not None else self.clock.time() + self.control_timeout_s
                    body = encode_body({"checkpoint_id": checkpoint_id, "deadline_ts": deadline, **make_body(batch)})
                    replies = await asyncio.gather(
                        *(_catch(self._channel.post(self._target(inst, p), op, body, deadline, reply_model)) for p in stage)
                    )
                    # Continue through every stage on failure: a callee still frees what it can.
                    for p, reply in zip(stage, replies):
                        if isinstance(reply, CallFailed):
                            parts[p.server_name] = reply.part
                            continue
                        problem = check(batch, reply)
                        if problem is not None:
                            parts[p.server_name] = server_failure(FailureClass.PROTOCOL_ERROR, op, problem, http_status=200)
                        else:
                            ok.append(p.server_name)
                if parts:
                    failure = GymControlError.from_parts({iid: parts}, f"{op} batch on {iid} failed: " + _summary({iid: parts}))
            results.append(
                BatchResult(
                    instance_id=iid,
                    op=op,
                    checkpoint_id=checkpoint_id,
                    episodes=tuple(batch) if op == "retire" else (),
                    rollout_ids=tuple(batch) if op == "forget" else (),
                    servers_ok=tuple(sorted(ok)),
                    failure=failure,
                )
            )
        return results

    # --- helpers -------------------------------------------------------------------------------

    @staticmethod
    def _target(inst: InstanceTopology, p: Participant) -> Target:
        return Target(inst.instance_id, p.server_name, p.base_url, inst.spec.token, p.kind)


# --- module helpers ------------------------------------------------------------------------------


@dataclass(slots=True)
class _PrepareOutcome:
    restarts: set[Episode] = field(default_factory=set)
    failures: dict[str, ServerFailure] = field(default_factory=dict)
    deadlines: dict[str, float] = field(default_factory=dict)


async def _catch(aw: Awaitable[T]) -> T | CallFailed | GymControlError:
    """Fan-out helper: a failed call becomes a value, so one failure never cancels its siblings."""
    try:
        return await aw
    except (CallFailed, GymControlError) as exc:
        return exc


def _lease_lost_if_stale(part: ServerFailure) -> ServerFailure:
    if part.get("code") == "stale_checkpoint":
        # Section 6: the participant already ended this checkpoint, so work moved past the cut.
        return {**part, "class": str(FailureClass.LEASE_LOST), "transient": True}
    return part


_STOP_WORD = re.compile(r"\bstop\b")


def _refuses_stop(part: ServerFailure) -> bool:
    """A 422 whose validation detail names the field ``stop`` (section 13 P4)."""
    if part.get("http_status") != 422:
        return False
    detail = part.get("detail") or ""
    try:
        errors = json.loads(detail)
    except ValueError:
        return bool(_STOP_WORD.search(detail))
    if isinstance(errors, list):
        return any(isinstance(e, dict) and "stop" in (e.get("loc") or ()) for e in errors)
    return bool(_STOP_WORD.search(detail))


def _make_dirs(paths: Iterable[str]) -> None:
    for path in paths:
        os.makedirs(path, exist_ok=True)


def callers_first(inst: InstanceTopology) -> list[list[Participant]]:
    """Retire and forget order: environment, then agent, then model and resources together.

    Public so that a durable outbox can record its progress stage by stage.
    """
    order = {ENVIRONMENT: 0, AGENT: 1, MODEL: 2, RESOURCES: 2}
    groups: dict[int, list[Participant]] = {}
    for p in inst.participants:
        groups.setdefault(order[p.kind], []).append(p)
    return [groups[k] for k in sorted(groups)]


def _check_retired(batch: Sequence[Episode], reply: RetireReply) -> str | None:
    expected = {e.capture_key for e in batch}
    got = set(reply.retired)
    if got != expected:
        return (
            f"retired set differs from the request: {len(expected - got)} missing, "
            f"{len(got - expected)} unexpected"
        )
    return None


def _check_forgotten(batch: Sequence[str], reply: ForgetReply) -> str | None:
    unexpected = set(reply.forgotten) - set(batch)
    if unexpected:
        return f"forgot {len(unexpected)} rollout(s) not asked for, e.g. {sorted(unexpected)[:SAMPLE]}"
    return None


def _refused(failure: GymControlError | None) -> bool:
    """A forget refusal in the sense of section 5.8: an HTTP reply, not a lost connection."""
    if failure is None:
        return False
    return any(
        part.get("http_status") is not None and part.get("code") == "checkpoint_error"
        for servers in failure.instances.values()
        for part in servers.values()
    )


def _summary(parts: Mapping[str, Mapping[str, ServerFailure]]) -> str:
    return "; ".join(
        f"{iid}/{server}: {part['op']} {part['class']}: {part['detail']}"
        for iid, servers in sorted(parts.items())
        for server, part in sorted(servers.items())
    )


def _prepare_message(cid: str, failed: Mapping[str, Mapping[str, ServerFailure]]) -> str:
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
        text += "; " + _summary({i: s for i, s in others.items() if s})
    return text


def _sample(items: Iterable[str]) -> list[str]:
    return sorted(items)[:SAMPLE]


def _validate_commit(
    cid: str,
    inst: InstanceTopology,
    directory: str,
    scope: list[Episode],
    restarts: list[Episode],
    replies: Mapping[str, CommitReply | CallFailed],
    sent: Mapping[str, set[str]] | None = None,
) -> InstanceCommit | dict[str, ServerFailure]:
    """Section 5.4 coordinator validation of one instance's commit replies.

    ``scope`` is the instance's effective scope; ``sent`` the scope each server was sent, when
    it differs (a participant committed again with fewer episodes)."""
    failed = {s: r.part for s, r in replies.items() if isinstance(r, CallFailed)}
    if failed:
        return {s: _lease_lost_if_stale(p) for s, p in failed.items()}
    ok: dict[str, CommitReply] = {s: r for s, r in replies.items() if isinstance(r, CommitReply)}
    problems: dict[str, list[str]] = {}
    samples: dict[str, list[str]] = {}

    def refuse(server: str, why: str, sample: Iterable[str] = ()) -> None:
        problems.setdefault(server, []).append(why)
        samples.setdefault(server, []).extend(sample)

    expected = {p.server_name for p in inst.participants}
    if set(ok) != expected:
        refuse(INSTANCE_WIDE, f"replying participants {sorted(ok)} differ from the discovered {sorted(expected)}")
    scope_keys = {ep.capture_key for ep in scope}
    candidate_keys = scope_keys | {ep.capture_key for ep in restarts}
    claims: dict[str, str] = {}
    double: dict[str, set[str]] = {}
    outside: dict[str, set[str]] = {}
    stranded: set[str] = set()
    no_map: list[str] = []
    for p in inst.participants:
        reply = ok.get(p.server_name)
        if reply is None:
            continue
        name = p.server_name
        m = reply.manifest
        if m.kind != p.kind:
            refuse(name, f"manifest kind {m.kind!r}, discovered {p.kind!r}")
        if m.instance != p.participant_name:
            refuse(name, f"manifest participant {m.instance!r}, discovered {p.participant_name!r}")
        if m.checkpoint_id != cid:
            refuse(name, f"manifest of checkpoint {m.checkpoint_id!r}, not {cid!r}")
        exported = set(reply.episode_ids)
        beyond = exported - scope_keys
        sent_keys = (sent or {}).get(name, scope_keys)
        if p.kind == MODEL and exported - sent_keys:
            # Staging keys come from the model: an export outside the scope cannot be told apart
            # from keys of the wrong episodes (section 13 P2 keeps this a protocol error).
            refuse(name, f"exported {len(exported - sent_keys)} episode(s) outside the scope", _sample(exported - sent_keys))
        elif beyond:
            # Published agents and resources export every live session (P2): accepted, not saved.
            outside.setdefault(p.kind, set()).update(beyond)
        if p.kind == AGENT:
            if reply.run_episode_ids is None:
                # Published Gym (P1): every agent session is a /run session, since environment
                # participants are refused at discovery; E is its export inside the scope.
                run = exported & scope_keys
                stranded |= beyond - candidate_keys
            else:
                run = set(reply.run_episode_ids)
                not_exported = run - exported
                if not_exported:
                    refuse(name, f"{len(not_exported)} run_episode_ids not among its episode_ids", _sample(not_exported))
                claimed_beyond = run - scope_keys
                if claimed_beyond:
                    refuse(name, f"{len(claimed_beyond)} run_episode_ids outside the scope", _sample(claimed_beyond))
                native = (exported & scope_keys) - run
                if native:
                    # Native sessions: nothing here can drive them after a restore.
                    refuse(name, f"stranded sessions: {len(native)} exported episode(s) outside run_episode_ids", _sample(native))
            for key in run & scope_keys:
                owner = claims.setdefault(key, name)
                if owner != name:
                    double.setdefault(key, {owner}).add(name)
        elif p.kind == MODEL:
            if reply.staging_keys is None:
                refuse(name, "model commit reply lacks staging_keys")
                continue
            by_ep = reply.staging_keys_by_episode
            if by_ep is None:
                # An older published model (no per-episode map): every key it lists is kept,
                # which is safe (keys of drained episodes are kept too), only larger.
                no_map.append(name)
                continue
            covered = {k for keys in by_ep.values() for k in keys}
            declared = set(reply.staging_keys)
            if covered != declared:
                refuse(
                    name,
                    f"staging keys mismatch: {len(declared - covered)} in staging_keys only, "
                    f"{len(covered - declared)} in staging_keys_by_episode only",
                    _sample(declared ^ covered),
                )
            foreign = set(by_ep) - sent_keys
            if foreign:
                refuse(name, f"staging_keys_by_episode names {len(foreign)} episode(s) outside the scope", _sample(foreign))
    if double:
        servers = sorted({s for owners in double.values() for s in owners})
        for server in servers:
            keys = [k for k, owners in double.items() if server in owners]
            refuse(server, f"{len(keys)} /run episode(s) claimed by more than one agent ({', '.join(servers)})", _sample(keys))
    if problems:
        return {
            server: server_failure(
                FailureClass.PROTOCOL_ERROR,
                "commit",
                "; ".join(whys),
                http_status=200 if server != INSTANCE_WIDE else None,
                samples=sorted(set(samples.get(server, [])))[:SAMPLE],
            )
            for server, whys in problems.items()
        }
    episodes_keys = set(claims)
    staging: set[str] = set()
    for p in inst.participants:
        if p.kind == MODEL:
            reply = ok[p.server_name]
            if reply.staging_keys_by_episode is None:
                staging.update(reply.staging_keys or ())
                continue
            for key in episodes_keys:
                staging.update(reply.staging_keys_by_episode.get(key, ()))
    episodes = sorted(Episode.from_capture_key(k) for k in episodes_keys)
    exported_set = set(episodes)
    if stranded:
        log.warning(
            "%s: %d agent export(s) of checkpoint %s are no dispatched attempt on this instance "
            "(stranded, left out of the snapshot), e.g. %s",
            inst.instance_id, len(stranded), cid, ", ".join(_sample(stranded)),
        )
    if no_map:
        log.info(
            "%s: model %s sent no staging_keys_by_episode; all of its staging keys are kept",
            inst.instance_id, ", ".join(no_map),
        )
    return InstanceCommit(
        instance_id=inst.instance_id,
        checkpoint_dir=directory,
        scope=tuple(scope),
        episodes=tuple(episodes),
        restarts=tuple(restarts),
        staging_keys=tuple(sorted(staging)),
        participants=tuple(sorted(ok)),
        pending=tuple(ep for ep in scope if ep not in exported_set),
        manifests={s: r.manifest.model_dump() for s, r in ok.items()},
        outside_scope={kind: len(keys) for kind, keys in sorted(outside.items())},
        stranded=len(stranded),
    )


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
        """Read what restore needs from an already validated Gym manifest v2.

        The loader (domain) owns validation; this only refuses a shape it cannot use, so a
        caller that skipped the loader still cannot restore from nonsense.
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
        return {
            iid: sorted({e.rollout_id for e in p.episodes})
            for iid, p in sorted(self.instances.items())
        }


def _validate_restore(
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
            problems.append(
                f"state from the wrong checkpoint: {reply.source_checkpoint_id!r}, expected {plan.source_id!r}"
            )
        got = set(reply.restored)
        unexpected = got - expected
        if unexpected:
            problems.append(f"{len(unexpected)} restored key(s) are not the N+1 of a saved episode, e.g. {_sample(unexpected)}")
        seen |= got
        if problems:
            parts[server] = server_failure(FailureClass.PROTOCOL_ERROR, "restore", "; ".join(problems), http_status=200)
    if not parts:
        never = expected - seen
        if never:
            parts[INSTANCE_WIDE] = server_failure(
                FailureClass.PROTOCOL_ERROR,
                "restore",
                f"{len(never)} saved episode(s) restored by no participant",
                samples=_sample(never),
            )
    return parts
