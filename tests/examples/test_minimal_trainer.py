"""The README's example trainer, run as a user runs it: against a live coordinator and a gymsim
process, killed after a snapshot (Gym killed too), killed again during its recovery, and then
left to finish. It must end with every group trained once, each rollout's turns applied once."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from ckpt_client import CoordinatorClient
from gymsim.testing import GymsimInstance, default_instance_config
from tests.client.conftest import LiveServer, free_port
from tests.conftest import ADMIN_TOKEN

pytestmark = pytest.mark.timeout(300)

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "minimal_trainer.py"
STEPS, GROUPS, TURNS = 3, 3, 12


def _gym(port: int) -> GymsimInstance:
    config = default_instance_config("math/replica-0", token="tok-gymsim", turn_seconds=0.05, lease_grace_seconds=60)
    return GymsimInstance.start(config, subprocess=True, port=port)


def _run_until(args: list[str], marker: str, timeout: float = 120) -> str:
    """Start the trainer; SIGKILL it as soon as it prints a line holding ``marker``."""
    proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    seen: list[str] = []
    hit = threading.Event()

    def read() -> None:
        for line in proc.stdout:  # type: ignore[union-attr]
            seen.append(line)
            if marker in line:
                proc.send_signal(signal.SIGKILL)
                hit.set()
        hit.set()

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    assert hit.wait(timeout), "".join(seen)
    proc.wait(30)
    reader.join(30)
    out = "".join(seen)
    assert proc.returncode == -signal.SIGKILL and marker in out, out
    return out


def test_the_example_trainer_finishes_after_being_killed_twice(coordinator: LiveServer, tmp_path: Path) -> None:
    port = free_port()
    gym = _gym(port)
    work = tmp_path / "work"
    args = [sys.executable, str(EXAMPLE), "--coordinator", coordinator.url, "--admin-token", ADMIN_TOKEN, "--gym", gym.base_url,
            "--work-dir", str(work), "--steps", str(STEPS), "--groups", str(GROUPS), "--turns", str(TURNS)]
    try:
        # Killed mid-step, once step 2's snapshot is published (its rows in flight), with its Gym.
        first = _run_until(args, "step 2: snapshot")
        assert "step 1: trained" in first
        gym.kill()
        gym = _gym(port)  # a fresh Gym process, on the same address
        # Killed again as soon as its restore was applied: the next start reads that answer again.
        second = _run_until(args, "restored ")
        assert "rows to send" in second
        done = subprocess.run(args, capture_output=True, text=True, timeout=180)
        assert done.returncode == 0, done.stdout + done.stderr
        assert f"done: {STEPS * GROUPS} groups trained over {STEPS} steps" in done.stdout, done.stdout
        assert "restored " in done.stdout and "step 3: trained" in done.stdout

        trained: dict[str, Any] = json.loads((work / f"ckpt-{STEPS}.json").read_text())
        assert sorted(trained) == sorted(f"s{s}-g{k}" for s in range(1, STEPS + 1) for k in range(GROUPS))
        # The reward counts the row's turns in its resources session: 1.0 is every turn once.
        assert all(rewards == [1.0, 1.0] for rewards in trained.values()), trained
        token = json.loads((work / "run.json").read_text())["token"]
        with CoordinatorClient(coordinator.url, token, run_id="example-run") as c:
            counts = c.counts()
            assert counts.groups == {"finalized": STEPS * GROUPS} and counts.live_attempts == {}
            snaps = c.list_snapshots()
        assert all(s.terminal for s in snaps) and any(s.published for s in snaps)
        sessions = gym.admin("GET", "/admin/resources/calendar_resources/sessions")["sessions"]
        for key, s in sessions.items():  # no turn applied twice in any session of the fresh Gym
            turns = [h["turn"] for h in s["history"]]
            assert len(turns) == len(set(turns)), (key, turns)
        resumed = [k for k, s in sessions.items() if s["history"] and s["history"][0]["attempt"] == 0]
        assert resumed, "the restore continued episodes from Gym's saved state"
    finally:
        gym.kill()
