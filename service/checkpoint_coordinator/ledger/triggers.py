"""The ledger's functions and triggers, written by hand into the migrations (autogenerate does
not see functions or triggers): the statement-level delete of a removed group's siblings and
attempts, and the recording of the groups written while a pending snapshot may hold a pre-cut.
Kept apart from the models as SQL text the migrations and the tests compare with."""

from __future__ import annotations

from ..domain.snapshot_state import SnapshotPhase

# Written by hand into the migration (autogenerate does not see functions or triggers); keep the
# two in step. It replaces the ``ON DELETE CASCADE`` foreign keys ``siblings -> prompt_groups``
# and ``attempts -> siblings``, whose per-row checks were most of the cost of an admit: one
# set-based delete per statement that removed groups (the restore's rewind, or a run's deletion
# cascading to its groups) instead of a check per inserted row.
GROUP_CHILDREN_TRIGGER_UP = (
    "CREATE FUNCTION prompt_groups_drop_children() RETURNS trigger LANGUAGE plpgsql AS $$\n"
    "BEGIN\n"
    "    IF EXISTS (SELECT 1 FROM gone) THEN\n"
    "        DELETE FROM attempts a USING gone g WHERE a.run_id = g.run_id AND a.group_id = g.group_id;\n"
    "        DELETE FROM siblings s USING gone g WHERE s.run_id = g.run_id AND s.group_id = g.group_id;\n"
    "    END IF;\n"
    "    RETURN NULL;\n"
    "END\n"
    "$$",
    "CREATE TRIGGER prompt_groups_drop_children AFTER DELETE ON prompt_groups REFERENCING OLD TABLE AS gone "
    "FOR EACH STATEMENT EXECUTE FUNCTION prompt_groups_drop_children()",
)
GROUP_CHILDREN_TRIGGER_DOWN = (
    "DROP TRIGGER IF EXISTS prompt_groups_drop_children ON prompt_groups",
    "DROP FUNCTION IF EXISTS prompt_groups_drop_children()",
)


#: Phases in which a pending snapshot's pre-cut may be taken or may wait for its barrier: writes
#: to the cut's tables are then recorded in ``snapshot_changed_groups``.
CHANGE_TRACKING_PHASES = (SnapshotPhase.prepare, SnapshotPhase.commit, SnapshotPhase.drain, SnapshotPhase.data_plane)
_TRACKED = ", ".join(f"'{p.value}'" for p in CHANGE_TRACKING_PHASES)
# (table, event, transition table): a statement on a cut table that wrote rows of a run whose
# snapshot is in a tracking phase records their group ids. One open snapshot lookup (a partial
# index of the open snapshots) per statement; nothing more when none is tracking.
_CHANGED_GROUPS_EVENTS = tuple(
    (table, event, "OLD" if event == "DELETE" else "NEW")
    for table in ("prompt_groups", "siblings", "attempts")
    for event in ("INSERT", "UPDATE", "DELETE")
)
CHANGED_GROUPS_TRIGGERS_UP = (
    "CREATE FUNCTION ckptc_note_changed_groups() RETURNS trigger LANGUAGE plpgsql AS $$\n"
    "DECLARE tracked text[];\n"
    "BEGIN\n"
    f"    SELECT array_agg(run_id) INTO tracked FROM snapshots WHERE outcome IS NULL AND cut_at IS NULL AND phase IN ({_TRACKED});\n"
    "    IF tracked IS NOT NULL THEN\n"
    "        INSERT INTO snapshot_changed_groups (run_id, group_id)\n"
    "        SELECT DISTINCT c.run_id, c.group_id FROM changed_rows c WHERE c.run_id = ANY(tracked) ORDER BY 1, 2\n"
    # An update, not DO NOTHING: it locks the row, so the pre-cut's DELETE waits for this
    # writer to commit and its copy then sees the write (DO NOTHING takes no lock, and a group
    # recorded before could be copied without this write and never recorded again).
    "        ON CONFLICT (run_id, group_id) DO UPDATE SET group_id = EXCLUDED.group_id;\n"
    "    END IF;\n"
    "    RETURN NULL;\n"
    "END\n"
    "$$",
    *(
        f"CREATE TRIGGER ckptc_changed_groups_{event.lower()} AFTER {event} ON {table} REFERENCING {which} TABLE AS changed_rows "
        "FOR EACH STATEMENT EXECUTE FUNCTION ckptc_note_changed_groups()"
        for table, event, which in _CHANGED_GROUPS_EVENTS
    ),
)
CHANGED_GROUPS_TRIGGERS_DOWN = (
    *(f"DROP TRIGGER IF EXISTS ckptc_changed_groups_{event.lower()} ON {table}" for table, event, _ in _CHANGED_GROUPS_EVENTS),
    "DROP FUNCTION IF EXISTS ckptc_note_changed_groups()",
)
