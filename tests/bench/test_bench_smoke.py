"""Smoke tests of the benchmarks: each runs at a tiny size (--quick), prints its figures, exits 0,
and leaves no process behind (embedded PostgreSQL, coordinator, gymsim), also when stopped
half-way. No timing is asserted: the figures only mean something at full size."""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

BENCH = Path(__file__).resolve().parents[2] / "bench"


@pytest.fixture
def tmp_path() -> Iterator[Path]:
    """A short private TMPDIR (PostgreSQL's socket path must stay under ~100 bytes, which
    pytest's own temporary directories do not leave room for)."""
    d = Path(tempfile.mkdtemp(prefix="ckb-", dir="/tmp"))
    try:
        yield d
    finally:
        shutil.rmtree(d, ignore_errors=True)


def _env(tmp_path: Path) -> dict[str, str]:
    # Every process the benchmark starts inherits this TMPDIR, so leftovers can be found by it.
    run = tmp_path / "run"
    run.mkdir(mode=0o700)
    return {**os.environ, "TMPDIR": str(tmp_path), "XDG_RUNTIME_DIR": str(run), "PYTHONUNBUFFERED": "1"}


def _leftovers(tmpdir: str) -> list[str]:
    found = []
    for p in psutil.process_iter(["pid", "name"]):
        try:
            if p.environ().get("TMPDIR") == tmpdir:
                found.append(f"{p.pid} {p.info['name']} {' '.join(p.cmdline())[:200]}")
        except (psutil.Error, OSError):
            continue
    return found


def _assert_no_leftovers(tmpdir: str) -> None:
    deadline = time.monotonic() + 20  # processes told to stop may take a moment to be reaped
    while (left := _leftovers(tmpdir)) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not left, left


def _run(script: str, tmp_path: Path, *args: str) -> str:
    env = _env(tmp_path)
    proc = subprocess.run([sys.executable, str(BENCH / script), *args], env=env, capture_output=True, text=True, timeout=540)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    _assert_no_leftovers(env["TMPDIR"])
    return proc.stdout


