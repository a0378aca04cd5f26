"""The Gym side of a restore with Gym state: the checks before Gym is touched (the registered
instances are the manifest's, discovery succeeds, every participant that committed is live, every
server is fresh), the all-or-nothing Gym restore, and what a Gym restore that failed after its
first call leaves of the plan. Kept apart from the ledger side of the restore (``service``)."""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

import httpx
from sqlalchemy.ext.asyncio import AsyncEngine

from ..domain.errors import TopologyMismatch
from ..domain.gym_manifest import GymManifest, dump_gym_manifest
from ..domain.restore_plan import Disposition, RestorePlan, RetireItem, demote_continuations
from ..domain.restore_topology import (
    compare_instance_sets,
    only_continued,
    remap_manifest,
    require_restorable_topology,
)
from ..domain.vocabulary import GymOperation
from ..errors import CoordinatorError
from ..gym.errors import GymControlError
from ..gym.models import InstanceSpec, InstanceTopology, parse_capture_key
from ..gym.results import RestoreResult
from .errors import GymFailure, GymNotFresh, SnapshotUnusable, TopologyDiffers
from .gym_access import make_client, probe_freshness, registered_specs
from .plan_loading import Planned
from .planning import rollout_minter
from .request import RestoreRequest

log = logging.getLogger("checkpoint_coordinator.restore")


class _Refusal(Exception):
    """Carries the refusal a restore answers (``error``) out of the Gym steps."""

    def __init__(self, error: CoordinatorError) -> None:
        super().__init__(str(error))
        self.error = error


class BeforeGym(_Refusal):
    """Wraps a refusal raised before any Gym state changed: the claim is released."""


class GymTouchedRefusal(_Refusal):
    """Wraps a refusal raised after Gym was touched (and cleaned up): the restore id keeps it."""


async def gym_restore(
    engine: AsyncEngine,
    run_id: str,
    req: RestoreRequest,
    p: Planned,
    transport: httpx.AsyncBaseTransport | None,
    gym: dict[str, Any],
) -> tuple[Any, RestoreResult | None, dict[str, Any], RestorePlan, list[RetireItem]]:
    assert p.manifest is not None
    manifest, saved_of, specs, issued = await _target_instances(engine, run_id, p)
    _require_registered_instances(manifest, specs)
    if not p.snap.snapshot_dir or not p.snap.snapshot_dir.startswith("/"):
        raise BeforeGym(
            SnapshotUnusable(f"snapshot {p.snap.snapshot_id!r} has a Gym manifest but no absolute snapshot_dir", code="snapshot_dir_missing")
        )
    client = make_client(p.cfg, transport=transport, issued=issued, run_id=run_id)
    try:
        try:
            live = await client.discover_all(specs, log_warnings=False)
        except GymControlError as exc:
            raise BeforeGym(GymFailure.of(exc, "Gym discovery before restore", {sp.instance_id: sp.servers for sp in specs})) from None
        try:
            require_restorable_topology(manifest, {iid: [x.server_name for x in t.participants] for iid, t in live.items()})
        except TopologyMismatch as e:
            raise BeforeGym(_participants_missing(e, manifest, live, saved_of)) from None
        stale = await probe_freshness(live, timeout_s=p.cfg.control_timeout_s, transport=transport)
        if stale:
            raise BeforeGym(not_fresh(stale))
        try:
            result = await client.restore(
                dump_gym_manifest(manifest), live, p.snap.snapshot_dir, resume=False, instance_dirs=saved_of or None
            )
        except GymControlError as exc:
            if "restore_id" not in exc.extra:
                # Refused before any restore call (re-discovery, topology, a busy participant).
                raise BeforeGym(GymFailure.of(exc, "Gym restore", {sp.instance_id: sp.servers for sp in specs})) from None
            return client, None, *after_failed_gym_restore(engine, run_id, req, p, gym, exc)
    except BaseException:
        await client.aclose()
        raise
    gym.update(installed=True, reason=None, restore_id=result.restore_id, source_checkpoint_id=result.source_checkpoint_id)
    return client, result, gym, p.plan, []


async def _target_instances(
    engine: AsyncEngine, run_id: str, p: Planned
) -> tuple[GymManifest, dict[str, str], list[InstanceSpec], frozenset[str]]:
    """The manifest to install, ``{live: saved}`` instance of an instance map, the registered
    instances that take Gym state, and the Gym ids the coordinator issued."""
    assert p.manifest is not None
    # Under an instance map each mapped live instance takes its saved instance's state, read from
    # the saved instance's directory; the other live instances start empty.
    saved_of: dict[str, str] = {}
    manifest = p.manifest
    async with engine.connect() as conn:
        specs, issued = await registered_specs(conn, run_id)
    if p.instance_map is not None:
        manifest = remap_manifest(manifest, p.instance_map)
        saved_of = {live: saved for saved, live in p.instance_map.items()}
        specs = [x for x in specs if x.instance_id in saved_of]
    # A saved episode the plan restarts (too_stale) is not installed: it starts over under a new
    # rollout id, and nothing of its old one may run on Gym (docs/ledger.md#stale-continuations).
    manifest = only_continued(manifest, p.plan.rows.columns(Disposition.continued).rollout_id)
    return manifest, saved_of, specs, issued


