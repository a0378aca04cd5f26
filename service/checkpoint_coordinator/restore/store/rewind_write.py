"""Steps 6 to 11 of a rewind (:func:`rewind.apply_restore`): the cut's groups, siblings and
attempts written back where the live ledger differs from them (the continued rows as Gym's
continuations), the plan's new attempts inserted, and the run's epoch bumped (fencing). Set-based,
by key from a small analyzed table of the rows in question (``restore_focus``)."""

from __future__ import annotations

from typing import Any

from sqlalchemy import text

from ...domain.vocabulary import AttemptStatus as A
from ...domain.vocabulary import GroupStatus as G
from ...domain.vocabulary import RetirementState as R
from ...ledger.db import execute as execute_binary
from .rewind_state import Rewinding

# The target state of a cut attempt (``restore_focus``): as in the cut, or continued (``cont``:
# Gym attempt N+1, reserved, Gym-owned, no result yet).
_TARGET = (
    "SELECT f.attempt_id, f.group_id, f.generation_index, f.rollout_id, f.cont, "
    f"CASE WHEN f.cont THEN '{A.reserved}' ELSE f.status END AS status, true AS is_current, f.gym_instance_id, "
    "f.gym_attempt + CASE WHEN f.cont THEN 1 ELSE 0 END AS gym_attempt, f.group_attempt, f.refusals, "
    "CASE WHEN f.cont THEN NULL ELSE f.receipt END AS receipt, "
    "CASE WHEN f.cont THEN NULL ELSE f.reward END AS reward, "
    "CASE WHEN f.cont THEN NULL ELSE f.mask_sample END AS mask_sample, "
    "CASE WHEN f.cont THEN NULL ELSE f.staging_keys END AS staging_keys, "
    "f.gym_owned OR f.cont AS gym_owned FROM restore_focus f"
)

async def groups_as_in_cut(c: Rewinding) -> None:
    # 6. Groups as in the cut (cohorts that rerun at group_attempt + 1): changed ones rewritten,
    #    missing ones (removed by an earlier restore, or an imported cut) inserted.
    gparams: dict[str, Any] = {**c.p, "bumped": sorted(c.bumped)}
    gsrc = (
        "SELECT sg.*, sg.group_attempt + CASE WHEN b.g IS NULL THEN 0 ELSE 1 END AS target_attempt FROM snapshot_groups sg "
        "LEFT JOIN unnest(CAST(:bumped AS text[])) AS b(g) ON b.g = sg.group_id WHERE sg.run_id = :r AND sg.snapshot_id = :s"
    )
    # Only groups whose live row may differ from the cut's: with ``cut_xmin``, those written since
    # the cut and the rerunning cohorts (by the cut's primary key); otherwise every cut group.
    usrc = gsrc
    if c.since is not None:
        usrc += " AND sg.group_id = ANY(CAST(:cand AS text[]))"
        gparams["cand"] = sorted(set(c.since.recent_groups) | c.bumped)
    changed = (
        await c.conn.execute(
            text(
                "UPDATE prompt_groups g SET group_attempt = t.target_attempt, data_attempts_used = t.data_attempts_used, "
                f"status = t.status, ended_at = CASE WHEN t.status IN ('{G.finalized}', '{G.abandoned}') THEN COALESCE(g.ended_at, now()) END, "
                f"abandon_reason = CASE WHEN t.status = '{G.abandoned}' THEN g.abandon_reason END "
                f"FROM ({usrc}) t WHERE g.run_id = :r AND g.group_id = t.group_id AND "
                "(g.group_attempt, g.data_attempts_used, g.status) IS DISTINCT FROM (t.target_attempt, t.data_attempts_used, t.status) "
                "RETURNING g.group_id"
            ),
            gparams,
        )
    ).scalars().all()
    # Cut groups missing from the live ledger, found on the keys alone (both primary keys), then
    # inserted whole: usually none.
    missing = (
        await c.conn.execute(
            text(
                "SELECT COALESCE(array_agg(c.group_id), '{}') FROM snapshot_cut_groups c WHERE c.run_id = :r AND c.snapshot_id = :s "
                "AND NOT EXISTS (SELECT 1 FROM prompt_groups g WHERE g.run_id = :r AND g.group_id = c.group_id)"
            ),
            c.p,
        )
    ).scalar()
    c.new_groups = []
    if missing:
        c.new_groups = (
            await c.conn.execute(
                text(
                    "INSERT INTO prompt_groups (run_id, group_id, prompt_ref, task_digest, task_source, agent_name, restore_level, "
                    "expected_generations, target_step, weight_version, group_attempt, data_attempts_used, status, ended_at) "
                    "SELECT :r, t.group_id, t.prompt_ref, t.task_digest, t.task_source, t.agent_name, t.restore_level, "
                    "t.expected_generations, t.target_step, t.weight_version, t.target_attempt, t.data_attempts_used, t.status, "
                    f"CASE WHEN t.status IN ('{G.finalized}', '{G.abandoned}') THEN now() END FROM ({gsrc} AND sg.group_id = ANY(CAST(:missing AS text[]))) t "
                    "RETURNING group_id"
                ),
                {**gparams, "missing": list(missing)},
            )
        ).scalars().all()
    c.touched.update(changed)
    c.touched.update(c.new_groups)
    c.touched |= c.bumped


