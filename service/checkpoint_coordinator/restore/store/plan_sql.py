"""The restore plan of a snapshot computed in the ledger
(docs/ledger.md#restore-plans-and-dispositions): set-based statements over the snapshot's cut
storage. This is the one production planner; ``tests/oracles/restore_plan.py`` is the pure
reference it is tested against."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncConnection

from ...domain.levels import RestoreLevel as L
from ...domain.restore_plan import REASON_CODES, may_run_in_gym
from ...domain.vocabulary import AttemptStatus as A
from ...domain.vocabulary import GroupStatus as G
from ...domain.vocabulary import RowReason
from ...ledger.db import fetch

_R = REASON_CODES
_R_SEALED, _R_COHORT, _R_NEVER_SENT = _R[RowReason.sealed_at_cut], _R[RowReason.cohort_incomplete], _R[RowReason.never_sent]
_R_FAILED, _R_IN_FLIGHT = _R[RowReason.failed_at_cut], _R[RowReason.in_flight_at_cut]
_R_EXPORTED, _R_RESTART_ONLY = _R[RowReason.exported_by_gym], _R[RowReason.restart_only_server]
_R_NOT_MAPPED = _R[RowReason.instance_not_mapped]
_R_TOO_STALE = _R[RowReason.too_stale]

# -------------------------------------------------------------------------------------------
# The plan in SQL (the dispositions of docs/ledger.md#restore-plans-and-dispositions, set-based)

# Disposition codes, as ``domain.restore_plan.DISPOSITION_CODES``: 1 reused, 2 continued,
# 3 restarted, 4 gym_restarted, 5 rerun, 6 dispatch.
#
# The plan reads the cut storage itself (``snapshot_cut_groups``: one row per group, its siblings
# in an array) rather than the views: a group and its rows are one table row, so no statement
# joins the cut with its groups, and a group's rows are unnested only when the group matters.
#
# One pass over the cut's groups checks the cut as the pure plan does and finds the skipped
# groups, the live rows and the prompt_group cohorts that rerun. Per group (a lateral aggregate
# over its own array): every row is checked; exactly one row per sibling index holds when the
# group has N rows, each index is in [0, N) and the indexes' bits cover 0..N-1 (N rows covering N
# values are all distinct). Groups of more than 62 siblings (``big``, beyond a bigint's bits) are
# checked by _PLAN_DUPLICATES. Group ids are unique by the table's primary key. A cohort is
# reused when all its rows are sealed and dispatched as it is when none was sent; anything else
# reruns.
_PLAN_SUMMARY = (
    f"SELECT COALESCE(bool_or(bad > 0 OR lvl NOT IN ('{L.turn}', '{L.sibling}', '{L.prompt_group}') OR n < 1 OR n >= 65536 OR ga < 0 "
    f"OR gst NOT IN ('{G.generating}', '{G.ready}', '{G.finalized}', '{G.abandoned}') OR k <> n "
    "OR (n <= 62 AND bits IS DISTINCT FROM (1::bigint << n) - 1)), false) AS broken, "
    "COALESCE(bool_or(n > 62), false) AS big, COALESCE(sum(n) FILTER (WHERE live), 0) AS live_rows, "
    "COALESCE(array_agg(group_id) FILTER (WHERE NOT live), '{}') AS skipped, "
    f"COALESCE(array_agg(group_id) FILTER (WHERE live AND lvl = '{L.prompt_group}' "
    f"AND (smin <> smax OR smin NOT IN ('{A.sealed}', '{A.reserved}'))), '{{}}') AS bumped "
    "FROM (SELECT c.group_id, c.restore_level AS lvl, c.expected_generations AS n, c.group_attempt AS ga, "
    f"c.status AS gst, c.status IN ('{G.generating}', '{G.ready}') AS live, x.* FROM snapshot_cut_groups c CROSS JOIN LATERAL ("
    "SELECT count(*) AS k, count(*) FILTER (WHERE (s.generation_index < 0 OR s.generation_index >= c.expected_generations "
    "OR s.group_attempt <> c.group_attempt "
    f"OR s.status NOT IN ('{A.reserved}', '{A.dispatched}', '{A.returned}', '{A.sealed}', '{A.failed}', '{A.abandoned}') OR s.gym_attempt < 0 "
    f"OR (s.gym_attempt > 0 AND (c.restore_level <> '{L.turn}' OR s.gym_instance_id IS NULL)) "
    f"OR (c.status IN ('{G.generating}', '{G.ready}') AND s.status = '{A.returned}' AND c.restore_level <> '{L.prompt_group}')) IS NOT FALSE) AS bad, "
    "bit_or(1::bigint << s.generation_index) FILTER (WHERE s.generation_index BETWEEN 0 AND 62) AS bits, "
    "min(s.status) AS smin, max(s.status) AS smax FROM unnest(c.siblings) AS s) AS x "
    "WHERE c.run_id = %(r)s AND c.snapshot_id = %(s)s) AS g"
)
_PLAN_DUPLICATES = (
    "SELECT EXISTS (SELECT 1 FROM snapshot_cut_groups c CROSS JOIN LATERAL (SELECT count(DISTINCT s.generation_index) AS d "
    "FROM unnest(c.siblings) AS s) AS x WHERE c.run_id = %(r)s AND c.snapshot_id = %(s)s AND c.expected_generations > 62 "
    "AND x.d <> c.expected_generations)"
)
# Every manifest entry must be the current attempt of a live turn-level sibling on that instance
# at that Gym attempt, and a saved one still running in Gym: the matches, per kind, must number
# the entries (the manifest's rollout ids are unique, the cut's too).
_CUT_TURN_ROWS = (
    "(SELECT s.rollout_id, s.gym_instance_id, s.gym_attempt, s.status FROM snapshot_cut_groups c "
    "CROSS JOIN LATERAL unnest(c.siblings) AS s WHERE c.run_id = %(r)s AND c.snapshot_id = %(s)s "
    f"AND c.restore_level = '{L.turn}' AND c.status IN ('{G.generating}', '{G.ready}')) sa "
    "ON sa.rollout_id = m.rid AND sa.gym_instance_id = m.inst AND sa.gym_attempt = m.n"
)
# A saved entry's row may still run in Gym (``may_run_in_gym``).
_RUNS_IN_GYM = f"(sa.status = '{A.dispatched}' OR (sa.status = '{A.reserved}' AND sa.gym_attempt > 0))"
_PLAN_MANIFEST = (
    "SELECT count(*) FILTER (WHERE m.saved), count(*) FILTER (WHERE NOT m.saved) "
    "FROM unnest(%(mi)s::text[], %(mr)s::text[], %(mn)s::int[], %(mk)s::boolean[]) AS m(inst, rid, n, saved) "
    f"JOIN {_CUT_TURN_ROWS} WHERE NOT m.saved OR {_RUNS_IN_GYM}"
)
# The saved entries that are no longer running in Gym in the cut (none, for a cut taken while Gym
# was parked): what a Gym that resumed before the cut finished meanwhile.
_ENDED_SAVED = (
    "SELECT m.rid FROM unnest(%(mi)s::text[], %(mr)s::text[], %(mn)s::int[]) AS m(inst, rid, n) "
    f"LEFT JOIN {_CUT_TURN_ROWS} AND {_RUNS_IN_GYM} WHERE sa.rollout_id IS NULL ORDER BY m.rid"
)


async def saved_episodes_ended(conn: AsyncConnection, run_id: str, snapshot_id: str, saved: list[tuple[str, str, int]]) -> list[str]:
    """Of the saved episodes ``(instance, rollout id, Gym attempt)``, the rollout ids whose row in
    the snapshot's cut is no longer running in Gym (sorted): a restore would refuse the
    snapshot's Gym manifest for them."""
    if not saved:
        return []
    mi, mr, mn = (list(col) for col in zip(*saved))
    return [r for (r,) in await fetch(conn, _ENDED_SAVED, {"r": run_id, "s": snapshot_id, "mi": mi, "mr": mr, "mn": mn})]
