"""``ckpt-coordinator restore-plan`` and ``ckpt-coordinator snapshots``, run as an operator runs
them: the console script as a subprocess against a live coordinator with a gymsim instance."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from ckpt_client import CoordinatorClient, GymInstance
from tests.gym_placeholders import register_placeholders_sync
from ckpt_client.ops import parse_instance_map
from tests.conftest import ADMIN_TOKEN

from .conftest import LiveServer, free_port, group, sealed

pytestmark = pytest.mark.timeout(180)

INSTANCE = "math/replica-0"
SCRIPT = str(Path(sys.executable).with_name("ckpt-coordinator"))


def cli(*args: str, token: str | None = None, timeout: float = 60, url: str | None = None) -> subprocess.CompletedProcess[str]:
    """The command as an operator runs it; ``url``: in ``CKPTC_URL`` instead of ``--url``."""
    env = {k: v for k, v in os.environ.items() if k not in ("CKPTC_RUN_TOKEN", "CKPTC_URL")}
    if token is not None:
        env["CKPTC_RUN_TOKEN"] = token
    if url is not None:
        env["CKPTC_URL"] = url
    return subprocess.run([SCRIPT, *args], capture_output=True, text=True, timeout=timeout, env=env)


def _published_run(coordinator: LiveServer, gym: Any, tmp_path: Path) -> tuple[str, str, int]:
    """A run with one published snapshot: 3 groups of 2 siblings, 3 rows sealed, 1 dispatched, 2
    never sent. Answers (run id, run token, rows to send)."""
    with CoordinatorClient(coordinator.url, ADMIN_TOKEN, retries=2, backoff=0.05) as admin:
        run = admin.create_run("ops-run", str(coordinator.checkpoint_root), {"target_level": "sibling"})
    assert run.run_token
    with CoordinatorClient(coordinator.url, run.run_token, run_id="ops-run", retries=2, backoff=0.05) as c:
        c.register_gym_instances([GymInstance(gym.instance_id, gym.token, gym.servers)])
        admitted = c.admit_groups([group("g0"), group("g1"), group("g2")])
        by_group = {g.group_id: g.rows for g in admitted.groups}
        c.dispatch([r.rollout_id for r in by_group["g0"] + by_group["g1"]], dispatch_id="d-1", instance_id=INSTANCE)
        c.report_sealed([sealed(r) for r in by_group["g0"] + by_group["g1"][:1]])

        def capture(keys: list[str]) -> dict[str, str]:
            path = tmp_path / "dp.json"
            path.write_text(json.dumps(sorted(keys)))
            return {"path": str(path), "digest": "sha256:" + hashlib.sha256(path.read_bytes()).hexdigest()}

        snap = c.snapshot(0, capture, snapshot_id="snap-1", poll_interval=0.05, timeout=60)
        assert snap.published
    return "ops-run", run.run_token, 3


def test_both_commands_against_a_live_coordinator(coordinator: LiveServer, gym: Any, tmp_path: Path) -> None:
    run_id, token, to_send = _published_run(coordinator, gym, tmp_path)
    url = coordinator.url

    # restore-plan, as a table
    p = cli("restore-plan", "--url", url, "--run", run_id, "--step", "0", token=token)
    assert p.returncode == 0, p.stderr
    out = p.stdout
    assert f"restore plan of run {run_id} (a preview: nothing is applied)" in out
    assert "snap-1" in out and "anchor step" in out and str(tmp_path / "dp.json") in out
    assert "rows per disposition (6 in all)" in out
    # 3 sealed rows are reused; the dispatched one reruns (sibling level), 2 were never sent.
    assert _count_line(out, "reused") == "3" and _count_line(out, "rerun") == "1" and _count_line(out, "dispatch") == "2"
    assert f"rows to send (reused rows: --include-reused), {to_send} of {to_send}" in out
    assert "rows per reason" in out  # a table when the coordinator sends reasons, else says it does not
    assert p.stderr == ""

    # --json: the whole plan, parseable, the same rows
    pj = cli("restore-plan", "--url", url, "--run", run_id, "--step", "0", "--json", "--include-reused", token=token)
    assert pj.returncode == 0, pj.stderr
    doc = json.loads(pj.stdout)
    assert doc["snapshot_id"] == "snap-1" and doc["counts"]["reused"] == 3 and len(doc["rows"]) == 6
    assert "next_cursor" not in doc and doc["data_plane_ref"]["path"] == str(tmp_path / "dp.json")

    # the row table is limited, with a line saying how many are left out
    pl = cli("restore-plan", "--url", url, "--run", run_id, "--snapshot", "snap-1", "--include-reused", "--rows", "2", token=token)
    assert pl.returncode == 0, pl.stderr
    assert "rows, 2 of 6" in pl.stdout and "… 4 more" in pl.stdout

    # snapshots, as a table and as JSON
    ps = cli("snapshots", "--url", url, "--run", run_id, token=token)
    assert ps.returncode == 0, ps.stderr
    assert f"snapshots of run {run_id}, newest first (1)" in ps.stdout
    assert "snap-1" in ps.stdout and "published" in ps.stdout and "phases: gate" in ps.stdout
    assert f"gym {INSTANCE}: " in ps.stdout and "participants" in ps.stdout and "outside the scope" in ps.stdout
    psj = cli("snapshots", "--url", url, "--run", run_id, "--json", "--limit", "5", token=token)
    assert psj.returncode == 0, psj.stderr
    hist = json.loads(psj.stdout)
    [s] = hist["snapshots"]
    assert s["snapshot_id"] == "snap-1" and s["outcome"] == "published" and "total" in s["phase_timings"]
    assert s["detail"]["gym"][INSTANCE]["participants"] >= 1

    # refusals: one line on stderr, exit 1, nothing on stdout, never a traceback
    for args, tok, words in [
        (("snapshots", "--url", url, "--run", run_id), "not-the-token", "forbidden"),
        (("restore-plan", "--url", url, "--run", "no-such-run"), ADMIN_TOKEN, "not_found"),
        (("restore-plan", "--url", url, "--run", run_id, "--snapshot", "no-such-snapshot"), token, "snapshot"),
        (("restore-plan", "--url", url, "--run", run_id, "--snapshot", "bad id!"), token, "invalid_request"),
    ]:
        bad = cli(*args, token=tok)
        assert bad.returncode == 1, (args, bad.stdout, bad.stderr)
        assert bad.stdout == "" and "Traceback" not in bad.stderr
        assert len(bad.stderr.strip().splitlines()) == 1 and words in bad.stderr, bad.stderr
        assert "the coordinator refused" in bad.stderr
    assert token not in "".join(cli("snapshots", "--url", url, "--run", run_id, token=token).stderr)


def _count_line(out: str, disposition: str) -> str:
    """The row count of a disposition in the 'rows per disposition' table."""
    section = out.split("rows per disposition", 1)[1].split("\n\n", 1)[0]
    for line in section.splitlines():
        parts = line.split()
        if parts[:1] == [disposition]:
            return parts[1]
    raise AssertionError(f"no {disposition} line in:\n{section}")


def test_missing_token_is_a_usage_error() -> None:
    for command in ("restore-plan", "snapshots"):
        p = cli(command, "--url", "http://127.0.0.1:9", "--run", "r")
        assert p.returncode == 2 and p.stdout == ""
        assert "CKPTC_RUN_TOKEN" in p.stderr and "Traceback" not in p.stderr and len(p.stderr.splitlines()) == 1


def test_unreachable_url_fails_in_one_line() -> None:
    url = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    for command in ("restore-plan", "snapshots"):
        p = cli(command, "--url", url, "--run", "r", token="t")
        assert p.returncode == 3 and p.stdout == ""
        assert url in p.stderr and "unreachable" in p.stderr
        assert "Traceback" not in p.stderr and len(p.stderr.splitlines()) == 1, p.stderr


def test_help_lists_both_commands_and_their_options() -> None:
    top = cli("--help")
    assert top.returncode == 0 and "restore-plan" in top.stdout and "snapshots" in top.stdout
    plan = cli("restore-plan", "--help")
    assert plan.returncode == 0
    for flag in ("--url", "--run", "--step", "--snapshot", "--instance-map", "--json", "--rows", "CKPTC_RUN_TOKEN", "Exit status"):
        assert flag in plan.stdout, flag
    # The token has no flag: an option for it would put it in shell histories and `ps`.
    assert "--token" not in plan.stdout
    snaps = cli("snapshots", "--help")
    assert snaps.returncode == 0
    for flag in ("--url", "--run", "--limit", "--json", "CKPTC_RUN_TOKEN"):
        assert flag in snaps.stdout, flag
    assert "--token" not in snaps.stdout


def test_bad_arguments_are_refused_before_any_request() -> None:
    for args, message in [
        (("restore-plan", "--url", "http://127.0.0.1:9", "--run", "r", "--instance-map", "a=b,a=c"), "mapped twice"),
        (("restore-plan", "--url", "http://127.0.0.1:9", "--run", "r", "--instance-map", "a"), "not SAVED=LIVE"),
        (("restore-plan", "--url", "http://127.0.0.1:9", "--run", "r", "--rows", "-1"), "must be >= 0"),
        (("snapshots", "--url", "http://127.0.0.1:9", "--run", "r", "--limit", "0"), "must be >= 1"),
        (("snapshots", "--url", "127.0.0.1:9", "--run", "r"), "--url must start with http"),
    ]:
        p = cli(*args, token="t")
        assert p.returncode == 2, (args, p.stderr)
        assert message in p.stderr and "Traceback" not in p.stderr


def test_instance_map_parsing() -> None:
    assert parse_instance_map("math/replica-0=job-2/gym-0, math/replica-1=job-2/gym-1") == {
        "math/replica-0": "job-2/gym-0",
        "math/replica-1": "job-2/gym-1",
    }


def test_plan_with_reasons_gets_a_reason_table_and_rows_say_why() -> None:
    from ckpt_client import RestorePlan
    from ckpt_client.ops import render_plan

    plan = RestorePlan.parse(
        {
            "snapshot_id": "s9",
            "anchor_step": 4,
            "data_plane_ref": {"path": "/ckpt/dp.json", "digest": "sha256:ab"},
            "counts": {"reused": 0, "continued": 1, "restarted": 1, "gym_restarted": 0, "rerun": 0, "dispatch": 0},
            "reasons": {"continued": {"exported_by_gym": 1}, "restarted": {"instance_not_mapped": 1}},
            "rows": [
                {"group_id": "g", "generation_index": 0, "disposition": "continued", "rollout_id": "r0", "gym_attempt": 2, "instance_id": "new-0", "reason": "exported_by_gym"},
                {"group_id": "g", "generation_index": 1, "disposition": "restarted", "rollout_id": "r1", "gym_attempt": 0, "reason": "instance_not_mapped"},
            ],
        }
    )
    text = render_plan("run-x", plan, instance_map={"old-0": "new-0"})
    assert "rows per reason" in text and "not reported" not in text
    reason_lines = [line.split() for line in text.split("rows per reason", 1)[1].split("\n\n", 1)[0].splitlines()]
    assert ["continued", "exported_by_gym", "1"] in reason_lines and ["restarted", "instance_not_mapped", "1"] in reason_lines
    assert "old-0 -> new-0" in text
    row_lines = [line.split() for line in text.split("rows to send", 1)[1].splitlines()]
    assert ["r0", "g", "0", "continued", "exported_by_gym", "2", "new-0"] in row_lines


def test_snapshot_history_shows_a_stop_and_the_slowest_participants() -> None:
    from ckpt_client import Snapshot
    from ckpt_client.ops import render_snapshots

    snap = Snapshot.parse(
        {
            "snapshot_id": "stop-1",
            "anchor_step": 7,
            "outcome": "published",
            "reason": "ok",
            "stop": True,
            "deadline_s": 90,
            "phase_timings": {"gate": 0.01, "prepare": 0.2, "commit": 0.3, "total": 0.9},
            "gym_parked_seconds": 0.5,
            "detail": {
                "gym": {
                    "job-1/gym-0": {
                        "participants": 3, "exported": 5, "exported_outside_scope": 0, "restarts": 1, "staging_keys": 5,
                        "stop_supported": False, "slowest": {"prepare": {"participant": "workplace_agent", "seconds": 0.18}},
                    }
                }
            },
        }
    )
    text = render_snapshots("run-x", [snap])
    assert "stop 90s, not honoured" in text
    assert "gym job-1/gym-0: 3 participants, 5 exported (0 outside the scope), 1 restarts, 5 staging keys" in text
    assert "slowest: prepare workplace_agent 0.18s" in text
    assert "phases: gate 0.01s, prepare 0.20s, commit 0.30s" in text


def test_snapshot_history_names_the_episodes_that_blocked_a_snapshot() -> None:
    from ckpt_client import Snapshot
    from ckpt_client.ops import render_snapshots

    ids = [f"g{k}_g0_a{k:032x}" for k in range(10)]
    snap = Snapshot.parse({"snapshot_id": "s3", "anchor_step": 2, "outcome": "failed", "reason": "gym_not_ready",
                           "phase_timings": {"prepare": 0.5}, "blockers": {"count": 12, "rollout_ids": ids}})
    assert snap.blockers is not None and (snap.blockers.count, snap.blockers.rollout_ids) == (12, ids)
    assert f"    blocked by 12 episode(s): {', '.join(ids)}, … 2 more" in render_snapshots("run-x", [snap])
    unblocked = Snapshot.parse({"snapshot_id": "s4", "outcome": "published", "phase_timings": {"prepare": 0.1}, "blockers": {"count": 0, "rollout_ids": []}})
    assert "blocked by" not in render_snapshots("run-x", [unblocked])


def test_history_pages_newest_first(coordinator: LiveServer) -> None:
    """Snapshots the trainer gave up are history all the same, each with its cause."""
    with CoordinatorClient(coordinator.url, ADMIN_TOKEN, retries=2, backoff=0.05) as admin:
        run = admin.create_run("ops-history", str(coordinator.checkpoint_root), {"target_level": "sibling"})
    assert run.run_token
    register_placeholders_sync(coordinator.database_url, "ops-history", "math/replica-0")
    with CoordinatorClient(coordinator.url, run.run_token, run_id="ops-history", retries=2, backoff=0.05) as c:
        for k in range(3):
            c.request_snapshot(0, snapshot_id=f"h{k}")
            c.abort_snapshot(f"h{k}", "data_plane_failed", detail=f"disk full {k}", timeout=30, poll_interval=0.05)
        assert [s.snapshot_id for s in c.snapshot_history(page_size=2)] == ["h2", "h1", "h0"]
        assert [s.snapshot_id for s in c.snapshot_history(limit=2, page_size=1)] == ["h2", "h1"]
        h0 = c.get_snapshot("h0")
    assert h0.reason == "data_plane_failed" and h0.retryable is False
    assert h0.cause and h0.cause.startswith("disk full 0: the trainer reported that its data-plane capture failed")
    p = cli("snapshots", "--run", "ops-history", "--all", token=run.run_token, url=coordinator.url)  # the URL from CKPTC_URL
    assert p.returncode == 0, p.stderr
    assert "newest first (3)" in p.stdout and p.stdout.index("h2") < p.stdout.index("h1") < p.stdout.index("h0")
    assert "data_plane_failed" in p.stdout and "failed" in p.stdout
    assert f"cause: {h0.cause} (waiting will not help)" in p.stdout
    one = cli("snapshots", "--url", coordinator.url, "--run", "ops-history", "--limit", "1", "--json", token=run.run_token)
    assert [s["snapshot_id"] for s in json.loads(one.stdout)["snapshots"]] == ["h2"]
