"""Restore (docs/ledger.md#restore), the Gym manifest export (docs/ledger.md#the-gym-manifest)
and NeMo RL ledger import/export (docs/ledger.md#importing-a-nemo-rl-ledger)."""

from __future__ import annotations

import re
from typing import Annotated, Any, Literal

from fastapi import APIRouter, Depends, Path, Query, Request, Response
from pydantic import Field, StringConstraints

from ..domain.errors import ManifestError
from ..domain.vocabulary import Disposition
from ..ledger.runs import get_run
from ..recovery_config import domain_problem
from ..restore import ledger_import, service
from ..restore.errors import (
    GymManifestAbsent,
    InstanceMapInvalid,
    SnapshotNotFound,
    SnapshotUnusable,
)
from ..restore.gym_manifest_file import manifest_document
from ..restore.store import reads
from ..snapshots import store as snapshot_rows
from .auth import Caller, require_run_access
from .common import (
    BIGINT_MAX,
    INSTANCE_ID_PATTERN,
    NAME_PATTERN,
    SNAPSHOT_ID_PATTERN,
    FastJSONRoute,
    Strict,
    as_built,
)
from .problem_docs import GYM, RUN, WRITE, problems
from .restore_schemas import (
    GymManifestOut,
    LedgerExportOut,
    LedgerImportOut,
    RestoreOut,
    RestorePlanOut,
    RestoreRecordOut,
    RestoreRowsOut,
)

router = APIRouter(prefix="/v1/runs/{run_id}", tags=["restore"], route_class=FastJSONRoute)

# Why a snapshot cannot be planned or restored.
_UNPLANNABLE = (
    "snapshot_not_found", "no_compatible_snapshot", "snapshot_unusable", "snapshot_not_published", "snapshot_after_step",
    "gym_manifest_mismatch", "gym_manifest_disagrees_with_ledger", "cut_invalid", "instance_map_invalid", "instance_map_unknown_instance",
)

Disp = Literal[tuple(d.value for d in Disposition)]  # type: ignore[valid-type]
InstanceId = Annotated[str, StringConstraints(pattern=INSTANCE_ID_PATTERN, min_length=1, max_length=200)]
MAX_INSTANCE_MAP = 1024
_MAP_ENTRY = re.compile(INSTANCE_ID_PATTERN[:-1] + "=" + INSTANCE_ID_PATTERN[1:].replace("^", ""))


def _query_instance_map(entries: list[str]) -> dict[str, str] | None:
    """``instance_map=saved=live`` query entries (repeated) as ``{saved: live}``; refused with
    the entry named when one is not of that form, or the map is not one-to-one."""
    if not entries:
        return None
    if len(entries) > MAX_INSTANCE_MAP:
        raise InstanceMapInvalid(f"at most {MAX_INSTANCE_MAP} instance_map entries")
    pairs = []
    for e in entries:
        saved, sep, live = e.partition("=")
        if not sep or len(e) > 401 or not _MAP_ENTRY.fullmatch(e):
            raise InstanceMapInvalid(
                f"instance_map entry {e[:100]!r} is not saved_instance_id=live_instance_id",
                errors=[{"field": "instance_map", "message": "expected saved_instance_id=live_instance_id"}],
            )
        pairs.append((saved, live))
    return service.parse_instance_map(pairs)
SnapshotIdPath = Path(..., pattern=SNAPSHOT_ID_PATTERN, max_length=100)


class RestoreIn(Strict):
    restore_id: str = Field(pattern=NAME_PATTERN, min_length=1, max_length=128, description="Caller-chosen; a repeat returns the stored answer.")
    snapshot_id: str | None = Field(default=None, pattern=SNAPSHOT_ID_PATTERN, max_length=100, description="Restore this snapshot.")
    step: int | None = Field(
        default=None, ge=0, le=BIGINT_MAX, description="The trainer's restored step: the newest published snapshot anchored at or before it."
    )
    with_gym_state: bool = Field(
        default=True,
        description="Install the snapshot's Gym state into freshly started instances. False (Gym kept running): every "
        "continuation restarts and every attempt the cut knows as running is retired.",
    )
    instance_map: dict[InstanceId, InstanceId] | None = Field(
        default=None,
        max_length=MAX_INSTANCE_MAP,
        description="Restore into another Gym topology: {saved instance id: live instance id}. Each mapped live instance "
        "takes its saved instance's Gym state; episodes of unmapped saved instances restart; the other rows are spread "
        "over the live instances. Without it the live instances must equal the saved ones.",
    )