async def focus_rows(c: Rewinding) -> None:
    # 7. The cut rows the rest works on, in a small analyzed table so that the steps below look
    #    attempts and siblings up by key instead of scanning the run: continued rows and the
    #    rows of touched groups. A rerunning cohort (``bumped``) needs none of its rows there:
    #    each of them is replaced (deleted in step 9, its successor inserted in step 10) and its
    #    siblings restart their budgets by group (step 8). So when no other group changed after
    #    the cut, the table is filled by one filter of the cut on the continued ids. After a
    #    restore applied after the cut, every row is compared.
    focus_cols = (
        "sa.attempt_id, sa.group_id, sa.generation_index, sa.row_attempts_used, sa.rollout_id, sa.gym_instance_id, "
        "sa.gym_attempt, sa.group_attempt, sa.status, sa.refusals, sa.receipt, sa.reward, sa.mask_sample, sa.staging_keys, "
        "sa.gym_owned"
    )
    # The same columns read from the cut storage itself: the group id is the cut row's, the rest
    # the sibling's (``sa`` an element of ``c.siblings``).
    cut_focus_cols = focus_cols.replace("sa.group_id", "c.group_id")
    bumped_list = sorted(c.bumped)
    if c.everything:
        await c.conn.execute(
            text(
                f"CREATE TEMP TABLE restore_focus ON COMMIT DROP AS SELECT {focus_cols}, p.id IS NOT NULL AS cont, "
                "b.g IS NOT NULL AS bumped FROM snapshot_attempts sa "
                "LEFT JOIN unnest(CAST(:cid AS bigint[])) AS p(id) ON p.id = sa.attempt_id "
                "LEFT JOIN unnest(CAST(:bumped AS text[])) AS b(g) ON b.g = sa.group_id "
                "WHERE sa.run_id = :r AND sa.snapshot_id = :s"
            ),
            {**c.p, "cid": c.rw.continued_ids, "bumped": bumped_list},
        )
    elif c.rw.continued_groups or not c.rw.continued_ids:
        # The continued rows, read by group key: their groups' cut rows by the primary key of
        # the cut storage (``pk_snapshot_cut_groups``; an attempt's group never changes), then
        # their siblings filtered on the ids. Through the ``snapshot_attempts`` view the same
        # filter unnests the whole cut.
        await execute_binary(
            c.conn,
            f"CREATE TEMP TABLE restore_focus ON COMMIT DROP AS SELECT {cut_focus_cols}, true AS cont, "
            "c.group_id = ANY(%(bumped)s::text[]) AS bumped "
            "FROM snapshot_cut_groups c CROSS JOIN LATERAL unnest(c.siblings) AS sa "
            "WHERE c.run_id = %(r)s AND c.snapshot_id = %(s)s AND c.group_id = ANY(%(cg)s::text[]) "
            "AND sa.attempt_id = ANY(%(cid)s::bigint[])",
            {**c.p, "cid": c.rw.continued_ids, "cg": sorted(set(c.rw.continued_groups)), "bumped": bumped_list},
        )
    else:
        # Continued rows without their groups: by a filter on their ids over the whole cut.
        await c.conn.execute(
            text(
                f"CREATE TEMP TABLE restore_focus ON COMMIT DROP AS SELECT {focus_cols}, true AS cont, "
                "b.g IS NOT NULL AS bumped FROM snapshot_attempts sa "
                "LEFT JOIN unnest(CAST(:bumped AS text[])) AS b(g) ON b.g = sa.group_id "
                "WHERE sa.run_id = :r AND sa.snapshot_id = :s AND sa.attempt_id = ANY(CAST(:cid AS bigint[]))"
            ),
            {**c.p, "cid": c.rw.continued_ids, "bumped": bumped_list},
        )
    if not c.everything:
        scan_groups = sorted(c.touched - c.bumped)
        if scan_groups:
            # By group key, as above.
            await execute_binary(
                c.conn,
                f"INSERT INTO restore_focus SELECT {cut_focus_cols}, false, false "
                "FROM snapshot_cut_groups c CROSS JOIN LATERAL unnest(c.siblings) AS sa "
                "WHERE c.run_id = %(r)s AND c.snapshot_id = %(s)s AND c.group_id = ANY(%(g)s::text[]) "
                "AND NOT (sa.attempt_id = ANY(%(cid)s::bigint[]))",
                {**c.p, "cid": c.rw.continued_ids, "g": scan_groups},
            )
    if c.rw.instance_map:
        # A continuation lives on the live instance its saved instance maps to.
        await execute_binary(
            c.conn,
            "UPDATE restore_focus f SET gym_instance_id = m.live FROM unnest(%(saved)s::text[], %(live)s::text[]) AS m(saved, live) "
            "WHERE f.cont AND f.gym_instance_id = m.saved",
            {"saved": list(c.rw.instance_map), "live": list(c.rw.instance_map.values())},
        )
    await c.conn.execute(text("CREATE UNIQUE INDEX ON restore_focus (attempt_id)"))
    await c.conn.execute(text("ANALYZE restore_focus"))
    # From here every statement starts at restore_focus (whose size the planner now knows) or
    # at the plan's arrays, and looks attempts and siblings up by key.
    await c.conn.execute(text("SET LOCAL enable_nestloop = on"))


