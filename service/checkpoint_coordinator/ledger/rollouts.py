"""Live rollout bookkeeping (recovery-ledger.md sections 1, 2, 4 and 7).

Every public function is one transaction that read-locks the run (fencing), locks the prompt
groups it touches in group-id order (so two batches on the same groups never deadlock), decides
in Python, and writes with set-based SQL (``unnest`` arrays), never a statement per row.

A batch is atomic: if any row is refused, nothing of the batch is written and the caller gets a
typed 409 naming each refused row.
"""

from __future__ import annotations

import functools
import secrets
from collections import defaultdict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from pydantic_core import to_json
from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine

from ..domain import levels
from ..domain.config import load_recovery_config
from ..domain.identity import capture_key, mint_rollout_id
from ..errors import Conflict, GateClosed, NotFound, RunStopped
from .db import execute, fetch, read_rows
from .runs import lock_run, stopped_by

# Every batch statement here is planned for its own arguments, never run as a prepared
# statement: after psycopg prepares a statement (its fifth run on a connection) PostgreSQL
# switches to a generic plan, which plans the arrays of thousands of ids as if they held a
# handful (the ingest benchmark's statements on one connection: 35 us of server CPU per
# transition prepared, 28-30 us planned each time).
_fetch = functools.partial(fetch, prepare=False)
_execute = functools.partial(execute, prepare=False)


def _hex() -> str:
    return secrets.token_hex(16)


def new_rollout_id(group_id: str, generation_index: int, token_hex: Callable[[], str] = _hex) -> str:
    return mint_rollout_id(group_id, generation_index, lambda _n: token_hex())


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


_GRANULARITY = {lv.value: levels.live_granularity(lv).value for lv in levels.RestoreLevel}


def granularity(level: str) -> str:
    # A dict lookup: it is asked once per row of every batch.
    g = _GRANULARITY.get(level)
    return g if g is not None else levels.live_granularity(levels.RestoreLevel(level)).value


@dataclass(frozen=True)
class Budgets:
    max_row_attempts: int
    max_group_attempts: int
    max_data_attempts: int

    @classmethod
    def of(cls, config: dict[str, Any]) -> Budgets:
        return cls(
            max_row_attempts=int(config.get("max_row_attempts", 3)),
            max_group_attempts=int(config.get("max_group_attempts", 3)),
            max_data_attempts=int(config.get("max_data_attempts", 2)),
        )


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


# --------------------------------------------------------------------------------------------
# Reading


@dataclass(slots=True)
class AttemptRow:
    attempt_id: int
    group_id: str
    generation_index: int
    rollout_id: str
    gym_instance_id: str | None
    gym_attempt: int
    group_attempt: int
    status: str
    is_current: bool
    refusals: int
    receipt: dict[str, Any] | None
    reward: float | None
    mask_sample: bool | None
    staging_keys: list[str] | None
    gym_owned: bool
    dispatch_id: str | None
    retirement: str
    row_attempts_used: int = 0

    @property
    def capture_key(self) -> str:
        return capture_key(self.rollout_id, self.gym_attempt)


@dataclass
class GroupRow:
    group_id: str
    restore_level: str
    expected_generations: int
    group_attempt: int
    data_attempts_used: int
    status: str
    fields: dict[str, Any] = field(default_factory=dict)


_ATT_COLS = (
    "a.attempt_id, a.group_id, a.generation_index, a.rollout_id, a.gym_instance_id, a.gym_attempt, "
    "a.group_attempt, a.status, a.is_current, a.refusals, a.receipt, a.reward, a.mask_sample, "
    "a.staging_keys, a.gym_owned, a.dispatch_id, a.retirement"
)


_GROUP_SQL = (
    "SELECT group_id, restore_level, expected_generations, group_attempt, data_attempts_used, status, "
    "prompt_ref, task_digest, task_source, agent_name, target_step, weight_version FROM prompt_groups "
)
_GROUP_FIELDS = ("prompt_ref", "task_digest", "task_source", "agent_name", "target_step", "weight_version")


def _group_rows(rows: list[tuple[Any, ...]]) -> dict[str, GroupRow]:
    out = {}
    for r in rows:
        fields = dict(zip(_GROUP_FIELDS, r[6:], strict=True))
        fields["expected_generations"] = r[2]
        out[r[0]] = GroupRow(r[0], r[1], r[2], r[3], r[4], r[5], fields)
    return out


async def _lock_groups(conn: AsyncConnection, run_id: str, group_ids: Iterable[str]) -> dict[str, GroupRow]:
    ids = sorted(set(group_ids))
    if not ids:
        return {}
    rows = await _fetch(conn, _GROUP_SQL + "WHERE run_id = %(r)s AND group_id = ANY(%(ids)s) ORDER BY group_id FOR UPDATE", {"r": run_id, "ids": ids})
    return _group_rows(rows)


async def _lock_groups_of(conn: AsyncConnection, run_id: str, rollout_ids: Sequence[str]) -> dict[str, GroupRow]:
    """Lock (in id order) the groups that own these rollouts: one query, no prior read."""
    rows = await _fetch(
        conn,
        _GROUP_SQL + "WHERE run_id = %(r)s AND group_id IN (SELECT DISTINCT group_id FROM attempts WHERE run_id = %(r)s AND rollout_id = ANY(%(ids)s)) "
        "ORDER BY group_id FOR UPDATE",
        {"r": run_id, "ids": list(rollout_ids)},
    )
    return _group_rows(rows)


_ATT_SQL = (
    f"SELECT {_ATT_COLS}, s.row_attempts_used FROM attempts a JOIN siblings s "
    "ON s.run_id = a.run_id AND s.group_id = a.group_id AND s.generation_index = a.generation_index "
)


def _groups_named_by(rollout_ids: Iterable[str]) -> list[str]:
    """The group ids minted rollout ids name (``<group>_g<i>_a<hex>``, section 1), sorted. Only a
    guess: an imported ledger's rollout ids need not have that form, see ``_lock_and_read``."""
    out = set()
    for rid in rollout_ids:
        g, sep, _ = rid.rpartition("_g")
        if sep and g:
            out.add(g)
    return sorted(out)


