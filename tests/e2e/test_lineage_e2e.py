"""After a restore the old lineage is gone (docs/ledger.md#the-discarded-lineage): the train
steps it announced after the restored anchor, and a snapshot it left open."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest

from ckpt_client import CoordinatorClient, GymInstance
from gymsim.testing import GymsimInstance, default_instance_config

from ..conftest import ADMIN_TOKEN
from ..fault.coordinator_process import CoordinatorProcess
from ..integration.ledger_helpers import group_body, new_run
from .harness import Trainer, drive_snapshot, register_by_discovery

pytestmark = pytest.mark.timeout(180)


async def test_a_restore_retires_the_discarded_train_steps_and_the_new_lineage_snapshots_again(client, admin, app, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    gym = GymsimInstance.start(default_instance_config("math/replica-0", token="tok-a", turn_seconds=0.02))
    try:
        iid = gym.instance_id
        api = await new_run(client, admin, drain_timeout_s=20, data_plane_timeout_s=20)
        await register_by_discovery(app.state.engine, "run-1", [gym])
        trainer = Trainer(api, {iid: gym}, turns=2)
        await trainer.admit_and_dispatch([group_body("g1", 2)], iid)
        await trainer.wait_idle()
        await api.post("/train-steps", {"step": 1, "checkpoint_ref": "ckpt-1"})
        s1 = await drive_snapshot(api, "s1", 1, tmp_path / "dp")
        assert s1["outcome"] == "published"
        # The trainer goes on: two more train steps, then it crashes.
        await api.post("/train-steps", {"step": 2, "checkpoint_ref": "ckpt-2"})
        await api.post("/train-steps", {"step": 3, "checkpoint_ref": "ckpt-3"})
        stale = await api.post("/snapshots", {"snapshot_id": "s-old", "anchor_step": 1}, 409)
        assert stale["code"] == "snapshot_anchor_stale"

        # The new incarnation restores to the anchor of s1 (Gym kept running: no Gym state).
        ans = await api.post("/restores", {"restore_id": "r1", "step": 1, "with_gym_state": False})
        assert ans["snapshot_id"] == "s1" and ans["train_steps_retired"] == [2, 3]
        # Steps 2 and 3 of the discarded lineage no longer count: the new lineage announces step 2
        # again with another checkpoint, and a snapshot anchored on it publishes.
        again = await api.post("/train-steps", {"step": 2, "checkpoint_ref": "ckpt-2-rerun"})
        assert again["created"] is True and again["checkpoint_ref"] == "ckpt-2-rerun"
        await trainer.admit_and_dispatch([group_body("g2", 2)], iid)
        await trainer.wait_idle()
        s2 = await drive_snapshot(api, "s2", 2, tmp_path / "dp")
        assert (s2["outcome"], s2["reason"]) == ("published", "ok"), s2
        # The announce history keeps what was retired and by which restore.
        history = (await api.get("/train-steps?include_retired=true"))["train_steps"]
        assert [(h["step"], h["checkpoint_ref"], h["retired_by_restore"]) for h in history] == [
            (1, "ckpt-1", None), (2, "ckpt-2", "r1"), (3, "ckpt-3", "r1"), (2, "ckpt-2-rerun", None),
        ]
        assert [h["step"] for h in (await api.get("/train-steps"))["train_steps"]] == [1, 2]
        # A repeat of the restore answers the same, and retires nothing more.
        assert (await api.post("/restores", {"restore_id": "r1", "step": 1, "with_gym_state": False}))["train_steps_retired"] == [2, 3]
        assert len((await api.get("/train-steps"))["train_steps"]) == 2
        await trainer.aclose()
    finally:
        gym.stop()


async def test_a_restore_aborts_the_snapshot_the_discarded_lineage_left_open(client, admin, app, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    gym = GymsimInstance.start(default_instance_config("math/replica-0", token="tok-a", turn_seconds=0.02))
    try:
        api = await new_run(client, admin, drain_timeout_s=20, data_plane_timeout_s=600)
        await register_by_discovery(app.state.engine, "run-1", [gym])
        s1 = await drive_snapshot(api, "s1", 0, tmp_path / "dp")
        assert s1["outcome"] == "published"
        # The trainer asks for a snapshot and dies before its barrier: it waits for the trainer.
        await api.post("/snapshots", {"snapshot_id": "s2", "anchor_step": 0}, 202)
        async with asyncio.timeout(20):
            while (await api.get("/snapshots/s2"))["awaiting"] != "barrier":
                await asyncio.sleep(0.02)
        started = time.monotonic()
        ans = await api.post("/restores", {"restore_id": "r1", "snapshot_id": "s1", "with_gym_state": False})
        assert ans["aborted_snapshots"] == ["s2"]
        assert time.monotonic() - started < 10
        s2 = await api.get("/snapshots/s2")
        assert (s2["outcome"], s2["reason"]) == ("aborted", "restored"), s2
        assert all(s["phase"] == "idle" for s in gym.state()["servers"].values() if s.get("participant"))
        assert (await api.get(""))["dispatch_gate"]["open"]
    finally:
        gym.stop()


def test_a_new_incarnation_takes_over_an_open_snapshot_with_the_client_alone(database_url: str, tmp_path: Path) -> None:
    """The trainer dies with its snapshot open (waiting for its barrier) together with a Gym
    instance; the next incarnation, with nothing but the run id, its token and the client, aborts
    what the old one left open, registers the fresh Gym and restores, within seconds."""
    coord = CoordinatorProcess(database_url, tmp_path, coordinator_id="takeover")
    gym = GymsimInstance.start(default_instance_config("math/replica-0", token="tok-a", turn_seconds=0.02))
    fresh: GymsimInstance | None = None
    try:
        coord.start()
        admin = CoordinatorClient(coord.url, ADMIN_TOKEN)
        token = admin.create_run("run-t", str(tmp_path / "ckpt"), {"target_level": "sibling", "data_plane_timeout_s": 600}).run_token
        old = CoordinatorClient(coord.url, token, run_id="run-t")
        old.register_gym_instances([GymInstance(gym.instance_id, gym.token, gym.servers)])
        published = old.snapshot(0, capture=lambda keys: ("/dp/0", "d0"), poll_interval=0.05)
        assert published.published
        left_open = old.request_snapshot(0, snapshot_id="s-left-open")
        deadline = time.monotonic() + 20
        while old.get_snapshot(left_open.snapshot_id).awaiting != "barrier":
            assert time.monotonic() < deadline
            time.sleep(0.02)
        old.close()  # the old incarnation is gone, and so is its Gym instance
        gym.kill()
        fresh = GymsimInstance.start(default_instance_config("math/replica-0", token="tok-a", turn_seconds=0.02))

        started = time.monotonic()
        new = CoordinatorClient(coord.url, token, run_id="run-t")
        for s in new.list_snapshots():
            if not s.terminal:
                ended = new.abort_snapshot(s.snapshot_id)  # reason "superseded"
                assert (ended.outcome, ended.reason) == ("aborted", "superseded")
        new.register_gym_instances([GymInstance(fresh.instance_id, fresh.token, fresh.servers)])
        restored = new.restore(step=0)
        took = time.monotonic() - started
        assert restored.snapshot_id == published.snapshot_id
        assert took < 10, took  # not the snapshot's own 600 s data-plane timeout
        print(f"\ntakeover: abort + register + restore in {took:.2f}s")
        new.close()
        admin.close()
    finally:
        coord.stop()
        gym.kill()
        if fresh is not None:
            fresh.kill()
