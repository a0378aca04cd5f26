"""Live rollout bookkeeping (docs/ledger.md#live-rollouts): the write paths.

Every public function is one transaction that read-locks the run (fencing), locks and reads the
rows the report touches (``rollout_locks``), lets the pure rules of ``domain.rollout_rules``
decide, and applies their change plan with set-based SQL (``plan_writes``: ``unnest`` arrays or
one JSON document), never a statement per row.

A batch is atomic: if any row is refused, nothing of the batch is written and the caller gets a
typed 409 naming each refused row.
"""

from __future__ import annotations

import secrets
from collections import defaultdict
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any

from pydantic_core import to_json
from sqlalchemy import select, text
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine

from ..domain import levels
from ..domain.config import load_recovery_config
from ..domain.identity import mint_rollout_id
from ..domain.levels import LiveGranularity
from ..domain.rollout_rules import (
    Budgets,
    Decision,
    admit_conflicts,
    decide_abandon,
    decide_dispatch,
    decide_fail,
    decide_finalize,
    decide_refused,
    decide_seal,
    decide_stream_end,
    granularity,
    send_row,
)
from ..domain.stragglers import name_replacements
from ..domain.vocabulary import (
    ENDED_ATTEMPT_STATUSES,
    FORGET_CHECKPOINT_ID,
    AttemptFailureClass,
    OutboxOp,
    sql_list,
)
from ..domain.vocabulary import AttemptStatus as A
from ..domain.vocabulary import GroupStatus as G
from ..domain.vocabulary import RetirementState as R
from ..errors import Conflict, NotFound
from ..ledger.models import GymInstance
from ..ledger.runs import lock_run, require_open
from ..effects import store as effects_store
from ..outbox import store as outbox
from .locks import (
    current_attempts,
    load_states,
    lock_and_read,
    lock_groups,
    states_of_locked,
)
from .plan_writes import (
    ENDED_WORK_RETURNING,
    ENDED_WORK_SUM,
    POLICY_VERSION_AT_DISPATCH,
    apply_plan,
    count_admitted,
    count_ended_work,
    count_transitions,
    execute_batch,
    fetch_batch,
)
from .stragglers import name_refused_replacements

# Batch statements, never run as prepared statements (``plan_writes``).
_fetch, _execute = fetch_batch, execute_batch

_ENDED_ATTEMPTS = sql_list(ENDED_ATTEMPT_STATUSES)


def _hex() -> str:
    return secrets.token_hex(16)


def new_rollout_id(group_id: str, generation_index: int, token_hex: Callable[[], str] = _hex) -> str:
    return mint_rollout_id(group_id, generation_index, lambda _n: token_hex())


def _mint(group_id: str, generation_index: int) -> str:
    return new_rollout_id(group_id, generation_index)


def resolve_level(config: dict[str, Any], agent_name: str | None, task_source: str | None) -> str:
    return levels.resolve_level(load_recovery_config(config), agent_name, task_source).value


def _level_resolver(config: dict[str, Any]) -> Callable[[str | None, str | None], str]:
    """resolve_level for one batch: the run's config is validated once, not once per group, and
    each (agent, task source) pair is resolved once."""
    cfg = load_recovery_config(config)
    seen: dict[tuple[str | None, str | None], str] = {}

    def resolve(agent_name: str | None, task_source: str | None) -> str:
        key = (agent_name, task_source)
        level = seen.get(key)
        if level is None:
            level = seen[key] = levels.resolve_level(cfg, agent_name, task_source).value
        return level

    return resolve


class BatchRefused(Conflict):
    """One or more rows of a batch were refused; nothing of the batch was written."""

    code = "batch_refused"

    def __init__(self, rows: list[dict[str, Any]]) -> None:
        codes = sorted({r["code"] for r in rows})
        super().__init__(
            f"{len(rows)} row(s) refused ({', '.join(codes)}); nothing of this batch was written",
            code=codes[0] if len(codes) == 1 else "batch_refused",
            rows=rows[:1000],
            refused_count=len(rows),
        )


def _accepted(d: Decision) -> Decision:
    if d.refused:
        raise BatchRefused(d.refused)
    return d


# --------------------------------------------------------------------------------------------
# Live rollout operations (docs/ledger.md#live-rollouts)


@dataclass(frozen=True)
class AdmitGroup:
    group_id: str
    prompt_ref: dict[str, Any]
    task_digest: str
    task_source: str | None
    agent_name: str | None
    expected_generations: int
    target_step: int | None
    weight_version: str | None


