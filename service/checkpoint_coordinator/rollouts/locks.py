"""Locking and reading the rows a trainer report touches (docs/ledger.md#fencing-and-concurrency).

A report locks the prompt groups it touches in group-id order (so two batches on the same groups
never deadlock), then reads their attempts; the rules in ``domain.rollout_rules`` decide from
what is read here.
"""

from __future__ import annotations

import functools
from collections import defaultdict
from collections.abc import Iterable, Sequence
from typing import Any

from sqlalchemy.ext.asyncio import AsyncConnection

from ..domain.rollout_rules import AttemptRow, GroupRow, GroupState
from ..ledger.db import execute, fetch

# Batch statements are planned for their own arguments, never run as prepared statements: a
# prepared statement's generic plan treats arrays of thousands of ids as if they held a handful.
_fetch = functools.partial(fetch, prepare=False)
_execute = functools.partial(execute, prepare=False)


_ATT_COLS = (
    "a.attempt_id, a.group_id, a.generation_index, a.rollout_id, a.gym_instance_id, a.gym_attempt, "
    "a.group_attempt, a.status, a.is_current, a.refusals, a.receipt, a.reward, a.mask_sample, "
    "a.staging_keys, a.gym_owned, a.dispatch_id, a.retirement, a.end_reason"
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


async def lock_groups(conn: AsyncConnection, run_id: str, group_ids: Iterable[str]) -> dict[str, GroupRow]:
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
    """The group ids minted rollout ids name (``<group>_g<i>_a<hex>``, docs/ledger.md#identifiers),
    sorted. Only a guess: an imported ledger's rollout ids need not have that form, see
    ``lock_and_read``."""
    out = set()
    for rid in rollout_ids:
        g, sep, _ = rid.rpartition("_g")
        if sep and g:
            out.add(g)
    return sorted(out)


async def lock_and_read(conn: AsyncConnection, run_id: str, rollout_ids: Sequence[str]) -> tuple[dict[str, GroupRow], dict[str, AttemptRow]]:
    """Lock (in group-id order) the groups that own these rollouts, then read the named attempts.

    The groups are taken from the rollout ids themselves (a minted id starts with its group id),
    locked by primary key, and their current attempts read through the partial index of current
    attempts: one key lookup per group instead of looking every rollout id up twice. Named
    attempts that are not current (a repeat about a replaced row) are looked up by rollout id.
    If an attempt turns out to belong to a group that was not locked (an imported rollout id of
    another form), the guessed locks are rolled back to a savepoint and the groups are found
    through the attempts, as before, so the lock order stays the group-id order either way."""
    guess = _groups_named_by(rollout_ids)
    if guess:
        await _execute(conn, "SAVEPOINT ckpt_lock_guess", {})
        groups = await lock_groups(conn, run_id, guess)
        atts: dict[str, AttemptRow] = {}
        if groups:
            wanted = set(rollout_ids)
            # One probe of uq_attempts_current_per_sibling per locked group, whatever the
            # statistics say: while the run grows its row count is underestimated and the plain
            # "group_id = ANY(...)" form is planned as a scan of the whole run. OFFSET 0 keeps the
            # subquery from being flattened into a hash join over the run.
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


async def current_attempts(conn: AsyncConnection, run_id: str, group_ids: Sequence[str]) -> dict[str, list[AttemptRow]]:
    rows = await _fetch(
        conn,
        _ATT_SQL + "WHERE a.run_id = %(r)s AND a.group_id = ANY(%(ids)s) AND a.is_current ORDER BY a.group_id, a.generation_index",
        {"r": run_id, "ids": list(group_ids)},
    )
    out: dict[str, list[AttemptRow]] = defaultdict(list)
    for r in rows:
        out[r[1]].append(AttemptRow(*r))
    return out


async def load_states(conn: AsyncConnection, run_id: str, group_ids: Iterable[str]) -> dict[str, GroupState]:
    return await states_of_locked(conn, run_id, await lock_groups(conn, run_id, group_ids))


async def states_of_locked(conn: AsyncConnection, run_id: str, groups: dict[str, GroupRow]) -> dict[str, GroupState]:
    current = await current_attempts(conn, run_id, list(groups))
    return {gid: GroupState(g, current.get(gid, [])) for gid, g in groups.items()}