class LedgerImportIn(Strict):
    snapshot_id: str = Field(pattern=SNAPSHOT_ID_PATTERN, min_length=1, max_length=100)
    document: dict[str, Any] = Field(description="NeMo RL rollout-recovery ledger, schema 2, 3 or 4.")
    anchor_step: int | None = Field(default=None, ge=0, le=BIGINT_MAX, description="Default: the newest target step the document names.")


@router.get("/restore-plan", operation_id="get_restore_plan", response_model=RestorePlanOut, responses=problems(RUN, _UNPLANNABLE))
async def get_restore_plan(
    request: Request,
    step: int | None = Query(None, ge=0, le=BIGINT_MAX, description="The trainer's restored step (newest compatible snapshot)."),
    snapshot_id: str | None = Query(None, pattern=SNAPSHOT_ID_PATTERN, max_length=100),
    with_gym_state: bool = Query(True),
    include_reused: bool = Query(False, description="Also list reused rows, with their staging keys."),
    disposition: Disp | None = Query(None, description="Only rows of this disposition."),
    cursor: int = Query(0, ge=0, description="Rows to skip (next_cursor of the previous page)."),
    limit: int = Query(10_000, ge=1, le=100_000),
    instance_map: list[str] = Query(
        [],
        description="Restore into another Gym topology: repeated saved_instance_id=live_instance_id (see POST /restores).",
    ),
    caller: Caller = Depends(require_run_access),
) -> Response:
    """The restore plan of the newest published snapshot compatible with ``step`` (or of
    ``snapshot_id``): counts per disposition and per disposition and reason, and, per row, what to
    send under which rollout id and capture key to which instance, and why. A preview;
    ``POST /restores`` applies it."""
    return as_built(await service.preview_plan(
        request.app.state.engine, str(caller.run_id), snapshot_id=snapshot_id, step=step, with_gym_state=with_gym_state,
        include_reused=include_reused, disposition=disposition, cursor=cursor, limit=limit,
        instance_map=_query_instance_map(instance_map),
    ))


@router.post(
    "/restores", operation_id="create_restore", response_model=RestoreOut,
    responses=problems(
        WRITE, _UNPLANNABLE, GYM, "fenced", "restore_conflict", "restore_in_progress", "restore_abandoned", "snapshot_in_progress",
        "snapshot_dir_missing", "gym_participants_missing", "gym_not_fresh", "restore_ledger_conflict", "snapshot_gone",
    ),
)
async def create_restore(body: RestoreIn, request: Request, caller: Caller = Depends(require_run_access)) -> Response:
    """Restore the run from a published snapshot: checks, Gym restore, one ledger transaction.

    Answers the summary and the first 10 000 rows to send (``rows_total`` in all); when there are
    more, ``next_cursor`` is the cursor of ``GET /restores/{restore_id}/rows``. Idempotent per
    ``restore_id`` (a repeat answers the same); the same id with another body is
    ``409 restore_conflict``."""
    imap = service.parse_instance_map(body.instance_map.items()) if body.instance_map is not None else None
    req = service.RestoreRequest(body.restore_id, body.snapshot_id, body.step, body.with_gym_state, imap)
    app = request.app
    runner = getattr(app.state, "snapshots", None)
    return as_built(await service.execute_restore(
        app.state.engine,
        str(caller.run_id),
        req,
        transport=getattr(app.state, "gym_transport", None),
        abort_local=runner.abort_local if runner is not None else None,
        # A snapshot of the discarded lineage is aborted first; a dead owner's lease must
        # expire before another replica may end it.
        snapshot_wait_s=2 * app.state.settings.ownership_lease_s,
    ))


