"""The problem answers each route documents (OpenAPI ``responses``): every failure leaves as
``application/problem+json`` with a stable ``code`` (``problems.py``), and each route lists the
codes it can answer, by HTTP status, in the description and in ``x-problem-codes``.

A route names its own codes (``problems(WRITE, "gate_closed", ...)``); the codes every ``/v1``
route can answer (authentication, limits, validation, availability) are added to each. A code
must be known here with its status: a misspelled one fails at import, not in a client.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from pydantic import BaseModel, ConfigDict

from .problems import PROBLEM


class Problem(BaseModel):
    """An error answer (RFC 9457 problem details) with the coordinator's stable ``code``."""

    model_config = ConfigDict(extra="allow")
    type: str
    title: str
    status: int
    code: str
    detail: str


# Every code a /v1 route answers, with its HTTP status (errors.py and the stores raise them).
STATUS_OF: dict[str, int] = {
    # authentication, body limits, validation, availability (every route: COMMON)
    "unauthorized": 401, "forbidden": 403, "request_timeout": 408, "payload_too_large": 413,
    "invalid_request": 422, "too_many_auth_failures": 429, "unavailable": 503, "schema_mismatch": 503,
    # runs
    "run_not_found": 404, "run_closed": 409, "run_exists": 409, "run_quota": 409, "invalid_config": 422,
    "fenced": 409, "gate_closed": 409, "run_stopped": 409, "replica_draining": 503,
    # live-rollout batches (docs/ledger.md#live-rollouts): one refused row refuses the batch, with that row's code (or batch_refused)
    "batch_refused": 409, "duplicate_in_batch": 409, "group_conflict": 409, "run_row_quota": 409,
    "unknown_rollout": 409, "unknown_group": 409, "already_dispatched": 409, "attempt_not_current": 409,
    "group_not_generating": 409, "instance_required": 409, "wrong_instance": 409, "attempt_sealed": 409,
    "attempt_not_dispatched": 409, "attempt_replaced": 409, "retired_straggler": 409, "seal_conflict": 409, "receipt_mismatch": 409,
    "group_not_ready": 409, "group_finalized": 409,
    "unknown_instance": 404, "unknown_dispatch": 404, "group_not_found": 404,
    # snapshots and train steps
    "snapshot_not_found": 404, "snapshot_not_awaiting": 409, "snapshot_conflict": 409, "snapshot_anchor_stale": 409,
    "snapshot_in_progress": 409, "restore_in_progress": 409, "gym_not_registered": 409, "capture_conflict": 409,
    "train_step_conflict": 409,
    # Gym registration and control
    "gym_instance_not_found": 404, "gym_egress_refused": 422, "restart_only_gym_servers": 422,
    "gym_config_error": 422, "gym_checkpoint_state": 422, "gym_topology_mismatch": 409, "gym_conflict": 409,
    "gym_protocol_error": 502, "gym_unavailable": 502,
    # restore, manifests, ledger import and export
    "no_compatible_snapshot": 404, "gym_manifest_absent": 404, "restore_not_found": 404,
    "snapshot_unusable": 409, "snapshot_not_published": 409, "snapshot_after_step": 409, "gym_manifest_mismatch": 409,
    "cut_invalid": 409, "snapshot_dir_missing": 409, "snapshot_gone": 409, "gym_manifest_disagrees_with_ledger": 409,
    "gym_participants_missing": 409, "gym_not_fresh": 409, "instance_map_invalid": 422,
    "instance_map_unknown_instance": 409, "restore_conflict": 409, "restore_abandoned": 409, "restore_not_applied": 409,
    "restore_ledger_conflict": 409, "snapshot_exists": 409, "legacy_ledger_invalid": 422, "legacy_ledger_version": 422,
    # the effect journal (docs/effects.md)
    "stale_attempt": 409, "effect_not_found": 404, "effect_completed": 409, "effect_abandoned": 409, "effect_result_too_large": 413,
}

# What every /v1 route can answer besides its own codes.
COMMON = (
    "unauthorized", "forbidden", "too_many_auth_failures", "request_timeout", "payload_too_large",
    "invalid_request", "unavailable", "schema_mismatch",
)
# A route under /v1/runs/{run_id}: the admin token reaches a run that does not exist.
RUN = ("run_not_found",)
# A route that writes the ledger of an open run.
WRITE = (*RUN, "run_closed")
# A route that calls Gym's control API.
GYM = ("gym_config_error", "gym_checkpoint_state", "gym_topology_mismatch", "gym_conflict", "gym_protocol_error", "gym_unavailable")

_STATUS_TEXT = {
    401: "Missing or malformed bearer token.",
    403: "The token does not grant access to this run (also for a run that does not exist, to a run token).",
    404: "Not found.",
    408: "The request body did not arrive in time (the connection is closed).",
    409: "Refused by the ledger's state.",
    413: "Request body above `CKPTC_MAX_BODY_BYTES`.",
    422: "Invalid request (each bad field named in `errors`).",
    429: "This client sent too many refused tokens lately (with `Retry-After`).",
    502: "A Gym instance could not be reached or refused (the servers are named).",
    503: "Not available now (with `Retry-After`); retry.",
}

_SCHEMA = Problem.model_json_schema()


def problems(*codes: str | Iterable[str]) -> dict[int | str, dict[str, Any]]:
    """OpenAPI ``responses`` of a route's problem answers: ``codes`` (single codes or groups such
    as ``WRITE``) and ``COMMON``, one entry per HTTP status, each listing its codes."""
    wanted: list[str] = list(COMMON)
    for c in codes:
        wanted.extend([c] if isinstance(c, str) else c)
    by_status: dict[int, list[str]] = {}
    for code in dict.fromkeys(wanted):
        by_status.setdefault(STATUS_OF[code], []).append(code)
    return {
        status: {
            "description": f"{_STATUS_TEXT[status]} Codes: {', '.join(f'`{c}`' for c in listed)}.",
            "content": {PROBLEM: {"schema": _SCHEMA}},
            "x-problem-codes": listed,
        }
        for status, listed in sorted(by_status.items())
    }
