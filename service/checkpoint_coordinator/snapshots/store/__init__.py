"""The snapshots' store: the SQL of the snapshot row and everything a pending snapshot writes,
split by concern; this facade is what the rest of the service uses.

``rows`` (reads, the API record) · ``phases`` (fenced phase moves, the gate's close, takeover) ·
``gym_entries`` · ``progress`` (the drain's and the row's reads) · ``cut`` and ``keys`` (the ledger
cut, its staging keys) · ``precut`` · ``handshakes`` (abort, capture) · ``ending`` · ``train_steps`` ·
``stragglers`` (who blocked the last snapshots, read by the gate's close).
"""

from __future__ import annotations

from ...ledger.notify import (
    NOTIFY_CHANNEL,
    notify_created,
    notify_payload,
    parse_notify_payload,
)
from .cut import (
    _DELTA_CUT_SQL,
    CURRENT_XMIN_SQL,
    NEXT_XID_SQL,
    SYSTEM_ID_SQL,
    _cut_insert,
    cut_keys,
    cut_xid_basis,
    delete_cut_rows,
    insert_cut_rows,
    set_cut_xid_basis,
    take_cut,
    xid_base_usable,
)
from .ending import Streaks, end
from .gym_entries import GymEntry, new_keys, store_gym_entry
from .handshakes import captured, request_abort
from .phases import (
    GateClosure,
    close_gate,
    close_gate_in,
    create_in,
    move,
    move_in,
    publish_phase,
    reopen,
    take_over,
)
from .precut import PRE_CUT_WAIT_S, PreCut, pre_cut, tracking_horizon
from .progress import _CANDIDATES_SQL, SnapshotProgress, candidates, poll, still_pending
from .rows import (
    TERMINAL,
    SnapshotNotAwaiting,
    SnapshotRow,
    awaiting,
    deadline_left_s,
    get,
    lease_owner,
    list_snapshots,
    unfinished,
)
from .train_steps import announce_train_step, list_train_steps, newest_train_step

__all__ = [
    "NOTIFY_CHANNEL",
    "notify_created",
    "notify_payload",
    "parse_notify_payload",
    "TERMINAL",
    "awaiting",
    "SnapshotNotAwaiting",
    "SnapshotRow",
    "get",
    "lease_owner",
    "deadline_left_s",
    "list_snapshots",
    "unfinished",
    "create_in",
    "move_in",
    "move",
    "take_over",
    "GateClosure",
    "close_gate",
    "close_gate_in",
    "publish_phase",
    "reopen",
    "GymEntry",
    "new_keys",
    "store_gym_entry",
    "_CANDIDATES_SQL",
    "candidates",
    "still_pending",
    "SnapshotProgress",
    "poll",
    "take_cut",
    "cut_keys",
    "_cut_insert",
    "CURRENT_XMIN_SQL",
    "NEXT_XID_SQL",
    "SYSTEM_ID_SQL",
    "cut_xid_basis",
    "set_cut_xid_basis",
    "xid_base_usable",
    "_DELTA_CUT_SQL",
    "insert_cut_rows",
    "delete_cut_rows",
    "PreCut",
    "pre_cut",
    "PRE_CUT_WAIT_S",
    "tracking_horizon",
    "request_abort",
    "captured",
    "Streaks",
    "end",
    "newest_train_step",
    "announce_train_step",
    "list_train_steps",
]