async def siblings_as_in_cut(c: Rewinding) -> None:
    bumped_list = sorted(c.bumped)
    # 8. Siblings as in the cut (a rerunning cohort starts its row budgets again).
    if c.new_groups:
        await c.conn.execute(
            text(
                "INSERT INTO siblings (run_id, group_id, generation_index, row_attempts_used) "
                "SELECT :r, sa.group_id, sa.generation_index, sa.row_attempts_used FROM snapshot_attempts sa "
                "WHERE sa.run_id = :r AND sa.snapshot_id = :s AND sa.group_id = ANY(:g) ON CONFLICT DO NOTHING"
            ),
            {**c.p, "g": sorted(c.new_groups)},
        )
    await c.conn.execute(
        text(
            "UPDATE siblings sb SET row_attempts_used = t.n FROM (SELECT f.group_id, f.generation_index, "
            "CASE WHEN f.bumped THEN 0 ELSE f.row_attempts_used END AS n FROM restore_focus f) t "
            "WHERE sb.run_id = :r AND sb.group_id = t.group_id AND sb.generation_index = t.generation_index "
            "AND sb.row_attempts_used <> t.n"
        ),
        c.p,
    )
    if bumped_list and not c.everything:
        await c.conn.execute(
            text(
                "UPDATE siblings sb SET row_attempts_used = 0 FROM unnest(CAST(:bumped AS text[])) AS b(g) "
                "WHERE sb.run_id = :r AND sb.group_id = b.g AND sb.row_attempts_used <> 0"
            ),
            {"r": c.r, "bumped": bumped_list},
        )


