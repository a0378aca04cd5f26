"""``ckpt-coordinator demo``: the whole crash-and-restore story as the user runs it, plus its
command line and the checks that decide its exit status."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from ckpt_demo import build_parser
from ckpt_demo.checks import (
    check_conserved,
    check_groups,
    check_instance_map,
    check_mails_once,
    check_mails_twice,
    check_mutations,
    check_orphans_replaced,
    check_rewards,
)
from ckpt_demo.runner import FIRST_ALLOCATION, INSTANCE_MAP, NEXT_ALLOCATION, pids_alive
from ckpt_demo.trainer import DataLoader, recovery_config

# Through the console script's module, as `ckpt-coordinator demo -- ARGS` (the `--` hands the
# options to the demo's own parser).
DEMO = [sys.executable, "-m", "ckpt_launcher", "demo", "--"]


def _run(args: list[str], timeout: float) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    return subprocess.run([*DEMO, *args], capture_output=True, text=True, timeout=timeout, env=env)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_demo_survives_the_crash_and_shows_every_disposition(tmp_path: Path) -> None:
    out = tmp_path / "summary.json"
    proc = _run(["--steps", "2", "--groups", "4", "--seed", "3", "--quiet", "--json-summary", str(out)], timeout=280)
    assert proc.returncode == 0, f"exit {proc.returncode}\nstdout:\n{proc.stdout[-4000:]}\nstderr:\n{proc.stderr[-4000:]}"
    assert "Traceback" not in proc.stderr
    s = json.loads(out.read_text())

    assert s["ok"] is True
    failed = [c for c in s["checks"] if not c["ok"]]
    assert not failed, failed
    names = {c["name"] for c in s["checks"]}
    assert {"no group lost", "no group trained twice", "no mutation applied twice"} <= names

    # The restore answer shows every kind of sibling the crash was arranged for.
    d = s["dispositions"]
    assert d["reused"] > 0 and d["continued"] > 0 and d["restarted"] > 0, d
    assert s["restore"]["gym_installed"] is True
    assert sum(s["restore"]["continued_by_instance"].values()) == d["continued"]
    # Gym restores only into fresh servers: the instance that kept running is the only one a
    # refusal may name (the demo then restarts it and restores again).
    assert all(names == ["math/replica-1"] for names in s["restore"]["refused_not_fresh"])

    # Every group of both steps was handed to the trainer exactly once, across the crash.
    g = s["groups"]
    assert g["expected"] == 8 and g["consumed"] == 8 and g["finalized"] == 8 and g["abandoned"] == 0
    assert s["crash"]["step"] == 2 and s["restore"]["anchor_step"] == 1

    # Snapshots: published ones, and the one that lost to a train step, with its reason.
    outcomes = s["snapshot_totals"]["outcomes"]
    assert outcomes.get("published", 0) >= 3
    assert s["snapshot_totals"]["not_published_reasons"].get("aborted:train_step_committed") == 1
    assert s["gym_parked_seconds"] > 0

    _assert_accounting(s, proc.stdout)

    # The summary table went to stdout; nothing the demo started is left running or on disk.
    assert "continued" in proc.stdout and "OK in" in proc.stdout
    assert pids_alive(s["processes"]) == []
    assert s["workdir"] and not Path(s["workdir"]).exists()


# Needs the coordinator's side of stopping snapshots (docs/ledger.md#stopping-snapshots) and
# instance maps (docs/ledger.md#another-gym-topology).
@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("profile", ["published", "strict"])
def test_demo_allocation_end_restores_into_fewer_renamed_instances(tmp_path: Path, profile: str) -> None:
    out = tmp_path / "summary.json"
    args = ["--scenario", "allocation-end", "--steps", "2", "--groups", "8", "--seed", "3", "--gym-profile", profile]
    proc = _run([*args, "--quiet", "--json-summary", str(out)], timeout=280)
    assert proc.returncode == 0, f"exit {proc.returncode}\nstdout:\n{proc.stdout[-4000:]}\nstderr:\n{proc.stderr[-4000:]}"
    assert "Traceback" not in proc.stderr
    s = json.loads(out.read_text())
    assert s["ok"] is True and not [c for c in s["checks"] if not c["ok"]]
    assert "episodes follow the instance map" in {c["name"] for c in s["checks"]}

    # SIGUSR1 -> a stopping snapshot that publishes; strict Gym honours the stop, published refuses it.
    a = s["allocation_end"]
    assert a["signal"] == "SIGUSR1" and a["outcome"] == "published"
    assert a["stop_honoured"] is (profile == "strict")
    assert s["restore"]["snapshot_id"] == a["snapshot_id"] and s["restore"]["anchor_step"] == 1
    assert a["saved_instances"] == list(FIRST_ALLOCATION) and a["live_instances"] == list(NEXT_ALLOCATION)

    # The mapped instances' episodes continue where they were mapped; the unmapped one's restart.
    # Under load the signal can come late in the step (the demo signals anyway at 75% sealed),
    # when an instance had nothing in flight: what it exported is then 0, and the plan says so.
    exported = a["exported_by_saved_instance"]
    assert sum(exported.values()) > 0, exported
    [unmapped] = sorted(set(FIRST_ALLOCATION) - set(INSTANCE_MAP))
    by_live = s["restore"]["continued_by_instance"]
    assert {live: by_live.get(live, 0) for live in INSTANCE_MAP.values()} == {live: exported[saved] for saved, live in INSTANCE_MAP.items()}
    reasons = s["restore"]["plan_reasons"]
    assert reasons.get("restarted", {}).get("instance_not_mapped", 0) == exported[unmapped], reasons
    carried = sum(exported[saved] for saved in INSTANCE_MAP)
    assert reasons.get("continued", {}) == ({"exported_by_gym": carried} if carried else {}), reasons

    # The summary prints the plan's reasons and whether the stop was honoured.
    assert "why (the plan's reason for each row)" in proc.stdout and "instance_not_mapped" in proc.stdout
    assert ("stop honoured" if profile == "strict" else "stop not honoured") in proc.stdout
    _assert_accounting(s, proc.stdout)
    assert pids_alive(s["processes"]) == []
    assert s["workdir"] and not Path(s["workdir"]).exists()


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_demo_side_effects_mails_twice_without_the_journal_and_once_with_it(tmp_path: Path) -> None:
    out = tmp_path / "summary.json"
    proc = _run(["--scenario", "side-effects", "--quiet", "--json-summary", str(out)], timeout=280)
    assert proc.returncode == 0, f"exit {proc.returncode}\nstdout:\n{proc.stdout[-4000:]}\nstderr:\n{proc.stderr[-4000:]}"
    assert "Traceback" not in proc.stderr
    s = json.loads(out.read_text())
    assert s["ok"] is True and not [c for c in s["checks"] if not c["ok"]]
    off, on = s["side_effects"]["without_journal"], s["side_effects"]["with_journal"]
    assert off["run_id"] != on["run_id"]

    # Without the journal every episode mailed the turns between its cut and the crash twice.
    for name, e in off["episodes"].items():
        assert e["mailed_twice"] and e["mailed_twice"][0] == e["saved_turn"] and e["places"] == 10, (name, e)
    assert off["effects"] == [] and off["orphans"] == []
    # With it no mail went out twice. The calendar's continuations asked for the same mails and
    # were answered done; the drafting agent's asked for others (naming their attempt): sent, and
    # the ones they replace are listed as orphans, `diverged`.
    for name, e in on["episodes"].items():
        assert e["sent_twice"] == [] and e["places"] == 10, (name, e)
        assert bool(e["orphaned"]) is ("drafting" in name) and set(e["mailed_twice"]) <= set(e["orphaned"]), (name, e)
        # (one more orphan than replaced mails: the Gym died between a begin and its mail)
        assert len(e["orphaned"]) <= len(e["mailed_twice"]) + 1, (name, e)
    assert on["orphans"] and {o["orphan_reason"] for o in on["orphans"]} == {"diverged"}
    assert sum(x["done_before"] for x in on["continuation_mail_tool"].values()) > 0
    for run in (off, on):
        p = run["accounting"]["prompts"]
        assert p["conserved"] is True and p["buckets"]["trained"] == 2, p

    assert "mails per episode" in proc.stdout and "listed as orphans" in proc.stdout and "OK in" in proc.stdout
    assert pids_alive(s["processes"]) == []
    assert s["workdir"] and not Path(s["workdir"]).exists()


def test_mail_checks_catch_a_mail_sent_twice_and_a_replacement_left_unlisted() -> None:
    def mail(rid: str, attempt: int, seq: int, body: str = "b") -> dict:
        return {"rollout_id": rid, "attempt": attempt, "seq": seq, "body": body}

    def rec(rid: str, attempt: int, seq: int, orphaned: bool = False) -> dict:
        return {"rollout_id": rid, "gym_attempt": attempt, "seq": seq, "state": "completed", "orphaned_at": "t" if orphaned else None}

    once = [mail("r", 0, 0), mail("r", 0, 1)]
    assert not check_mails_twice(once).ok and check_mails_twice([*once, mail("r", 1, 1)]).ok
    assert check_mails_once(once, [rec("r", 0, 0), rec("r", 0, 1)], expected=2).ok
    doubled = check_mails_once([*once, mail("r", 1, 1)], [rec("r", 0, 0), rec("r", 0, 1), rec("r", 1, 1)], expected=2)
    assert not doubled.ok and "sent twice: r seq 1" in doubled.detail
    assert "without a completed record" in check_mails_once(once, [rec("r", 0, 0)], expected=2).detail
    assert "not every place" in check_mails_once(once[:1], [rec("r", 0, 0)], expected=2).detail
    # A replaced mail (another body at the same place) passes only when its record is an orphan.
    replaced = [*once, mail("r", 1, 1, "other")]
    assert check_orphans_replaced(replaced, [rec("r", 0, 0), rec("r", 0, 1, orphaned=True), rec("r", 1, 1)]).ok
    assert not check_orphans_replaced(replaced, [rec("r", 0, 0), rec("r", 0, 1), rec("r", 1, 1)]).ok


def _assert_accounting(s: dict, stdout: str) -> None:
    """The coordinator's accounting is in the summary and on stdout, and its conservation is one
    of the checks that decide the exit status."""
    acc = s["accounting"]
    p = acc["prompts"]
    assert p["conserved"] is True and p["missing"] == 0 and p["buckets"]["live"] == 0, p
    # Every group was trained in the end; a rewound one was admitted again, and counted again.
    assert p["buckets"]["trained"] == s["groups"]["expected"] and p["admitted"] == p["buckets"]["trained"] + p["buckets"]["rewound"]
    [conserved] = [c for c in s["checks"] if c["name"] == "every prompt group accounted for (conserved)"]
    assert conserved["ok"] is True
    [r] = acc["restores"]
    assert r["restore_id"] == s["restore"]["restore_id"] and r["recorded"] is True and r["found_seconds"] > 0
    assert abs(r["carried_seconds"] + r["redone_seconds"] - r["found_seconds"]) < 0.01

    section = stdout.split("accounting (the coordinator's, from its ledger)\n", 1)[1].split("\n\n", 1)[0].splitlines()
    assert section[0].split() == ["admitted", "trained", "abandoned", "live", "rewound", "missing", "conserved"]
    assert section[2].split()[-1] == "yes"
    [line] = [ln.split() for ln in section if ln.split()[:1] == [r["restore_id"]]]
    # found, carried and redone read as durations ("1m 02s" is two words): the share and the
    # groups rewound end the line.
    assert line[1] == s["restore"]["snapshot_id"] and line[-2:] == [f"{r['carried_share'] * 100:.1f}%", str(r["groups_rewound"])], line
    assert f"restore {r['restore_id']} kept {r['carried_share'] * 100:.1f}% of the work it found in flight" in stdout


def test_help_explains_every_flag() -> None:
    proc = _run(["--help"], timeout=60)
    assert proc.returncode == 0
    for flag in ("--steps", "--groups", "--seed", "--data-dir", "--keep", "--quiet", "--json-summary", "--scenario", "allocation-end", "side-effects"):
        assert flag in proc.stdout
    assert "Exit status" in proc.stdout


@pytest.mark.parametrize(
    "args, message",
    [
        (["--scenario", "flood"], "invalid choice"),
        (["--steps", "0"], "must be at least 1"),
        (["--groups", "many"], "not an integer"),
        (["--timeout", "0"], "--timeout must be positive"),
    ],
)
def test_bad_arguments_fail_cleanly_before_starting_anything(args: list[str], message: str) -> None:
    proc = _run(args, timeout=60)
    assert proc.returncode == 2
    assert message in proc.stderr and "Traceback" not in proc.stderr


def test_data_dir_that_is_a_file_is_refused(tmp_path: Path) -> None:
    f = tmp_path / "not-a-dir"
    f.write_text("x")
    proc = _run(["--data-dir", str(f)], timeout=60)
    assert proc.returncode == 2 and "is not a directory" in proc.stderr


def test_parser_defaults() -> None:
    a = build_parser().parse_args([])
    assert (a.steps, a.groups, a.seed, a.keep, a.quiet, a.data_dir, a.json_summary) == (4, 8, 1, False, False, None, None)


# --------------------------------------------------------------------------------------------
# The pieces the verdict rests on


def test_data_loader_is_deterministic_and_mixes_levels() -> None:
    a, b = DataLoader(7, 8), DataLoader(7, 8)
    assert a.step(3) == b.step(3) and a.step(3) != DataLoader(8, 8).step(3)
    kinds = [g.kind for g in a.step(1)]
    assert kinds.count("turn") == 4 and kinds.count("sibling") == 2 and kinds.count("prompt_group") == 2
    g = a.step(2)[3]
    assert a.group(g.group_id) == g and DataLoader.kind_of(g.group_id) == g.kind
    # Each kind reaches its level through the run's overrides (agent first, then task source).
    cfg = recovery_config()
    for grp in a.step(1):
        spec = grp.spec()
        level = cfg["agent_target_level_overrides"].get(spec.agent_name) or cfg["task_source_target_level_overrides"].get(spec.task_source) or cfg["target_level"]
        assert level == grp.level


def _lineage(*groups: str) -> list[dict]:
    return [{"group_id": g, "rewards": [1.0, 1.0]} for g in groups]


def test_group_checks_catch_a_lost_and_a_doubled_group() -> None:
    ok = check_groups(
        expected=["a", "b", "c"],
        lineage=_lineage("a", "b"),
        abandoned=["c"],
        finalize_results=[("a", "finalized"), ("b", "finalized")],
        coordinator_groups={"finalized": 2, "abandoned": 1},
    )
    assert all(c.ok for c in ok), ok
    bad = check_groups(
        expected=["a", "b", "c"],
        lineage=_lineage("a", "a"),
        abandoned=[],
        finalize_results=[("a", "finalized"), ("a", "unchanged")],
        coordinator_groups={"finalized": 1, "ready": 1},
    )
    by_name = {c.name: c for c in bad}
    assert not by_name["no group lost"].ok and "b, c" in by_name["no group lost"].detail
    assert not by_name["no group trained twice"].ok and "a" in by_name["no group trained twice"].detail
    assert not by_name["every finalize handed a group over for the first time"].ok
    assert not by_name["the coordinator agrees"].ok


def test_mutation_check_catches_a_turn_applied_twice_and_a_gap_in_a_continuation() -> None:
    h = lambda rid, att, turns: [{"rollout_id": rid, "attempt": att, "turn": t} for t in turns]  # noqa: E731
    sessions = {"i0": {"r1-a1": {"history": h("r1", 0, [0, 1]) + h("r1", 1, [2, 3])}, "r2": {"history": h("r2", 0, [0, 1, 2])}}}
    continued = [{"capture_key": "r1-a1", "instance_id": "i0"}]
    replies = {"r1-a1": {"turns_completed": 4, "resumed_from_turn": 2}}
    good = check_mutations(sessions, continued, replies)
    assert good.ok and "1 resumed after turn 0" in good.detail

    doubled = {"i0": {**sessions["i0"], "r2": {"history": h("r2", 0, [0, 1, 1, 2])}}}
    assert not check_mutations(doubled, continued, replies).ok
    gap = {"i0": {**sessions["i0"], "r1-a1": {"history": h("r1", 0, [0]) + h("r1", 1, [2, 3])}}}
    bad = check_mutations(gap, continued, replies)
    assert not bad.ok and "r1-a1" in bad.detail
    assert not check_mutations(sessions, continued, {}).ok  # a continuation that never sealed


def test_instance_map_check_holds_continuations_to_the_map_and_restarts_to_their_reason() -> None:
    exported = {"old-0": 2, "old-1": 1, "old-2": 3}
    m = {"old-0": "new-0", "old-1": "new-1"}
    good = check_instance_map(exported, m, {"new-0": 2, "new-1": 1}, {"continued": {"exported_by_gym": 3}, "restarted": {"instance_not_mapped": 3}})
    assert good.ok and "3 of unmapped old-2 restart" in good.detail
    swapped = check_instance_map(exported, m, {"new-0": 1, "new-1": 2}, {"restarted": {"instance_not_mapped": 3}})
    assert not swapped.ok and "old-0 exported 2 episodes, new-0 continues 1" in swapped.detail
    assert not check_instance_map(exported, m, {"new-0": 2, "new-1": 1}, {"restarted": {"instance_not_mapped": 1}}).ok
    # A coordinator that sends no reasons cannot show that the unmapped episodes restart.
    assert "no reasons" in check_instance_map(exported, m, {"new-0": 2, "new-1": 1}, {}).detail


def test_reward_check_flags_a_row_with_a_lost_or_doubled_turn() -> None:
    assert check_rewards(_lineage("a")).ok
    assert not check_rewards([{"group_id": "a", "rewards": [1.0, 1.25]}]).ok


def test_pids_alive_tells_our_process_from_one_that_reused_its_pid() -> None:
    import psutil

    me = os.getpid()
    born = psutil.Process(me).create_time()
    # Recorded with its start time: the same process is ours, still running.
    assert pids_alive({"coordinator": me, "gymsim": [], "started": {str(me): born}}) == [me]
    # The pid now belongs to a process that started at another time: not ours.
    assert pids_alive({"coordinator": me, "gymsim": [], "started": {str(me): born - 60}}) == []
    # Recorded as already ended (no start time while others have one): a later holder is not ours.
    assert pids_alive({"coordinator": 1 << 22, "gymsim": [me], "started": {str(1 << 22): 1.0}}) == []
    # A summary without start times falls back to the pid alone.
    assert pids_alive({"coordinator": me, "gymsim": []}) == [me]


def test_summary_of_an_allocation_end_names_the_stop_the_map_and_the_reasons() -> None:
    from ckpt_demo.report import render_summary

    summary = {
        "ok": True,
        "wall_seconds": 27.0,
        "run_id": "demo-x",
        "scenario": "allocation-end",
        "options": {"steps": 4, "groups": 8, "seed": 1, "generations": 4, "gym_profile": "published"},
        "allocation_end": {
            "stop_step": 3, "signal": "SIGUSR1", "deadline_s": 30.0, "snapshot_id": "snap-stop", "outcome": "published", "reason": "ok",
            "stop_honoured": False, "saved_instances": list(FIRST_ALLOCATION), "live_instances": list(NEXT_ALLOCATION),
            "instance_map": dict(INSTANCE_MAP),
        },
        "groups": {"expected": 32, "admitted": 32, "finalized": 32, "abandoned": 0, "consumed": 32, "rolled_back": 0},
        "restore": {
            "restore_id": "r1", "snapshot_id": "snap-stop", "anchor_step": 2, "gym_installed": True, "refused_not_fresh": [],
            "counts": {"reused": 17, "continued": 3, "restarted": 2}, "continued_by_instance": {NEXT_ALLOCATION[0]: 2, NEXT_ALLOCATION[1]: 1},
            "plan_reasons": {"continued": {"exported_by_gym": 3}, "restarted": {"instance_not_mapped": 2}, "reused": {"sealed_at_cut": 17}},
        },
        "snapshots": [],
        "snapshot_totals": {"outcomes": {"published": 1}, "not_published_reasons": {}},
        "gym_parked_seconds": 0.5,
        "siblings": {"sealed_reports": 100, "gym_refusals": 0, "transport_failures": 0},
        "checks": [{"name": "episodes follow the instance map", "ok": True, "detail": "..."}],
    }
    text = render_summary(summary)
    assert "scenario allocation-end" in text and "SIGUSR1 -> stopping snapshot snap-stop within 30s: published; stop not honoured" in text
    assert f"instance map {FIRST_ALLOCATION[0]} -> {NEXT_ALLOCATION[0]}" in text
    why = [line.split() for line in text.split("why (the plan's reason for each row)", 1)[1].split("\n\n", 1)[0].splitlines()]
    assert ["reused", "sealed_at_cut", "17"] in why and ["restarted", "instance_not_mapped", "2"] in why
    assert [w[0] for w in why if w and not w[0].startswith("-")][1:] == ["reused", "continued", "restarted"]  # in the dispositions' order


def test_conservation_check_fails_the_demo_when_a_group_is_in_no_bucket() -> None:
    good = check_conserved({"admitted": 10, "accounted": 10, "missing": 0, "conserved": True,
                            "buckets": {"trained": 8, "abandoned": 0, "live": 0, "rewound": 2}})
    assert good.ok and "trained 8, abandoned 0, live 0, rewound 2" in good.detail
    bad = check_conserved({"admitted": 10, "accounted": 9, "missing": 1, "conserved": False,
                           "buckets": {"trained": 7, "abandoned": 0, "live": 0, "rewound": 2}})
    assert not bad.ok and "1 unaccounted for" in bad.detail
    # An answer without the verdict is not taken for a conserved run.
    assert not check_conserved({}).ok


def test_summary_prints_the_accounting_and_the_failed_conservation() -> None:
    from ckpt_demo.report import render_accounting

    acc = {
        "prompts": {"admitted": 10, "buckets": {"trained": 7, "abandoned": 0, "live": 0, "rewound": 2}, "accounted": 9, "missing": 1,
                    "conserved": False},
        "work": {"seconds_by_fate": {"trained": 80.0, "in_flight": 0.0, "carried": 6.0, "redone": 4.0}, "total_seconds": 90.0},
        "restores": [{"restore_id": "r1", "snapshot_id": "s1", "found_seconds": 10.0, "carried_seconds": 6.0, "redone_seconds": 4.0,
                      "carried_share": 0.6, "groups_rewound": 2, "recorded": True}],
    }
    lines = render_accounting(acc)
    assert lines[1].split() == ["admitted", "trained", "abandoned", "live", "rewound", "missing", "conserved"]
    assert lines[3].split() == ["10", "7", "0", "0", "2", "1", "NO"]
    assert "  rollout work 1m 30s: trained 1m 20s, in_flight 0.00s, carried 6.00s, redone 4.00s" in lines
    assert ["r1", "s1", "10.0s", "6.00s", "4.00s", "60.0%", "2"] in [ln.split() for ln in lines]
    assert "  restore r1 kept 60.0% of the work it found in flight" in lines
