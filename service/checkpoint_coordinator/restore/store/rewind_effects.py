"""What a rewind does to the effect journal (docs/effects.md#orphans), in its transaction and
before it deletes anything: the effects of every attempt it discards (replaced, ended, or of a
rewound group) become orphans, with the reason and the restore; those a continued episode made
after the cut wait for the continuation to make them again (``pending_restore``) until it
seals. A run without a journal pays one index probe."""

from __future__ import annotations

from ...effects.store import LIVE
from ...ledger.db import fetch
from .rewind_diff import CUT_TIME_BINARY
from .rewind_state import Rewinding
from .rewind_work import removed_source, source_params, sources_sql

_LIVE = f"e.{LIVE}"  # neither orphaned nor abandoned


async def orphan_effects(c: Rewinding) -> None:
    if not (await fetch(c.conn, "SELECT EXISTS (SELECT 1 FROM effects WHERE run_id = %(r)s)", {"r": c.r}))[0][0]:
        return
    # The continued rows are not discarded: left out of the sources, handled below.
    p = {
        **source_params(c.r, c.s, c.rw, c.removed, continued=False),
        "rid": c.rw.restore_id, "tag": c.rw.restore_id or c.s, "cro": list(c.rw.continued_rollouts),
    }
    rows = await fetch(
        c.conn,
        f"WITH x AS ({sources_sql(removed_source(c), with_unknown=True)}), "
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
        f"WHERE e.run_id = %(r)s AND e.rollout_id = ro.id AND {_LIVE} AND e.begun_at > {CUT_TIME_BINARY} RETURNING 1) "
        "SELECT count(*) FROM u",
        p,
    )
    c.report.effects_pending = int(pending)