async def _lock_and_read(conn: AsyncConnection, run_id: str, rollout_ids: Sequence[str]) -> tuple[dict[str, GroupRow], dict[str, AttemptRow]]:
    """Lock (in group-id order) the groups that own these rollouts, then read the named attempts.

    The groups are taken from the rollout ids themselves (a minted id starts with its group id),
    locked by primary key, and their current attempts read through the partial index of current
    attempts: 1 000 key lookups for a batch of 8 000 rows instead of looking every rollout id up
    twice (once to find the groups to lock, once to read the attempts after the lock). Named
    attempts that are not current (a repeat about a replaced row) are looked up by rollout id.
    If an attempt turns out to belong to a group that was not locked (an imported rollout id of
    another form), the guessed locks are rolled back to a savepoint and the groups are found
    through the attempts, as before, so the lock order stays the group-id order either way."""
    guess = _groups_named_by(rollout_ids)
    if guess:
        await _execute(conn, "SAVEPOINT ckpt_lock_guess", {})
        groups = await _lock_groups(conn, run_id, guess)
        atts: dict[str, AttemptRow] = {}
        if groups:
            wanted = set(rollout_ids)
            # One probe of uq_attempts_current_per_sibling per locked group, whatever the
            # statistics say: the plain "group_id = ANY(...)" form was planned, with the run's
            # row count underestimated while it grows, as a scan of the whole run filtered by the
            # 1 000-element array (~120-140 ms per 8 000-row batch at 200 000 attempts, growing with
            # the run) instead of ~15 ms. OFFSET 0 keeps the subquery from being flattened into a
            # hash join over the run.
            rows = await _fetch(
                conn,
                f"SELECT {_ATT_COLS}, 0 FROM unnest(%(g)s::text[]) AS t(g) CROSS JOIN LATERAL "
                "(SELECT * FROM attempts WHERE run_id = %(r)s AND group_id = t.g AND is_current OFFSET 0) AS a",
                {"r": run_id, "g": list(groups)},
            )
            atts = {r[3]: AttemptRow(*r) for r in rows if r[3] in wanted}
        if len(atts) < len(rollout_ids):
            rest = [rid for rid in rollout_ids if rid not in atts]
            atts.update(await _attempts_by_rollout(conn, run_id, rest))
        if all(a.group_id in groups for a in atts.values()):
            await _execute(conn, "RELEASE SAVEPOINT ckpt_lock_guess", {})
            return groups, atts
        await _execute(conn, "ROLLBACK TO SAVEPOINT ckpt_lock_guess", {})
    groups = await _lock_groups_of(conn, run_id, rollout_ids)
    return groups, await _attempts_by_rollout(conn, run_id, rollout_ids)


async def _attempts_by_rollout(conn: AsyncConnection, run_id: str, rollout_ids: Sequence[str]) -> dict[str, AttemptRow]:
    """The named attempts, without their sibling's ``row_attempts_used`` (left 0): dispatch, seal
    and refusal never read it, and a failure takes it from the current attempts of its locked
    group. Saves a primary-key probe into ``siblings`` per row of every batch."""
    rows = await _fetch(conn, f"SELECT {_ATT_COLS}, 0 FROM attempts a WHERE a.run_id = %(r)s AND a.rollout_id = ANY(%(ids)s)", {"r": run_id, "ids": list(rollout_ids)})
    return {r[3]: AttemptRow(*r) for r in rows}


async def _current_attempts(conn: AsyncConnection, run_id: str, group_ids: Sequence[str]) -> dict[str, list[AttemptRow]]:
    rows = await _fetch(
        conn,
        _ATT_SQL + "WHERE a.run_id = %(r)s AND a.group_id = ANY(%(ids)s) AND a.is_current ORDER BY a.group_id, a.generation_index",
        {"r": run_id, "ids": list(group_ids)},
    )
    out: dict[str, list[AttemptRow]] = defaultdict(list)
    for r in rows:
        out[r[1]].append(AttemptRow(*r))
    return out


def send_row(a: AttemptRow, level: str, instance_id: str | None = None) -> dict[str, Any]:
    return {
        "group_id": a.group_id,
        "generation_index": a.generation_index,
        "rollout_id": a.rollout_id,
        "capture_key": a.capture_key,
        "gym_attempt": a.gym_attempt,
        "group_attempt": a.group_attempt,
        "status": a.status,
        "restore_level": level,
        # A Gym-owned continuation must go back to the instance holding its state.
        "instance_id": instance_id if instance_id is not None else (a.gym_instance_id if a.gym_owned else None),
    }


# --------------------------------------------------------------------------------------------
# Writing helpers


