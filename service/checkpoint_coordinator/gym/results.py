"""What each control operation hands back to the choreographies. Plain, immutable data."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from .errors import GymControlError
from .models import Episode, InstanceTopology

__all__ = [
    "BatchResult",
    "CommitResult",
    "ForgetSettlement",
    "InstanceCommit",
    "PrepareResult",
    "RenewResult",
    "RestoreCleanup",
    "RestoreResult",
    "ResumeReport",
    "SaveResult",
]


@dataclass(frozen=True, slots=True)
class PrepareResult:
    checkpoint_id: str
    # Per instance, the union of every reply's restarts: a rollout restarts if any part does.
    restarts: Mapping[str, frozenset[Episode]]
    # The deadline_ts each participant was sent, per instance and server. The lease a
    # participant reports afterwards is at least this plus its grace
    # (docs/gym-protocol.md#leases-and-renewals).
    deadlines: Mapping[str, Mapping[str, float]]
    first_sent_at: float
    finished_at: float


@dataclass(frozen=True, slots=True)
class RenewResult:
    checkpoint_id: str
    deadline_ts: float
    # lease_expires_at per instance and server, from the servers that answered.
    leases: Mapping[str, Mapping[str, float]]
    failure: GymControlError | None = None

    @property
    def earliest_expiry(self) -> float | None:
        values = [t for servers in self.leases.values() for t in servers.values()]
        return min(values) if values else None


@dataclass(frozen=True, slots=True)
class InstanceCommit:
    instance_id: str
    checkpoint_dir: str
    scope: tuple[Episode, ...]
    # E (docs/gym-protocol.md#commit): the agents' run_episode_ids, or without them (P1 of
    # docs/gym-protocol.md#what-differs-rule-by-rule) the agents' exports inside the scope; sorted.
    episodes: tuple[Episode, ...]
    restarts: tuple[Episode, ...]
    # Staging keys of E only, sorted and unique.
    staging_keys: tuple[str, ...]
    # Server names of the participants that committed, sorted.
    participants: tuple[str, ...]
    # scope - E: /run replies already on the wire, which the caller must drain.
    pending: tuple[Episode, ...]
    # The participant manifests as replied, per server (plain dicts).
    manifests: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)
    # Exports outside the scope (published Gym's agents and resources export every live session,
    # P2): accepted, left out of E, counted per kind of the exporter.
    outside_scope: Mapping[str, int] = field(default_factory=dict)
    # Agent exports that are no candidate of this instance at all (no dispatched attempt here).
    stranded: int = 0
    # Whether every participant took the commit's ``stop``; None when no stop was asked for.
    stop_supported: bool | None = None
    # This instance's entry of the Gym manifest in its text form (``manifest.encode_instance_entry``),
    # encoded by the commit once the instance is validated; empty when not encoded yet.
    # Not compared nor shown: it is derived from the fields above (hundreds of kilobytes).
    manifest_entry: str = field(default="", compare=False, repr=False)

    @property
    def exported_outside_scope(self) -> int:
        return sum(self.outside_scope.values())

    def figures(self) -> dict[str, Any]:
        """The per-instance Gym figures a snapshot keeps for operators (docs/ledger.md#snapshot-history)."""
        out: dict[str, Any] = {
            "participants": len(self.participants),
            "scope": len(self.scope),
            "exported": len(self.episodes),
            "exported_outside_scope": self.exported_outside_scope,
            "restarts": len(self.restarts),
            "staging_keys": len(self.staging_keys),
            "drained": len(self.pending),
        }
        if self.stranded:
            out["stranded"] = self.stranded
        if self.stop_supported is not None:
            out["stop_supported"] = self.stop_supported
        return out


@dataclass(frozen=True, slots=True)
class CommitResult:
    checkpoint_id: str
    instances: Mapping[str, InstanceCommit]

    def pending(self) -> dict[str, set[Episode]]:
        return {iid: set(ic.pending) for iid, ic in self.instances.items()}


@dataclass(frozen=True, slots=True)
class ResumeReport:
    checkpoint_id: str
    failure: GymControlError | None
    answered_at: float
    # Per instance and server, the idempotent flag of its first answer (servers that answered):
    # true when the checkpoint had already ended there (a lapsed lease, or a resume before).
    idempotent: Mapping[str, Mapping[str, bool]] = field(default_factory=dict)
    rounds: int = 1

    @property
    def ok(self) -> bool:
        return self.failure is None

    def raise_for_failure(self) -> None:
        if self.failure is not None:
            raise self.failure

    def summary(self) -> dict[str, Any]:
        """Plain data for an answer: whether every participant resumed, and the failure if not."""
        return {"ok": self.ok, "failure": self.failure.to_dict() if self.failure is not None else None}


@dataclass(frozen=True, slots=True)
class RestoreResult:
    restore_id: str
    source_checkpoint_id: str
    # Per instance, the N+1 attempts the caller dispatches on that same instance.
    continued: Mapping[str, tuple[Episode, ...]]
    # Per instance, the manifest's restarts, which start over from their tasks.
    restarts: Mapping[str, tuple[Episode, ...]]
    topology: Mapping[str, InstanceTopology]
    resume: ResumeReport | None = None


@dataclass(frozen=True, slots=True)
class BatchResult:
    """One retire or forget batch on one instance, for a durable outbox to keep or drop."""

    instance_id: str
    op: str
    checkpoint_id: str
    episodes: tuple[Episode, ...] = ()
    rollout_ids: tuple[str, ...] = ()
    servers_ok: tuple[str, ...] = ()
    failure: GymControlError | None = None

    @property
    def ok(self) -> bool:
        return self.failure is None


@dataclass(frozen=True, slots=True)
class ForgetSettlement:
    """Outcome of forget with its refusal rule (re-retire, then forget again;
    docs/gym-protocol.md#forget)."""

    instance_id: str
    forgotten: tuple[str, ...]
    # What must stay queued because even the second round failed.
    owed_retires: tuple[Episode, ...]
    owed_forgets: tuple[str, ...]
    batches: tuple[BatchResult, ...]


@dataclass(frozen=True, slots=True)
class SaveResult:
    checkpoint_id: str
    commit: CommitResult
    restarts: Mapping[str, frozenset[Episode]]
    # None when no resume was sent (a stopping snapshot that every instance honoured).
    resume: ResumeReport | None
    timings: Mapping[str, float]
    gym_parked_seconds: float | None
    warnings: tuple[str, ...] = ()
    # Per instance, the participants whose lease lapsed after the instance committed: Gym
    # resumed them on its own (a stop was not honoured there).
    lapsed: Mapping[str, tuple[str, ...]] = field(default_factory=dict)

    @property
    def stop_honoured(self) -> dict[str, bool]:
        """Per instance, whether it was left parked as a stopping save asked (an instance that
        refused ``stop``, or whose lease lapsed, was not); empty without a stop."""
        return {
            iid: bool(ic.stop_supported) and iid not in self.lapsed
            for iid, ic in sorted(self.commit.instances.items())
            if ic.stop_supported is not None
        }

    @property
    def gym_restarted_episodes(self) -> int:
        return sum(len(r) for r in self.restarts.values())

    @property
    def manifest(self) -> dict[str, Any]:
        """The Gym manifest of the commit as a plain dict, built on each access (the pending
        snapshot stores the manifest's text and never needs this)."""
        from .manifest import build_gym_manifest  # that module imports this one

        return build_gym_manifest(self.checkpoint_id, self.commit)


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