@router.get("/restores/{restore_id}", operation_id="get_restore", response_model=RestoreRecordOut, responses=problems(RUN, "restore_not_found"))
async def get_restore(
    request: Request, restore_id: str = Path(..., pattern=NAME_PATTERN, max_length=128), caller: Caller = Depends(require_run_access),
) -> Response:
    """A restore's state, its request and its stored answer (or refusal)."""
    return as_built(await service.restore_record(request.app.state.engine, str(caller.run_id), restore_id))


@router.get(
    "/restores/{restore_id}/rows", operation_id="get_restore_rows", response_model=RestoreRowsOut,
    responses=problems(RUN, "restore_not_found", "restore_not_applied"),
)
async def get_restore_rows(
    request: Request,
    restore_id: str = Path(..., pattern=NAME_PATTERN, max_length=128),
    cursor: int = Query(0, ge=0, description="Rows to skip (next_cursor of the previous page)."),
    limit: int | None = Query(None, ge=1, le=100_000, description="Rows per page (default 10 000)."),
    caller: Caller = Depends(require_run_access),
) -> Response:
    """A page of the rows an applied restore answers (``POST /restores`` answers the first
    ``10 000``, with ``next_cursor`` when there are more). ``409 restore_not_applied`` for a restore
    that is running, refused or failed."""
    return as_built(await service.answer_rows_page(
        request.app.state.engine, str(caller.run_id), restore_id, cursor, limit or service.ANSWER_PAGE_ROWS
    ))


@router.get(
    "/snapshots/{snapshot_id}/gym-manifest", operation_id="get_snapshot_gym_manifest", response_model=GymManifestOut,
    responses=problems(RUN, "snapshot_not_found", "gym_manifest_absent", "snapshot_unusable"),
)
async def get_snapshot_gym_manifest(
    request: Request, snapshot_id: str = SnapshotIdPath, caller: Caller = Depends(require_run_access)
) -> Response:
    """The snapshot's ``gym_checkpoint.json`` (Gym manifest, schema 2, lists sorted)."""
    async with request.app.state.engine.connect() as conn:
        await get_run(conn, str(caller.run_id))
        snap = await reads.get_snapshot(conn, str(caller.run_id), snapshot_id)
        manifest = snap.gym_manifest if snap is not None else None
        if snap is not None and manifest is None and snap.outcome is None:
            # Pending: its manifest is its per-instance entries, joined once all are in.
            manifest = (await snapshot_rows.get(conn, str(caller.run_id), snapshot_id, with_manifest=True)).gym_manifest
    if snap is None:
        raise SnapshotNotFound(f"snapshot {snapshot_id!r} not found", snapshot_id=snapshot_id)
    if manifest is None:
        raise GymManifestAbsent(f"snapshot {snapshot_id!r} holds no Gym manifest", snapshot_id=snapshot_id)
    try:
        return as_built(manifest_document(manifest))
    except ManifestError as e:
        raise domain_problem(e, prefix="gym_manifest", error=SnapshotUnusable) from e


@router.post(
    "/ledger-import", operation_id="import_ledger", status_code=201, response_model=LedgerImportOut,
    responses=problems(WRITE, "legacy_ledger_invalid", "legacy_ledger_version", "snapshot_exists"),
)
async def import_ledger(body: LedgerImportIn, request: Request, caller: Caller = Depends(require_run_access)) -> Response:
    """Import a NeMo RL rollout-recovery ledger (schema 2, 3 or 4) as a published snapshot.

    Schemas 2 and 3 are rewritten as schema 4; refusals name the field. A repeat with the same
    document answers the stored snapshot (``created: false``)."""
    imported = await ledger_import.import_document(
        request.app.state.engine, str(caller.run_id), body.snapshot_id, body.document, anchor_step=body.anchor_step
    )
    return as_built(imported, status_code=201)


@router.get(
    "/snapshots/{snapshot_id}/ledger-export", operation_id="export_ledger", response_model=LedgerExportOut,
    responses=problems(RUN, "snapshot_not_found"),
)
async def export_ledger(
    request: Request, snapshot_id: str = SnapshotIdPath, caller: Caller = Depends(require_run_access)
) -> Response:
    """The snapshot's ledger cut as a NeMo RL rollout-recovery ledger, schema 4."""
    return as_built(await ledger_import.export_document(request.app.state.engine, str(caller.run_id), snapshot_id))