# ``n`` more admitted rows on the run's quota row, unless they pass ``limit`` (then no row).
_TAKE_ROWS_SQL = (
    "INSERT INTO run_quotas (run_id, admitted_rows) VALUES (:r, :n) ON CONFLICT (run_id) DO UPDATE "
    "SET admitted_rows = run_quotas.admitted_rows + :n WHERE run_quotas.admitted_rows + :n <= :limit RETURNING admitted_rows"
)


async def _take_rows(conn: AsyncConnection, run_id: str, n: int, limit: int) -> None:
    """Count ``n`` more admitted rows against the run's quota, or refuse them."""
    used = (await conn.execute(text(_TAKE_ROWS_SQL), {"r": run_id, "n": n, "limit": limit})).scalar()
    if used is None or used > limit:
        have = (await conn.execute(text("SELECT admitted_rows FROM run_quotas WHERE run_id = :r"), {"r": run_id})).scalar() or 0
        raise Conflict(
            f"run {run_id!r} has admitted {have} sibling rows; {n} more would pass its quota of {limit} "
            "(CKPTC_MAX_RUN_ROWS): finish this run and start another, or raise the quota",
            code="run_row_quota", admitted_rows=have, quota=limit,
        )


async def admit(engine: AsyncEngine, run_id: str, groups: Sequence[AdmitGroup], *, max_run_rows: int | None = None) -> list[dict[str, Any]]:
    """Create groups, siblings and one reserved attempt per sibling; answer the rows to send.

    An identical repeat answers the group's current rows; a repeat with other fields is refused.
    ``max_run_rows``: the sibling rows the run may have admitted in all (``run_quotas``); an admit
    that would pass it is refused ``run_row_quota`` and writes nothing.
    """
    seen: set[str] = set()
    dups = [g.group_id for g in groups if g.group_id in seen or seen.add(g.group_id)]  # type: ignore[func-returns-value]
    if dups:
        raise BatchRefused([{"group_id": d, "code": "duplicate_in_batch", "detail": "group named twice in one batch"} for d in dups])
    async with engine.begin() as conn:
        run = await lock_run(conn, run_id)
        existing = await lock_groups(conn, run_id, (g.group_id for g in groups))
        refused = admit_conflicts(groups, existing)
        if refused:
            raise BatchRefused(refused)
        new = [g for g in groups if g.group_id not in existing]
        if new and max_run_rows is not None:
            await _take_rows(conn, run_id, sum(g.expected_generations for g in new), max_run_rows)
        resolve = _level_resolver(run.config)
        levels = {g.group_id: resolve(g.agent_name, g.task_source) for g in new}
        minted = await _insert_new_groups(conn, run_id, new, levels) if new else {}
        current = await current_attempts(conn, run_id, list(existing)) if existing else {}
        out = []
        for g in groups:
            ex = existing.get(g.group_id)
            level = ex.restore_level if ex else levels[g.group_id]
            if ex:
                send = [send_row(a, level) for a in current.get(g.group_id, [])]
            else:
                # send_row of a fresh attempt (gym_attempt 0: the capture key is the rollout id),
                # built straight from the inserted rows: no intermediate object per row.
                gid = g.group_id
                send = [
                    {"group_id": gid, "generation_index": i, "rollout_id": ro, "capture_key": ro, "gym_attempt": 0, "group_attempt": 0,
                     "status": A.reserved.value, "restore_level": level, "instance_id": None}
                    for i, ro in sorted(minted[gid])
                ]
            out.append(
                {
                    "group_id": g.group_id,
                    "restore_level": level,
                    "granularity": granularity(level),
                    "status": ex.status if ex else G.generating.value,
                    "group_attempt": ex.group_attempt if ex else 0,
                    "admitted": ex is None,
                    "rows": send,
                }
            )
        return out