async def attempts_as_in_cut(c: Rewinding) -> None:
    # 9. The cut's attempts. Replaced ones are deleted: their replacement (step 10) is the
    #    sibling's attempt from now on, and a deleted row costs far less than a rewritten one
    #    (their rollout ids live on in the retires queued above and the restore's answer).
    #    Everything from here goes by primary key (a few percent of the run's rows, which a
    #    sequential scan of the whole run would cost more to find).
    for knob in ("enable_seqscan", "enable_hashjoin", "enable_mergejoin"):
        await c.conn.execute(text(f"SET LOCAL {knob} = off"))
    # The plan's arrays go as binary parameters: as text, psycopg escapes every element in
    # Python.
    new_old_ids = sorted(c.rw.new_old_ids)
    if new_old_ids:
        await execute_binary(
            c.conn, "DELETE FROM attempts a WHERE a.attempt_id = ANY(%(nid)s::bigint[]) AND a.run_id = %(r)s", {"r": c.r, "nid": new_old_ids}
        )
    # The focus rows back to their target state (only those that differ are written).
    c.report.attempts_rewritten = (
        await c.conn.execute(
            text(
                "UPDATE attempts a SET status = t.status, is_current = t.is_current, gym_instance_id = t.gym_instance_id, "
                "gym_attempt = t.gym_attempt, group_attempt = t.group_attempt, refusals = t.refusals, receipt = t.receipt, "
                "reward = t.reward, mask_sample = t.mask_sample, staging_keys = t.staging_keys, gym_owned = t.gym_owned, "
                f"retirement = CASE WHEN t.cont THEN '{R.none}' ELSE a.retirement END, "
                f"dispatch_id = CASE WHEN t.status = '{A.reserved}' THEN NULL ELSE a.dispatch_id END, "
                f"ended_at = CASE WHEN t.status IN ('{A.sealed}', '{A.failed}', '{A.abandoned}') THEN COALESCE(a.ended_at, now()) END, "
                # Every focus row becomes its sibling's current attempt again: nothing ended it any
                # more, whatever a restore or the straggler rule did to it since the cut
                # (docs/accounting.md#rollout-seconds).
                "end_reason = NULL "
                f"FROM ({_TARGET}) t WHERE a.attempt_id = t.attempt_id AND a.run_id = :r AND (a.end_reason IS NOT NULL OR "
                "(a.status, a.is_current, a.gym_instance_id, a.gym_attempt, a.group_attempt, a.refusals, a.receipt, a.reward, "
                "a.mask_sample, a.staging_keys, a.gym_owned) IS DISTINCT FROM (t.status, t.is_current, t.gym_instance_id, "
                "t.gym_attempt, t.group_attempt, t.refusals, t.receipt, t.reward, t.mask_sample, t.staging_keys, t.gym_owned) "
                f"OR (t.cont AND a.retirement <> '{R.none}') OR (t.status = '{A.reserved}' AND a.dispatch_id IS NOT NULL))"
            ),
            c.p,
        )
    ).rowcount
    # Cut attempts missing from the live ledger (their group was removed by an earlier restore,
    # or the cut was imported) come back as rows of their own, unless replaced. Only touched
    # groups can miss attempts.
    c.report.attempts_inserted = await execute_binary(
        c.conn,
        "INSERT INTO attempts (attempt_id, run_id, group_id, generation_index, rollout_id, gym_instance_id, gym_attempt, "
        "group_attempt, status, is_current, refusals, receipt, reward, mask_sample, staging_keys, gym_owned, ended_at) "
        "SELECT t.attempt_id, %(r)s, t.group_id, t.generation_index, t.rollout_id, t.gym_instance_id, t.gym_attempt, "
        "t.group_attempt, t.status, t.is_current, t.refusals, t.receipt, t.reward, t.mask_sample, t.staging_keys, "
        f"t.gym_owned, CASE WHEN t.status IN ('{A.sealed}', '{A.failed}', '{A.abandoned}') THEN now() END "
        f"FROM ({_TARGET}) t LEFT JOIN unnest(%(nid)s::bigint[]) AS n(id) ON n.id = t.attempt_id WHERE n.id IS NULL "
        "AND NOT EXISTS (SELECT 1 FROM attempts a WHERE a.attempt_id = t.attempt_id)",
        {"r": c.r, "nid": new_old_ids},
    )


async def insert_new_attempts(c: Rewinding) -> None:
    # 10. New attempts (restarted, gym_restarted, rerun) under their new rollout ids, in sibling
    #     order: each index then takes them in one sweep (its pages stay in memory) instead of
    #     one sweep per disposition.
    if c.rw.new_old_ids:
        await execute_binary(
            c.conn,
            "INSERT INTO attempts (run_id, group_id, generation_index, rollout_id, group_attempt) "
            "SELECT %(r)s, g, i, ro, ga FROM unnest(%(g)s::text[], %(i)s::int[], %(ro)s::text[], %(ga)s::int[]) "
            "AS t(g, i, ro, ga) ORDER BY g, i",
            {"r": c.r, "g": c.rw.new_groups, "i": c.rw.new_indexes, "ro": c.rw.new_rollouts, "ga": c.rw.new_group_attempts},
        )
        c.report.attempts_inserted += len(c.rw.new_old_ids)
    for knob in ("enable_seqscan", "enable_hashjoin", "enable_mergejoin"):
        await c.conn.execute(text(f"SET LOCAL {knob} = on"))


async def bump_epoch(c: Rewinding) -> None:
    # 11. Fencing: every writer of the old epoch is refused from now on; the gate reopens.
    await c.conn.execute(
        text(
            "UPDATE runs SET epoch = epoch + 1, restored_from_rollout_snapshot = :s, gate_snapshot_id = NULL WHERE run_id = :r"
        ),
        c.p,
    )