@pytest.mark.parametrize("script", ["pending_lookup.py", "snapshot_overhead.py", "ledger_ingest.py", "accounting_read.py", "effects_journal.py"])
def test_help(script: str) -> None:
    out = subprocess.run([sys.executable, str(BENCH / script), "--help"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert "--quick" in out.stdout and "Target" in out.stdout


def test_pending_lookup_quick(tmp_path: Path) -> None:
    out = _run("pending_lookup.py", tmp_path, "--quick")
    for name in ("pending_attempts", "still_pending", "HTTP pending", r"scan \(SQL filter\)", r"scan \(Python filter\)"):
        assert re.search(rf"pending_lookup:\s+{name}\s+[\d.]+ ms\s+scan/this = +[\d.]+x", out), (name, out)
    assert re.search(r"ratio scan / pending_attempts = [\d.]+, scan / still_pending = [\d.]+", out), out
    assert re.search(r"drain ratio [\d,]+ / [\d,]+ live = [\d.]+ interleaved", out), out
    assert "plan of pending_attempts: " in out and "json {" in out
    assert re.search(r"pending_lookup:\s+still_pending via read_rows\s+[\d.]+ ms", out), out


def test_ledger_ingest_quick(tmp_path: Path) -> None:
    out = _run("ledger_ingest.py", tmp_path, "--quick")
    assert re.search(r"ledger_ingest: 3200 siblings, 9600 transitions in [\d.]+ s = [\d,]+ transitions/s", out), out
    assert re.search(r"ledger_ingest: COPY of 3200 rows into a bare table = [\d,]+ rows/s", out), out
    assert re.search(r"ledger_ingest: ratio = [\d.]+ \(target >= 0.15\)", out), out
    assert re.search(r"CPU during the [\d.]+ s: coordinator [\d.]+ s, PostgreSQL [\d.]+ s, benchmark client [\d.]+ s", out), out
    assert re.search(r"service peak RSS \d+ MiB", out), out


def test_snapshot_overhead_quick(tmp_path: Path) -> None:
    out = _run("snapshot_overhead.py", tmp_path, "--quick")
    assert re.search(r"s1 published: cut [\d,]+ groups \+ 4,000 siblings, 160 episodes exported, 0 drained", out), out
    assert re.search(r"phase timings gate [\d.]+, prepare [\d.]+, commit [\d.]+, drain [\d.]+, data_plane [\d.]+, resume [\d.]+, total [\d.]+ s", out), out
    assert re.search(r"gym_parked_seconds [\d.]+ s", out), out
    assert re.search(r"Gym control calls in flight [\d.]+ s", out), out
    assert re.search(r"coordinator's own time \(also minus Gym calls in flight\) [\d.]+ s", out), out
    assert re.search(r"ledger cut [\d.]+ s .*INSERT \.\.\. SELECT reference [\d.]+ s; ratio cut / reference = [\d.]+", out), out
    assert re.search(r"take_cut called in this process .* [\d.]+ s; ratio to the reference = [\d.]+", out), out


@pytest.mark.parametrize(
    ("script", "after"),
    [
        ("pending_lookup.py", "building a run"), ("snapshot_overhead.py", "ledger of"), ("accounting_read.py", "building a run"),
        ("effects_journal.py", "dispatched rows ready"),
    ],
)
def test_stopped_half_way_leaves_nothing(tmp_path: Path, script: str, after: str) -> None:
    env = _env(tmp_path)
    proc = subprocess.Popen([sys.executable, str(BENCH / script), "--quick"], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        assert proc.stdout is not None
        seen = []
        for line in proc.stdout:
            seen.append(line)
            if after in line:
                break
        else:
            pytest.fail("".join(seen))
        proc.send_signal(signal.SIGTERM)
        proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode != 0
    _assert_no_leftovers(env["TMPDIR"])


def test_accounting_read_quick(tmp_path: Path) -> None:
    out = _run("accounting_read.py", tmp_path, "--quick")
    # The run was built and the read checked against it (``check_answer``), then both timed.
    assert re.search(r"accounting_read: built 24,000 siblings \(3,000 groups, [\d,]+ attempts, [\d,]+ in flight\)", out), out
    assert re.search(r"accounting_read: run_accounting \(the accounting read\)\s+median [\d.]+ ms\s+\(min [\d.]+ ms, max [\d.]+ ms, 3 rounds\)", out), out
    assert re.search(r"accounting_read: SELECT count\(\*\) of the run's attempts\s+median [\d.]+ ms", out), out
    assert re.search(r"accounting_read: ratio accounting / count\(\*\) = [\d.]+ \(per round [\d.]+-[\d.]+; target <= 5\)", out), out
    assert "accounting_read: json {" in out


def test_effects_journal_quick(tmp_path: Path) -> None:
    out = _run("effects_journal.py", tmp_path, "--quick")
    # Every effect was begun (proceed) and completed (``check_journal``), then each way timed.
    assert re.search(r"effects_journal: 228 effects journalled, each begun \(proceed\) and completed", out), out
    assert re.search(r"effects_journal: HTTP sequential, begin \+ complete\s+median [\d.]+ ms per effect = [\d,]+ effects/s", out), out
    assert re.search(r"effects_journal: HTTP 2 concurrent workers\s+median [\d,]+ effects/s", out), out
    assert re.search(r"coordinator's own time \(ckptc_http_request_seconds, begin \+ complete\)\s+median [\d.]+ ms per effect "
                     r"\(begin [\d.]+ ms, complete [\d.]+ ms\)", out), out
    for name in (r"in-process store\.begin \+ store\.complete", r"the SQL alone \(begin's statement \+ complete's UPDATE\)",
                 r"reference INSERT \.\.\. ON CONFLICT DO NOTHING round trip"):
        assert re.search(rf"effects_journal: {name}\s+median [\d.]+ ms", out), (name, out)
    assert re.search(r"ratio own time / reference = [\d.]+ \(per round [\d.]+-[\d.]+; target <= 3\); in-process / reference = [\d.]+; "
                     r"SQL alone / reference = [\d.]+", out), out
    assert "effects_journal: json {" in out


def test_restore_plan_quick(tmp_path: Path) -> None:
    out = _run("restore_plan.py", tmp_path, "--quick")
    # Both sizes measured, the rewind verified (a no-op would fail ``verify``), the answer paged.
    assert len(re.findall(r"restore_plan:\s+plan [\d.]+s \+ rewind [\d.]+s = [\d.]+s", out)) == 2, out
    assert re.search(r"15,330 answer rows, the pages after the first read in [\d.]+s", out), out
    assert re.search(r"peak RSS of this process: \d+ MiB", out) and "ratio" in out, out


def test_restore_plan_with_an_instance_map_quick(tmp_path: Path) -> None:
    out = _run("restore_plan.py", tmp_path, "--quick", "--instance-map")
    assert len(re.findall(r"restore_plan:\s+plan [\d.]+s \+ rewind [\d.]+s = [\d.]+s", out)) == 2, out


def test_restore_plan_without_gym_state_quick(tmp_path: Path) -> None:
    out = _run("restore_plan.py", tmp_path, "--quick", "--without-gym-state")
    assert re.search(r"without Gym state, 40,000 siblings: execute_restore [\d.]+s .* 15,330 rows to send, 3,998 retires queued", out), out


def test_gym_control_round_measures_both_profiles(tmp_path: Path) -> None:
    out = _run("gym_control_round.py", tmp_path, "--rounds", "3")
    import json

    figures = json.loads(out)
    assert set(figures["profiles"]) == {"published", "strict"}
    for profile in figures["profiles"].values():
        assert profile["participants"] == 8 and profile["replay"]["client_own_cpu_ms_per_round"] is not None