async def _insert_new_groups(
    conn: AsyncConnection, run_id: str, new: Sequence[AdmitGroup], levels: dict[str, str]
) -> dict[str, list[tuple[int, str]]]:
    """Insert the admitted groups, their siblings and one reserved attempt each, set-based;
    returns the minted (generation index, rollout id) pairs by group."""
    minted: dict[str, list[tuple[int, str]]] = defaultdict(list)
    # The admission is counted in the same statement, apart from the groups themselves
    # (docs/accounting.md#prompt-conservation): one row per admit call, not per group.
    await _execute(
        conn,
        "WITH ins AS (INSERT INTO prompt_groups (run_id, group_id, prompt_ref, task_digest, task_source, agent_name, restore_level, "
        "expected_generations, target_step, weight_version) "
        "SELECT %(r)s, g, pr, td, ts, an, lv, n, st, wv FROM unnest(%(g)s::text[], "
        "ARRAY(SELECT e FROM jsonb_array_elements(%(pr)s::jsonb) WITH ORDINALITY AS x(e, o) ORDER BY o), "
        "%(td)s::text[], %(ts)s::text[], %(an)s::text[], %(lv)s::text[], %(n)s::int[], "
        "%(st)s::bigint[], %(wv)s::text[]) AS t(g, pr, td, ts, an, lv, n, st, wv) RETURNING 1) "
        "INSERT INTO group_admissions (run_id, groups) SELECT %(r)s, count(*) FROM ins HAVING count(*) > 0",
        {
            "r": run_id,
            "g": [g.group_id for g in new],
            # The prompt refs travel as one JSON array serialised in one native call
            # (jsonb keeps no key order or spacing, so the stored values are the same).
            "pr": to_json([g.prompt_ref for g in new]).decode(),
            "td": [g.task_digest for g in new],
            "ts": [g.task_source for g in new],
            "an": [g.agent_name for g in new],
            "lv": [levels[g.group_id] for g in new],
            "n": [g.expected_generations for g in new],
            "st": [g.target_step for g in new],
            "wv": [g.weight_version for g in new],
        },
    )
    sizes = {"r": run_id, "g": [g.group_id for g in new], "n": [g.expected_generations for g in new]}
    await _execute(
        conn,
        "INSERT INTO siblings (run_id, group_id, generation_index) "
        "SELECT %(r)s, t.g, i FROM unnest(%(g)s::text[], %(n)s::int[]) AS t(g, n), generate_series(0, t.n - 1) AS i",
        sizes,
    )
    # Rollout ids are minted here, one fresh random 32-hex suffix per attempt
    # (docs/ledger.md#identifiers).
    rows = await _fetch(
        conn,
        "INSERT INTO attempts (run_id, group_id, generation_index, rollout_id, group_attempt) "
        "SELECT %(r)s, t.g, i, t.g || '_g' || i || '_a' || replace(gen_random_uuid()::text, '-', ''), 0 "
        "FROM unnest(%(g)s::text[], %(n)s::int[]) AS t(g, n), generate_series(0, t.n - 1) AS i "
        "RETURNING attempt_id, group_id, generation_index, rollout_id",
        sizes,
    )
    for _aid, gid, i, ro in rows:
        minted[gid].append((i, ro))
    count_admitted(len(new))
    count_transitions({A.reserved.value: len(rows)})
    return minted


async def dispatch(
    engine: AsyncEngine,
    run_id: str,
    dispatch_id: str,
    instance_id: str | None,
    rollout_ids: Sequence[str],
    *,
    retry_after_s: float = 1.0,
) -> dict[str, Any]:
    """Mark reserved attempts as sent to Gym (to ``instance_id``) in dispatch ``dispatch_id``."""
    async with engine.begin() as conn:
        run = await lock_run(conn, run_id)
        await require_open(conn, run, retry_after_s=retry_after_s)
        if instance_id is not None:
            gi = GymInstance.__table__
            known = (await conn.execute(select(gi.c.instance_id).where(gi.c.run_id == run_id))).scalars().all()
            if instance_id not in known:
                # Accepted, the row would run where no snapshot reaches it, and every snapshot
                # would fail later for a cause far from here.
                raise NotFound(
                    f"instance {instance_id!r} is not registered for run {run_id!r}"
                    + (f" (registered: {', '.join(sorted(known)[:10])}{', ...' if len(known) > 10 else ''})" if known else " (none is)")
                    + "; register it first (POST /v1/runs/{run}/gym-instances, client.register_gym_instances), then dispatch",
                    code="unknown_instance", instance_id=instance_id,
                )
        groups, atts = await lock_and_read(conn, run_id, rollout_ids)
        d = _accepted(decide_dispatch(rollout_ids, atts, groups, dispatch_id, instance_id))
        if d.extra:
            # One statement: the update (every row gets the same values: one array of ids, and
            # the policy version it goes out under, docs/ledger.md#stale-continuations), and the
            # dispatch_calls row that "stream ended" looks the dispatch's rows up by.
            await _execute(
                conn,
                f"WITH u AS (UPDATE attempts a SET status = '{A.dispatched}', gym_instance_id = %(i)s, dispatch_id = %(d)s, "
                f"dispatched_at = now(), policy_version = {POLICY_VERSION_AT_DISPATCH} WHERE attempt_id = ANY(%(ids)s::bigint[])) "
                "INSERT INTO dispatch_calls (run_id, dispatch_id, attempt_ids) VALUES (%(r)s, %(d)s, %(ids)s::bigint[])",
                {"r": run_id, "i": instance_id, "d": dispatch_id, "ids": [a.attempt_id for a in d.extra]},
            )
            count_transitions(d.plan.transitions)
        return {"dispatch_id": dispatch_id, "instance_id": instance_id, "rows": d.rows}


