"""The coordinator's validation of one instance's commit replies (docs/gym-protocol.md#commit;
rules P1, P2 and P8 of docs/gym-protocol.md#what-differs-rule-by-rule).

Pure: it turns the replies into the instance's saved episodes ``E``, their staging keys and the
drain set, or into the ``protocol_error`` parts that name each offending server.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping

from ..domain.vocabulary import GymOperation
from .channel import CallFailed
from .errors import (
    INSTANCE_WIDE,
    SAMPLE,
    FailureClass,
    ServerFailure,
    sample,
    server_failure,
)
from .models import AGENT, MODEL, CommitReply, Episode, InstanceTopology, Participant
from .renew import lease_lost_if_stale
from .results import InstanceCommit

__all__ = ["validate_commit"]

log = logging.getLogger("checkpoint_coordinator.gym")


def validate_commit(
    cid: str,
    inst: InstanceTopology,
    directory: str,
    scope: list[Episode],
    restarts: list[Episode],
    replies: Mapping[str, CommitReply | CallFailed],
    sent: Mapping[str, set[str]] | None = None,
) -> InstanceCommit | dict[str, ServerFailure]:
    """``scope`` is the instance's effective scope; ``sent`` the scope each server was sent,
    when it differs (a participant committed again with fewer episodes)."""
    failed = {s: r.part for s, r in replies.items() if isinstance(r, CallFailed)}
    if failed:
        return {s: lease_lost_if_stale(p) for s, p in failed.items()}
    ok = {s: r for s, r in replies.items() if isinstance(r, CommitReply)}
    check = _Check(cid, scope, restarts, sent or {})
    expected = {p.server_name for p in inst.participants}
    if set(ok) != expected:
        check.refuse(INSTANCE_WIDE, f"replying participants {sorted(ok)} differ from the discovered {sorted(expected)}")
    for p in inst.participants:
        reply = ok.get(p.server_name)
        if reply is not None:
            check.participant(p, reply)
    check.double_claims()
    if check.problems:
        return check.failure_parts()
    return check.result(inst, directory, ok)


class _Check:
    def __init__(self, cid: str, scope: list[Episode], restarts: list[Episode], sent: Mapping[str, set[str]]) -> None:
        self.cid = cid
        self.scope = scope
        self.restarts = restarts
        self.sent = sent
        # Each scope episode by its capture key, in the scope's order.
        self.scope_by_key = {ep.capture_key: ep for ep in scope}
        self.scope_keys = self.scope_by_key.keys()
        self.candidate_keys = self.scope_keys | {ep.capture_key for ep in restarts}
        self.problems: dict[str, list[str]] = {}
        self.samples: dict[str, list[str]] = {}
        # capture key of a /run episode (in the scope or not) -> the agent that claimed it first.
        self.claims: dict[str, str] = {}
        self.double: dict[str, set[str]] = {}
        # Exports outside the scope, per kind of the exporter: accepted, not saved.
        self.outside: dict[str, set[str]] = {}
        self.stranded: set[str] = set()
        # Models that sent no per-episode map of their staging keys.
        self.no_map: list[str] = []

    def refuse(self, server: str, why: str, samples: Iterable[str] = ()) -> None:
        self.problems.setdefault(server, []).append(why)
        self.samples.setdefault(server, []).extend(samples)

    def participant(self, p: Participant, reply: CommitReply) -> None:
        name = p.server_name
        m = reply.manifest
        if m.kind != p.kind:
            self.refuse(name, f"manifest kind {m.kind!r}, discovered {p.kind!r}")
        if m.instance != p.participant_name:
            self.refuse(name, f"manifest participant {m.instance!r}, discovered {p.participant_name!r}")
        if m.checkpoint_id != self.cid:
            self.refuse(name, f"manifest of checkpoint {m.checkpoint_id!r}, not {self.cid!r}")
        exported = set(reply.episode_ids)
        beyond = exported - self.scope_keys
        sent_keys = self.sent.get(name, self.scope_keys)
        if p.kind == MODEL and exported - sent_keys:
            # Staging keys come from the model: an export outside the scope cannot be told apart
            # from keys of the wrong episodes, so it stays a protocol error (P2).
            foreign = exported - sent_keys
            self.refuse(name, f"exported {len(foreign)} episode(s) outside the scope", sample(foreign))
        elif beyond:
            # Published agents and resources export every live session: accepted, not saved.
            self.outside.setdefault(p.kind, set()).update(beyond)
        if p.kind == AGENT:
            self.agent(name, reply, exported, beyond)
        elif p.kind == MODEL:
            self.model(name, reply, sent_keys)

    def agent(self, name: str, reply: CommitReply, exported: set[str], beyond: set[str]) -> None:
        if reply.run_episode_ids is None:
            # Published Gym (P1): every agent session is a /run session, since environment
            # participants are refused at discovery; E is its export inside the scope.
            run = exported & self.scope_keys
            self.stranded |= beyond - self.candidate_keys
        else:
            run = set(reply.run_episode_ids)
            not_exported = run - exported
            if not_exported:
                self.refuse(name, f"{len(not_exported)} run_episode_ids not among its episode_ids", sample(not_exported))
            # Those outside the scope (P8: an agent that exports every live session
            # names its /run sessions among all of them) are exports outside the scope: already
            # counted in ``outside`` above, never saved.
            native = (exported & self.scope_keys) - run
            if native:
                # Native sessions: nothing here can drive them after a restore.
                self.refuse(
                    name, f"stranded sessions: {len(native)} exported episode(s) outside run_episode_ids", sample(native)
                )
        # A /run session has one driver, in the scope or not: two agents claiming it is a broken
        # deployment. E is the claims in the scope.
        for key in run:
            owner = self.claims.setdefault(key, name)
            if owner != name:
                self.double.setdefault(key, {owner}).add(name)

    def model(self, name: str, reply: CommitReply, sent_keys: set[str]) -> None:
        if reply.staging_keys is None:
            self.refuse(name, "model commit reply lacks staging_keys")
            return
        by_ep = reply.staging_keys_by_episode
        if by_ep is None:
            # An older published model: every key it lists is kept, which is safe (keys of
            # drained episodes are kept too), only larger.
            self.no_map.append(name)
            return
        covered = {k for keys in by_ep.values() for k in keys}
        declared = set(reply.staging_keys)
        if covered != declared:
            self.refuse(
                name,
                f"staging keys mismatch: {len(declared - covered)} in staging_keys only, "
                f"{len(covered - declared)} in staging_keys_by_episode only",
                sample(declared ^ covered),
            )
        foreign = set(by_ep) - sent_keys
        if foreign:
            self.refuse(name, f"staging_keys_by_episode names {len(foreign)} episode(s) outside the scope", sample(foreign))

    def double_claims(self) -> None:
        if not self.double:
            return
        servers = sorted({s for owners in self.double.values() for s in owners})
        for server in servers:
            keys = [k for k, owners in self.double.items() if server in owners]
            self.refuse(server, f"{len(keys)} /run episode(s) claimed by more than one agent ({', '.join(servers)})", sample(keys))

    def failure_parts(self) -> dict[str, ServerFailure]:
        return {
            server: server_failure(
                FailureClass.PROTOCOL_ERROR,
                GymOperation.commit,
                "; ".join(whys),
                http_status=200 if server != INSTANCE_WIDE else None,
                samples=sorted(set(self.samples.get(server, [])))[:SAMPLE],
            )
            for server, whys in self.problems.items()
        }

    def result(self, inst: InstanceTopology, directory: str, ok: Mapping[str, CommitReply]) -> InstanceCommit:
        saved_keys = self.claims.keys() & self.scope_keys
        staging: set[str] = set()
        for p in inst.participants:
            if p.kind != MODEL:
                continue
            reply = ok[p.server_name]
            if reply.staging_keys_by_episode is None:
                staging.update(reply.staging_keys or ())
                continue
            for key in saved_keys:
                staging.update(reply.staging_keys_by_episode.get(key, ()))
        # Saved keys are scope keys: their episodes come from the scope, not parsed again.
        episodes = [ep for k, ep in self.scope_by_key.items() if k in saved_keys]
        episodes.sort()  # the scope comes sorted: one pass
        saved = set(episodes)
        if self.stranded:
            log.warning(
                "%s: %d agent export(s) of checkpoint %s are no dispatched attempt on this instance "
                "(stranded, left out of the snapshot), e.g. %s",
                inst.instance_id, len(self.stranded), self.cid, ", ".join(sample(self.stranded)),
            )
        if self.no_map:
            log.info(
                "%s: model %s sent no staging_keys_by_episode; all of its staging keys are kept",
                inst.instance_id, ", ".join(self.no_map),
            )
        return InstanceCommit(
            instance_id=inst.instance_id,
            checkpoint_dir=directory,
            scope=tuple(self.scope),
            episodes=tuple(episodes),
            restarts=tuple(self.restarts),
            staging_keys=tuple(sorted(staging)),
            participants=tuple(sorted(ok)),
            pending=tuple(ep for ep in self.scope if ep not in saved),
            manifests={s: r.manifest.model_dump() for s, r in ok.items()},
            outside_scope={kind: len(keys) for kind, keys in sorted(self.outside.items())},
            stranded=len(self.stranded),
        )