# The rows the plan sends (every live row but reused ones; with ``reused`` those too, code 1, with
# their staging keys), in cut order, each with one number: its disposition code times 16 plus its
# reason code (split in Python with two byte translations). A turn-level row that is neither
# sealed nor never sent is ``restarted`` (3) here, with the reason ``%(tr)s`` (no Gym state, or
# none restored), and continued or gym_restarted when the manifest lists it (decided by the
# caller, see plan_in_sql).
def _plan_rows_sql(reused: bool) -> str:
    return (
        "SELECT c.group_id, s.generation_index, s.attempt_id, s.rollout_id, s.gym_instance_id, s.gym_attempt, "
        + ("s.group_attempt, s.status, COALESCE(s.staging_keys, '{}'::text[]), " if reused else "s.group_attempt, s.status, ")
        + f"CASE WHEN c.bumped THEN {5 * 16 + _R_COHORT} "
        + (f"WHEN s.status = '{A.sealed}' THEN {1 * 16 + _R_SEALED} " if reused else "")
        + f"WHEN s.status = '{A.reserved}' AND (c.restore_level <> '{L.turn}' OR s.gym_attempt = 0) THEN {6 * 16 + _R_NEVER_SENT} "
        f"WHEN c.restore_level = '{L.turn}' AND s.status IN ('{A.failed}', '{A.abandoned}') THEN {3 * 16 + _R_FAILED} "
        f"WHEN c.restore_level = '{L.turn}' THEN 48 + %(tr)s::int "
        f"WHEN s.status IN ('{A.failed}', '{A.abandoned}') THEN {5 * 16 + _R_FAILED} ELSE {5 * 16 + _R_IN_FLIGHT} END "
        "FROM (SELECT group_id, restore_level, siblings, group_id = ANY(%(bumped)s::text[]) AS bumped FROM snapshot_cut_groups "
        f"WHERE run_id = %(r)s AND snapshot_id = %(s)s AND status IN ('{G.generating}', '{G.ready}')) AS c "
        "CROSS JOIN LATERAL unnest(c.siblings) AS s"
        + ("" if reused else f" WHERE c.bumped OR s.status <> '{A.sealed}'")
        + " ORDER BY s.attempt_id"
    )