async def refused(engine: AsyncEngine, run_id: str, rollout_ids: Sequence[str]) -> dict[str, Any]:
    """Gym refused these rows at admission: back to reserved, same identity, no attempt spent."""
    async with engine.begin() as conn:
        await lock_run(conn, run_id)
        groups, atts = await lock_and_read(conn, run_id, rollout_ids)
        d = _accepted(decide_refused(rollout_ids, atts, groups))
        await apply_plan(conn, run_id, d.plan)
        return {"rows": d.rows}


@dataclass(frozen=True)
class SealRow:
    """A seal report; ``seal`` takes anything with these attributes (the API's validated rows)."""

    rollout_id: str
    receipt: dict[str, Any]
    staging_keys: list[str]
    reward: float | None
    mask_sample: bool | None


async def seal(engine: AsyncEngine, run_id: str, rows_in: Sequence[SealRow]) -> dict[str, Any]:
    """Record finished rows. Sibling recovery seals each row; prompt_group recovery marks rows
    returned and seals the cohort in this same transaction once all N have returned."""
    by_id = {r.rollout_id: r for r in rows_in}
    async with engine.begin() as conn:
        await lock_run(conn, run_id)
        groups, atts = await lock_and_read(conn, run_id, list(by_id))
        d = _accepted(await name_refused_replacements(conn, run_id, decide_seal(by_id, atts, groups)))
        results, updates, touched_groups = d.results, d.extra, d.touched
        await _seal_rows(conn, updates)
        count_transitions(d.plan.transitions)
        cohort_sealed: list[str] = []
        # Only restored continuations (Gym-owned) can owe a forget (docs/ledger.md#the-outbox); the
        # others are not worth sending to that query.
        owned = {a.attempt_id for a in atts.values() if a.gym_owned}
        sealed_ids = [u["id"] for u in updates if u["status"] == A.sealed and u["id"] in owned] if owned else []
        if touched_groups:
            # Completion is decided in SQL over the applied rows: one pass, no re-read into Python.
            touched = touched_groups
            cohorts = [g for g in touched if granularity(groups[g].restore_level) == LiveGranularity.prompt_group]
            if cohorts:
                cohort_rows = [
                    r
                    for r in await _fetch(
                        conn,
                        "WITH done AS (SELECT a.group_id FROM attempts a JOIN prompt_groups g ON g.run_id = a.run_id AND g.group_id = a.group_id "
                        "  WHERE a.run_id = %(r)s AND a.group_id = ANY(%(g)s) AND a.is_current "
                        f"  GROUP BY a.group_id, g.expected_generations HAVING count(*) FILTER (WHERE a.status = '{A.returned}') = g.expected_generations), "
                        f"sealed AS (UPDATE attempts a SET status = '{A.sealed}', ended_at = now() FROM done "
                        "  WHERE a.run_id = %(r)s AND a.group_id = done.group_id AND a.is_current RETURNING a.group_id, a.attempt_id, a.gym_owned, "
                        "  EXTRACT(EPOCH FROM a.ended_at - a.dispatched_at)::float8 AS w) "
                        "SELECT group_id, coalesce(array_agg(attempt_id) FILTER (WHERE gym_owned), '{}'), sum(w) FROM sealed GROUP BY group_id ORDER BY 1",
                        {"r": run_id, "g": cohorts},
                    )
                ]
                cohort_sealed = [r[0] for r in cohort_rows]
                count_ended_work([(A.sealed.value, sum(float(r[2] or 0.0) for r in cohort_rows))])
                sealed_ids.extend(aid for r in cohort_rows for aid in r[1])
                if cohort_sealed:
                    count_transitions({A.sealed.value: sum(groups[g].expected_generations for g in cohort_sealed)})
            newly_ready = [
                r[0]
                for r in await _fetch(
                    conn,
                    f"UPDATE prompt_groups g SET status = '{G.ready}' WHERE g.run_id = %(r)s AND g.group_id = ANY(%(g)s) AND g.status = '{G.generating}' "
                    f"AND (SELECT count(*) FROM attempts a WHERE a.run_id = g.run_id AND a.group_id = g.group_id AND a.is_current AND a.status = '{A.sealed}') "
                    "= g.expected_generations RETURNING g.group_id",
                    {"r": run_id, "g": touched},
                )
            ]
            count_transitions({G.ready.value: len(newly_ready)})
        await forget_restored_on_seal(conn, run_id, sealed_ids)
        # A continuation that sealed without making an effect again leaves it an orphan
        # (docs/effects.md#orphans).
        await effects_store.orphan_unrepeated(conn, run_id, sealed_ids)
        sealed_now = set(cohort_sealed)
        for r in results:
            if r["result"] == A.returned and atts[r["rollout_id"]].group_id in sealed_now:
                r["status"] = A.sealed.value
        # Every group of the batch that is ready now, so a retried batch whose first answer was
        # lost still tells the trainer which groups it may consume.
        batch_groups = sorted({atts[r["rollout_id"]].group_id for r in results})
        ready = [r[0] for r in await _fetch(conn, f"SELECT group_id FROM prompt_groups WHERE run_id = %(r)s AND group_id = ANY(%(g)s) AND status = '{G.ready}' ORDER BY 1",
                                           {"r": run_id, "g": batch_groups})] if batch_groups else []
        return {"rows": results, "ready_groups": ready, "cohorts_sealed": sorted(cohort_sealed)}


