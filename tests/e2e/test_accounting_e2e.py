"""What a restore kept, priced end to end against gymsim's own clock (docs/accounting.md#what-a-restore-kept).

Episodes with turns of known length run on gymsim; a snapshot saves them mid-way; they run on
past the cut; the Gym process dies, the trainer sees its calls fail and reports them; a fresh Gym
is registered and the restore continues every episode from its saved state. The restore's carried
seconds must match what the saved states embodied (gymsim reports, per resumed episode, the
seconds from its start to the commit that captured it) and its redone seconds the work the
episodes did after that commit until the Gym died, each within 10 %."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest

from gymsim.testing import GymsimInstance, default_instance_config

from ..integration.ledger_helpers import group_body, new_run
from .harness import ReportingTrainer, drive_snapshot, kill_all, turns_done, until_every_episode_has

pytestmark = pytest.mark.timeout(240)

IID = "math/replica-0"
TURN_S = 0.2
TURNS = 32
SAVED_AFTER = 14  # turns every episode has done before the snapshot is requested
LOST_AFTER = 14  # turns every episode does after the snapshot before its Gym dies



def _start(profile: str) -> GymsimInstance:
    config = default_instance_config(IID, token="tok-0", turn_seconds=TURN_S, lease_grace_seconds=10, gym_profile=profile)
    return GymsimInstance.start(config, subprocess=True)


@pytest.mark.parametrize("profile", ["published", "strict"])
async def test_carried_and_redone_seconds_match_gymsim(client, admin, app, tmp_path: Path, profile: str) -> None:  # type: ignore[no-untyped-def]
    gym = _start(profile)
    fresh: GymsimInstance | None = None
    trainer: ReportingTrainer | None = None
    try:
        api = await new_run(client, admin, target_level="turn", control_timeout_s=10, drain_timeout_s=20, data_plane_timeout_s=20)
        await api.post("/gym-instances", {"instances": [{"instance_id": IID, "control_token": gym.token, "servers": gym.servers}]})
        trainer = ReportingTrainer(api, {IID: gym}, turns=TURNS)
        rows = await trainer.admit_and_dispatch([group_body(f"g{k}", 2) for k in range(2)], IID)
        keys = [r["capture_key"] for r in rows]
        await until_every_episode_has(gym, keys, SAVED_AFTER)
        snap = await drive_snapshot(api, "s1", 0, tmp_path / "dp")
        assert snap["outcome"] == "published", snap
        saved = (await api.get("/snapshots/s1?manifest=true"))["gym_manifest"]["instances"][IID]["episodes"]
        assert {e["rollout_id"] for e in saved} == {r["rollout_id"] for r in rows}
        done = await turns_done(gym)
        await until_every_episode_has(gym, keys, max(done[k] for k in keys) + LOST_AFTER)

        # The Gym process dies; the trainer's calls fail and it reports each one.
        killed_at = time.time()
        await asyncio.to_thread(gym.kill)
        await trainer.wait_idle(60)
        failed = await api.get("/accounting")
        assert failed["work"]["attempts_by_fate"]["in_flight"] == 0 and failed["prompts"]["conserved"]

        fresh = _start(profile)
        await api.post("/gym-instances", {"instances": [{"instance_id": IID, "control_token": fresh.token, "servers": fresh.servers}]})
        preview = (await api.get("/restore-plan?step=0"))["accounting"]
        ans = await api.post("/restores", {"restore_id": "r1", "step": 0})
        assert ans["counts"]["continued"] == len(rows), ans["counts"]
        acct = ans["accounting"]
        # The preview priced the same work (nothing changed in between).
        assert preview["carried_seconds"] == pytest.approx(acct["carried_seconds"], rel=1e-6)

        trainer.instances = {IID: fresh}
        await trainer.dispatch(ans["rows"], IID)
        await trainer.wait_idle(120)
        replies = [trainer.replies[r["capture_key"]] for r in ans["rows"]]
        assert all(x["resumed_saved"] is not None and x["turns_completed"] == TURNS for x in replies), replies
        gym_carried = sum(x["resumed_saved"]["seconds"] for x in replies)
        gym_redone = sum(killed_at - x["resumed_saved"]["at"] for x in replies)
        assert abs(acct["carried_seconds"] - gym_carried) <= 0.1 * gym_carried, (acct, gym_carried)
        assert abs(acct["redone_seconds"] - gym_redone) <= 0.1 * gym_redone, (acct, gym_redone)
        assert set(acct["redone_by_reason"]) == {"after_cut"} and acct["attempts"] == len(rows)
        assert acct["found_seconds"] == pytest.approx(acct["carried_seconds"] + acct["redone_seconds"], abs=0.01)
        (inst,) = acct["by_instance"]
        assert inst["instance_id"] == IID and inst["carried_share"] == acct["carried_share"]
        assert [x["restore_level"] for x in acct["by_level"]] == ["turn"]

        # The run's accounting says the same, and every group trained once the trainer finishes.
        run = await api.get("/accounting")
        assert run["restores"][0]["carried_seconds"] == acct["carried_seconds"]
        assert run["work"]["seconds_by_fate"]["carried"] == acct["carried_seconds"]
        await api.post("/groups/finalize", {"group_ids": ["g0", "g1"]})
        end = await api.get("/accounting")
        assert end["prompts"]["buckets"] == {"trained": 2, "abandoned": 0, "live": 0, "rewound": 0} and end["prompts"]["conserved"]
        assert end["work"]["attempts_by_fate"]["trained"] == len(rows)
    finally:
        if trainer is not None:
            await trainer.aclose()
        await kill_all(gym, *([fresh] if fresh else []))