class _Plan:
    """Collects the writes of one batch, then applies them set-based."""

    def __init__(self, run_id: str, token_hex: Callable[[], str]) -> None:
        self.run_id = run_id
        self.token_hex = token_hex
        self.status_updates: dict[int, dict[str, Any]] = {}
        self.new_attempts: list[dict[str, Any]] = []
        self.retires: list[AttemptRow] = []
        self.group_updates: dict[str, dict[str, Any]] = {}
        self.row_attempts: dict[tuple[str, int], int] = {}
        self.transitions: dict[str, int] = defaultdict(int)

    def set_attempt(self, a: AttemptRow, **changes: Any) -> None:
        cur = self.status_updates.setdefault(a.attempt_id, {})
        cur.update(changes)
        if "status" in changes:
            self.transitions[changes["status"]] += 1

    def end_attempt(self, a: AttemptRow, status: str, failure_class: str | None = None) -> None:
        """Abandon/fail an attempt; one that may still run in Gym gets a retire item."""
        needs_retire = a.status == "dispatched" or (a.gym_owned and a.gym_instance_id is not None)
        changes: dict[str, Any] = {"status": status, "is_current": False}
        if failure_class:
            changes["failure_class"] = failure_class
        if needs_retire and a.gym_instance_id is not None and a.retirement == "none":
            changes["retirement"] = "retire_pending"
            self.retires.append(a)
        self.set_attempt(a, **changes)

    def mint(self, group_id: str, generation_index: int, group_attempt: int) -> dict[str, Any]:
        row = {
            "group_id": group_id,
            "generation_index": generation_index,
            "rollout_id": new_rollout_id(group_id, generation_index, self.token_hex),
            "group_attempt": group_attempt,
        }
        self.new_attempts.append(row)
        self.transitions["reserved"] += 1
        return row

    def set_group(self, group_id: str, **changes: Any) -> None:
        self.group_updates.setdefault(group_id, {}).update(changes)

    async def apply(self, conn: AsyncConnection) -> None:
        await self._apply_attempt_updates(conn)
        if self.new_attempts:
            await _execute(
                conn,
                "INSERT INTO attempts (run_id, group_id, generation_index, rollout_id, group_attempt) "
                "SELECT %(r)s, g, i, ro, ga FROM unnest(%(g)s::text[], %(i)s::int[], %(ro)s::text[], %(ga)s::int[]) AS t(g, i, ro, ga)",
                {
                    "r": self.run_id,
                    "g": [x["group_id"] for x in self.new_attempts],
                    "i": [x["generation_index"] for x in self.new_attempts],
                    "ro": [x["rollout_id"] for x in self.new_attempts],
                    "ga": [x["group_attempt"] for x in self.new_attempts],
                },
            )
        if self.row_attempts:
            keys = list(self.row_attempts)
            await _execute(
                conn,
                "UPDATE siblings s SET row_attempts_used = t.n FROM unnest(%(g)s::text[], %(i)s::int[], %(n)s::int[]) AS t(g, i, n) "
                "WHERE s.run_id = %(r)s AND s.group_id = t.g AND s.generation_index = t.i",
                {"r": self.run_id, "g": [k[0] for k in keys], "i": [k[1] for k in keys], "n": [self.row_attempts[k] for k in keys]},
            )
        await self._apply_group_updates(conn)
        if self.retires:
            await enqueue_retires(conn, self.run_id, self.retires)
        _count_transitions(self.transitions)

    async def _apply_group_updates(self, conn: AsyncConnection) -> None:
        by_shape: dict[tuple[str, ...], list[tuple[str, dict[str, Any]]]] = defaultdict(list)
        for gid, ch in self.group_updates.items():
            by_shape[tuple(sorted(ch))].append((gid, ch))
        for cols, items in by_shape.items():
            params: dict[str, Any] = {"r": self.run_id, "gids": [gid for gid, _ in items]}
            for c in cols:
                params[c] = [ch[c] for _, ch in items]
            casts = ", ".join(f"%({c})s::{_GROUP_COL_TYPES[c]}[]" for c in cols)
            sets = ", ".join(f"{c} = t.{c}" for c in cols)
            if "status" in cols:
                sets += ", ended_at = CASE WHEN t.status IN ('finalized', 'abandoned') THEN now() ELSE g.ended_at END"
            await _execute(
                conn,
                f"UPDATE prompt_groups g SET {sets} FROM unnest(%(gids)s::text[], {casts}) AS t(gid, {', '.join(cols)}) "
                "WHERE g.run_id = %(r)s AND g.group_id = t.gid",
                params,
            )

    async def _apply_attempt_updates(self, conn: AsyncConnection) -> None:
        if not self.status_updates:
            return
        # Group updates by the set of columns they touch, one UPDATE per shape. The rows travel as
        # one JSON document (serialised in one native call) that PostgreSQL unpacks with
        # jsonb_to_recordset: no per-row JSON dump of receipts, no per-element array dumping.
        by_shape: dict[tuple[str, ...], list[tuple[int, dict[str, Any]]]] = defaultdict(list)
        for aid, ch in self.status_updates.items():
            by_shape[tuple(sorted(ch))].append((aid, ch))
        for cols, items in by_shape.items():
            doc = to_json([{"id": aid, **ch} for aid, ch in items]).decode()
            sets = [f"{c} = t.{c}" for c in cols]
            if "status" in cols:
                sets.append("ended_at = CASE WHEN t.status IN ('sealed','failed','abandoned') THEN now() ELSE a.ended_at END")
                sets.append("dispatched_at = CASE WHEN t.status = 'dispatched' THEN now() ELSE a.dispatched_at END")
            record = ", ".join(["id bigint", *(f"{c} {_COL_TYPES[c]}" for c in cols)])
            await _execute(
                conn,
                f"UPDATE attempts a SET {', '.join(sets)} FROM jsonb_to_recordset(%(doc)s::jsonb) AS t({record}) WHERE a.attempt_id = t.id",
                {"doc": doc},
            )


_GROUP_COL_TYPES = {"status": "text", "group_attempt": "int", "data_attempts_used": "int"}

_COL_TYPES = {
    "status": "text",
    "is_current": "boolean",
    "failure_class": "text",
    "retirement": "text",
    "gym_instance_id": "text",
    "dispatch_id": "text",
    "refusals": "int",
    "receipt": "jsonb",
    "reward": "float8",
    "mask_sample": "boolean",
    "staging_keys": "text[]",
    "gym_owned": "boolean",
    "replaced_by_attempt_id": "bigint",
}


def _count_transitions(transitions: dict[str, int]) -> None:
    from ..observability.metrics import record_ledger_transition

    for to, n in transitions.items():
        if n:
            record_ledger_transition(to, n)


async def enqueue_retires(conn: AsyncConnection, run_id: str, attempts: Sequence[AttemptRow], checkpoint_id: str = "retire") -> None:
    """Queue a retire of each attempt on its instance, in the caller's transaction (section 7)."""
    items = [a for a in attempts if a.gym_instance_id is not None]
    if not items:
        return
    await _execute(
        conn,
        "INSERT INTO outbox_items (run_id, instance_id, op, rollout_id, gym_attempt, attempt_id, checkpoint_id) "
        "SELECT %(r)s, inst, 'retire', ro, ga, aid, %(cp)s FROM unnest(%(inst)s::text[], %(ro)s::text[], %(ga)s::int[], %(aid)s::bigint[]) AS t(inst, ro, ga, aid)",
        {
            "r": run_id,
            "cp": checkpoint_id,
            "inst": [a.gym_instance_id for a in items],
            "ro": [a.rollout_id for a in items],
            "ga": [a.gym_attempt for a in items],
            "aid": [a.attempt_id for a in items],
        },
    )


# --------------------------------------------------------------------------------------------
# Section 4 operations


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


