"""A tiny scripted coordinator speaking the client contract, for the helper edge cases the real
coordinator cannot be steered into on demand (a barrier asked too early, a helper resumed after
the cut, a snapshot that never ends, paged plans, a restore still running, 503s).

It follows the documented shapes only; it is not a model of the coordinator's behaviour.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

PROBLEM = "application/problem+json"


def problem(status: int, code: str, detail: str = "", headers: dict[str, str] | None = None, **extra: Any) -> Response:
    body = {"type": f"fake/{code}", "title": code, "status": status, "code": code, "detail": detail or code, **extra}
    return Response(json.dumps(body), status_code=status, media_type=PROBLEM, headers=headers)


@dataclass
class FakeSnapshot:
    snapshot_id: str
    anchor_step: int
    #: Phases walked by successive GETs before the data-plane phase is reached.
    before_barrier: list[str] = field(default_factory=lambda: ["gate", "prepare", "commit", "drain"])
    phase: str = "requested"
    outcome: str | None = None
    reason: str | None = None
    cut: bool = False
    reference: dict[str, Any] | None = None
    staging_keys: list[str] = field(default_factory=lambda: ["tq/a/0", "tq/b/0"])
    stuck: bool = False
    end_as: tuple[str, str] = ("published", "ok")

    def doc(self) -> dict[str, Any]:
        awaiting = None
        if self.outcome is None and self.phase == "data_plane":
            awaiting = "capture" if self.cut and self.reference is None else (None if self.cut else "barrier")
        d: dict[str, Any] = {
            "snapshot_id": self.snapshot_id,
            "anchor_step": self.anchor_step,
            "phase": self.phase,
            "outcome": self.outcome,
            "reason": self.reason,
            "awaiting": awaiting,
            "phase_timings": {"gate": 0.01},
            "gym_parked_seconds": 0.5,
            "counts": {"cut_siblings": 2},
            "data_plane_ref": self.reference,
            "a_field_from_the_future": {"x": 1},
        }
        if awaiting == "capture":
            d["staging_keys"] = list(self.staging_keys)
        return d

    def advance(self) -> None:
        if self.outcome is not None or self.stuck:
            return
        if self.before_barrier:
            self.phase = self.before_barrier.pop(0)
        elif self.phase not in ("data_plane", "resume", "publish"):
            self.phase = "data_plane"
        elif self.phase == "resume":
            self.phase = "publish"
        elif self.phase == "publish":
            self.outcome, self.reason = self.end_as
            self.phase = self.end_as[0]


class FakeCoordinator:
    def __init__(self) -> None:
        self.snapshots: dict[str, FakeSnapshot] = {}
        self.calls: list[tuple[str, str, dict[str, Any]]] = []
        self.early_barrier_refusals = 0
        self.plan_rows: list[dict[str, Any]] = []
        self.plan_page = 2
        self.restore_busy = 0
        self.unavailable = 0
        self.gate_closed = 0
        self.app = Starlette(
            routes=[
                Route("/v1/runs/{run_id}/snapshots", self.request_snapshot, methods=["POST"]),
                Route("/v1/runs/{run_id}/snapshots/{sid}", self.get_snapshot, methods=["GET"]),
                Route("/v1/runs/{run_id}/snapshots/{sid}/barrier", self.barrier, methods=["POST"]),
                Route("/v1/runs/{run_id}/snapshots/{sid}/captured", self.captured, methods=["POST"]),
                Route("/v1/runs/{run_id}/restore-plan", self.restore_plan, methods=["GET"]),
                Route("/v1/runs/{run_id}/restores", self.restores, methods=["POST"]),
                Route("/v1/runs/{run_id}/restores/{rid}/rows", self.restore_rows, methods=["GET"]),
                Route("/v1/runs/{run_id}/counts", self.counts, methods=["GET"]),
                Route("/v1/runs/{run_id}/attempts/dispatch", self.dispatch, methods=["POST"]),
            ]
        )

    def count(self, name: str) -> int:
        return sum(1 for c in self.calls if c[0] == name)

    async def _note(self, name: str, request: Request) -> dict[str, Any]:
        body = await request.json() if request.method == "POST" and await request.body() else {}
        self.calls.append((name, request.url.path, {**dict(request.query_params), **body}))
        return body

    async def request_snapshot(self, request: Request) -> Response:
        body = await self._note("request", request)
        sid = body["snapshot_id"]
        snap = self.snapshots.get(sid)
        if snap is None:
            snap = self.snapshots[sid] = FakeSnapshot(sid, body["anchor_step"])
            return JSONResponse(snap.doc(), status_code=202)
        return JSONResponse(snap.doc())

    async def get_snapshot(self, request: Request) -> Response:
        await self._note("get", request)
        snap = self.snapshots[request.path_params["sid"]]
        snap.advance()
        return JSONResponse(snap.doc())

    async def barrier(self, request: Request) -> Response:
        await self._note("barrier", request)
        snap = self.snapshots[request.path_params["sid"]]
        if self.early_barrier_refusals > 0:
            self.early_barrier_refusals -= 1
            return problem(409, "snapshot_not_awaiting", "not yet", phase="drain")
        if snap.phase != "data_plane" or snap.outcome is not None:
            return problem(409, "snapshot_not_awaiting", "too late", phase=snap.phase, reason=snap.reason)
        snap.cut = True
        return JSONResponse({**snap.doc(), "staging_keys": list(snap.staging_keys)})

    async def captured(self, request: Request) -> Response:
        body = await self._note("captured", request)
        snap = self.snapshots[request.path_params["sid"]]
        snap.reference = body["reference"]
        snap.phase = "resume"
        return JSONResponse(snap.doc())

    async def restore_plan(self, request: Request) -> Response:
        await self._note("plan", request)
        q = request.query_params
        cursor = int(q.get("cursor", 0))
        page = self.plan_rows[cursor : cursor + self.plan_page]
        more = cursor + len(page) < len(self.plan_rows)
        counts: dict[str, int] = {}
        for r in self.plan_rows:
            counts[r["disposition"]] = counts.get(r["disposition"], 0) + 1
        return JSONResponse(
            {
                "snapshot_id": q.get("snapshot_id", "s-newest"),
                "anchor_step": 7,
                "data_plane_ref": {"path": "/dp/s", "digest": "sha256:0"},
                "counts": counts,
                "rows": page,
                "next_cursor": cursor + len(page) if more else None,
            }
        )

    async def restores(self, request: Request) -> Response:
        body = await self._note("restore", request)
        if self.restore_busy > 0:
            self.restore_busy -= 1
            return problem(409, "restore_in_progress", "still running", restore_id=body["restore_id"])
        # Like the coordinator: the first page of rows with the answer, the rest by cursor.
        page = self.plan_rows[: self.plan_page]
        return JSONResponse(
            {
                "restore_id": body["restore_id"], "snapshot_id": "s1", "state": "applied", "epoch": 2, "counts": {"rerun": 1},
                "rows": page, "rows_total": len(self.plan_rows), "next_cursor": len(page) if len(page) < len(self.plan_rows) else None,
            }
        )

    async def restore_rows(self, request: Request) -> Response:
        await self._note("restore_rows", request)
        cursor = int(request.query_params.get("cursor", 0))
        page = self.plan_rows[cursor : cursor + self.plan_page]
        end = cursor + len(page)
        return JSONResponse(
            {"restore_id": request.path_params["rid"], "rows": page, "rows_total": len(self.plan_rows),
             "next_cursor": end if end < len(self.plan_rows) else None}
        )

    async def counts(self, request: Request) -> Response:
        await self._note("counts", request)
        if self.unavailable > 0:
            self.unavailable -= 1
            return problem(503, "unavailable", "database restarting", headers={"Retry-After": "0"})
        return JSONResponse({"groups": {"generating": 1}, "live_attempts": {}, "outbox_pending": {}})

    async def dispatch(self, request: Request) -> Response:
        body = await self._note("dispatch", request)
        if self.gate_closed > 0:
            self.gate_closed -= 1
            # Only the header, no body hint: the client must read Retry-After.
            return problem(409, "gate_closed", "gate closed", headers={"Retry-After": "2"}, snapshot_id="s-x")
        rows = [{"rollout_id": r, "group_id": "g", "generation_index": i, "status": "dispatched"} for i, r in enumerate(body["rollout_ids"])]
        return JSONResponse({"dispatch_id": body["dispatch_id"], "instance_id": body.get("instance_id"), "rows": rows})
