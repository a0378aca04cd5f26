"""The restore choreography of ledger spec section 6 (protocol 5.6).

``GET /restore-plan`` (:func:`preview_plan`) and ``POST /restores`` (:func:`execute_restore`)
compute the plan from the snapshot's ledger cut and Gym manifest, nothing held in memory: the
dispositions in SQL (``ledger.restore_plan_sql.plan_in_sql``; only the rows that are sent reach Python,
where new rollout ids are minted), with the pure domain function as the reference a differential
test compares it with, and as the fallback that names what is wrong with a broken cut or a
disagreeing manifest (and lists reused rows, for ``include_reused``). The restore then runs:

1. checks before Gym is touched, each naming what is wrong: the manifest agrees with the cut
   (the plan refuses otherwise), the registered instances equal the manifest's, discovery
   succeeds, every participant that committed an instance is live on it, and every participant is
   fresh;
2. the Gym restore, all or nothing, left ``restored`` (admission closed) until the ledger has
   committed; a failure after the first restore call has been cleaned up by the client (N+1
   retired everywhere, everyone resumed) and every continuation becomes a restart;
3. one ledger transaction (``ledger.rewind.apply_restore``) that rewinds the live ledger to the
   cut with the plan applied, queues the retires, bumps the epoch and stores the answer under
   the restore id;
4. Gym is resumed with the restore id (a resume failure is reported, not raised).

Without Gym state (section 6.6) nothing is installed on Gym: every continuation restarts and
every attempt the cut knows as running in Gym is retired on its instance.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import httpx
from sqlalchemy.ext.asyncio import AsyncEngine

from ..domain.config import RecoveryConfig
from ..domain.cut import Cut
from ..domain.cut_checks import cut_issues, manifest_disagreements
from ..domain.errors import CutError, FieldIssue, ManifestError, ManifestLedgerMismatch, PlanError, TopologyMismatch
from ..domain.gym_manifest import GymManifest, dump_gym_manifest, load_gym_manifest
from ..domain.restore_plan import Disposition, Placement, RestorePlan, RetireItem, assemble_plan, demote_continuations
from ..domain.restore_topology import (
    compare_instance_sets,
    instance_map_pairs,
    remap_manifest,
    require_restorable_topology,
    unknown_in_map,
)
from ..domain.vocabulary import RowReason
from ..errors import Conflict, CoordinatorError, RunClosed
from ..gym.errors import GymControlError
from ..gym.models import parse_capture_key
from ..gym.results import RestoreResult
from .store import plan_sql
from .store import reads
from .store import records
from .store import rewind
from ..ledger.runs import RunRow, get_run
from ..recovery_config import domain_problem
from .errors import (
    GymFailure,
    GymNotFresh,
    InstanceMapInvalid,
    InstanceMapUnknown,
    ManifestDisagrees,
    NoCompatibleSnapshot,
    RestoreConflict,
    RestoreInProgress,
    RestoreNotApplied,
    RestoreRefusedEarlier,
    SnapshotNotFound,
    SnapshotUnusable,
    TopologyDiffers,
)
from .gym_access import make_client, probe_freshness, registered_instance_ids, registered_specs
from .planning import (
    METRIC_DISPOSITIONS,
    NEW_ATTEMPT_DISPOSITIONS,
    counts_json,
    live_retire_items,
    row_json,
    rollout_minter,
)
from .registration import run_config

log = logging.getLogger("checkpoint_coordinator.restore")


# -------------------------------------------------------------------------------------------
# Loading a snapshot and planning


async def resolve_snapshot(conn: Any, run_id: str, snapshot_id: str | None, step: int | None) -> reads.SnapshotRow:
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


def load_manifest(snap: reads.SnapshotRow) -> GymManifest | None:
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
    snap: reads.SnapshotRow
    cut: Cut
    manifest: GymManifest | None
    plan: RestorePlan
    # Gym state will be installed (with_gym_state and the snapshot has a Gym manifest).
    install: bool
    # Why no Gym state is installed, when none is.
    no_gym_reason: str | None
    retire: list[RetireItem]
    # The snapshot of the discarded lineage this restore aborted (section 6.7), if one was open.
    aborted_snapshot: str | None = None
    # {saved instance: live instance} of a restore into another topology (section 6.1).
    instance_map: dict[str, str] | None = None

    def retire_candidates(self) -> list[RetireItem]:
        """The attempts of live groups the cut knows as possibly running in Gym (6.6): every such
        attempt is one of the rows the plan carries in ``cut``."""
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
    ``instance_map`` (section 6.1): checked against the snapshot and the registered instances,
    the exported episodes of unmapped saved instances restart, the rows are placed on the live
    instances."""
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
        # the cut knows as running is retired where it still can be (section 6.6).
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