async def admit(engine: AsyncEngine, run_id: str, groups: Sequence[AdmitGroup]) -> list[dict[str, Any]]:
    """Create groups, siblings and one reserved attempt per sibling; answer the rows to send.

    An identical repeat answers the group's current rows; a repeat with other fields is refused.
    """
    seen: set[str] = set()
    dups = [g.group_id for g in groups if g.group_id in seen or seen.add(g.group_id)]  # type: ignore[func-returns-value]
    if dups:
        raise BatchRefused([{"group_id": d, "code": "duplicate_in_batch", "detail": "group named twice in one batch"} for d in dups])
    async with engine.begin() as conn:
        run = await lock_run(conn, run_id)
        existing = await _lock_groups(conn, run_id, (g.group_id for g in groups))
        refused = []
        for g in groups:
            ex = existing.get(g.group_id)
            if ex is None:
                continue
            want = {
                "prompt_ref": g.prompt_ref, "task_digest": g.task_digest, "task_source": g.task_source,
                "agent_name": g.agent_name, "target_step": g.target_step, "weight_version": g.weight_version,
                "expected_generations": g.expected_generations,
            }
            diff = sorted(k for k, v in want.items() if ex.fields.get(k) != v)
            if diff:
                refused.append({"group_id": g.group_id, "code": "group_conflict", "detail": f"admitted before with other {', '.join(diff)}"})
        if refused:
            raise BatchRefused(refused)
        new = [g for g in groups if g.group_id not in existing]
        resolve = _level_resolver(run.config)
        levels = {g.group_id: resolve(g.agent_name, g.task_source) for g in new}
        minted: dict[str, list[tuple[int, str]]] = defaultdict(list)
        if new:
            await _execute(
                conn,
                "INSERT INTO prompt_groups (run_id, group_id, prompt_ref, task_digest, task_source, agent_name, restore_level, "
                "expected_generations, target_step, weight_version) "
                "SELECT %(r)s, g, pr, td, ts, an, lv, n, st, wv FROM unnest(%(g)s::text[], "
                "ARRAY(SELECT e FROM jsonb_array_elements(%(pr)s::jsonb) WITH ORDINALITY AS x(e, o) ORDER BY o), "
                "%(td)s::text[], %(ts)s::text[], %(an)s::text[], %(lv)s::text[], %(n)s::int[], "
                "%(st)s::bigint[], %(wv)s::text[]) AS t(g, pr, td, ts, an, lv, n, st, wv)",
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
            # Rollout ids are minted here, one fresh random 32-hex suffix per attempt (section 1).
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
            _count_transitions({"reserved": len(rows)})
        current = await _current_attempts(conn, run_id, list(existing)) if existing else {}
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
                     "status": "reserved", "restore_level": level, "instance_id": None}
                    for i, ro in sorted(minted[gid])
                ]
            out.append(
                {
                    "group_id": g.group_id,
                    "restore_level": level,
                    "granularity": granularity(level),
                    "status": ex.status if ex else "generating",
                    "group_attempt": ex.group_attempt if ex else 0,
                    "admitted": ex is None,
                    "rows": send,
                }
            )
        return out


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
        if run.gate_snapshot_id is not None:
            stopped = await stopped_by(conn, run_id, run.gate_snapshot_id)
            if stopped is not None:
                raise RunStopped(f"run {run_id!r} was stopped by snapshot {stopped!r}; restore it or reopen it first", snapshot_id=stopped)
            raise GateClosed(
                f"dispatch gate closed by snapshot {run.gate_snapshot_id}; retry after it reopens",
                snapshot_id=run.gate_snapshot_id,
                retry_after_s=retry_after_s,
            )
        if instance_id is not None:
            known = (await conn.execute(text("SELECT array_agg(instance_id) FROM gym_instances WHERE run_id = :r"), {"r": run_id})).scalar()
            if known and instance_id not in known:
                raise NotFound(f"instance {instance_id!r} is not registered for this run", code="unknown_instance", instance_id=instance_id)
        groups, atts = await _lock_and_read(conn, run_id, rollout_ids)
        refused, todo, rows = [], [], []
        for rid in rollout_ids:
            a = atts.get(rid)
            if a is None:
                refused.append({"rollout_id": rid, "code": "unknown_rollout", "detail": "no attempt with this rollout id"})
                continue
            level = groups[a.group_id].restore_level
            if a.status == "dispatched" and a.is_current:
                if a.dispatch_id == dispatch_id and a.gym_instance_id == instance_id:
                    rows.append(send_row(a, level, instance_id))  # identical repeat
                else:
                    refused.append({"rollout_id": rid, "code": "already_dispatched", "detail": f"dispatched in {a.dispatch_id} to {a.gym_instance_id}"})
                continue
            if not a.is_current or a.status != "reserved":
                refused.append({"rollout_id": rid, "code": "attempt_not_current", "detail": f"attempt is {a.status}; send its replacement"})
                continue
            if groups[a.group_id].status != "generating":
                refused.append({"rollout_id": rid, "code": "group_not_generating", "detail": f"group is {groups[a.group_id].status}"})
                continue
            if level == "turn" and instance_id is None:
                refused.append({"rollout_id": rid, "code": "instance_required", "detail": "turn-level attempts need a Gym instance"})
                continue
            if a.gym_owned and a.gym_instance_id != instance_id:
                refused.append({"rollout_id": rid, "code": "wrong_instance", "detail": f"restored continuation lives on {a.gym_instance_id}"})
                continue
            todo.append(a)
            rows.append(send_row(a, level, instance_id))
        if refused:
            raise BatchRefused(refused)
        if todo:
            # Every row gets the same values: one array of ids, no per-row document.
            ids = [a.attempt_id for a in todo]
            # One statement: the update, and the dispatch_calls row that "stream ended" looks the
            # dispatch's rows up by (no index on dispatch_id); the id array is sent once.
            await _execute(
                conn,
                "WITH u AS (UPDATE attempts SET status = 'dispatched', gym_instance_id = %(i)s, dispatch_id = %(d)s, dispatched_at = now() "
                "WHERE attempt_id = ANY(%(ids)s::bigint[])) "
                "INSERT INTO dispatch_calls (run_id, dispatch_id, attempt_ids) VALUES (%(r)s, %(d)s, %(ids)s::bigint[])",
                {"r": run_id, "i": instance_id, "d": dispatch_id, "ids": ids},
            )
            _count_transitions({"dispatched": len(todo)})
        for r in rows:
            r["status"] = "dispatched"
        return {"dispatch_id": dispatch_id, "instance_id": instance_id, "rows": rows}


