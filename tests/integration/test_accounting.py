"""A run's accounting (docs/accounting.md) against the ledger: every admitted group in one
bucket, the buckets adding up, the rollout-seconds by fate, and what a restore recorded."""

from __future__ import annotations

from typing import Any

from sqlalchemy import text

from checkpoint_coordinator.observability import metrics as m
from checkpoint_coordinator.restore.store import records

from ..accounting_check import problems
from .ledger_helpers import group_body, new_run
from .test_restore_rewind import _rewind, _scenario

INSTANCE = "math/replica-0"


def _sample(name: str, **labels: str) -> float:
    return m.REGISTRY.get_sample_value(name, labels) or 0.0


def _counters() -> dict[str, float]:
    return {
        **{b: _sample("ckptc_prompts_total", bucket=b) for b in ("live", "trained", "abandoned", "rewound")},
        **{f"{f}_s": _sample("ckptc_rollout_seconds_total", fate=f) for f in ("trained", "carried", "redone")},
    }


async def test_every_admitted_group_is_in_one_bucket_and_a_lost_one_shows(client, admin, app) -> None:  # type: ignore[no-untyped-def]
    before = _counters()
    api = await new_run(client, admin, run_id="acct-buckets")
    rows = {g["group_id"]: g["rows"] for g in (await api.admit(*(group_body(g, 2) for g in "ABCD")))["groups"]}
    await api.admit(group_body("A", 2))  # an identical repeat is no new admission
    await api.dispatch([r["rollout_id"] for g in "ABC" for r in rows[g]], INSTANCE)
    await api.seal(rows["A"])
    await api.post("/groups/finalize", {"group_ids": ["A"]})
    await api.post("/groups/abandon", {"group_ids": ["B"]})
    # C's data budget (2 attempts): two data failures abandon it.
    nxt = (await api.fail(rows["C"][:1], "data"))["groups"][0]["rows_to_send"]
    await api.dispatch([r["rollout_id"] for r in nxt], INSTANCE)
    await api.fail(nxt[:1], "data")

    acct = await api.get("/accounting")
    p = acct["prompts"]
    assert p["admitted"] == 4 and p["conserved"] and p["missing"] == 0
    assert p["buckets"] == {"trained": 1, "abandoned": 2, "live": 1, "rewound": 0}
    assert p["abandoned_by_reason"] == {"data_attempts_exhausted": 1, "trainer": 1}
    assert p["live_by_status"] == {"generating": 1, "ready": 0}
    w = acct["work"]
    assert w["attempts_by_fate"]["trained"] == 2 and w["seconds_by_fate"]["trained"] > 0
    assert set(w["redone_by_reason"]) == {"abandoned", "failed"}, w
    assert w["attempts_by_fate"]["in_flight"] == 0 and acct["restores"] == []
    assert problems(acct) == []
    after = _counters()
    assert {b: after[b] - before[b] for b in ("live", "trained", "abandoned", "rewound")} == {"live": 4, "trained": 1, "abandoned": 2, "rewound": 0}
    assert after["trained_s"] > before["trained_s"] and after["redone_s"] > before["redone_s"]

    # A group that leaves the ledger unrecorded (what a non-atomic resume path does) is missing.
    async with app.state.engine.begin() as conn:
        await conn.execute(text("DELETE FROM prompt_groups WHERE run_id = 'acct-buckets' AND group_id = 'D'"))
    broken = await api.get("/accounting")
    assert broken["prompts"]["conserved"] is False and broken["prompts"]["missing"] == 1
    assert problems(broken) and "4 groups admitted, 3 accounted for" in problems(broken)[0]


async def test_a_restore_records_what_it_rewound_and_what_it_kept(client, admin, app) -> None:  # type: ignore[no-untyped-def]
    api, rows = await _scenario(client, admin, app, "acct-restore")
    before = await api.get("/accounting")
    assert before["prompts"]["conserved"] and before["prompts"]["admitted"] == 7
    async with app.state.engine.begin() as conn:
        await conn.execute(
            text("INSERT INTO restores (run_id, restore_id, snapshot_id, state, with_gym_state) VALUES (:r, 'r1', 's1', 'running', true)"),
            {"r": api.run_id},
        )

    def result_of(report: Any) -> tuple[dict[str, Any], records.AnswerRows]:
        return {"answer": {"accounting": {}}}, records.AnswerRows()

    report = await _rewind(app, api.run_id, record=("r1", result_of))
    assert report.groups_rewound == 1
    acct = await api.get("/accounting")
    p = acct["prompts"]
    # LATE was admitted after the cut: rewound by r1, owed again by the data loader.
    assert p["conserved"] and p["buckets"]["rewound"] == 1 and p["rewound_by_restore"] == {"r1": 1}
    (r1,) = acct["restores"]
    assert r1["restore_id"] == "r1" and r1["recorded"] and r1["groups_rewound"] == 1
    # T[1] and U[0] continue from Gym state: their work up to the cut is carried.
    assert r1["carried_seconds"] > 0 and r1["found_seconds"] >= r1["carried_seconds"]
    assert 0 < r1["carried_share"] <= 1
    assert {"after_cut", "retired_by_restore"} <= set(r1["redone_by_reason"]), r1
    assert {x["restore_level"] for x in r1["by_level"]} >= {"turn"}
    assert [x["instance_id"] for x in r1["by_instance"]] == [INSTANCE]
    assert acct["work"]["seconds_by_fate"]["carried"] == r1["carried_seconds"]

    # The data loader sends LATE again: a second admission of the same group id.
    await api.admit(group_body("LATE", 1))
    again = (await api.get("/accounting"))["prompts"]
    assert again["admitted"] == 8 and again["conserved"] and again["buckets"]["live"] == before["prompts"]["buckets"]["live"]
