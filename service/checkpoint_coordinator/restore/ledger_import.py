"""NeMo RL ledger import (as a published snapshot) and export (schema 4),
docs/ledger.md#importing-a-nemo-rl-ledger."""

from __future__ import annotations

import hashlib
import json
from typing import Any

from sqlalchemy.ext.asyncio import AsyncEngine

from ..domain.errors import LegacyLedgerError
from ..domain.identity import SNAPSHOT_ID
from ..errors import BadRequest
from .store import imports as imported
from .store import reads
from ..ledger.runs import get_run
from ..recovery_config import domain_problem
from .errors import LedgerImportRefused, SnapshotNotFound
from ..domain.legacy_ledger import export_legacy_ledger, load_legacy_ledger


def document_digest(document: Any) -> str:
    canon = json.dumps(document, sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False)
    return "sha256:" + hashlib.sha256(canon.encode()).hexdigest()


async def import_document(
    engine: AsyncEngine, run_id: str, snapshot_id: str, document: Any, *, anchor_step: int | None = None
) -> dict[str, Any]:
    """Create published snapshot ``snapshot_id`` holding the ledger of a NeMo RL document.

    The snapshot has no Gym manifest: nothing of Gym is restored from it, and every turn that
    was running restarts from its task. ``anchor_step`` defaults to the newest target step the
    document names (its groups' ``target_step``, its sampler stamps), else 0.
    """
    reason = SNAPSHOT_ID.problem(snapshot_id)
    if reason is not None:
        raise BadRequest(reason, errors=[{"field": "snapshot_id", "message": reason}])
    try:
        digest = document_digest(document)
    except (TypeError, ValueError) as e:
        raise LedgerImportRefused(f"document: not a JSON document: {e}", errors=[{"field": "document", "message": str(e)}]) from e
    try:
        ledger = load_legacy_ledger(document)
    except LegacyLedgerError as e:
        problem = domain_problem(e, prefix="document", error=LedgerImportRefused)
        problem.code = e.code  # legacy_ledger_version or legacy_ledger_invalid
        raise problem from e
    if anchor_step is None:
        steps = [g.target_step for g in ledger.cut.groups if g.target_step is not None]
        stamps = ledger.sampler_stamps_target_steps
        steps.extend(stamps.values() if isinstance(stamps, dict) else stamps)
        anchor_step = max(steps, default=0)
    detail = {
        "imported_from": "nemo_rl_rollout_recovery_ledger",
        "source_schema_version": ledger.source_version,
        "document_sha256": digest,
        "batch_shortfall": ledger.batch_shortfall,
        "sampler_stamps_target_steps": ledger.sampler_stamps_target_steps,
        "notes": list(ledger.notes),
    }
    async with engine.connect() as conn:
        await get_run(conn, run_id)
    created, snap = await imported.create_imported_snapshot(
        engine, run_id, snapshot_id, ledger.cut, anchor_step=anchor_step, detail=detail, data_attempts_used=dict(ledger.data_attempts_used)
    )
    return {
        "run_id": run_id,
        "snapshot_id": snap.snapshot_id,
        "created": created,
        "outcome": snap.outcome,
        "anchor_step": snap.anchor_step,
        "source_schema_version": (snap.detail or {}).get("source_schema_version"),
        "document_sha256": (snap.detail or {}).get("document_sha256"),
        "groups": len(ledger.cut.groups),
        "siblings": len(ledger.cut.attempts),
        "notes": (snap.detail or {}).get("notes", []),
    }


async def export_document(engine: AsyncEngine, run_id: str, snapshot_id: str) -> dict[str, Any]:
    """The schema 4 NeMo RL document of a published snapshot's ledger cut."""
    async with engine.connect() as conn:
        await get_run(conn, run_id)
        snap = await reads.get_snapshot(conn, run_id, snapshot_id)
        if snap is None or snap.outcome != "published":
            raise SnapshotNotFound(f"no published snapshot {snapshot_id!r} in run {run_id!r}", snapshot_id=snapshot_id)
        cut, extras = await reads.load_cut(conn, run_id, snapshot_id, detailed=True)
    detail = snap.detail or {}
    return export_legacy_ledger(
        cut,
        data_attempts_used={gid: e.data_attempts_used for gid, e in extras.items()},
        batch_shortfall=int(detail.get("batch_shortfall", 0) or 0),
        sampler_stamps_target_steps=detail.get("sampler_stamps_target_steps"),
    )
