"""gymsim as a process: the CLI, the announce line, and surviving a real crash through a restore."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest

from gymsim.cli import main
from gymsim.conformance import Harness
from gymsim.testing import GymsimInstance, default_instance_config


def test_cli_default_config_prints_a_loadable_config(capsys):
    assert main(["default-config", "--instance-id", "code/replica-3", "--token", "t0k"]) == 0
    config = json.loads(capsys.readouterr().out)
    assert config["instance_id"] == "code/replica-3" and config["token"] == "t0k"


def test_cli_refuses_a_bad_config(tmp_path, capsys):
    path = tmp_path / "bad.json"
    path.write_text(json.dumps({**default_instance_config(), "surprise": True}))
    assert main(["serve", "--config", str(path)]) == 2
    assert "surprise" in capsys.readouterr().err
    assert main(["serve", "--config", str(tmp_path / "missing.json")]) == 2


async def test_a_killed_process_is_restored_on_a_fresh_one_without_applying_a_turn_twice(tmp_path):
    config = default_instance_config(turn_seconds=0.02)
    directory = tmp_path / "snap" / "gym-instances" / "math" / "replica-0"
    directory.mkdir(parents=True)

    first = await asyncio.to_thread(GymsimInstance.start, config, subprocess=True)
    async with httpx.AsyncClient(timeout=30) as client:
        a = Harness(first, client)
        # The announce line gave every server's URL, all on the announced port.
        assert set(first.servers) == {"policy_model", "workplace_agent", "calendar_resources", "judge_model"}
        assert all(url.startswith(f"http://127.0.0.1:{first.port}/s/") for url in first.servers.values())
        saved = await a.save("snap-1", directory, ["r1", "r2"], turns=8)
        sessions_at_cut = a.sessions()
        first.kill()  # SIGKILL: the parked /run calls lose their connections
        for run in saved.runs.values():
            with pytest.raises(httpx.TransportError):
                await run
        with pytest.raises(httpx.TransportError):
            await client.get(first.base_url + "/admin/state")

        second = await asyncio.to_thread(GymsimInstance.start, config)  # in-process is as fresh
        try:
            b = Harness(second, client)
            replies = await b.restore_all("restore-1", saved)
            assert {r["source_checkpoint_id"] for r in replies.values()} == {"snap-1"}
            await b.resume_all("restore-1")
            rows = await asyncio.gather(*(b.run(r, 1, task={"rollout": r}, turns=8) for r in ("r1", "r2")))
            sessions = b.sessions()
            for rollout, row in zip(("r1", "r2"), rows):
                body = row.json()
                assert body["resumed_from_turn"] == saved.saved_turns[rollout] and body["reward"] == 1.0
                history = sessions[f"{rollout}-a1"]["history"]
                assert [h["turn"] for h in history] == list(range(8))
                assert history[: saved.saved_turns[rollout]] == sessions_at_cut[rollout]["history"]
        finally:
            second.stop()