async def refused(engine: AsyncEngine, run_id: str, rollout_ids: Sequence[str]) -> dict[str, Any]:
    """Gym refused these rows at admission: back to reserved, same identity, no attempt spent."""
    async with engine.begin() as conn:
        await lock_run(conn, run_id)
        groups, atts = await _lock_and_read(conn, run_id, rollout_ids)
        bad, plan, rows = [], _Plan(run_id, _hex), []
        for rid in rollout_ids:
            a = atts.get(rid)
            if a is None:
                bad.append({"rollout_id": rid, "code": "unknown_rollout", "detail": "no attempt with this rollout id"})
            elif a.is_current and a.status == "reserved":
                rows.append(send_row(a, groups[a.group_id].restore_level))  # repeat: already back
            elif a.is_current and a.status == "dispatched":
                changes: dict[str, Any] = {"status": "reserved", "refusals": a.refusals + 1, "dispatch_id": None}
                if not a.gym_owned:
                    changes["gym_instance_id"] = None  # it never ran: any instance may take it
                plan.set_attempt(a, **changes)
                a.status = "reserved"
                rows.append(send_row(a, groups[a.group_id].restore_level))
            else:
                bad.append({"rollout_id": rid, "code": "attempt_not_current", "detail": f"attempt is {a.status}"})
        if bad:
            raise BatchRefused(bad)
        await plan.apply(conn)
        return {"rows": rows}


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
        groups, atts = await _lock_and_read(conn, run_id, list(by_id))
        bad: list[dict[str, Any]] = []
        results: list[dict[str, Any]] = []
        # One record per row to write, serialised as one JSON document (see _seal_rows).
        updates: list[dict[str, Any]] = []
        touched_groups: set[str] = set()
        for rid, row in by_id.items():
            a = atts.get(rid)
            if a is None:
                bad.append({"rollout_id": rid, "code": "unknown_rollout", "detail": "no attempt with this rollout id"})
                continue
            got_key = row.receipt.get("rollout_id")
            if got_key != a.capture_key:
                bad.append({"rollout_id": rid, "code": "receipt_mismatch", "detail": f"receipt names {got_key!r}, expected capture key {a.capture_key!r}"})
                continue
            if a.status in ("sealed", "returned"):
                same = a.receipt == row.receipt and list(a.staging_keys or []) == list(row.staging_keys) and a.reward == row.reward and a.mask_sample == row.mask_sample
                if same:
                    results.append({"rollout_id": rid, "result": "unchanged", "status": a.status})
                else:
                    bad.append({"rollout_id": rid, "code": "seal_conflict", "detail": "sealed before with a different receipt or payload"})
                continue
            if not a.is_current:
                bad.append({"rollout_id": rid, "code": "attempt_replaced", "detail": f"attempt was {a.status} and replaced; its result is discarded"})
                continue
            if a.status != "dispatched" or groups[a.group_id].status != "generating":
                bad.append({"rollout_id": rid, "code": "attempt_not_current", "detail": f"attempt is {a.status}, group {groups[a.group_id].status}"})
                continue
            level = groups[a.group_id].restore_level
            status = "returned" if granularity(level) == "prompt_group" else "sealed"
            updates.append(
                {"id": a.attempt_id, "status": status, "receipt": row.receipt, "staging_keys": list(row.staging_keys),
                 "reward": row.reward, "mask_sample": row.mask_sample}
            )
            a.status = status
            touched_groups.add(a.group_id)
            results.append({"rollout_id": rid, "result": status, "status": status})
        if bad:
            raise BatchRefused(bad)
        await _seal_rows(conn, updates)
        cohort_sealed: list[str] = []
        # Only restored continuations (Gym-owned) can owe a forget (section 7); the others are not
        # worth sending to that query.
        owned = {a.attempt_id for a in atts.values() if a.gym_owned}
        sealed_ids = [u["id"] for u in updates if u["status"] == "sealed" and u["id"] in owned] if owned else []
        if touched_groups:
            # Completion is decided in SQL over the applied rows: one pass, no re-read into Python.
            touched = sorted(touched_groups)
            cohorts = [g for g in touched if granularity(groups[g].restore_level) == "prompt_group"]
            if cohorts:
                cohort_rows = [
                    r
                    for r in await _fetch(
                        conn,
                        "WITH done AS (SELECT a.group_id FROM attempts a JOIN prompt_groups g ON g.run_id = a.run_id AND g.group_id = a.group_id "
                        "  WHERE a.run_id = %(r)s AND a.group_id = ANY(%(g)s) AND a.is_current "
                        "  GROUP BY a.group_id, g.expected_generations HAVING count(*) FILTER (WHERE a.status = 'returned') = g.expected_generations), "
                        "sealed AS (UPDATE attempts a SET status = 'sealed', ended_at = now() FROM done "
                        "  WHERE a.run_id = %(r)s AND a.group_id = done.group_id AND a.is_current RETURNING a.group_id, a.attempt_id, a.gym_owned) "
                        "SELECT group_id, coalesce(array_agg(attempt_id) FILTER (WHERE gym_owned), '{}') FROM sealed GROUP BY group_id ORDER BY 1",
                        {"r": run_id, "g": cohorts},
                    )
                ]
                cohort_sealed = [r[0] for r in cohort_rows]
                sealed_ids.extend(aid for r in cohort_rows for aid in r[1])
                if cohort_sealed:
                    _count_transitions({"sealed": sum(groups[g].expected_generations for g in cohort_sealed)})
            newly_ready = [
                r[0]
                for r in await _fetch(
                    conn,
                    "UPDATE prompt_groups g SET status = 'ready' WHERE g.run_id = %(r)s AND g.group_id = ANY(%(g)s) AND g.status = 'generating' "
                    "AND (SELECT count(*) FROM attempts a WHERE a.run_id = g.run_id AND a.group_id = g.group_id AND a.is_current AND a.status = 'sealed') "
                    "= g.expected_generations RETURNING g.group_id",
                    {"r": run_id, "g": touched},
                )
            ]
            _count_transitions({"ready": len(newly_ready)})
        await _forget_restored(conn, run_id, sealed_ids)
        sealed_now = set(cohort_sealed)
        for r in results:
            if r["result"] == "returned" and atts[r["rollout_id"]].group_id in sealed_now:
                r["status"] = "sealed"
        # Every group of the batch that is ready now, so a retried batch whose first answer was
        # lost still tells the trainer which groups it may consume.
        batch_groups = sorted({atts[r["rollout_id"]].group_id for r in results})
        ready = [r[0] for r in await _fetch(conn, "SELECT group_id FROM prompt_groups WHERE run_id = %(r)s AND group_id = ANY(%(g)s) AND status = 'ready' ORDER BY 1",
                                           {"r": run_id, "g": batch_groups})] if batch_groups else []
        return {"rows": results, "ready_groups": ready, "cohorts_sealed": sorted(cohort_sealed)}


