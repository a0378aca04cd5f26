"""Loading a snapshot and planning its restore (``GET /restore-plan`` and the first step of
``POST /restores``): kept apart from the restore's execution because both endpoints plan the same
way, and a snapshot, cut or manifest that cannot be restored is refused here with errors that
name what is wrong.

The dispositions are computed in the ledger (``plan_sql.plan_in_sql``, set-based); only the rows
that are sent reach Python, where new rollout ids are minted (``domain.restore_plan``)."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from sqlalchemy.ext.asyncio import AsyncEngine

from ..domain.config import RecoveryConfig
from ..domain.cut import Cut
from ..domain.cut_checks import cut_issues, manifest_disagreements
from ..domain.errors import (
    CutError,
    FieldIssue,
    ManifestError,
    ManifestLedgerMismatch,
    PlanError,
)
from ..domain.gym_manifest import GymManifest, load_gym_manifest
from ..domain.restore_plan import (
    Disposition,
    Placement,
    RestorePlan,
    RetireItem,
    assemble_plan,
    oldest_continuable_version,
)
from ..domain.restore_topology import instance_map_pairs, unknown_in_map
from ..errors import Conflict, CoordinatorError
from ..ledger.runs import RunRow, get_run
from ..recovery_config import domain_problem
from .errors import (
    InstanceMapInvalid,
    InstanceMapUnknown,
    ManifestDisagrees,
    NoCompatibleSnapshot,
    SnapshotNotFound,
    SnapshotUnusable,
)
from .gym_access import registered_instance_ids
from .planning import counts_json, live_retire_items, rollout_minter, row_json
from .registration import run_config
from .store import plan_sql, reads


async def resolve_snapshot(conn: Any, run_id: str, snapshot_id: str | None, step: int | None) -> reads.RestorableSnapshot:
    if snapshot_id is not None:
        snap = await reads.get_snapshot(conn, run_id, snapshot_id)
        if snap is None:
            raise SnapshotNotFound(f"snapshot {snapshot_id!r} not found in run {run_id!r}", snapshot_id=snapshot_id)
        if snap.outcome != "published":
            raise SnapshotUnusable(
                f"snapshot {snapshot_id!r} is {snap.outcome or 'in phase ' + snap.phase}, not published; only a published "
                "snapshot can be restored",
                code="snapshot_not_published",
                snapshot_id=snapshot_id,
            )
        if step is not None and snap.anchor_step > step:
            raise SnapshotUnusable(
                f"snapshot {snapshot_id!r} is anchored on step {snap.anchor_step}, after the trainer's step {step}",
                code="snapshot_after_step",
                snapshot_id=snapshot_id,
            )
        return snap
    snap = await reads.newest_published(conn, run_id, step)
    if snap is None:
        where = f" anchored at or before step {step}" if step is not None else ""
        raise NoCompatibleSnapshot(f"run {run_id!r} has no published snapshot{where}", step=step)
    return snap


def load_manifest(snap: reads.RestorableSnapshot) -> GymManifest | None:
    if snap.gym_manifest is None:
        return None
    try:
        manifest = load_gym_manifest(snap.gym_manifest)
    except ManifestError as e:
        raise domain_problem(e, prefix="gym_manifest", error=SnapshotUnusable) from e
    if snap.gym_checkpoint_id is not None and manifest.checkpoint_id != snap.gym_checkpoint_id:
        raise SnapshotUnusable(
            f"snapshot {snap.snapshot_id!r}: its Gym manifest is of checkpoint {manifest.checkpoint_id!r}, the snapshot "
            f"recorded {snap.gym_checkpoint_id!r}",
            code="gym_manifest_mismatch",
        )
    return manifest


@dataclass
class Planned:
    run: RunRow
    cfg: RecoveryConfig
    snap: reads.RestorableSnapshot
    cut: Cut
    manifest: GymManifest | None
    plan: RestorePlan
    # Gym state will be installed (with_gym_state and the snapshot has a Gym manifest).
    install: bool
    # Why no Gym state is installed, when none is.
    no_gym_reason: str | None
    retire: list[RetireItem]
    # The snapshot of the discarded lineage this restore aborted, if one was open
    # (docs/ledger.md#the-discarded-lineage).
    aborted_snapshot: str | None = None
    # {saved instance: live instance} of a restore into another topology
    # (docs/ledger.md#another-gym-topology).
    instance_map: dict[str, str] | None = None

    def retire_candidates(self) -> list[RetireItem]:
        """The attempts of live groups the cut knows as possibly running in Gym
        (docs/ledger.md#without-gym-state): every such attempt is one of the rows the plan carries
        in ``cut``."""
        return live_retire_items(self.cut.attempts)


def unplannable(cut: Cut, manifest: GymManifest | None, snapshot_id: str) -> CoordinatorError:
    """The refusal of a cut the planner finds broken or a manifest that disagrees with it,
    naming what is wrong."""
    issues = cut_issues(cut)
    if issues:
        return domain_problem(CutError(issues), prefix="cut", error=SnapshotUnusable)
    bad = manifest_disagreements(manifest, cut) if manifest is not None else {}
    if bad:
        return refusal_of(
            ManifestLedgerMismatch(
                [FieldIssue(("instances", iid), "; ".join(reasons)) for iid, reasons in sorted(bad.items())], instance_ids=sorted(bad)
            ),
            snapshot_id,
        )
    return SnapshotUnusable(
        f"the ledger cut of snapshot {snapshot_id!r} breaks an invariant of the restore plan", code="cut_invalid"
    )


def refusal_of(e: CutError | ManifestLedgerMismatch | PlanError, snapshot_id: str) -> CoordinatorError:
    """The API's refusal of a plan the domain refused."""
    if isinstance(e, ManifestLedgerMismatch):
        return ManifestDisagrees(
            f"the Gym manifest of snapshot {snapshot_id!r} disagrees with its ledger cut on instance(s) "
            f"{', '.join(e.instance_ids) or '?'}: " + "; ".join(i.message for i in e.issues[:10]),
            instances=list(e.instance_ids),
            errors=[{"field": f"gym_manifest.{i.path}", "message": i.message} for i in e.issues],
        )
    if isinstance(e, CutError):
        return domain_problem(e, prefix="cut", error=SnapshotUnusable)
    return domain_problem(e, prefix="cut", error=Conflict)


async def load_and_plan(
    engine: AsyncEngine,
    run_id: str,
    *,
    snapshot_id: str | None,
    step: int | None,
    with_gym_state: bool,
    include_reused: bool = False,
    instance_map: Mapping[str, str] | None = None,
) -> Planned:
    """The plan of a restore, computed in the ledger (``plan_sql.plan_in_sql``, set-based);
    ``plan.rows`` carries every row but the reused ones unless ``include_reused``. A cut or
    manifest the planner finds wrong is refused with the errors that name what is wrong.
    ``instance_map`` (docs/ledger.md#another-gym-topology): checked against the snapshot and the registered instances,
    the exported episodes of unmapped saved instances restart, the rows are placed on the live
    instances. Under the run's ``max_continue_staleness`` an exported episode dispatched under a
    policy too far behind the snapshot's anchor restarts (docs/ledger.md#stale-continuations)."""
    async with engine.connect() as conn:
        run = await get_run(conn, run_id)
        snap = await resolve_snapshot(conn, run_id, snapshot_id, step)
        live_ids = sorted(await registered_instance_ids(conn, run_id)) if instance_map is not None else []
    cfg = run_config(run.config)
    manifest = load_manifest(snap)
    mapped: frozenset[str] | None = None
    if instance_map is not None:
        if manifest is not None:
            _require_known(instance_map, manifest.instances, live_ids)
        mapped = frozenset(instance_map)
    async with engine.begin() as conn:
        sp = await plan_sql.plan_in_sql(
            conn, run_id, snap.snapshot_id, manifest if with_gym_state else None, include_reused=include_reused,
            gym_state=with_gym_state, mapped=mapped,
            oldest_version=oldest_continuable_version(snap.anchor_step, cfg.max_continue_staleness),
        )
    if sp is None:
        async with engine.connect() as conn:
            cut, _ = await reads.load_cut(conn, run_id, snap.snapshot_id)
        raise unplannable(cut, manifest if with_gym_state else None, snap.snapshot_id)
    minter = rollout_minter(run_id, snap.snapshot_id, run.epoch)
    rows = sp.rows
    placement = None
    if instance_map is not None:
        if manifest is None:
            # No manifest names the saved instances: those the cut's rows ran on do.
            _require_known(instance_map, {a[4] for a in rows if a[4] is not None}, live_ids)
        # (No live instance at all: the map is empty, and there is nothing to spread over.)
        placement = Placement(dict(instance_map), tuple(live_ids)) if live_ids else None
    try:
        plan = assemble_plan(
            rows,
            sp.codes,
            minter,
            cohort_reruns=sp.cohort_reruns,
            skipped_groups=sp.skipped_groups,
            reused=sp.reused,
            with_gym_state=with_gym_state,
            reasons=sp.reasons,
            placement=placement,
        )
    except PlanError as e:
        raise refusal_of(e, snap.snapshot_id) from e
    imap = dict(instance_map) if instance_map is not None else None
    # The rows a plan carries are every live row the cut knows as possibly running in Gym (only
    # sealed rows are left out), so the retires come from them.
    cut = Cut(groups=(), attempts=rows)
    if not with_gym_state:
        return Planned(run, cfg, snap, cut, manifest, plan, False, "with_gym_state is false", list(plan.retire), instance_map=imap)
    if manifest is None:
        return Planned(
            run, cfg, snap, cut, manifest, plan, False, "the snapshot holds no Gym state", live_retire_items(rows), instance_map=imap
        )
    if imap is not None and not imap:
        # Nothing is installed: every exported episode restarts (instance_not_mapped), and what
        # the cut knows as running is retired where it still can be
        # (docs/ledger.md#without-gym-state).
        return Planned(
            run, cfg, snap, cut, manifest, plan, False, "the instance map maps no saved instance", live_retire_items(rows), instance_map=imap
        )
    return Planned(run, cfg, snap, cut, manifest, plan, True, None, [], instance_map=imap)


def _require_known(instance_map: Mapping[str, str], saved: Iterable[str], live: Iterable[str]) -> None:
    issues = unknown_in_map(instance_map, saved, live)
    if issues:
        raise InstanceMapUnknown(
            "; ".join(i.message for i in issues),
            unknown_saved_instances=next((list(i.instances) for i in issues if i.kind == "unknown_saved"), []),
            unknown_live_instances=next((list(i.instances) for i in issues if i.kind == "unknown_live"), []),
        )


def parse_instance_map(entries: Iterable[tuple[str, str]]) -> dict[str, str]:
    """``{saved: live}`` from the pairs a request gives, refused when it is not one-to-one."""
    out, issues = instance_map_pairs(entries)
    if issues:
        raise InstanceMapInvalid(
            "; ".join(i.message for i in issues),
            errors=[{"field": "instance_map", "message": i.message, "kind": i.kind, "instances": list(i.instances)} for i in issues],
        )
    return out


def snapshot_fields(p: Planned) -> dict[str, Any]:
    return {
        "snapshot_id": p.snap.snapshot_id,
        "anchor_step": p.snap.anchor_step,
        "data_plane_ref": p.snap.data_plane_ref,
        "gym_checkpoint_id": p.manifest.checkpoint_id if p.manifest is not None else None,
        "snapshot_dir": p.snap.snapshot_dir,
    }


async def preview_plan(
    engine: AsyncEngine,
    run_id: str,
    *,
    snapshot_id: str | None,
    step: int | None,
    with_gym_state: bool,
    include_reused: bool,
    disposition: str | None,
    cursor: int,
    limit: int,
    instance_map: Mapping[str, str] | None = None,
) -> dict[str, Any]:
    """The plan a restore of this snapshot would apply now (``GET /restore-plan``)."""
    # Imported here: the preview's accounting builds on the answer's rewind columns, which are
    # built from this module's ``Planned``.
    from .preview_work import preview_accounting

    p = await load_and_plan(
        engine,
        run_id,
        snapshot_id=snapshot_id,
        step=step,
        with_gym_state=with_gym_state,
        include_reused=include_reused or disposition == Disposition.reused.value,
        instance_map=instance_map,
    )
    wanted = Disposition(disposition) if disposition else None
    rows = (
        r
        for r in p.plan.rows
        if (wanted is None or r.disposition is wanted) and (include_reused or wanted is not None or r.disposition is not Disposition.reused)
    )
    out_rows: list[dict[str, Any]] = []
    seen = 0
    more = False
    for r in rows:
        if seen < cursor:
            seen += 1
            continue
        if len(out_rows) == limit:
            more = True
            break
        out_rows.append(row_json(r, include_staging_keys=include_reused))
    return {
        "run_id": run_id,
        **snapshot_fields(p),
        "with_gym_state": with_gym_state,
        "gym_state": {"installs": p.install, "reason": p.no_gym_reason},
        "epoch": p.run.epoch,
        "total": p.plan.total,
        "counts": counts_json(p.plan),
        "reasons": p.plan.reasons(),
        "instance_map": p.instance_map,
        "cohort_reruns": sorted(p.plan.cohort_reruns),
        "skipped_groups": len(p.plan.skipped_groups),
        "retires": len(p.retire),
        "continued_by_instance": {iid: len(eps) for iid, eps in sorted(p.plan.continued_by_instance().items())},
        "accounting": await preview_accounting(engine, run_id, p),
        "rows": out_rows,
        "next_cursor": cursor + len(out_rows) if more else None,
    }