_PLAN_SEND = _plan_rows_sql(False)
_PLAN_ALL = _plan_rows_sql(True)
_CONTINUED, _RESTARTED, _GYM_RESTARTED = 2, 3, 4
_HIGH = bytes(b >> 4 for b in range(256))
_LOW = bytes(b & 15 for b in range(256))


@dataclass(frozen=True)
class SqlPlan:
    """The plan's dispositions as the ledger computes them (:func:`plan_in_sql`)."""

    rows: list[tuple[Any, ...]]  # CutAttempt's first eight fields of every row sent (nine: staging keys too)
    codes: bytes  # the disposition code of each row
    reasons: bytes  # the reason code of each row
    reused: int  # live rows left out (sealed, reused)
    cohort_reruns: list[str]
    skipped_groups: list[str]


async def plan_in_sql(
    conn: AsyncConnection,
    run_id: str,
    snapshot_id: str,
    manifest: Any | None,
    *,
    include_reused: bool = False,
    gym_state: bool = True,
    mapped: frozenset[str] | None = None,
    oldest_version: int | None = None,
) -> SqlPlan | None:
    """The restore plan of a snapshot computed from its cut with set-based statements, as the
    first statements of a transaction (made repeatable-read and read-only): the dispositions of
    docs/ledger.md#restore-plans-and-dispositions (``tests/oracles/restore_plan.py`` is the
    reference, compared on random ledgers by a differential test) for the rows that are sent
    (``include_reused``: every live row), with the reason of each (docs/ledger.md#row-reasons),
    and how many live rows are reused and left out.
    ``manifest`` (a ``GymManifest``, or None when no Gym state is installed) decides continued and
    gym_restarted turn-level rows; ``gym_state`` false: a restore without Gym state (its
    restarts say so); ``mapped``: the saved instances an instance map keeps (the exported
    episodes of the others restart, ``instance_not_mapped``); ``oldest_version``: the oldest policy
    version a continuation may have (``domain.restore_plan.oldest_continuable_version``; older
    ones restart, ``too_stale``; None: no limit).

    The cut is read by ``run_id``/``snapshot_id`` with joins only (no per-key probe). ``None``
    when the cut breaks one of the plan's invariants or the manifest disagrees with it: the
    caller then asks ``domain.cut_checks`` what is wrong."""
    p: dict[str, Any] = {"r": run_id, "s": snapshot_id}
    await _plan_settings(conn)
    ((broken, big, live_rows, skipped, bumped),) = await fetch(conn, _PLAN_SUMMARY, p, binary=False)
    if broken or (big and (await fetch(conn, _PLAN_DUPLICATES, p))[0][0]):
        return None
    bumped = sorted(bumped)
    turn_reason = _R[RowReason.no_gym_state] if gym_state else _R[RowReason.gym_not_restored]
    rows = await fetch(conn, _PLAN_ALL if include_reused else _PLAN_SEND, {**p, "bumped": bumped, "tr": turn_reason}, binary=False)
    width = 9 if include_reused else 8
    both = bytes(r[width] for r in rows)
    codes, reasons = bytearray(both.translate(_HIGH)), bytearray(both.translate(_LOW))
    entries = _manifest_entries(manifest)
    if entries and not await _apply_manifest(conn, p, rows, codes, reasons, entries, mapped):
        return None
    if oldest_version is not None and _CONTINUED in codes:
        await _restart_stale(conn, run_id, rows, codes, reasons, oldest_version)
    if include_reused:
        picked = [(*r[:8], tuple(r[8])) for r in rows]
    else:
        picked = [r[:8] for r in rows]
    return SqlPlan(picked, bytes(codes), bytes(reasons), int(live_rows) - len(rows), list(bumped), list(skipped))


