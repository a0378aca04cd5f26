"""Snapshots imported from another trainer's ledger (NeMo RL), stored as published snapshots
whose cut is the imported ledger."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncEngine

from ...domain.cut import Cut, CutAttempt, CutGroup
from ...errors import Conflict
from ...ledger.db import dump_json
from ...ledger.runs import lock_run
from ...snapshots.store import insert_cut_rows
from .reads import RestorableSnapshot, get_snapshot


async def create_imported_snapshot(
    engine: AsyncEngine,
    run_id: str,
    snapshot_id: str,
    cut: Cut,
    *,
    anchor_step: int,
    detail: dict[str, Any],
    data_attempts_used: dict[str, int],
) -> tuple[bool, RestorableSnapshot]:
    """Store a published snapshot holding ``cut`` (no Gym manifest). Returns (created, row).

    An identical repeat (same ``detail['document_sha256']``) answers the stored snapshot; a
    different document under the same id is a conflict.
    """
    async with engine.begin() as conn:
        await lock_run(conn, run_id)
        existing = await get_snapshot(conn, run_id, snapshot_id)
        if existing is not None:
            same = (existing.detail or {}).get("document_sha256") == detail.get("document_sha256")
            if same and existing.outcome == "published":
                return False, existing
            raise Conflict(
                f"snapshot {snapshot_id!r} already exists in run {run_id!r}"
                + (" with another ledger document" if (existing.detail or {}).get("imported_from") else ""),
                code="snapshot_exists",
                snapshot_id=snapshot_id,
            )
        n = len(cut.attempts)
        ids = list(
            (
                await conn.execute(
                    text("SELECT nextval(pg_get_serial_sequence('attempts', 'attempt_id')) FROM generate_series(1, :n)"), {"n": n}
                )
            ).scalars()
        ) if n else []
        await conn.execute(
            text(
                "INSERT INTO snapshots (run_id, snapshot_id, anchor_step, phase, outcome, reason, detail, owner, counts, "
                "cut_at, published_at, ended_at) VALUES (:r, :s, :step, 'published', 'published', 'ok', CAST(:detail AS jsonb), "
                "'ledger-import', CAST(:counts AS jsonb), now(), now(), now())"
            ),
            {
                "r": run_id,
                "s": snapshot_id,
                "step": anchor_step,
                "detail": _json(detail),
                "counts": _json({"groups": len(cut.groups), "siblings": n}),
            },
        )
        at = [CutAttempt(*a) if not isinstance(a, CutAttempt) else a for a in cut.attempts]
        # The cut tables are views over one row per group (``snapshot_cut_groups``).
        await insert_cut_rows(
            conn,
            run_id,
            snapshot_id,
            _GROUPS_SQL,
            _ATTEMPTS_SQL,
            {**_group_columns(cut.groups, data_attempts_used), "id": ids, **_attempt_columns(at)},
        )
        row = await get_snapshot(conn, run_id, snapshot_id)
        assert row is not None
        return True, row


# The imported groups and attempts as the rows of the ``snapshot_groups`` and ``snapshot_attempts``
# views, from the column arrays of :func:`_group_columns` and :func:`_attempt_columns`.
_GROUPS_SQL = (
    "SELECT g AS group_id, CAST(pr AS jsonb) AS prompt_ref, td AS task_digest, ts AS task_source, an AS agent_name, "
    "lv AS restore_level, n AS expected_generations, st AS target_step, wv AS weight_version, ga AS group_attempt, "
    "du AS data_attempts_used, gs AS status FROM unnest(CAST(:g AS text[]), CAST(:pr AS text[]), "
    "CAST(:td AS text[]), CAST(:ts AS text[]), CAST(:an AS text[]), CAST(:lv AS text[]), CAST(:n AS int[]), "
    "CAST(:st AS bigint[]), CAST(:wv AS text[]), CAST(:ga AS int[]), CAST(:du AS int[]), CAST(:gs AS text[])) "
    "AS t(g, pr, td, ts, an, lv, n, st, wv, ga, du, gs)"
)
_ATTEMPTS_SQL = (
    "SELECT id AS attempt_id, g AS group_id, i AS generation_index, ru AS row_attempts_used, ro AS rollout_id, "
    "gi AS gym_instance_id, gya AS gym_attempt, aga AS group_attempt, ast AS status, 0 AS refusals, "
    "CAST(NULL AS jsonb) AS receipt, rw AS reward, ms AS mask_sample, "
    "CASE WHEN sk IS NULL THEN NULL ELSE ARRAY(SELECT jsonb_array_elements_text(CAST(sk AS jsonb))) END AS staging_keys, "
    "false AS gym_owned "
    "FROM unnest(CAST(:id AS bigint[]), CAST(:ag AS text[]), CAST(:i AS int[]), CAST(:ru AS int[]), CAST(:ro AS text[]), "
    "CAST(:gi AS text[]), CAST(:gya AS int[]), CAST(:aga AS int[]), CAST(:ast AS text[]), CAST(:rw AS float8[]), "
    "CAST(:ms AS boolean[]), CAST(:sk AS text[])) AS t(id, g, i, ru, ro, gi, gya, aga, ast, rw, ms, sk)"
)

# Parameter -> the field it carries as it is, of every group and of every attempt.
_GROUP_FIELDS = {
    "g": "group_id", "td": "task_digest", "ts": "task_source", "an": "agent_name", "n": "expected_generations",
    "st": "target_step", "ga": "group_attempt",
}
_ATTEMPT_FIELDS = {
    "ag": "group_id", "i": "generation_index", "ru": "row_attempts_used", "ro": "rollout_id", "gi": "gym_instance_id",
    "gya": "gym_attempt", "aga": "group_attempt", "rw": "reward", "ms": "mask_sample",
}


def _group_columns(gs: Sequence[CutGroup], data_attempts_used: dict[str, int]) -> dict[str, list[Any]]:
    cols = {p: [getattr(g, f) for g in gs] for p, f in _GROUP_FIELDS.items()}
    cols["pr"] = [_json({"sample_id": g.prompt_ref.sample_id, "task_name": g.prompt_ref.task_name}) for g in gs]
    cols["lv"] = [str(g.restore_level) for g in gs]
    cols["wv"] = [None if g.weight_version is None else str(g.weight_version) for g in gs]
    cols["du"] = [data_attempts_used.get(g.group_id, 0) for g in gs]
    cols["gs"] = [str(g.status) for g in gs]
    return cols


def _attempt_columns(at: Sequence[CutAttempt]) -> dict[str, list[Any]]:
    cols = {p: [getattr(a, f) for a in at] for p, f in _ATTEMPT_FIELDS.items()}
    cols["ast"] = [str(a.status) for a in at]
    cols["sk"] = [_json(list(a.staging_keys)) if a.staging_keys else None for a in at]
    return cols


def _json(v: Any) -> str:
    return dump_json(v, default=str)