def _require_registered_instances(manifest: GymManifest, specs: list[InstanceSpec]) -> None:
    diff = compare_instance_sets(manifest, (s.instance_id for s in specs))
    if not diff.equal:
        raise BeforeGym(
            TopologyDiffers(
                "registered Gym instances differ from the snapshot's: "
                + "; ".join(
                    x
                    for x in (
                        f"missing (in the snapshot, not registered): {', '.join(diff.missing)}" if diff.missing else "",
                        f"unknown (registered, not in the snapshot): {', '.join(diff.unknown)}" if diff.unknown else "",
                    )
                    if x
                ),
                missing_instances=list(diff.missing),
                unknown_instances=list(diff.unknown),
            )
        )


def _participants_missing(
    e: TopologyMismatch, manifest: GymManifest, live: Mapping[str, InstanceTopology], saved_of: Mapping[str, str]
) -> TopologyDiffers:
    """The refusal of a restore whose manifest names participants that are not live."""
    missing = {
        iid: names
        for iid, names in (
            (iid, sorted(set(inst.participants) - {x.server_name for x in live[iid].participants}))
            for iid, inst in manifest.instances.items()
        )
        if names
    }
    detail = "; ".join(str(i) for i in e.issues)
    if saved_of:
        detail = "; ".join(
            f"participants of saved instance {saved_of[iid]} are not live on its mapped instance {iid}: {', '.join(names)}"
            for iid, names in sorted(missing.items())
        ) or detail
    return TopologyDiffers(
        detail,
        code="gym_participants_missing",
        missing_participants=missing,
        **({"saved_instances": {iid: saved_of[iid] for iid in missing}} if saved_of else {}),
        errors=[{"field": i.path or "instances", "message": i.message} for i in e.issues],
    )

def not_fresh(stale: dict[str, dict[str, list[str]]]) -> GymNotFresh:
    named = sorted(f"{iid}/{srv}" for iid, servers in stale.items() for srv in servers)
    return GymNotFresh(
        "Gym restores only into freshly started servers; these have served work: "
        + "; ".join(f"{iid}/{srv}: {', '.join(signs)}" for iid, servers in sorted(stale.items()) for srv, signs in sorted(servers.items()))
        + ". Restart them, or restore with with_gym_state false",
        instances=sorted(stale),
        servers=named,
    )


def _is_not_fresh_refusal(exc: GymControlError) -> dict[str, dict[str, list[str]]]:
    """Servers that refused the restore as not fresh (409 ``checkpoint_error``,
    docs/gym-protocol.md#restore)."""
    out: dict[str, dict[str, list[str]]] = {}
    for iid, servers in exc.instances.items():
        for srv, part in servers.items():
            if part.get("op") == GymOperation.restore and part.get("http_status") == 409 and part.get("code") == "checkpoint_error":
                out.setdefault(iid, {})[srv] = [str(part.get("detail", "not fresh"))[:300]]
    return out


def after_failed_gym_restore(
    engine: AsyncEngine, run_id: str, req: RestoreRequest, p: Planned, gym: dict[str, Any], exc: GymControlError
) -> tuple[dict[str, Any], RestorePlan, list[RetireItem]]:
    """Gym restore failed after its first call; the client already retired N+1 of every saved
    episode everywhere and resumed, so those continuations can no longer run. Servers that
    refused as not fresh make the restore refuse (the ledger is left as it is); any other
    failure turns every continuation into a restart."""
    gym.update(
        installed=False,
        reason="the Gym restore failed; its cleanup retired every continuation",
        restore_id=exc.extra.get("restore_id"),
        failure=exc.to_dict(),
        continuations_retired=True,
        # The cleanup resumed every instance (docs/gym-protocol.md#restore): what that resume did.
        resume=exc.extra.get("resume"),
    )
    stale = _is_not_fresh_refusal(exc)
    if stale:
        problem = not_fresh(stale)
        problem.extra["gym"] = gym
        problem.detail += (
            " (the Gym restore was attempted and cleaned up; restart every instance before restoring with Gym state again)"
        )
        raise GymTouchedRefusal(problem)
    log.warning("run %s restore %s: Gym restore failed, continuations restart: %s", run_id, req.restore_id, exc)
    demoted = demote_continuations(p.plan, rollout_minter(run_id, p.snap.snapshot_id, p.run.epoch, "demoted"))
    retire = p.retire_candidates()
    by_rollout = {a[3]: a[2] for a in p.cut.attempts}
    for iid, keys in (exc.extra.get("unretired") or {}).items():
        for key in keys:
            rid, n = parse_capture_key(key)
            if rid in by_rollout:
                retire.append(RetireItem(iid, rid, n, by_rollout[rid]))
    return gym, demoted, retire
