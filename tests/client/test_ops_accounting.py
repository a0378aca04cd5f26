"""``ckpt-coordinator accounting`` as an operator runs it (the console script against a live
coordinator), its exit status when a run's prompt groups are not conserved, and its tables."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import pytest
from ckpt_client import CoordinatorClient
from ckpt_client.accounting import Accounting
from ckpt_client.ops_accounting import duration, percent, render_accounting

from tests.conftest import ADMIN_TOKEN

from .conftest import LiveServer, free_port, group
from .test_ops_cli import _published_run, cli

pytestmark = pytest.mark.timeout(180)


def _delete_group(database_url: str, run_id: str, group_id: str) -> None:
    """Break the ledger the way a non-atomic resume path would: a group gone, unrecorded."""
    from checkpoint_coordinator.ledger.db import make_async_engine
    from sqlalchemy import text

    async def go() -> None:
        engine = make_async_engine(database_url, pool_size=1)
        try:
            async with engine.begin() as conn:
                await conn.execute(text("DELETE FROM prompt_groups WHERE run_id = :r AND group_id = :g"), {"r": run_id, "g": group_id})
        finally:
            await engine.dispose()

    asyncio.run(go())


def _restored_run(coordinator: LiveServer, gym: Any, tmp_path: Path) -> tuple[str, str]:
    """The published run of test_ops_cli, then a group admitted after the cut, a restore of the
    snapshot (which rewinds that group), one group trained and one abandoned: every bucket holds
    one group of the four admitted."""
    run_id, token, _ = _published_run(coordinator, gym, tmp_path)
    with CoordinatorClient(coordinator.url, token, run_id=run_id, retries=2, backoff=0.05) as c:
        c.admit_groups([group("g3")])
        restored = c.restore("rst-1", snapshot_id="snap-1", with_gym_state=False, timeout=60, poll_interval=0.05)
        assert restored.accounting is not None and restored.accounting.groups_rewound == 1
        c.finalize_groups(["g0"])
        c.abandon_groups(["g2"])
    return run_id, token


def _bucket(out: str, bucket: str) -> str:
    section = out.split("prompt groups:", 1)[1].split("\n\n", 1)[0]
    return next(line.split()[1] for line in section.splitlines() if line.split()[:1] == [bucket])


def test_accounting_of_a_restored_run_then_of_a_broken_ledger(coordinator: LiveServer, gym: Any, tmp_path: Path) -> None:
    run_id, token = _restored_run(coordinator, gym, tmp_path)
    url = coordinator.url

    p = cli("accounting", "--url", url, "--run", run_id, token=token)
    assert p.returncode == 0 and p.stderr == "", p.stderr
    out = p.stdout
    assert out.startswith(f"accounting of run {run_id} (as of ")
    assert "prompt groups: 4 admitted, 4 accounted for, 0 missing" in out
    assert [_bucket(out, b) for b in ("trained", "abandoned", "live", "rewound")] == ["1", "1", "1", "1"]
    assert "CONSERVED: each of the 4 admitted groups is trained, abandoned, live or rewound" in out
    assert "NOT CONSERVED" not in out
    rewound = out.split("rewound by restore", 1)[1].split("\n\n", 1)[0]
    assert ["rst-1", "1"] in [line.split() for line in rewound.splitlines()]
    assert "rollout work: " in out and "redone by reason" in out
    # One line per restore: found, carried, redone, the carried share, groups rewound.
    restores = out.split("restores (1)", 1)[1]
    [line] = [ln.split() for ln in restores.splitlines() if ln.split()[:1] == ["rst-1"]]
    assert line[1] == "snap-1" and line[6] == "0.0%" and line[7] == "1", line  # nothing continued without Gym state
    assert "per instance" not in out

    detailed = cli("accounting", "--url", url, "--run", run_id, "--by-instance", "--by-level", token=token)
    assert detailed.returncode == 0, detailed.stderr
    assert "restore rst-1 per instance" in detailed.stdout and "restore rst-1 per level" in detailed.stdout
    assert "math/replica-0" in detailed.stdout.split("restore rst-1 per instance", 1)[1]

    pj = cli("accounting", "--url", url, "--run", run_id, "--json", token=token)
    assert pj.returncode == 0, pj.stderr
    doc = json.loads(pj.stdout)
    assert doc["run_id"] == run_id and doc["prompts"]["conserved"] is True and doc["prompts"]["admitted"] == 4
    assert [r["restore_id"] for r in doc["restores"]] == ["rst-1"] and doc["restores"][0]["groups_rewound"] == 1

    # A group vanishes from the ledger unrecorded: the tables still print, the verdict says so,
    # and the exit status is the one scripts alert on.
    _delete_group(coordinator.database_url, run_id, "g0")
    bad = cli("accounting", "--url", url, "--run", run_id, token=token)
    assert bad.returncode == 4, (bad.stdout, bad.stderr)
    assert "prompt groups: 4 admitted, 3 accounted for, 1 missing" in bad.stdout
    assert "NOT CONSERVED: 1 of 4 admitted groups are in no bucket" in bad.stdout and "\nCONSERVED" not in bad.stdout
    assert bad.stderr.strip() == f"ckpt-coordinator accounting: run {run_id} is NOT CONSERVED: 1 of 4 admitted groups are in no bucket " \
        "(docs/accounting.md#prompt-conservation)"
    badj = cli("accounting", "--url", url, "--run", run_id, "--json", token=token)
    assert badj.returncode == 4 and json.loads(badj.stdout)["prompts"]["missing"] == 1


def test_accounting_fails_like_the_other_operator_commands(coordinator: LiveServer) -> None:
    url = coordinator.url
    with CoordinatorClient(url, ADMIN_TOKEN, retries=2, backoff=0.05) as admin:
        run = admin.create_run("ops-acct", str(coordinator.checkpoint_root), {"target_level": "sibling"})
    # A run with nothing admitted yet is conserved (0 of 0) and has no work and no restore.
    empty = cli("accounting", "--run", "ops-acct", token=run.run_token, url=url)  # the URL from CKPTC_URL
    assert empty.returncode == 0, empty.stderr
    assert "prompt groups: 0 admitted, 0 accounted for, 0 missing" in empty.stdout and "\nCONSERVED" in empty.stdout
    assert "restores: none applied" in empty.stdout and "redone by reason: none" in empty.stdout

    for args, tok, words in [
        (("accounting", "--url", url, "--run", "ops-acct"), "not-the-token", "forbidden"),
        (("accounting", "--url", url, "--run", "no-such-run"), ADMIN_TOKEN, "not_found"),
    ]:
        p = cli(*args, token=tok)
        assert p.returncode == 1 and p.stdout == "", (args, p.stdout, p.stderr)
        assert len(p.stderr.strip().splitlines()) == 1 and words in p.stderr and "the coordinator refused" in p.stderr, p.stderr
    missing = cli("accounting", "--url", url, "--run", "ops-acct")
    assert missing.returncode == 2 and "CKPTC_RUN_TOKEN" in missing.stderr and missing.stdout == ""
    nowhere = f"http://127.0.0.1:{free_port()}"
    down = cli("accounting", "--url", nowhere, "--run", "ops-acct", token="t")
    assert down.returncode == 3 and nowhere in down.stderr and "Traceback" not in down.stderr
    assert len(down.stderr.splitlines()) == 1


def test_accounting_help_says_what_exit_status_4_means() -> None:
    top = cli("--help")
    assert top.returncode == 0 and "accounting" in top.stdout
    h = cli("accounting", "--help")
    assert h.returncode == 0
    text = " ".join(h.stdout.split())
    for flag in ("--url", "--run", "--json", "--by-instance", "--by-level", "CKPTC_RUN_TOKEN", "Exit status 4", "NOT CONSERVED"):
        assert flag in text, flag
    assert "--token" not in text


def _split(**kw: Any) -> dict[str, Any]:
    return {"attempts": 1, "found_seconds": 0.0, "carried_seconds": 0.0, "redone_seconds": 0.0, "carried_share": None, "redone_by_reason": {}, **kw}


def test_tables_of_a_run_with_restores_read_in_plain_words() -> None:
    acc = Accounting.parse(
        {
            "run_id": "run-x",
            "as_of": "2026-12-06T03:59:23.5+00:00",
            "prompts": {
                "admitted": 10, "buckets": {"trained": 6, "abandoned": 1, "live": 1, "rewound": 3}, "accounted": 11, "missing": -1,
                "conserved": False, "abandoned_by_reason": {"data_attempts_exhausted": 1}, "live_by_status": {"generating": 1, "ready": 0},
                "rewound_by_restore": {"r-old": 1, "r-new": 2},
            },
            "work": {
                "seconds_by_fate": {"trained": 5400.0, "in_flight": 30.0, "carried": 250.0, "redone": 320.0},
                "attempts_by_fate": {"trained": 24, "in_flight": 2, "carried": 3, "redone": 5},
                "redone_by_reason": {"rerun": 300.0, "failed": 20.0}, "total_seconds": 6000.0, "kept_share": 0.9467,
            },
            "restores": [
                {**_split(attempts=0), "restore_id": "r-old", "snapshot_id": "s1", "applied_at": None, "recorded": False, "groups_rewound": 1,
                 "already_redone_seconds": 0.0, "by_instance": [], "by_level": []},
                {**_split(attempts=8, found_seconds=570.0, carried_seconds=250.0, redone_seconds=320.0, carried_share=0.4386,
                          redone_by_reason={"rerun": 300.0, "restarted": 20.0}),
                 "restore_id": "r-new", "snapshot_id": "s2", "applied_at": "2026-12-06T03:50:00+00:00", "recorded": True, "groups_rewound": 2,
                 "already_redone_seconds": 0.0,
                 "by_instance": [_split(instance_id="gym-0", attempts=8, found_seconds=570.0, carried_seconds=250.0, redone_seconds=320.0,
                                        carried_share=0.4386)],
                 "by_level": [_split(restore_level="turn", attempts=3, found_seconds=260.0, carried_seconds=250.0, redone_seconds=10.0,
                                     carried_share=0.9615)]},
            ],
        }
    )
    text = render_accounting(acc, by_instance=True)
    assert "NOT CONSERVED: 11 groups in the buckets, 1 more than the 10 admitted" in text
    assert "rollout work: 1h 40m in all; 94.7% kept (trained, in flight or carried)" in text
    fates = {ln.split()[0]: ln.split()[1:] for ln in text.split("rollout work:", 1)[1].split("\n\n", 1)[0].splitlines()[1:]}
    assert fates["trained"] == ["24", "1h", "30m", "90.0%"] and fates["carried"] == ["3", "4m", "10s", "4.2%"]
    rows = {ln.split()[0]: ln for ln in text.split("restores (2)", 1)[1].splitlines() if ln.split()}
    assert "not recorded" in rows["r-old"] and "43.9%" in rows["r-new"] and "rerun 5m 00s, restarted 20.0s" in rows["r-new"]
    assert "restore r-new per instance" in text and "per level" not in text and "restore r-old per" not in text
    assert "not recorded: applied before the coordinator kept accounting" in text


def test_durations_and_shares_are_human_friendly() -> None:
    assert [duration(x) for x in (0, 0.417, 12.46, 245, 7380, 3 * 86400 + 7 * 3600 + 5)] == ["0.00s", "0.42s", "12.5s", "4m 05s", "2h 03m", "3d 07h"]
    assert percent(None) == "-" and percent(0.93) == "93.0%" and percent(1.0) == "100.0%"