def _snapshot_fields(p: Planned) -> dict[str, Any]:
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
        **_snapshot_fields(p),
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
        "rows": out_rows,
        "next_cursor": cursor + len(out_rows) if more else None,
    }


# -------------------------------------------------------------------------------------------
# Executing a restore


@dataclass(frozen=True)
class RestoreRequest:
    restore_id: str
    snapshot_id: str | None
    step: int | None
    with_gym_state: bool
    instance_map: Mapping[str, str] | None = None

    def stored(self) -> dict[str, Any]:
        return {
            "snapshot_id": self.snapshot_id,
            "step": self.step,
            "with_gym_state": self.with_gym_state,
            "instance_map": dict(self.instance_map) if self.instance_map is not None else None,
        }


class _BeforeGym(Exception):
    """Wraps a refusal raised before any Gym state changed: the claim is released."""

    def __init__(self, error: CoordinatorError) -> None:
        super().__init__(str(error))
        self.error = error


def _replay(rec: records.RestoreRecord, req: RestoreRequest) -> dict[str, Any]:
    stored = (rec.result or {}).get("request") or {}
    diff = sorted(k for k, v in req.stored().items() if stored.get(k) != v)
    if diff:
        raise RestoreConflict(
            f"restore {req.restore_id!r} was requested before with other {', '.join(diff)}; use a new restore_id",
            restore_id=req.restore_id,
            errors=[{"field": k, "message": f"was {stored.get(k)!r}"} for k in diff],
        )
    if rec.state == "applied":
        return dict((rec.result or {})["answer"])
    if rec.state == "running":
        raise RestoreInProgress(f"restore {req.restore_id!r} is still running; ask again later", restore_id=req.restore_id)
    problem = (rec.result or {}).get("problem")
    if problem:
        raise RestoreRefusedEarlier(problem)
    raise RestoreConflict(
        f"restore {req.restore_id!r} ended {rec.state} (its coordinator stopped mid-way); use a new restore_id",
        code="restore_abandoned",
        restore_id=req.restore_id,
    )


def _stale_after_s(cfg: RecoveryConfig) -> float:
    # Discovery, restore, cleanup and resume each take at most a few control budgets.
    return max(600.0, 8.0 * cfg.control_timeout_s + 60.0)