async def _seal_rows(conn: AsyncConnection, updates: list[dict[str, Any]]) -> None:
    """Write seal records (``id``, ``status``, ``receipt``, ``staging_keys``, ``reward``,
    ``mask_sample``): one JSON document serialised in one native call, unpacked by
    ``jsonb_to_recordset``, as ``_Plan`` writes its updates, without its per-row bookkeeping."""
    if not updates:
        return
    await _execute(
        conn,
        "UPDATE attempts a SET mask_sample = t.mask_sample, receipt = t.receipt, reward = t.reward, staging_keys = t.staging_keys, "
        "status = t.status, ended_at = CASE WHEN t.status IN ('sealed','failed','abandoned') THEN now() ELSE a.ended_at END "
        "FROM jsonb_to_recordset(%(doc)s::jsonb) AS t(id bigint, mask_sample boolean, receipt jsonb, reward float8, staging_keys text[], status text) "
        "WHERE a.attempt_id = t.id",
        {"doc": to_json(updates).decode()},
    )
    n: dict[str, int] = defaultdict(int)
    for u in updates:
        n[u["status"]] += 1
    _count_transitions(n)


async def _forget_restored(conn: AsyncConnection, run_id: str, ended_attempt_ids: list[int]) -> None:
    """A restored rollout is forgotten on Gym once its continued attempt has replied (section 7)."""
    if ended_attempt_ids:
        from .restore import forget_restored_on_seal

        await forget_restored_on_seal(conn, run_id, ended_attempt_ids)


class _GroupState:
    """In-memory view of one locked group while a batch decides its fate."""

    def __init__(self, g: GroupRow, current: list[AttemptRow]) -> None:
        self.g = g
        self.current = {a.generation_index: a for a in current}
        self.minted: list[dict[str, Any]] = []

    @property
    def granularity(self) -> str:
        return granularity(self.g.restore_level)


def _replace_cohort(plan: _Plan, st: _GroupState, budgets: Budgets, *, data: bool) -> None:
    """Fail the group's current cohort; mint a fresh one under group_attempt + 1, or abandon."""
    for a in list(st.current.values()):
        if a.status in ("dispatched", "reserved", "returned"):
            plan.end_attempt(a, "abandoned")
        else:
            plan.set_attempt(a, is_current=False)
    st.current.clear()
    g = st.g
    if data:
        g.data_attempts_used += 1
        plan.set_group(g.group_id, data_attempts_used=g.data_attempts_used)
        exhausted = g.data_attempts_used >= budgets.max_data_attempts
    else:
        exhausted = g.group_attempt + 1 >= budgets.max_group_attempts
    if exhausted:
        g.status = "abandoned"
        plan.set_group(g.group_id, status="abandoned")
        return
    g.group_attempt += 1
    plan.set_group(g.group_id, group_attempt=g.group_attempt)
    for i in range(g.expected_generations):
        row = plan.mint(g.group_id, i, g.group_attempt)
        plan.row_attempts[(g.group_id, i)] = 0
        st.minted.append(row)
        st.current[i] = _minted_view(row)


def _minted_view(row: dict[str, Any]) -> AttemptRow:
    return AttemptRow(
        attempt_id=-1, group_id=row["group_id"], generation_index=row["generation_index"], rollout_id=row["rollout_id"],
        gym_instance_id=None, gym_attempt=0, group_attempt=row["group_attempt"], status="reserved", is_current=True,
        refusals=0, receipt=None, reward=None, mask_sample=None, staging_keys=None, gym_owned=False, dispatch_id=None,
        retirement="none",
    )


def _transport_failure(plan: _Plan, st: _GroupState, a: AttemptRow, budgets: Budgets) -> None:
    if st.granularity == "prompt_group":
        plan.end_attempt(a, "abandoned", "transport")
        st.current.pop(a.generation_index, None)
        _replace_cohort(plan, st, budgets, data=False)
        return
    used = a.row_attempts_used + 1
    plan.end_attempt(a, "abandoned", "transport")
    del st.current[a.generation_index]
    if used >= budgets.max_row_attempts:
        _replace_cohort(plan, st, budgets, data=False)
        return
    plan.row_attempts[(a.group_id, a.generation_index)] = used
    row = plan.mint(a.group_id, a.generation_index, st.g.group_attempt)
    st.minted.append(row)
    view = _minted_view(row)
    view.row_attempts_used = used
    st.current[a.generation_index] = view


def _data_failure(plan: _Plan, st: _GroupState, a: AttemptRow, budgets: Budgets) -> None:
    # The row got a reply, so it ended in Gym: failed, no retire. Its siblings may still run.
    plan.set_attempt(a, status="failed", is_current=False, failure_class="data")
    st.current.pop(a.generation_index, None)
    _replace_cohort(plan, st, budgets, data=True)


def _group_answer(st: _GroupState) -> dict[str, Any]:
    level = st.g.restore_level
    send = [send_row(a, level) for _, a in sorted(st.current.items()) if a.status == "reserved"] if st.g.status == "generating" else []
    return {"group_id": st.g.group_id, "status": st.g.status, "group_attempt": st.g.group_attempt, "rows_to_send": send}


