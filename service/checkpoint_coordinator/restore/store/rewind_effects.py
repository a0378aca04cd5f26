"""What a rewind does to the effect journal (docs/effects.md#orphans), in its transaction and
before it deletes anything: the effects of every attempt it discards (replaced, ended, or of a
rewound group) become orphans, with the reason and the restore; those a continued episode made
after the cut wait for the continuation to make them again (``pending_restore``) until it
seals. A run without a journal pays one index probe."""

from __future__ import annotations

from ...ledger.db import fetch
from .rewind_state import Rewinding
from .rewind_work import sources_sql

_LIVE = "e.live"  # neither orphaned nor abandoned (effects.store.LIVE)


async def orphan_effects(c: Rewinding) -> None:
    if not (await fetch(c.conn, "SELECT EXISTS (SELECT 1 FROM effects WHERE run_id = %(r)s)", {"r": c.r}))[0][0]:
        return
    tag = c.rw.restore_id or c.s
    removed_src = "restore_since_cut" if c.since is not None else "(SELECT attempt_id, group_id FROM attempts WHERE run_id = %(r)s)"
    p = {
        "r": c.r, "s": c.s, "rid": c.rw.restore_id, "tag": tag, "cid": [], "nid": [int(x) for x in c.rw.new_old_ids],
        "nwhy": list(c.rw.new_reasons), "rm": c.removed, "cro": list(c.rw.continued_rollouts),
    }
    rows = await fetch(
        c.conn,
        f"WITH x AS ({sources_sql(removed_src, with_unknown=True)}), "
        "o AS (UPDATE effects e SET orphaned_at = now(), orphan_reason = x.why, orphaned_by = %(rid)s, pending_restore = NULL, live = false "
        "FROM x JOIN attempts a ON a.attempt_id = x.id AND a.run_id = %(r)s "
        f"WHERE e.run_id = %(r)s AND e.rollout_id = a.rollout_id AND {_LIVE} RETURNING e.orphan_reason) "
        "SELECT orphan_reason, count(*) FROM o GROUP BY 1",
        p,
    )
    c.report.effects_orphaned = {str(why): int(n) for why, n in rows}
    # The continued episodes' effects made after the cut: the continuation makes them again (the
    # journal answers done) or they become orphans when it seals (effects.store.orphan_unrepeated).
    ((pending,),) = await fetch(
        c.conn,
        "WITH u AS (UPDATE effects e SET pending_restore = %(tag)s FROM unnest(%(cro)s::text[]) AS ro(id) "
        f"WHERE e.run_id = %(r)s AND e.rollout_id = ro.id AND {_LIVE} AND e.begun_at > "
        "(SELECT COALESCE(cut_at, published_at, created_at) FROM snapshots WHERE run_id = %(r)s AND snapshot_id = %(s)s) RETURNING 1) "
        "SELECT count(*) FROM u",
        p,
    )
    c.report.effects_pending = int(pending)