async def execute_restore(
    engine: AsyncEngine,
    run_id: str,
    req: RestoreRequest,
    *,
    transport: httpx.AsyncBaseTransport | None = None,
    abort_local: Callable[[str, list[str], str], None] | None = None,
    snapshot_wait_s: float = 60.0,
) -> dict[str, Any]:
    """``abort_local`` tells this process's snapshot runner to abort a snapshot it drives;
    ``snapshot_wait_s`` bounds the wait for an open snapshot to end (its owner may be another
    replica, or a dead one whose lease must expire first)."""
    started = time.monotonic()
    async with engine.connect() as conn:
        run = await get_run(conn, run_id)
        existing = await records.get_restore(conn, run_id, req.restore_id)
    if existing is not None:
        return await _stored_answer(engine, run_id, req.restore_id, _replay(existing, req))
    if run.state != "open":
        raise RunClosed(f"run {run_id!r} is closed")
    aborted = await end_discarded_snapshot(engine, run_id, abort_local=abort_local, wait_s=snapshot_wait_s)
    p = await load_and_plan(
        engine, run_id, snapshot_id=req.snapshot_id, step=req.step, with_gym_state=req.with_gym_state, instance_map=req.instance_map
    )
    p.aborted_snapshot = aborted
    claimed = await records.claim_restore(
        engine, run_id, req.restore_id, p.snap.snapshot_id, req.with_gym_state, req.stored(), stale_after_s=_stale_after_s(p.cfg)
    )
    if claimed is not None:
        return await _stored_answer(engine, run_id, req.restore_id, _replay(claimed, req))
    try:
        answer = await _restore(engine, run_id, req, p, transport)
    except _BeforeGym as e:
        await records.release_claim(engine, run_id, req.restore_id)
        _observe(started, "failed", run_id)
        raise e.error from None
    except _GymTouchedRefusal as e:
        # Gym was touched (and cleaned up): the refusal is this restore id's answer from now on.
        problem = e.error.problem()
        await records.end_restore(
            engine,
            run_id,
            req.restore_id,
            "refused",
            {"request": req.stored(), "problem": problem},
            gym_restore_id=(problem.get("gym") or {}).get("restore_id"),
        )
        _observe(started, "failed", run_id)
        raise e.error from None
    except BaseException as exc:
        _observe(started, "failed", run_id)
        # Whatever failed unexpectedly, the restore id must not stay 'running' forever.
        problem = exc.problem() if isinstance(exc, CoordinatorError) else CoordinatorError("the restore failed; see the coordinator log").problem()
        try:
            await records.end_restore(
                engine, run_id, req.restore_id, "failed", {"request": req.stored(), "problem": problem}, only_running=True
            )
        except Exception as record_exc:
            log.error("run %s restore %s: recording the failure failed: %r", run_id, req.restore_id, record_exc)
        raise
    _observe(started, "succeeded", run_id)
    _record_counts(answer["counts"], run_id)
    return answer


async def end_discarded_snapshot(
    engine: AsyncEngine, run_id: str, *, abort_local: Callable[[str, list[str], str], None] | None, wait_s: float
) -> str | None:
    """A snapshot still open when a restore starts belongs to the lineage the restore discards
    (section 6.7): ask its owner to abort it (reason ``restored``; Gym is resumed as in any
    abort) and wait until it has ended. One whose capture was already reported publishes
    instead, and is waited for too. Returns the snapshot's id, or None when none was open."""
    from ..snapshots import store as snaps
    from ..ledger.gym_registry import open_snapshot_id

    async with engine.connect() as conn:
        sid = await open_snapshot_id(conn, run_id)
    if sid is None:
        return None
    try:
        await snaps.request_abort(engine, run_id, sid, "restored", "a restore of this run discards the lineage this snapshot belonged to")
    except snaps.SnapshotNotAwaiting:
        pass  # captured already: it publishes in a moment
    if abort_local is not None:
        abort_local(run_id, [sid], "restored")
    deadline = time.monotonic() + wait_s
    while True:
        async with engine.connect() as conn:
            row = await snaps.get(conn, run_id, sid)
        if row.outcome is not None:
            log.info("run %s: snapshot %s of the discarded lineage ended %s/%s before the restore", run_id, sid, row.outcome, row.reason)
            return sid
        if time.monotonic() > deadline:
            raise records.SnapshotBusy(
                f"snapshot {sid} of this run is still ending (its owner may have died: its lease expires first); retry the restore",
                snapshot_id=sid,
            )
        await asyncio.sleep(0.1)


def _observe(started: float, outcome: str, run_id: str) -> None:
    from ..observability.metrics import observe_restore_duration

    observe_restore_duration(time.monotonic() - started, outcome, run_id)


def _record_counts(counts: dict[str, int], run_id: str) -> None:
    from ..observability.metrics import record_restore_plan

    record_restore_plan({d: counts.get(d, 0) for d in METRIC_DISPOSITIONS}, run_id)