async def _load_states(conn: AsyncConnection, run_id: str, group_ids: Iterable[str]) -> dict[str, _GroupState]:
    return await _load_states_locked(conn, run_id, await _lock_groups(conn, run_id, group_ids))


async def _load_states_locked(conn: AsyncConnection, run_id: str, groups: dict[str, GroupRow]) -> dict[str, _GroupState]:
    current = await _current_attempts(conn, run_id, list(groups))
    return {gid: _GroupState(g, current.get(gid, [])) for gid, g in groups.items()}


@dataclass(frozen=True)
class FailRow:
    rollout_id: str
    failure_class: str  # "data" | "transport"
    detail: str | None = None


async def fail(engine: AsyncEngine, run_id: str, rows_in: Sequence[FailRow]) -> dict[str, Any]:
    async with engine.begin() as conn:
        run = await lock_run(conn, run_id)
        budgets = Budgets.of(run.config)
        ids = [r.rollout_id for r in rows_in]
        groups, atts = await _lock_and_read(conn, run_id, ids)
        states = await _load_states_locked(conn, run_id, groups)
        plan, bad, results = _Plan(run_id, _hex), [], []
        touched: list[str] = []
        for r in rows_in:
            a = atts.get(r.rollout_id)
            if a is None:
                bad.append({"rollout_id": r.rollout_id, "code": "unknown_rollout", "detail": "no attempt with this rollout id"})
                continue
            st = states[a.group_id]
            cur = st.current.get(a.generation_index)
            if a.status in ("failed", "abandoned") or (cur is not None and cur.rollout_id != a.rollout_id):
                results.append({"rollout_id": r.rollout_id, "result": "unchanged"})  # already handled
            elif a.status in ("sealed", "returned"):
                bad.append({"rollout_id": r.rollout_id, "code": "attempt_sealed", "detail": "a sealed row cannot fail"})
                continue
            elif a.status == "reserved":
                bad.append({"rollout_id": r.rollout_id, "code": "attempt_not_dispatched", "detail": "a reserved row never reached Gym; dispatch it"})
                continue
            elif st.g.status != "generating":
                results.append({"rollout_id": r.rollout_id, "result": "unchanged"})
            else:
                a.row_attempts_used = cur.row_attempts_used if cur else 0
                if r.failure_class == "data":
                    _data_failure(plan, st, a, budgets)
                else:
                    _transport_failure(plan, st, a, budgets)
                results.append({"rollout_id": r.rollout_id, "result": "failed" if r.failure_class == "data" else "abandoned"})
            if a.group_id not in touched:
                touched.append(a.group_id)
        if bad:
            raise BatchRefused(bad)
        await plan.apply(conn)
        await _forget_restored(conn, run_id, [aid for aid, ch in plan.status_updates.items() if ch.get("status") == "failed"])
        return {"rows": results, "groups": [_group_answer(states[g]) for g in touched]}


async def stream_ended(
    engine: AsyncEngine, run_id: str, dispatch_id: str, returned: Sequence[str] | None, *, missing: Sequence[str] | None = None
) -> dict[str, Any]:
    """A dispatch's stream ended; rows that never came back are transport failures. The caller
    names either the rows that came back (all others are lost) or the rows that did not."""
    async with engine.begin() as conn:
        run = await lock_run(conn, run_id)
        budgets = Budgets.of(run.config)
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
        states = await _load_states(conn, run_id, gids)
        back = set(returned or ())
        named_missing = set(missing) if missing is not None else None
        plan, lost_ids = _Plan(run_id, _hex), []
        for gid in sorted(states):
            st = states[gid]
            if st.g.status != "generating":
                continue
            lost = [
                a for a in st.current.values()
                if a.dispatch_id == dispatch_id and a.status == "dispatched"
                and (a.rollout_id in named_missing if named_missing is not None else a.rollout_id not in back)
            ]
            for a in sorted(lost, key=lambda x: x.generation_index):
                if st.current.get(a.generation_index) is not a:
                    continue  # replaced by an earlier row's cohort replacement in this batch
                lost_ids.append(a.rollout_id)
                _transport_failure(plan, st, a, budgets)
        await plan.apply(conn)
        return {"dispatch_id": dispatch_id, "missing": lost_ids, "groups": [_group_answer(states[g]) for g in sorted(states)]}


async def finalize(engine: AsyncEngine, run_id: str, group_ids: Sequence[str]) -> dict[str, Any]:
    """The trainer consumed these ready groups; they leave the live ledger."""
    async with engine.begin() as conn:
        await lock_run(conn, run_id)
        groups = await _lock_groups(conn, run_id, group_ids)
        bad, done, plan = [], [], _Plan(run_id, _hex)
        for gid in group_ids:
            g = groups.get(gid)
            if g is None:
                bad.append({"group_id": gid, "code": "unknown_group", "detail": "no such group"})
            elif g.status == "finalized":
                done.append({"group_id": gid, "result": "unchanged"})
            elif g.status != "ready":
                bad.append({"group_id": gid, "code": "group_not_ready", "detail": f"group is {g.status}; every sibling must be sealed"})
            else:
                plan.set_group(gid, status="finalized")
                plan.transitions["finalized"] += 1
                done.append({"group_id": gid, "result": "finalized"})
        if bad:
            raise BatchRefused(bad)
        await plan.apply(conn)
        return {"groups": done}


async def abandon(engine: AsyncEngine, run_id: str, group_ids: Sequence[str]) -> dict[str, Any]:
    """Give up on groups; every attempt that may still run in Gym is queued for retirement."""
    async with engine.begin() as conn:
        await lock_run(conn, run_id)
        states = await _load_states(conn, run_id, group_ids)
        bad, done, plan = [], [], _Plan(run_id, _hex)
        for gid in group_ids:
            st = states.get(gid)
            if st is None:
                bad.append({"group_id": gid, "code": "unknown_group", "detail": "no such group"})
            elif st.g.status == "abandoned":
                done.append({"group_id": gid, "result": "unchanged"})
            elif st.g.status == "finalized":
                bad.append({"group_id": gid, "code": "group_finalized", "detail": "the trainer already consumed this group"})
            else:
                for a in st.current.values():
                    if a.status in ("dispatched", "reserved", "returned"):
                        plan.end_attempt(a, "abandoned")
                plan.set_group(gid, status="abandoned")
                plan.transitions["group_abandoned"] += 1
                done.append({"group_id": gid, "result": "abandoned"})
        if bad:
            raise BatchRefused(bad)
        await plan.apply(conn)
        return {"groups": done}


