"""Stale continuations end to end (docs/ledger.md#stale-continuations): a gymsim process runs two
long turn-level episodes, one dispatched under train step 0 and one under step 1; a snapshot
anchored at step 2 saves both; the trainer and Gym crash, a fresh Gym process is registered and
the run restores. Under ``max_continue_staleness: 1`` the episode two steps behind the anchor
restarts (``too_stale``) and Gym does not install it; without the setting both continue."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest

from gymsim.testing import GymsimInstance, default_instance_config

from ..integration.ledger_helpers import group_body, new_run
from ..integration.test_restore_support import fetch
from .harness import Trainer, drive_snapshot, kill_all, wait_mid_way

pytestmark = pytest.mark.timeout(240)

TURNS = 12
IID = "math/replica-0"


def _start() -> GymsimInstance:
    config = default_instance_config(IID, token="tok-0", turn_seconds=0.1, lease_grace_seconds=10)
    return GymsimInstance.start(config, subprocess=True)


def _registration(g: GymsimInstance) -> dict[str, Any]:
    return {"instances": [{"instance_id": g.instance_id, "control_token": g.token, "servers": g.servers}]}


def _by_old_id(rows: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    return {r["replaces_rollout_id"] or r["rollout_id"]: r for r in rows}


@pytest.mark.parametrize("limit", [1, None])
async def test_a_restore_restarts_a_continuation_too_far_behind_the_anchor(client, admin, app, tmp_path: Path, limit: int | None) -> None:  # type: ignore[no-untyped-def]
    gym = _start()
    fresh: GymsimInstance | None = None
    trainer: Trainer | None = None
    try:
        recovery: dict[str, Any] = {} if limit is None else {"max_continue_staleness": limit}
        api = await new_run(client, admin, target_level="turn", control_timeout_s=10, drain_timeout_s=20, data_plane_timeout_s=20, **recovery)
        await api.post("/gym-instances", _registration(gym))
        trainer = Trainer(api, {IID: gym}, turns=TURNS)
        # Policy versions: "told" goes out under step 0, "tnew" under step 1.
        await api.post("/train-steps", {"step": 0})
        old = (await trainer.admit_and_dispatch([group_body("told", 1)], IID))[0]["rollout_id"]
        await api.post("/train-steps", {"step": 1})
        new = (await trainer.admit_and_dispatch([group_body("tnew", 1)], IID))[0]["rollout_id"]
        versions = await fetch(app.state.engine, "SELECT rollout_id, policy_version FROM attempts WHERE run_id = :r", r=api.run_id)
        assert {v["rollout_id"]: v["policy_version"] for v in versions} == {old: 0, new: 1}
        await api.post("/train-steps", {"step": 2})
        await wait_mid_way({IID: gym}, TURNS)
        snap = await drive_snapshot(api, "s1", 2, tmp_path / "dp")
        assert snap["outcome"] == "published", snap
        manifest = (await api.get("/snapshots/s1?manifest=true"))["gym_manifest"]
        assert {e["rollout_id"] for e in manifest["instances"][IID]["episodes"]} == {old, new}

        # Crash: the trainer and the Gym process die; a fresh Gym process takes the instance's place.
        for t in list(trainer.tasks):
            t.cancel()
        await asyncio.gather(*list(trainer.tasks), return_exceptions=True)
        await trainer.http.aclose()
        trainer = None
        await asyncio.to_thread(gym.kill)
        fresh = _start()
        await api.post("/gym-instances", _registration(fresh))

        plan = await api.get("/restore-plan?step=2")
        ans = await api.post("/restores", {"restore_id": "r1", "step": 2})
        assert ans["gym"]["installed"] is True and ans["anchor_step"] == 2, ans["gym"]
        stale = {old} if limit is not None else set()
        expected = {"continued": {"exported_by_gym": 2 - len(stale)}, **({"restarted": {"too_stale": 1}} if stale else {})}
        assert plan["reasons"] == expected and ans["reasons"] == expected
        assert ans["counts"] == plan["counts"] and ans["counts"]["restarted"] == len(stale)
        rows = _by_old_id(ans["rows"])
        assert (rows[new]["disposition"], rows[new]["reason"], rows[new]["rollout_id"]) == ("continued", "exported_by_gym", new)
        if stale:
            # A restart under a new rollout id, sent like a new row; the trainer learns why.
            assert (rows[old]["disposition"], rows[old]["reason"], rows[old]["gym_attempt"]) == ("restarted", "too_stale", 0)
            assert rows[old]["rollout_id"] != old and rows[old]["instance_id"] is None
        else:
            assert (rows[old]["disposition"], rows[old]["reason"], rows[old]["rollout_id"]) == ("continued", "exported_by_gym", old)
        # Gym installed the continuations, and nothing of the stale episode.
        servers = (await asyncio.to_thread(fresh.state))["servers"].values()
        installed = {k for srv in servers if srv["participant"] for k in srv["unclaimed"]}
        assert f"{new}-a1" in installed and (f"{old}-a1" in installed) is not bool(stale), installed

        # The restarted trainer sends what the answer says; every row seals.
        trainer = Trainer(api, {IID: fresh}, turns=TURNS)
        await trainer.dispatch(ans["rows"], IID)
        await trainer.wait_idle(60)
        assert (await api.get("/counts"))["live_attempts"] == {"sealed": 2}
        resumed = {k: r["resumed_from_turn"] for k, r in trainer.replies.items()}
        assert resumed[f"{new}-a1"] is not None and all(r["turns_completed"] == TURNS for r in trainer.replies.values())
        if stale:
            assert resumed[rows[old]["capture_key"]] is None  # from its task, not from saved turns
        # The continuation keeps the version its saved turns were sampled under; the restart is
        # dispatched under the restored anchor.
        versions = await fetch(
            app.state.engine, "SELECT group_id, policy_version FROM attempts WHERE run_id = :r AND is_current", r=api.run_id
        )
        assert {v["group_id"]: v["policy_version"] for v in versions} == {"tnew": 1, "told": 2 if stale else 0}
    finally:
        if trainer is not None:
            await trainer.aclose()
        await kill_all(gym, *([fresh] if fresh is not None else []))