async def _seal_rows(conn: AsyncConnection, updates: list[dict[str, Any]]) -> None:
    """Write seal records (``id``, ``status``, ``receipt``, ``staging_keys``, ``reward``,
    ``mask_sample``): one JSON document serialised in one native call, unpacked by
    ``jsonb_to_recordset``, as ``apply_plan`` writes its updates, without its per-column grouping."""
    if not updates:
        return
    # The sealed rows' work is counted as trained (ckptc_rollout_seconds_total) from what the
    # statement returns.
    count_ended_work(await _fetch(
        conn,
        "WITH u AS (UPDATE attempts a SET mask_sample = t.mask_sample, receipt = t.receipt, reward = t.reward, staging_keys = t.staging_keys, "
        f"status = t.status, ended_at = CASE WHEN t.status IN ({_ENDED_ATTEMPTS}) THEN now() ELSE a.ended_at END "
        "FROM jsonb_to_recordset(%(doc)s::jsonb) AS t(id bigint, mask_sample boolean, receipt jsonb, reward float8, staging_keys text[], status text) "
        f"WHERE a.attempt_id = t.id RETURNING {ENDED_WORK_RETURNING}) {ENDED_WORK_SUM}",
        {"doc": to_json(updates).decode()},
    ))


async def forget_restored_on_seal(conn: AsyncConnection, run_id: str, sealed_attempt_ids: Sequence[int]) -> int:
    """Queue a forget for every restored rollout whose continued attempt has just ended with a
    reply (sealed, or failed with a data failure): its restore left a mark at N on its instance
    that nothing else will drop (docs/ledger.md#the-outbox). Called inside the seal or fail transaction, after
    its writes.

    Only Gym-owned attempts (restored continuations) with retirement ``none`` are affected; each
    gets one ``forget`` outbox item (checkpoint id ``forget``) on its instance and moves to
    retirement ``forget_pending``. Idempotent: a second call finds nothing left to do. Returns the
    number of forget items queued.
    """
    if not sealed_attempt_ids:
        return 0
    ins = outbox.insert_items_sql(f"SELECT %(r)s, gym_instance_id, '{OutboxOp.forget}', rollout_id, gym_attempt, attempt_id, '{FORGET_CHECKPOINT_ID}' FROM f")
    ((n,),) = await _fetch(
        conn,
        "WITH f AS (SELECT attempt_id, rollout_id, gym_attempt, gym_instance_id FROM attempts "
        "WHERE run_id = %(r)s AND attempt_id = ANY(%(ids)s::bigint[]) AND gym_owned AND gym_instance_id IS NOT NULL "
        f"AND retirement = '{R.none}' AND (status = '{A.sealed}' OR (status = '{A.failed}' AND failure_class = '{AttemptFailureClass.data}'))), "
        f"ins AS ({ins}), "
        f"upd AS (UPDATE attempts a SET retirement = '{R.forget_pending}' FROM ins WHERE a.attempt_id = ins.attempt_id RETURNING 1) "
        "SELECT count(*) FROM ins",
        {"r": run_id, "ids": [int(x) for x in sealed_attempt_ids]},
    )
    return int(n or 0)


