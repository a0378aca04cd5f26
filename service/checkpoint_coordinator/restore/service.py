"""The restore choreography (docs/ledger.md#restore, docs/gym-protocol.md#restore).

``GET /restore-plan`` (:func:`preview_plan`) and ``POST /restores`` (:func:`execute_restore`)
compute the plan from the snapshot's ledger cut and Gym manifest, nothing held in memory: the
dispositions in SQL (``ledger.restore_plan_sql.plan_in_sql``; only the rows that are sent reach Python,
where new rollout ids are minted), with the pure domain function as the reference a differential
test compares it with, and as the fallback that names what is wrong with a broken cut or a
disagreeing manifest (and lists reused rows, for ``include_reused``). The plan is loaded by
``plan_loading``, the steps on Gym are ``gym_install``'s, the rewind and the answer are built by
``answer``; this module runs the restore:

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

Without Gym state (docs/ledger.md#without-gym-state) nothing is installed on Gym: every
continuation restarts and every attempt the cut knows as running in Gym is retired on its
instance.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Sequence
from typing import Any

import httpx
from sqlalchemy.ext.asyncio import AsyncEngine

from ..domain.config import RecoveryConfig
from ..domain.restore_plan import RestorePlan, RetireItem
from ..domain.vocabulary import PromptBucket, WorkFate
from ..domain.vocabulary import RestoreRecordState, RunState
from ..errors import CoordinatorError, RunClosed
from ..gym.results import RestoreResult
from ..ledger.runs import get_run
from .answer import build_answer, rewind_of
from .errors import RestoreNotApplied
from .gym_install import BeforeGym, GymTouchedRefusal, gym_restore
from .plan_loading import (
    Planned,
    load_and_plan,
    load_manifest,
    parse_instance_map,
    preview_plan,
    refusal_of,
)
from .planning import METRIC_DISPOSITIONS, rollout_minter
from .request import RestoreRequest, replay
from .store import records, rewind

# The API, the tests and the benchmarks reach the restore through this module.
__all__ = [
    "ANSWER_PAGE_ROWS",
    "RestoreRequest",
    "answer_rows_page",
    "apply_and_record",
    "end_discarded_snapshot",
    "execute_restore",
    "load_and_plan",
    "load_manifest",
    "parse_instance_map",
    "preview_plan",
    "refusal_of",
    "restore_record",
]

log = logging.getLogger("checkpoint_coordinator.restore")

# Rows per page of a restore's answer: ``POST /restores`` answers the first page, ``GET
# /restores/{id}/rows`` the others (``next_cursor``).
ANSWER_PAGE_ROWS = 10_000


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
        return await _stored_answer(engine, run_id, req.restore_id, replay(existing, req))
    if run.state != RunState.open:
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
        return await _stored_answer(engine, run_id, req.restore_id, replay(claimed, req))
    try:
        answer = await _restore(engine, run_id, req, p, transport)
    except BeforeGym as e:
        await records.release_claim(engine, run_id, req.restore_id)
        _observe(started, "failed", run_id)
        raise e.error from None
    except GymTouchedRefusal as e:
        # Gym was touched (and cleaned up): the refusal is this restore id's answer from now on.
        problem = e.error.problem()
        await records.end_restore(
            engine,
            run_id,
            req.restore_id,
            RestoreRecordState.refused,
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
    _record_accounting(answer.get("accounting"), answer.get("effects"))
    return answer


async def end_discarded_snapshot(
    engine: AsyncEngine, run_id: str, *, abort_local: Callable[[str, list[str], str], None] | None, wait_s: float
) -> str | None:
    """A snapshot still open when a restore starts belongs to the lineage the restore discards
    (docs/ledger.md#the-discarded-lineage): ask its owner to abort it (reason ``restored``; Gym is resumed as in any
    abort) and wait until it has ended. One whose capture was already reported publishes
    instead, and is waited for too. Returns the snapshot's id, or None when none was open."""
    from ..ledger.gym_registry import open_snapshot_id
    from ..snapshots import store as snaps

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


def _record_accounting(accounting: dict[str, Any] | None, answer_effects: dict[str, Any] | None = None) -> None:
    """What the restore rewound and threw away or carried (docs/accounting.md#where-it-shows),
    and the effects it orphaned (docs/effects.md#orphans)."""
    from ..observability.metrics import record_effect_orphans, record_prompts, record_rollout_seconds

    for why, n in ((answer_effects or {}).get("orphaned") or {}).items():
        record_effect_orphans(why, int(n))
    if accounting:
        record_prompts(PromptBucket.rewound, int(accounting.get("groups_rewound", 0)))
        record_rollout_seconds(WorkFate.carried, float(accounting.get("carried_seconds", 0.0)))
        record_rollout_seconds(WorkFate.redone, float(accounting.get("redone_seconds", 0.0)))


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
            client, result, gym, plan, retire = await gym_restore(engine, run_id, req, p, transport, gym)
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
        built.append(build_answer(run_id, req, p, plan, report, gym))
        summary, rows = built[-1]
        return {"request": req.stored(), "answer": summary}, rows

    report = await rewind.apply_restore(
        engine,
        run_id,
        rewind_of(p, plan, retire, installed=installed),
        after_cut_minter=rollout_minter(run_id, p.snap.snapshot_id, p.run.epoch, "after-cut"),
        record=(req.restore_id, result_of),
        expect_epoch=p.run.epoch,
    )
    summary, rows = built[-1]
    return summary, rows, report


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
        if rec.state != RestoreRecordState.applied or answer is None:
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
