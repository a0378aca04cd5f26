"""Per-run series go when the run ends or moves to another replica (a finished run's alert does
not fire for ever, and the series of a long-lived fleet stay bounded)."""

from __future__ import annotations

from sqlalchemy import text

from checkpoint_coordinator import background
from checkpoint_coordinator.observability import metrics

ROOT = "/tmp/ckptc-series"


def _series_of(run_id: str) -> list[str]:
    body = metrics.render_latest()[0].decode()
    return [line for line in body.splitlines() if f'run="{run_id}"' in line]


def _drilldown_of(run_id: str) -> list[str]:
    return [line for line in _series_of(run_id) if line.startswith("ckptc_run_")]


def _record_for(run_id: str) -> None:
    metrics.set_snapshot_losses(run_id, 2, 3)
    metrics.set_snapshot_failures(run_id, 4)
    metrics.record_snapshot_outcome("failed", "gym_not_ready", run_id)
    metrics.observe_snapshot_phase("total", 1.5, run_id)
    metrics.observe_gym_control("prepare", "agent", "ok", 0.1, run_id)
    metrics.record_restore_plan({"reused": 3}, run_id)
    metrics.observe_restore_duration(2.0, "succeeded", run_id)


async def _run(client, admin, run_id: str) -> dict[str, str]:  # type: ignore[no-untyped-def]
    r = await client.post("/v1/runs", json={"run_id": run_id, "checkpoint_root": ROOT, "recovery": {"target_level": "sibling"}}, headers=admin)
    assert r.status_code == 201, r.text
    return {"Authorization": f"Bearer {r.json()['run_token']}"}


async def test_closing_a_run_drops_its_series(client, admin) -> None:  # type: ignore[no-untyped-def]
    token = await _run(client, admin, "series-closed")
    _record_for("series-closed")
    names = {line.split("{")[0] for line in _series_of("series-closed")}
    assert {"ckptc_snapshot_losses_consecutive", "ckptc_snapshot_failures_consecutive", "ckptc_run_snapshots_total",
            "ckptc_run_snapshot_phase_seconds", "ckptc_run_gym_control_calls_total", "ckptc_run_restore_siblings_total",
            "ckptc_run_restore_seconds"} <= names, names
    assert (await client.post("/v1/runs/series-closed/close", headers=token)).status_code == 200
    assert _series_of("series-closed") == []


async def test_the_sweep_drops_runs_that_moved_away_and_keeps_its_own(app, client, admin, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    owner = app.state.settings.coordinator_id
    for run_id in ("series-moved", "series-mine", "series-fresh"):
        await _run(client, admin, run_id)
        _record_for(run_id)
    async with app.state.engine.begin() as conn:
        await conn.execute(text("INSERT INTO ownership_leases (run_id, owner, epoch, expires_at) VALUES "
                                "('series-moved', 'another-replica', 2, now() + interval '1 minute'), "
                                "('series-mine', :o, 1, now() - interval '1 minute')"), {"o": owner})
    await background._sweep_run_series(app.state.engine, owner)
    assert _drilldown_of("series-moved")  # within the grace: Prometheus scrapes the last values first
    monkeypatch.setattr(background, "RUN_SERIES_GRACE_S", 0.0)
    await background._sweep_run_series(app.state.engine, owner)
    assert _drilldown_of("series-moved") == []
    # Its own (even with the lease lapsed between snapshots) and a run nobody drove yet stay.
    assert _drilldown_of("series-mine") and _drilldown_of("series-fresh")
    for run_id in ("series-moved", "series-mine", "series-fresh"):
        metrics.forget_run(run_id)


async def test_streaks_come_from_the_ledger_on_every_replica(app, client, admin) -> None:  # type: ignore[no-untyped-def]
    """A run's losses and failures in a row are reported from the ledger whoever drives it: after a
    restart or a lease moving the failing-snapshots alert keeps its count; a run without a streak
    has no series."""
    from checkpoint_coordinator.ledger import leases

    for run_id in ("streak-failing", "streak-healthy"):
        await _run(client, admin, run_id)
    async with app.state.engine.begin() as conn:
        await conn.execute(text("UPDATE runs SET consecutive_snapshot_failures = 4, consecutive_snapshot_losses = 3 WHERE run_id = 'streak-failing'"))
    metrics.set_snapshot_failures("streak-healthy", 0)  # set by a snapshot's end, a streak since ended
    streaks = await leases.run_streaks(app.state.engine)
    assert streaks["streak-failing"] == (3, 4, 3) and "streak-healthy" not in streaks
    metrics.set_run_streaks(streaks)
    assert 'ckptc_snapshot_failures_consecutive{run="streak-failing"} 4.0' in _series_of("streak-failing")
    assert 'ckptc_snapshot_losses_warning{run="streak-failing"} 1.0' in _series_of("streak-failing")
    assert _series_of("streak-healthy") == []
    async with app.state.engine.begin() as conn:
        await conn.execute(text("UPDATE runs SET consecutive_snapshot_failures = 0, consecutive_snapshot_losses = 0 WHERE run_id = 'streak-failing'"))
    metrics.set_run_streaks(await leases.run_streaks(app.state.engine))
    assert _series_of("streak-failing") == []
