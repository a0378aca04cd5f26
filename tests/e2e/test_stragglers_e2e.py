"""Stragglers end to end (docs/ledger.md#stragglers): one episode stuck between two turn
boundaries (a tool that never answers, gymsim's ``hang`` fault) blocks three snapshots, each
failing and naming it; the fourth gives it up at its gate, retires it on Gym before its prepare
and publishes; the trainer learns the replacement from the pending read, sends it, it seals and
its group is trained once."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from sqlalchemy import text

from checkpoint_coordinator.observability import metrics
from gymsim.testing import GymsimInstance, default_instance_config

from ..integration.ledger_helpers import group_body, new_run
from .harness import Trainer, drive_snapshot, register_by_discovery

pytestmark = pytest.mark.timeout(120)
INST = "math/replica-0"


@pytest.fixture
def gym():
    g = GymsimInstance.start(default_instance_config(INST, token="tok-a", turn_seconds=0.05))
    try:
        yield g
    finally:
        g.stop()


async def _until(predicate, what: str, timeout: float = 20) -> None:  # type: ignore[no-untyped-def]
    try:
        async with asyncio.timeout(timeout):
            while not await predicate():
                await asyncio.sleep(0.02)
    except TimeoutError:
        raise AssertionError(f"timed out waiting until {what}") from None


def _retired() -> float:
    return metrics.REGISTRY.get_sample_value("ckptc_straggler_retirements_total") or 0.0


async def test_an_episode_stuck_between_boundaries_is_given_up_after_three_snapshots(client, admin, app, gym, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    api = await new_run(client, admin, target_level="turn", prepare_timeout_s=0.5, drain_timeout_s=20, data_plane_timeout_s=20)
    await register_by_discovery(app.state.engine, api.run_id, [gym])
    admitted = await api.admit(group_body("g0", 2), group_body("g1", 2))
    rows = [r for g in admitted["groups"] for r in g["rows"]]
    stuck = rows[0]
    # Its tool (the resources' mutate) never answers: the episode stays working, no boundary.
    gym.admin("POST", "/admin/faults", {"server_name": "calendar_resources", "op": "mutate", "type": "hang", "rollout_id": stuck["rollout_id"]})
    trainer = Trainer(api, {INST: gym}, turns=2)
    before = _retired()
    try:
        await trainer.dispatch(rows, INST)

        async def stuck_working() -> bool:
            episodes = (await asyncio.to_thread(gym.admin, "GET", "/admin/state"))["servers"]["workplace_agent"]["episodes"]
            return episodes.get(stuck["capture_key"], {}).get("state") == "working" and len(trainer.replies) == 3

        await _until(stuck_working, "the stuck episode works and the three others sealed")

        for sid in ("s1", "s2", "s3"):
            snap = await drive_snapshot(api, sid, 0, tmp_path / "dp")
            assert (snap["outcome"], snap["reason"]) == ("failed", "gym_not_ready"), snap
            assert snap["blockers"] == {"count": 1, "rollout_ids": [stuck["rollout_id"]]}, snap
            assert snap["retryable"] is True
            assert (await api.get(""))["dispatch_gate"]["open"]
        assert _retired() == before and trainer.stragglers == []

        snap = await drive_snapshot(api, "s4", 0, tmp_path / "dp")
        assert snap["outcome"] == "published", snap
        assert snap["blockers"] == {"count": 0, "rollout_ids": []}  # its prepare no longer waited for it
        assert _retired() == before + 1

        await trainer.wait_idle()
    finally:
        await trainer.aclose()
    assert trainer.stragglers == [stuck["rollout_id"]]  # learned from the pending read

    # Retired on Gym (callers first), before the prepare of s4: the episode is gone.
    agent = (await asyncio.to_thread(gym.admin, "GET", "/admin/state"))["servers"]["workplace_agent"]
    assert stuck["capture_key"] not in agent["episodes"]
    assert any(stuck["capture_key"] in call for call in agent["retire_calls"])
    async with app.state.engine.connect() as conn:
        atts = [dict(r._mapping) for r in await conn.execute(text(
            "SELECT rollout_id, status, is_current, end_reason FROM attempts WHERE run_id = :r AND group_id = 'g0' AND generation_index = 0 "
            "ORDER BY attempt_id"), {"r": api.run_id})]
    assert [(a["status"], a["is_current"], a["end_reason"]) for a in atts] == [("abandoned", False, "straggler"), ("sealed", True, None)]
    replacement = atts[1]["rollout_id"]
    assert replacement != stuck["rollout_id"] and any(k.startswith(replacement) for k in trainer.replies)

    # Its group is trained once: ready, finalized, and a second finalize changes nothing.
    counts = await api.get("/counts")
    assert counts["groups"] == {"ready": 2}
    assert (await api.post("/groups/finalize", {"group_ids": ["g0", "g1"]}))["groups"] == [
        {"group_id": "g0", "result": "finalized"}, {"group_id": "g1", "result": "finalized"}]
    assert (await api.post("/groups/finalize", {"group_ids": ["g0"]}))["groups"] == [{"group_id": "g0", "result": "unchanged"}]
    history = (await api.get("/snapshots"))["snapshots"]
    assert [(s["snapshot_id"], s["outcome"], s["blockers"]["count"]) for s in history] == [
        ("s4", "published", 0), ("s3", "failed", 1), ("s2", "failed", 1), ("s1", "failed", 1)]