# --------------------------------------------------------------------------------------------
# Reads for operators


async def live_counts(engine: AsyncEngine, run_id: str) -> dict[str, Any]:
    async with engine.connect() as conn:
        await lock_run(conn, run_id, allow_closed=True)
        groups = dict((await conn.execute(text("SELECT status, count(*) FROM prompt_groups WHERE run_id = :r GROUP BY status"), {"r": run_id})).all())
        atts = dict(
            (
                await conn.execute(
                    text(
                        "SELECT a.status, count(*) FROM attempts a JOIN prompt_groups g ON g.run_id = a.run_id AND g.group_id = a.group_id "
                        "WHERE a.run_id = :r AND a.is_current AND g.status IN ('generating', 'ready') GROUP BY a.status"
                    ),
                    {"r": run_id},
                )
            ).all()
        )
        outbox = dict(
            (await conn.execute(text("SELECT op, count(*) FROM outbox_items WHERE run_id = :r AND state = 'pending' GROUP BY op"), {"r": run_id})).all()
        )
    return {"groups": groups, "live_attempts": atts, "outbox_pending": outbox}


async def group_detail(engine: AsyncEngine, run_id: str, group_id: str) -> dict[str, Any]:
    async with engine.connect() as conn:
        await lock_run(conn, run_id, allow_closed=True)
        g = (await conn.execute(text("SELECT * FROM prompt_groups WHERE run_id = :r AND group_id = :g"), {"r": run_id, "g": group_id})).first()
        if g is None:
            raise NotFound(f"group {group_id!r} not found in run {run_id!r}", code="group_not_found")
        sibs = (await conn.execute(text("SELECT generation_index, row_attempts_used FROM siblings WHERE run_id = :r AND group_id = :g ORDER BY generation_index"), {"r": run_id, "g": group_id})).all()
        atts = (
            await conn.execute(
                text(
                    "SELECT attempt_id, generation_index, rollout_id, gym_instance_id, gym_attempt, group_attempt, status, is_current, refusals, "
                    "reward, mask_sample, staging_keys, failure_class, retirement, gym_owned, dispatch_id, created_at, dispatched_at, ended_at "
                    "FROM attempts WHERE run_id = :r AND group_id = :g ORDER BY generation_index, attempt_id"
                ),
                {"r": run_id, "g": group_id},
            )
        ).all()
    m = dict(g._mapping)
    by_sib: dict[int, list[dict[str, Any]]] = defaultdict(list)
    for a in atts:
        d = dict(a._mapping)
        d["capture_key"] = capture_key(d["rollout_id"], d["gym_attempt"])
        for k in ("created_at", "dispatched_at", "ended_at"):
            d[k] = d[k].isoformat() if d[k] else None
        by_sib[d.pop("generation_index")].append(d)
    return {
        "group_id": m["group_id"],
        "status": m["status"],
        "restore_level": m["restore_level"],
        "granularity": granularity(m["restore_level"]),
        "expected_generations": m["expected_generations"],
        "group_attempt": m["group_attempt"],
        "data_attempts_used": m["data_attempts_used"],
        "prompt_ref": m["prompt_ref"],
        "task_digest": m["task_digest"],
        "task_source": m["task_source"],
        "agent_name": m["agent_name"],
        "target_step": m["target_step"],
        "weight_version": m["weight_version"],
        "siblings": [
            {"generation_index": s.generation_index, "row_attempts_used": s.row_attempts_used, "attempts": by_sib.get(s.generation_index, [])}
            for s in sibs
        ],
    }


async def pending_outbox(engine: AsyncEngine, run_id: str, *, limit: int, after: int | None) -> dict[str, Any]:
    async with engine.connect() as conn:
        await lock_run(conn, run_id, allow_closed=True)
        rows = (
            await conn.execute(
                text(
                    "SELECT item_id, instance_id, op, rollout_id, gym_attempt, checkpoint_id, tries, last_error, next_attempt_at, created_at "
                    "FROM outbox_items WHERE run_id = :r AND state = 'pending' AND item_id > :after ORDER BY item_id LIMIT :lim"
                ),
                {"r": run_id, "after": after or 0, "lim": limit},
            )
        ).all()
        oldest = (await conn.execute(text("SELECT min(created_at) FROM outbox_items WHERE run_id = :r AND state = 'pending'"), {"r": run_id})).scalar()
    items = []
    for r in rows:
        d = dict(r._mapping)
        d["next_attempt_at"] = d["next_attempt_at"].isoformat()
        d["created_at"] = d["created_at"].isoformat()
        items.append(d)
    return {"items": items, "oldest_created_at": oldest.isoformat() if oldest else None, "next_after": items[-1]["item_id"] if len(items) == limit else None}


async def pending_attempts(engine: AsyncEngine, run_id: str, rollout_ids: Sequence[str]) -> list[str]:
    """Which of these attempts are still pending (dispatched, current)? Index lookups only:
    the cost follows the number asked about, never the number of live rollouts."""
    rows = await read_rows(
        engine,
        "SELECT rollout_id FROM attempts WHERE run_id = %(r)s AND rollout_id = ANY(%(ids)s) AND is_current AND status = 'dispatched'",
        {"r": run_id, "ids": list(rollout_ids)},
    )
    return sorted(r[0] for r in rows)


# --------------------------------------------------------------------------------------------
# Dispatch gate (closed by a snapshot; see snapshots/)


async def close_gate(conn: AsyncConnection, run_id: str, snapshot_id: str) -> None:
    await conn.execute(text("UPDATE runs SET gate_snapshot_id = :s WHERE run_id = :r"), {"r": run_id, "s": snapshot_id})


async def open_gate(conn: AsyncConnection, run_id: str, snapshot_id: str) -> None:
    """Reopen the gate if (and only if) this snapshot still holds it."""
    await conn.execute(text("UPDATE runs SET gate_snapshot_id = NULL WHERE run_id = :r AND gate_snapshot_id = :s"), {"r": run_id, "s": snapshot_id})