async def _restore(
    engine: AsyncEngine, run_id: str, req: RestoreRequest, p: Planned, transport: httpx.AsyncBaseTransport | None
) -> dict[str, Any]:
    gym: dict[str, Any] = {
        "installed": False,
        "reason": p.no_gym_reason,
        "restore_id": None,
        "source_checkpoint_id": p.manifest.checkpoint_id if p.manifest is not None else None,
        "failure": None,
        "continuations_retired": False,
        "resume": None,
    }
    plan = p.plan
    retire = list(p.retire)
    result: RestoreResult | None = None
    client = None
    try:
        if p.install:
            assert p.manifest is not None
            client, result, gym, plan, retire = await _gym_restore(engine, run_id, req, p, transport, gym)
        try:
            summary, rows, _ = await apply_and_record(engine, run_id, req, p, plan, retire, gym, installed=result is not None)
        except BaseException as exc:
            await _ledger_failed(engine, run_id, req, client, result, gym, exc)
            raise
        if client is not None and result is not None:
            resumed = await client.finish_restore(result)
            rep = resumed.resume
            gym["resume"] = rep.summary() if rep is not None else {"ok": True, "failure": None}
            if rep is not None and rep.failure is not None:
                log.warning("run %s restore %s: Gym resume failed (leases reopen Gym): %s", run_id, req.restore_id, rep.failure)
            summary["gym"] = gym
            await records.update_restore_result(engine, run_id, req.restore_id, {"answer": summary})
        return _with_page(summary, rows.page(0, ANSWER_PAGE_ROWS), 0)
    finally:
        if client is not None:
            await client.aclose()


async def apply_and_record(
    engine: AsyncEngine,
    run_id: str,
    req: RestoreRequest,
    p: Planned,
    plan: RestorePlan,
    retire: Sequence[RetireItem],
    gym: dict[str, Any],
    *,
    installed: bool,
) -> tuple[dict[str, Any], records.AnswerRows, rewind.RewindReport]:
    """The one ledger transaction of a claimed restore: the rewind, and the answer stored with it
    (its summary on the restore record, its rows as chunks). Returns the summary, the rows and
    what the rewind did."""
    built: list[tuple[dict[str, Any], records.AnswerRows]] = []

    def result_of(report: rewind.RewindReport) -> tuple[dict[str, Any], records.AnswerRows]:
        built.append(_answer(run_id, req, p, plan, report, gym))
        summary, rows = built[-1]
        return {"request": req.stored(), "answer": summary}, rows

    report = await rewind.apply_restore(
        engine,
        run_id,
        _rewind_of(p, plan, retire, installed=installed),
        after_cut_minter=rollout_minter(run_id, p.snap.snapshot_id, p.run.epoch, "after-cut"),
        record=(req.restore_id, result_of),
        expect_epoch=p.run.epoch,
    )
    summary, rows = built[-1]
    return summary, rows, report