@dataclass(frozen=True)
class FailRow:
    rollout_id: str
    failure_class: str  # AttemptFailureClass
    detail: str | None = None


async def fail(engine: AsyncEngine, run_id: str, rows_in: Sequence[FailRow]) -> dict[str, Any]:
    async with engine.begin() as conn:
        run = await lock_run(conn, run_id)
        groups, atts = await lock_and_read(conn, run_id, [r.rollout_id for r in rows_in])
        states = await states_of_locked(conn, run_id, groups)
        d = _accepted(decide_fail(rows_in, atts, states, Budgets.of(run.config), _mint))
        await apply_plan(conn, run_id, d.plan)
        name_replacements(d.results, atts, states)  # a late report of a replaced row (a straggler's)
        await forget_restored_on_seal(conn, run_id, [aid for aid, ch in d.plan.status_updates.items() if ch.get("status") == A.failed])
        return {"rows": d.results, "groups": [states[g].answer() for g in d.touched]}


async def stream_ended(
    engine: AsyncEngine, run_id: str, dispatch_id: str, returned: Sequence[str] | None, *, missing: Sequence[str] | None = None
) -> dict[str, Any]:
    """A dispatch's stream ended; rows that never came back are transport failures. The caller
    names either the rows that came back (all others are lost) or the rows that did not."""
    async with engine.begin() as conn:
        run = await lock_run(conn, run_id)
        # The dispatch's calls name its attempts (there is no index on attempts.dispatch_id, so
        # that a dispatch stays a heap-only update); each attempt's own dispatch_id decides.
        gids = [
            r[0]
            for r in await _fetch(
                conn,
                "SELECT DISTINCT a.group_id FROM dispatch_calls c CROSS JOIN LATERAL unnest(c.attempt_ids) AS u(id) "
                "JOIN attempts a ON a.attempt_id = u.id WHERE c.run_id = %(r)s AND c.dispatch_id = %(d)s "
                "AND a.run_id = %(r)s AND a.dispatch_id = %(d)s",
                {"r": run_id, "d": dispatch_id},
            )
        ]
        if not gids:
            raise NotFound(f"no dispatch {dispatch_id!r} in this run", code="unknown_dispatch")
        states = await load_states(conn, run_id, gids)
        d = decide_stream_end(states, dispatch_id, returned, missing, Budgets.of(run.config), _mint)
        await apply_plan(conn, run_id, d.plan)
        return {"dispatch_id": dispatch_id, "missing": d.extra, "groups": [states[g].answer() for g in sorted(states)]}


async def finalize(engine: AsyncEngine, run_id: str, group_ids: Sequence[str]) -> dict[str, Any]:
    """The trainer consumed these ready groups; they leave the live ledger."""
    return await _group_report(engine, run_id, group_ids, lock_groups, decide_finalize)


async def abandon(engine: AsyncEngine, run_id: str, group_ids: Sequence[str]) -> dict[str, Any]:
    """Give up on groups; every attempt that may still run in Gym is queued for retirement."""
    return await _group_report(engine, run_id, group_ids, load_states, decide_abandon)


async def _group_report(
    engine: AsyncEngine,
    run_id: str,
    group_ids: Sequence[str],
    read: Callable[[AsyncConnection, str, Sequence[str]], Awaitable[Any]],
    decide: Callable[[Sequence[str], Any], Decision],
) -> dict[str, Any]:
    """A report on whole groups: the groups read (and locked) by ``read``, decided by ``decide``."""
    async with engine.begin() as conn:
        await lock_run(conn, run_id)
        rows = await read(conn, run_id, group_ids)
        d = _accepted(decide(group_ids, rows))
        await apply_plan(conn, run_id, d.plan)
        return {"groups": d.results}