# The continued rows' attempts dispatched under a policy older than the limit. The cut does not
# carry policy versions: they are read from the live attempts by id (a continuation keeps its
# attempt, and its version, across restores; docs/ledger.md#stale-continuations). One statement.
_STALE_ATTEMPTS = (
    "SELECT attempt_id FROM attempts WHERE run_id = %(r)s AND attempt_id = ANY(%(ids)s::bigint[]) "
    "AND policy_version < %(oldest)s"
)


async def _restart_stale(
    conn: AsyncConnection, run_id: str, rows: list[Any], codes: bytearray, reasons: bytearray, oldest: int
) -> None:
    """Continued rows whose attempt's policy version is older than ``oldest`` restart, reason
    ``too_stale`` (``codes`` and ``reasons`` in place); a NULL version is never stale."""
    at = [m.start() for m in re.finditer(b"\\x02", codes)]
    stale = {aid for (aid,) in await fetch(conn, _STALE_ATTEMPTS, {"r": run_id, "ids": [int(rows[k][2]) for k in at], "oldest": oldest})}
    for k in at:
        if rows[k][2] in stale:
            codes[k] = _RESTARTED
            reasons[k] = _R_TOO_STALE


async def _plan_settings(conn: AsyncConnection) -> None:
    # One snapshot for the passes below: a cut that retention removes meanwhile is then either
    # read whole or not at all.
    await conn.execute(text("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ, READ ONLY"))
    # A fresh cut has no statistics: the planner takes a million rows for one. Every join here
    # is a bulk join of the cut with its groups, for which a hash join on the groups is right.
    for knob in ("enable_nestloop", "enable_mergejoin"):
        await conn.execute(text(f"SET LOCAL {knob} = off"))
    await conn.execute(text("SET LOCAL work_mem = '128MB'"))


def _manifest_entries(manifest: Any | None) -> dict[str, tuple[str, int, bool]]:
    """``{rollout id: (instance, Gym attempt, saved)}`` of every manifest entry."""
    entries: dict[str, tuple[str, int, bool]] = {}
    if manifest is not None:
        for iid, inst in manifest.instances.items():
            for is_saved, listed in ((True, inst.episodes), (False, inst.restarts)):
                for rid, n in listed:
                    entries[rid] = (iid, n, is_saved)
    return entries


async def _apply_manifest(
    conn: AsyncConnection,
    p: dict[str, Any],
    rows: list[Any],
    codes: bytearray,
    reasons: bytearray,
    entries: dict[str, tuple[str, int, bool]],
    mapped: frozenset[str] | None,
) -> bool:
    """Continue or restart from Gym the rows the manifest lists (``codes`` and ``reasons`` in
    place); False when the manifest disagrees with the cut.

    Manifest entries name live turn-level rows that are running in Gym (saved) or ended there
    (restarts): most of them are rows planned ``restarted`` here, checked on the spot and then
    continued or restarted from Gym. The others (a restart of a row sealed since, or of a row
    never sent; or a wrong entry) are checked by the ledger."""
    left = dict(entries)
    for m in re.finditer(b"\\x03", codes):
        a = rows[m.start()]
        e = left.get(a[3])
        if e is None or e[0] != a[4] or e[1] != a[5]:
            continue
        if e[2]:
            if not may_run_in_gym(a[7], a[5]):
                return False
            if mapped is None or e[0] in mapped:
                codes[m.start()] = _CONTINUED
                reasons[m.start()] = _R_EXPORTED
            else:
                reasons[m.start()] = _R_NOT_MAPPED
        else:
            codes[m.start()] = _GYM_RESTARTED
            reasons[m.start()] = _R_RESTART_ONLY
        del left[a[3]]
    if left:
        mi = [e[0] for e in left.values()]
        mn = [e[1] for e in left.values()]
        mk = [e[2] for e in left.values()]
        ((n_saved, n_restarts),) = await fetch(conn, _PLAN_MANIFEST, {**p, "mi": mi, "mr": list(left), "mn": mn, "mk": mk})
        if n_saved != sum(mk) or n_restarts != len(mk) - sum(mk):
            return False
        # Those rows are sealed (reused) or never sent (dispatch): their codes stand.
    return True