async def _gym_restore(
    engine: AsyncEngine,
    run_id: str,
    req: RestoreRequest,
    p: Planned,
    transport: httpx.AsyncBaseTransport | None,
    gym: dict[str, Any],
) -> tuple[Any, RestoreResult | None, dict[str, Any], RestorePlan, list[RetireItem]]:
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
    diff = compare_instance_sets(manifest, (s.instance_id for s in specs))
    if not diff.equal:
        raise _BeforeGym(
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
    if not p.snap.snapshot_dir or not p.snap.snapshot_dir.startswith("/"):
        raise _BeforeGym(
            SnapshotUnusable(f"snapshot {p.snap.snapshot_id!r} has a Gym manifest but no absolute snapshot_dir", code="snapshot_dir_missing")
        )
    client = make_client(p.cfg, transport=transport, issued=issued, run_id=run_id)
    try:
        try:
            live = await client.discover_all(specs, log_warnings=False)
        except GymControlError as exc:
            raise _BeforeGym(GymFailure.of(exc, "Gym discovery before restore", {sp.instance_id: sp.servers for sp in specs})) from None
        try:
            require_restorable_topology(manifest, {iid: [x.server_name for x in t.participants] for iid, t in live.items()})
        except TopologyMismatch as e:
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
            raise _BeforeGym(
                TopologyDiffers(
                    detail,
                    code="gym_participants_missing",
                    missing_participants=missing,
                    **({"saved_instances": {iid: saved_of[iid] for iid in missing}} if saved_of else {}),
                    errors=[{"field": i.path or "instances", "message": i.message} for i in e.issues],
                )
            ) from None
        stale = await probe_freshness(live, timeout_s=p.cfg.control_timeout_s, transport=transport)
        if stale:
            raise _BeforeGym(_not_fresh(stale))
        try:
            result = await client.restore(
                dump_gym_manifest(manifest), live, p.snap.snapshot_dir, resume=False, instance_dirs=saved_of or None
            )
        except GymControlError as exc:
            if "restore_id" not in exc.extra:
                # Refused before any restore call (re-discovery, topology, a busy participant).
                raise _BeforeGym(GymFailure.of(exc, "Gym restore", {sp.instance_id: sp.servers for sp in specs})) from None
            return client, None, *_after_failed_gym_restore(engine, run_id, req, p, gym, exc)
    except BaseException:
        await client.aclose()
        raise
    gym.update(installed=True, reason=None, restore_id=result.restore_id, source_checkpoint_id=result.source_checkpoint_id)
    return client, result, gym, p.plan, []


def _not_fresh(stale: dict[str, dict[str, list[str]]]) -> GymNotFresh:
    named = sorted(f"{iid}/{srv}" for iid, servers in stale.items() for srv in servers)
    return GymNotFresh(
        "Gym restores only into freshly started servers; these have served work: "
        + "; ".join(f"{iid}/{srv}: {', '.join(signs)}" for iid, servers in sorted(stale.items()) for srv, signs in sorted(servers.items()))
        + ". Restart them, or restore with with_gym_state false",
        instances=sorted(stale),
        servers=named,
    )


def _is_not_fresh_refusal(exc: GymControlError) -> dict[str, dict[str, list[str]]]:
    """Servers that refused the restore as not fresh (409 ``checkpoint_error``, protocol 5.6)."""
    out: dict[str, dict[str, list[str]]] = {}
    for iid, servers in exc.instances.items():
        for srv, part in servers.items():
            if part.get("op") == "restore" and part.get("http_status") == 409 and part.get("code") == "checkpoint_error":
                out.setdefault(iid, {})[srv] = [str(part.get("detail", "not fresh"))[:300]]
    return out


def _after_failed_gym_restore(
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
        # The cleanup resumed every instance (protocol 5.6 step 9): what that resume did.
        resume=exc.extra.get("resume"),
    )
    stale = _is_not_fresh_refusal(exc)
    if stale:
        problem = _not_fresh(stale)
        problem.extra["gym"] = gym
        problem.detail += (
            " (the Gym restore was attempted and cleaned up; restart every instance before restoring with Gym state again)"
        )
        raise _GymTouchedRefusal(problem)
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


class _GymTouchedRefusal(Exception):
    def __init__(self, error: CoordinatorError) -> None:
        super().__init__(str(error))
        self.error = error


def _rewind_of(p: Planned, plan: RestorePlan, retire: Sequence[RetireItem], *, installed: bool) -> rewind.Rewind:
    # Columns straight from the plan's columns: a large plan has many such rows,
    # and building a PlanRow for each only to take it apart again cost a second.
    rw = rewind.Rewind(snapshot_id=p.snap.snapshot_id, retire=list(retire), bumped_groups=list(plan.cohort_reruns))
    rw.into_other_topology = p.instance_map is not None
    if installed:
        rw.instance_map = dict(p.instance_map or {})
        c = plan.rows.columns(Disposition.continued)
        rw.continued_ids = list(map(int, c.attempt_id))
        rw.continued_rollouts = list(c.rollout_id)
        rw.continued_groups = list(c.group_id)
    for d in NEW_ATTEMPT_DISPOSITIONS:
        c = plan.rows.columns(d)
        rw.new_old_ids.extend(map(int, c.attempt_id))
        rw.new_groups.extend(c.group_id)
        rw.new_indexes.extend(c.generation_index)
        rw.new_rollouts.extend(c.rollout_id)
        rw.new_group_attempts.extend(c.group_attempt)
    return rw


# Rows per page of a restore's answer: ``POST /restores`` answers the first page, ``GET
# /restores/{id}/rows`` the others (``next_cursor``).
ANSWER_PAGE_ROWS = 10_000


def _answer(
    run_id: str, req: RestoreRequest, p: Planned, plan: RestorePlan, report: rewind.RewindReport, gym: dict[str, Any]
) -> tuple[dict[str, Any], records.AnswerRows]:
    """The answer without its rows (``rows_total`` of them), and the rows, in plan order."""
    counts = counts_json(plan)
    reasons = plan.reasons()
    c = plan.rows.sent_columns()
    rows = records.AnswerRows(
        c.group_id, c.generation_index, c.disposition, c.rollout_id, c.gym_attempt, c.group_attempt, c.instance_id,
        c.replaces_rollout_id, c.reason,
    )
    if report.after_cut:
        # Rows sent under their old identity whose attempt reached Gym after the cut: new ids.
        adjusted = {int(a.attempt_id): a for a in report.after_cut}
        for k, aid in enumerate(c.attempt_id):
            adj = adjusted.get(int(aid))
            if adj is None:
                continue
            counts["dispatch"] -= 1
            counts[adj.disposition] += 1
            _move_reason(reasons, (Disposition.dispatch.value, rows.reasons[k]), (adj.disposition, RowReason.sent_after_cut.value))
            rows.reasons[k] = RowReason.sent_after_cut.value
            rows.dispositions[k] = adj.disposition
            rows.rollout_ids[k] = adj.rollout_id
            rows.gym_attempts[k] = 0
            rows.group_attempts[k] = adj.group_attempt
            if p.instance_map is None:
                rows.instance_ids[k] = None
            rows.replaces_rollout_ids[k] = adj.replaces_rollout_id
    summary = {
        "restore_id": req.restore_id,
        "run_id": run_id,
        **_snapshot_fields(p),
        "state": "applied",
        "with_gym_state": req.with_gym_state,
        "epoch": report.epoch,
        "gym": gym,
        "total": plan.total,
        "counts": counts,
        "reasons": reasons,
        "instance_map": p.instance_map,
        "cohort_reruns": sorted(set(plan.cohort_reruns) | set(report.bumped_after_cut)),
        "dispatched_after_cut": len(report.after_cut),
        "retires_queued": report.retires_queued,
        "groups_removed": report.groups_removed,
        "train_steps_retired": report.train_steps_retired,
        "aborted_snapshots": [p.aborted_snapshot] if p.aborted_snapshot else [],
        "rows_total": len(rows),
    }
    return summary, rows


def _move_reason(reasons: dict[str, dict[str, int]], old: tuple[str, str], new: tuple[str, str]) -> None:
    """One row of the summary's reasons moves from (disposition, reason) ``old`` to ``new``."""
    d, why = old
    left = reasons.get(d, {}).get(why, 0) - 1
    if left > 0:
        reasons[d][why] = left
    else:
        reasons.get(d, {}).pop(why, None)
        if d in reasons and not reasons[d]:
            del reasons[d]
    d, why = new
    reasons.setdefault(d, {})[why] = reasons.get(d, {}).get(why, 0) + 1


def _with_page(summary: dict[str, Any], page: list[dict[str, Any]], cursor: int) -> dict[str, Any]:
    """``summary`` with the page of rows that starts at ``cursor`` and the cursor of the next."""
    total = int(summary.get("rows_total", cursor + len(page)))
    end = cursor + len(page)
    return {**summary, "rows": page, "next_cursor": end if end < total else None}


async def _stored_answer(engine: AsyncEngine, run_id: str, restore_id: str, summary: dict[str, Any]) -> dict[str, Any]:
    """A stored answer with its first page of rows (an answer stored before the rows moved to
    ``restore_row_chunks`` still holds all of them)."""
    if "rows" in summary:
        return {**summary, "next_cursor": summary.get("next_cursor")}
    async with engine.connect() as conn:
        page = await records.read_answer_rows(conn, run_id, restore_id, 0, ANSWER_PAGE_ROWS)
    return _with_page(summary, page, 0)


async def answer_rows_page(engine: AsyncEngine, run_id: str, restore_id: str, cursor: int, limit: int) -> dict[str, Any]:
    """``GET /restores/{id}/rows``: rows ``cursor``.. of an applied restore's answer."""
    async with engine.connect() as conn:
        rec = await _restore_or_404(conn, run_id, restore_id)
        answer = (rec.result or {}).get("answer")
        if rec.state != "applied" or answer is None:
            raise RestoreNotApplied(
                f"restore {restore_id!r} is {rec.state}: only an applied restore has rows", restore_id=restore_id, state=rec.state
            )
        total = int(answer.get("rows_total", len(answer.get("rows") or ())))
        if "rows" in answer:  # stored whole, before restore_row_chunks
            page = list(answer["rows"][cursor:cursor + limit])
        elif cursor >= total:  # past the end: nothing to read (any cursor is accepted)
            page = []
        else:
            page = await records.read_answer_rows(conn, run_id, restore_id, cursor, limit)
    return _with_page({"restore_id": restore_id, "rows_total": total, "cursor": cursor}, page, cursor)


async def _restore_or_404(conn: Any, run_id: str, restore_id: str) -> records.RestoreRecord:
    await get_run(conn, run_id)
    rec = await records.get_restore(conn, run_id, restore_id)
    if rec is None:
        from ..errors import NotFound

        raise NotFound(f"restore {restore_id!r} not found in run {run_id!r}", code="restore_not_found")
    return rec


async def _ledger_failed(
    engine: AsyncEngine,
    run_id: str,
    req: RestoreRequest,
    client: Any,
    result: RestoreResult | None,
    gym: dict[str, Any],
    exc: BaseException,
) -> None:
    """The ledger transaction failed (nothing of it committed). Installed Gym state is discarded
    (N+1 retired, resumed) so nothing can continue from it, and the restore id ends failed."""
    if client is not None and result is not None:
        try:
            cleanup = await client.discard_restore(result)
            gym.update(
                installed=False,
                continuations_retired=True,
                failure=cleanup.failure.to_dict() if cleanup.failure else None,
                resume=cleanup.resume.summary(),
            )
        except Exception as cleanup_exc:  # keep the original failure; the leases reopen Gym
            log.error("run %s restore %s: discarding the Gym restore failed: %r", run_id, req.restore_id, cleanup_exc)
    problem = exc.problem() if isinstance(exc, CoordinatorError) else CoordinatorError("the ledger rewind failed; see the coordinator log").problem()
    try:
        await records.end_restore(
            engine,
            run_id,
            req.restore_id,
            "failed",
            {"request": req.stored(), "problem": problem, "gym": gym},
        )
    except Exception as record_exc:
        log.error("run %s restore %s: recording the failure failed: %r", run_id, req.restore_id, record_exc)


async def restore_record(engine: AsyncEngine, run_id: str, restore_id: str) -> dict[str, Any]:
    async with engine.connect() as conn:
        rec = await _restore_or_404(conn, run_id, restore_id)
    res = rec.result or {}
    answer = res.get("answer")
    if answer is not None:
        answer = await _stored_answer(engine, run_id, restore_id, answer)
    return {
        "restore_id": rec.restore_id,
        "snapshot_id": rec.snapshot_id,
        "state": rec.state,
        "with_gym_state": rec.with_gym_state,
        "gym_restore_id": rec.gym_restore_id,
        "request": res.get("request"),
        "answer": answer,
        "problem": res.get("problem"),
        "created_at": rec.created_at.isoformat(),
    }
