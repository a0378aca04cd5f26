"""The demo's stories, start to finish: bring everything up, train, crash (or reach the end of
the allocation), restore, train on, check, summarise, and stop everything that was started
whatever happens on the way."""

from __future__ import annotations

import asyncio
import contextlib
import os
import secrets
import shutil
import signal
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil
from ckpt_client import AsyncCoordinatorClient, GymInstance, RestorePlan

from .checks import Check, check_capture, check_conserved, check_groups, check_instance_map, check_mutations, check_rewards
from .processes import CoordinatorProcess, EmbeddedPostgres, GymProcess
from .progress import Progress, bar
from .trainer import DataLoader, Journal, RestoreReport, SnapshotRecord, Trainer, recovery_config, sealed_fraction

__all__ = ["DemoOptions", "DemoError", "Demo", "INSTANCES", "RESTART_ONLY_INSTANCE", "CRASHED_INSTANCE"]

CRASHED_INSTANCE = "math/replica-0"
RESTART_ONLY_INSTANCE = "math/replica-1"
INSTANCES = (CRASHED_INSTANCE, RESTART_ONLY_INSTANCE)
RESOURCES_SERVER = "calendar_resources"
CONTROL_TIMEOUT_S = 10.0

# allocation-end: the first allocation's Gym deployment, and the next one's: other names, one
# instance fewer. The map restores two of the three saved instances; the third one's episodes
# start over.
FIRST_ALLOCATION = ("job-1041/gym-0", "job-1041/gym-1", "job-1041/gym-2")
NEXT_ALLOCATION = ("job-1042/gym-0", "job-1042/gym-1")
INSTANCE_MAP = {FIRST_ALLOCATION[0]: NEXT_ALLOCATION[0], FIRST_ALLOCATION[1]: NEXT_ALLOCATION[1]}
# What the trainer's SIGUSR1 handler gives the stopping snapshot: Slurm's --signal=USR1@120 warns
# two minutes ahead; the demo's Gym and ledger are small, so a fraction of that is plenty.
STOP_DEADLINE_S = 30.0


@dataclass
class DemoOptions:
    steps: int = 4
    groups: int = 8
    seed: int = 1
    data_dir: Path | None = None
    keep: bool = False
    quiet: bool = False
    json_summary: Path | None = None
    generations: int = 4
    # Episodes of about 0.3-1 s: long enough that a snapshot finds some mid-way (exported),
    # short enough that the whole demo stays around a minute.
    turn_seconds: float = 0.08
    min_turns: int = 4
    max_turns: int = 12
    timeout: float = 900.0
    gym_profile: str = "published"
    scenario: str = "crash"

    @property
    def crash_step(self) -> int:
        """The step the crash happens in: the middle of the run, after at least one trained step
        when there is more than one."""
        return min(self.steps, self.steps // 2 + 1)

    @property
    def slots_per_instance(self) -> int:
        # Fewer rollouts in flight than a step has rows, so some wait in the trainer's queue
        # (reserved in the ledger) while others run: a cut then holds every kind of row.
        rows = self.groups * self.generations
        return max(2, rows // 5)


class DemoError(RuntimeError):
    """A failure with a message fit for the user (no traceback)."""


@dataclass
class _Crash:
    step: int
    snapshot_id: str
    in_flight: int
    queued: int
    killed_pid: int | None
    note: str | None = None


@dataclass
class Demo:
    opts: DemoOptions
    progress: Progress
    gyms: dict[str, GymProcess] = field(default_factory=dict)
    stopped_gyms: list[GymProcess] = field(default_factory=list)
    pg: EmbeddedPostgres | None = None
    coordinator: CoordinatorProcess | None = None
    base_dir: Path | None = None
    workdir: Path | None = None
    pg_dir: Path | None = None
    started_at: float = field(default_factory=time.monotonic)
    journal: Journal = field(default_factory=Journal)
    trainer: Trainer | None = None
    run_id: str | None = None
    admin_token: str = ""
    _phase: str = "setup"
    _temp_base: bool = False
    _generation: dict[str, int] = field(default_factory=dict)
    _failed: bool = False
    _tasks: list[asyncio.Task[Any]] = field(default_factory=list)

    @property
    def phase(self) -> str:
        return self._phase

    @phase.setter
    def phase(self, value: str) -> None:
        # A new phase: the status line of the previous one (e.g. a killed trainer's) goes.
        self._phase = value
        self.progress.clear()

    # ------------------------------------------------------------------ entry

    async def run(self) -> dict[str, Any]:
        self.journal.on_event = self.progress.event
        ticker = asyncio.create_task(self._tick(), name="progress")
        try:
            async with asyncio.timeout(self.opts.timeout):
                return await self._story()
        except TimeoutError:
            self._failed = True
            raise DemoError(f"the demo did not finish within {self.opts.timeout:.0f}s (phase {self.phase})") from None
        except BaseException:
            self._failed = True
            raise
        finally:
            ticker.cancel()
            for task in self._tasks:
                task.cancel()
            await asyncio.gather(ticker, *self._tasks, return_exceptions=True)
            if self.trainer is not None:
                # A trainer that failed mid-way still holds sockets; nothing is sent on close.
                with contextlib.suppress(Exception):
                    await self.trainer.aclose()
            self.progress.done()

    async def _story(self) -> dict[str, Any]:
        if self.opts.scenario == "allocation-end":
            return await self._allocation_end()
        if self.opts.scenario == "side-effects":
            from .side_effects import run_side_effects

            return await run_side_effects(self)
        return await self._crash_and_restore()

    async def _begin(self, instances: tuple[str, ...]) -> tuple[DataLoader, str, str]:
        """Everything up, a run created and its Gym registered: (data loader, run id, token)."""
        o = self.opts
        await self._setup(instances)
        loader = DataLoader(o.seed, o.groups, generations=o.generations, min_turns=o.min_turns, max_turns=o.max_turns)
        run_id, token = await self._create_run()
        await self._register(token, run_id, list(self.gyms.values()))
        return loader, run_id, token

    def _train_first(self, run_id: str, token: str, loader: DataLoader, *, hold: int, late: set[int], snapshot_when: Any = None) -> tuple[Trainer, asyncio.Task[None]]:
        """Incarnation 1, training from step 1 until it holds before step ``hold``."""
        self.phase = "train"
        first = self._trainer(run_id, token, loader, incarnation=1, hold=hold, late=late, snapshot_when=snapshot_when)
        self.trainer = first
        run_task = asyncio.create_task(first.run(1, self.opts.steps), name="trainer-1")
        self._tasks.append(run_task)
        return first, run_task

    async def _crash_and_restore(self) -> dict[str, Any]:
        o = self.opts
        loader, run_id, token = await self._begin(INSTANCES)
        # Incarnation 1 trains until it is killed during the crash step.
        crash_step = o.crash_step
        first, run_task = self._train_first(run_id, token, loader, hold=crash_step, late={1} if crash_step > 1 else set())
        crash = await self._arrange_crash(first, run_task, loader, run_id, token)

        # Everything comes back: a fresh Gym process for the killed instance, a fresh trainer
        # that knows the run, its token and its last checkpoint step, nothing else.
        self.phase = "restart"
        await self._replace_gym(CRASHED_INSTANCE, token, run_id, why="the crashed instance comes back empty")
        self.phase = "restore"
        second = self._trainer(run_id, token, loader, incarnation=2, hold=None, late=set())
        self.trainer = second

        async def not_fresh(instances: list[str]) -> None:
            for iid in instances:
                if iid not in self.gyms:
                    raise DemoError(f"the coordinator names Gym instance {iid!r}, which this demo did not start")
                await self._replace_gym(iid, token, run_id, why="Gym restores only into freshly started servers")
            second.gym_agents.update(self._agents())

        report = await second.restore(crash_step - 1, not_fresh)
        self.phase = "train"
        await second.run(report.anchor_step + 1, o.steps)

        self.phase = "verify"
        return await self._verify(run_id, token, loader, second, report, {"crash": _crash_json(crash)})

    async def _allocation_end(self) -> dict[str, Any]:
        """The allocation ends mid-step: the trainer gets SIGUSR1 (as Slurm's --signal=USR1@N
        sends it), takes a stopping snapshot and exits; the next allocation brings a Gym
        deployment with other instance names and one instance fewer, and a fresh trainer
        restores into it with an instance map."""
        o = self.opts
        loader, run_id, token = await self._begin(FIRST_ALLOCATION)
        stop_step = o.crash_step
        first, run_task = self._train_first(run_id, token, loader, hold=stop_step, late=set(), snapshot_when=self._periodic_snapshot(stop_step))
        stop = await self._signal_allocation_end(first, run_task, stop_step)

        # The allocation is over: the trainer process and its Gym deployment are gone.
        self.phase = "allocation end"
        run_task.cancel()
        await asyncio.gather(run_task, return_exceptions=True)
        await first.aclose()
        old = [self.gyms.pop(iid) for iid in FIRST_ALLOCATION]
        await asyncio.gather(*(asyncio.to_thread(g.stop) for g in old))
        self.stopped_gyms.extend(old)
        self.progress.event(self.phase, f"trainer 1 exited; Gym instances {', '.join(FIRST_ALLOCATION)} stopped with the allocation")

        # The next allocation: new names, one instance fewer.
        self.phase = "next allocation"
        assert self.workdir is not None
        fresh = [GymProcess(self._gym_config(iid), self.workdir, generation=self._next_generation(iid)) for iid in NEXT_ALLOCATION]
        started = await asyncio.gather(*(asyncio.to_thread(g.start) for g in fresh), return_exceptions=True)
        for g in fresh:
            self.gyms[g.instance_id] = g  # kept even if it failed: cleanup stops it
        failed = [e for e in started if isinstance(e, BaseException)]
        if failed:
            raise failed[0]
        for g in fresh:
            self.progress.event(self.phase, f"gymsim {g.instance_id} on {g.base_url} (pid {g.pid})")
        assert self.coordinator is not None
        async with AsyncCoordinatorClient(self.coordinator.url, token, run_id=run_id) as c:
            for iid in FIRST_ALLOCATION:
                await c.unregister_gym_instance(iid)
        self.progress.event(self.phase, f"unregistered the ended allocation's instances {', '.join(FIRST_ALLOCATION)}")
        await self._register(token, run_id, fresh)

        self.phase = "restore"
        second = self._trainer(run_id, token, loader, incarnation=2, hold=None, late=set())
        self.trainer = second
        mapping = ", ".join(f"{k} -> {v}" for k, v in INSTANCE_MAP.items())
        unmapped = sorted(set(FIRST_ALLOCATION) - set(INSTANCE_MAP))
        self.progress.event(self.phase, f"instance map {mapping}; {', '.join(unmapped)} is not mapped: its episodes start over")

        async def not_fresh(instances: list[str]) -> None:
            raise DemoError(f"the coordinator says Gym instances {', '.join(instances)} are not fresh, but this allocation just started them")

        report = await second.restore(stop_step - 1, not_fresh, instance_map=INSTANCE_MAP)
        if report.plan_reasons:
            self.progress.event(self.phase, "plan reasons: " + _reasons_text(report.plan_reasons))
        self.phase = "train"
        await second.run(report.anchor_step + 1, o.steps)

        self.phase = "verify"
        exported = {iid: int(f.get("exported", 0)) for iid, f in stop.gym.items()}
        extra = [
            Check(
                "the restore used the stopping snapshot",
                stop.published and report.snapshot_id == stop.snapshot_id,
                f"stopping snapshot {stop.snapshot_id}: {stop.outcome}" + (f" ({stop.reason})" if not stop.published else "")
                + f"; restored from {report.snapshot_id}",
            ),
            check_instance_map(exported, INSTANCE_MAP, _by_instance(report.continued), report.plan_reasons),
        ]
        allocation = {
            "stop_step": stop_step,
            "signal": "SIGUSR1",
            "deadline_s": STOP_DEADLINE_S,
            "snapshot_id": stop.snapshot_id,
            "outcome": stop.outcome,
            "reason": stop.reason,
            "stop_honoured": stop.stop_honoured,
            "gym_parked_seconds": stop.gym_parked_seconds,
            "saved_instances": list(FIRST_ALLOCATION),
            "live_instances": list(NEXT_ALLOCATION),
            "instance_map": dict(INSTANCE_MAP),
            "exported_by_saved_instance": exported,
        }
        return await self._verify(run_id, token, loader, second, report, {"allocation_end": allocation}, extra_checks=extra)

    def _periodic_snapshot(self, stop_step: int) -> Any:
        """The usual mid-step snapshots, except in the step the allocation ends in: there the
        stopping snapshot is the one (a run takes one snapshot at a time)."""
        usual = sealed_fraction(0.35)
        return lambda t: t.step != stop_step and usual(t)

    async def _signal_allocation_end(self, trainer: Trainer, run_task: asyncio.Task[None], step: int) -> SnapshotRecord:
        """Wait until the stop step has turn-level episodes with turns ahead running on every
        instance (so each saved instance has Gym state to carry over or lose), then send the
        process SIGUSR1; the handler takes the stopping snapshot. Late in the step it signals
        anyway rather than not at all."""
        loop = asyncio.get_running_loop()
        started: list[asyncio.Task[SnapshotRecord]] = []

        def on_usr1() -> None:
            # What a trainer's handler does: start the stopping snapshot, nothing else, at once.
            if not started:
                started.append(asyncio.create_task(trainer.stop_snapshot(STOP_DEADLINE_S), name="stop snapshot"))

        loop.add_signal_handler(signal.SIGUSR1, on_usr1)
        try:
            while not self._stop_due(trainer, step):
                if run_task.done():
                    run_task.result()
                    raise DemoError("the trainer stopped before the allocation ended")
                await asyncio.sleep(0.02)
            p = trainer.step_progress()
            self.phase = "allocation end"
            os.kill(os.getpid(), signal.SIGUSR1)
            self.progress.event(
                self.phase,
                f"step {step}: SIGUSR1 to the trainer (pid {os.getpid()}) with {p['in_flight']} rollouts in flight and "
                f"{p['queued']} queued: stopping snapshot within {STOP_DEADLINE_S:.0f}s",
            )
            while not started:
                await asyncio.sleep(0.01)
            self._tasks.append(started[0])
            return await started[0]
        finally:
            loop.remove_signal_handler(signal.SIGUSR1)

    def _stop_due(self, t: Trainer, step: int) -> bool:
        if t.step != step:
            return False
        p = t.step_progress()
        rows = max(1, p["rows"])
        if p["sealed"] >= 0.75 * rows or t.at_hold.is_set():
            return True
        if p["sealed"] < 0.2 * rows:
            return False
        ahead = {
            r[2] for r in t.running_rows()
            if DataLoader.kind_of(r[0]) == "turn" and r[4] * self.opts.turn_seconds - r[3] >= 0.25
        }
        return ahead >= set(FIRST_ALLOCATION)

    # ------------------------------------------------------------------ setup

    async def _setup(self, instances: tuple[str, ...]) -> None:
        o = self.opts
        if o.data_dir is not None:
            self.base_dir = o.data_dir.expanduser().resolve()
            self.base_dir.mkdir(parents=True, exist_ok=True)
            self.pg_dir = self.base_dir
        else:
            self.base_dir = Path(tempfile.mkdtemp(prefix="ckpt-demo-"))
            self._temp_base = True
            self.pg_dir = self.base_dir / "db"
        self.workdir = self.base_dir / f"work-{time.strftime('%Y%m%d-%H%M%S')}-{secrets.token_hex(3)}"
        self.workdir.mkdir(parents=True)

        t0 = time.monotonic()
        gym_procs = [GymProcess(self._gym_config(iid), self.workdir, generation=self._next_generation(iid)) for iid in instances]
        # Gym needs nothing from the coordinator: both instances start while it (and its
        # database) does.
        gym_starts = [asyncio.create_task(asyncio.to_thread(g.start)) for g in gym_procs]
        self.pg = EmbeddedPostgres(self.pg_dir)
        self.pg.note_before_start()
        self.admin_token = secrets.token_urlsafe(24)
        self.coordinator = CoordinatorProcess(
            self.workdir / "coordinator.log",
            self.pg_dir,
            self.admin_token,
            extra_env={
                "CKPTC_COORDINATOR_ID": "demo",
                # Quicker than the production defaults, so the short demo waits less.
                "CKPTC_GATE_RETRY_AFTER_S": "0.2",
                "CKPTC_OUTBOX_POLL_S": "0.2",
                "CKPTC_LOG_LEVEL": "INFO",
            },
        )
        try:
            await asyncio.to_thread(self.coordinator.start)
        finally:
            started = await asyncio.gather(*gym_starts, return_exceptions=True)
            for g, outcome in zip(gym_procs, started):
                self.gyms[g.instance_id] = g  # registered even if it failed: cleanup stops it
            failed = [e for e in started if isinstance(e, BaseException)]
        if failed:
            raise failed[0]
        self.progress.event(
            "setup",
            f"coordinator on {self.coordinator.url} (pid {self.coordinator.pid}) with its embedded PostgreSQL "
            f"({self.pg.pgdata}, pid {self.pg.pid}), migrated and ready in {time.monotonic() - t0:.1f}s",
        )
        for g in gym_procs:
            what = "policy model, agent, resources (restart-only)" if g.instance_id == RESTART_ONLY_INSTANCE else "policy model, agent, resources"
            self.progress.event("setup", f"gymsim {g.instance_id} on {g.base_url} (pid {g.pid}): {what}")

    def _next_generation(self, iid: str) -> int:
        self._generation[iid] = self._generation.get(iid, 0) + 1
        return self._generation[iid]

    def _gym_config(self, iid: str) -> dict[str, Any]:
        from gymsim.testing import default_instance_config, server_config

        config = default_instance_config(
            iid,
            token="gym-" + secrets.token_urlsafe(16),
            turn_seconds=self.opts.turn_seconds,
            # What the coordinator asks of Gym for this run (lease grace = control timeout).
            lease_grace_seconds=CONTROL_TIMEOUT_S,
            gym_profile=self.opts.gym_profile,
        )
        if iid == RESTART_ONLY_INSTANCE:
            config = server_config(config, RESOURCES_SERVER, mode="restart_only")
        return config

    def _agents(self) -> dict[str, str]:
        return {iid: g.servers["workplace_agent"] for iid, g in self.gyms.items()}

    async def _create_run(self) -> tuple[str, str]:
        assert self.coordinator is not None and self.workdir is not None
        run_id = f"demo-{time.strftime('%Y%m%d-%H%M%S')}-{secrets.token_hex(3)}"
        cfg = recovery_config(
            control_timeout_s=CONTROL_TIMEOUT_S,
            prepare_timeout_s=30,
            drain_timeout_s=30,
            data_plane_timeout_s=30,
            stall_timeout_s=600,
        )
        async with AsyncCoordinatorClient(self.coordinator.url, self.admin_token) as admin:
            run = await admin.create_run(run_id, str(self.workdir / "checkpoints"), cfg)
        if not run.run_token:
            raise DemoError("the coordinator created the run but answered no run token")
        self.progress.event(
            "setup",
            f"run {run_id} created: target level turn; task source 'retrieval' -> sibling, "
            "agent 'cohort_judge_agent' -> prompt_group; restart-only Gym servers allowed",
        )
        for w in run.warnings:
            self.progress.event("setup", f"coordinator warning: {w}")
        self.run_id = run_id
        return run_id, run.run_token

    async def _register(self, token: str, run_id: str, gyms: list[GymProcess]) -> None:
        assert self.coordinator is not None
        async with AsyncCoordinatorClient(self.coordinator.url, token, run_id=run_id) as c:
            reg = await c.register_gym_instances([GymInstance(g.instance_id, g.token, g.servers) for g in gyms])
        names = ", ".join(g.instance_id for g in gyms)
        ro = f"; restart-only: {', '.join(reg.restart_only_servers)}" if reg.restart_only_servers else ""
        self.progress.event("setup" if self.phase == "setup" else self.phase, f"registered Gym instance(s) {names}{ro}")

    def _trainer(
        self, run_id: str, token: str, loader: DataLoader, *, incarnation: int, hold: int | None, late: set[int], snapshot_when: Any = None
    ) -> Trainer:
        assert self.coordinator is not None and self.workdir is not None
        client = AsyncCoordinatorClient(self.coordinator.url, token, run_id=run_id)
        return Trainer(
            client,
            self._agents(),
            loader,
            self.workdir,
            self.journal,
            incarnation=incarnation,
            slots_per_instance=self.opts.slots_per_instance,
            late_snapshot_steps=late,
            hold_before_training=hold,
            snapshot_when=snapshot_when or self._snapshot_due,
        )

    def _snapshot_due(self, t: Trainer) -> bool:
        """When the demo's trainer snapshots mid-step: once some rows are sealed, while a
        turn-level row with turns still ahead runs on the instance that exports episodes and
        another waits in the queue, so the cut holds every kind of row a restore handles. Late
        in the step it snapshots anyway rather than not at all."""
        p = t.step_progress()
        rows = max(1, p["rows"])
        if p["sealed"] >= 0.75 * rows:
            return True
        if p["sealed"] < 0.2 * rows:
            return False
        ahead = [
            r for r in t.running_rows()
            if DataLoader.kind_of(r[0]) == "turn" and r[2] == CRASHED_INSTANCE and r[4] * self.opts.turn_seconds - r[3] >= 0.25
        ]
        queued = [q for q in t.queued_rows() if DataLoader.kind_of(q[0]) == "turn"]
        return bool(ahead) and bool(queued)

    # ------------------------------------------------------------------ the crash

    async def _arrange_crash(self, trainer: Trainer, run_task: asyncio.Task[None], loader: DataLoader, run_id: str, token: str) -> _Crash:
        """Let the trainer reach the crash step and publish a snapshot there whose restore shows
        every disposition (sealed siblings, Gym-exported turn-level episodes, turn-level rows
        still queued at the cut), wait until one of those queued rows was dispatched after the
        cut, then kill the trainer and one Gym instance."""
        assert self.coordinator is not None
        step = self.opts.crash_step
        checked: set[str] = set()
        chosen: SnapshotRecord | None = None
        note: str | None = None
        asked = 0
        after_cut: set[str] = set()
        async with AsyncCoordinatorClient(self.coordinator.url, token, run_id=run_id) as c:
            while chosen is None:
                if run_task.done():
                    run_task.result()  # re-raise what stopped it
                    raise DemoError("the trainer stopped before the crash step")
                published = [r for r in self.journal.snapshots if r.incarnation == 1 and r.taken_in_step == step and r.published and r.snapshot_id not in checked]
                if published:
                    rec = published[-1]
                    checked.add(rec.snapshot_id)
                    plan = await c.restore_plan(snapshot_id=rec.snapshot_id, step=step - 1, include_reused=True)
                    missing, after_cut = _missing_dispositions(plan, loader)
                    if not missing:
                        chosen = rec
                    elif trainer.at_hold.is_set() or asked >= 3:
                        chosen, note = rec, f"the cut of {rec.snapshot_id} lacks {', '.join(missing)}"
                    else:
                        asked += 1
                        self.progress.event("crash", f"the cut of {rec.snapshot_id} lacks {', '.join(missing)}; asking the trainer for another snapshot")
                        trainer.request_snapshot()
                elif trainer.at_hold.is_set():
                    tried = [f"{r.snapshot_id}: {r.outcome} ({r.reason})" for r in self.journal.snapshots if r.taken_in_step == step]
                    raise DemoError(f"no snapshot was published during step {step}, so there is nothing to restore: {'; '.join(tried) or 'none taken'}")
                await asyncio.sleep(0.05)
            # Rows queued at the cut and dispatched after it are what the restore turns into
            # restarts: wait until one is on its way to Gym, then crash with it in flight.
            deadline = time.monotonic() + 30
            while not (after_cut & self.journal.dispatched) and not trainer.at_hold.is_set() and time.monotonic() < deadline:
                if run_task.done():
                    run_task.result()
                    raise DemoError("the trainer stopped before the crash")
                await asyncio.sleep(0.02)
            await asyncio.sleep(0.1)

        self.phase = "crash"
        p = trainer.step_progress()
        run_task.cancel()
        await asyncio.gather(run_task, return_exceptions=True)
        await trainer.aclose()
        victim = self.gyms[CRASHED_INSTANCE]
        pid = victim.pid
        await asyncio.to_thread(victim.kill)
        self.stopped_gyms.append(victim)
        self.progress.event(
            "crash",
            f"step {step}: trainer killed with {p['in_flight']} rollouts in flight and {p['queued']} queued; "
            f"gymsim {CRASHED_INSTANCE} (pid {pid}) killed with SIGKILL",
        )
        if note:
            self.progress.event("crash", f"note: {note}; the summary will show it")
        return _Crash(step, chosen.snapshot_id, p["in_flight"], p["queued"], pid, note)

    async def _replace_gym(self, iid: str, token: str, run_id: str, *, why: str) -> None:
        old = self.gyms[iid]
        if old.alive():
            await asyncio.to_thread(old.stop)
            self.stopped_gyms.append(old)
        assert self.workdir is not None
        fresh = GymProcess(old.config, self.workdir, generation=self._next_generation(iid))
        await asyncio.to_thread(fresh.start)
        self.gyms[iid] = fresh
        self.progress.event(self.phase, f"fresh gymsim {iid} on {fresh.base_url} (pid {fresh.pid}): {why}")
        await self._register(token, run_id, [fresh])

    # ------------------------------------------------------------------ the verdict

    async def _verify(
        self,
        run_id: str,
        token: str,
        loader: DataLoader,
        trainer: Trainer,
        report: RestoreReport,
        story: dict[str, Any],
        *,
        extra_checks: list[Check] | None = None,
    ) -> dict[str, Any]:
        assert self.coordinator is not None
        o = self.opts
        async with AsyncCoordinatorClient(self.coordinator.url, token, run_id=run_id) as c:
            counts = await c.counts()
            snapshots = await c.list_snapshots()
            # Read once the trainers are done: every group then trained, abandoned or rewound.
            accounting = await c.accounting()
        await trainer.aclose()
        sessions = {}
        for iid, g in self.gyms.items():
            dump = await asyncio.to_thread(g.admin, "GET", f"/resources/{RESOURCES_SERVER}/sessions")
            sessions[iid] = dump.get("sessions", {})

        lineage = list(trainer.consumed)
        expected = [g.group_id for s in range(1, o.steps + 1) for g in loader.step(s)]
        checks: list[Check] = check_groups(
            expected=expected,
            lineage=lineage,
            abandoned=self.journal.abandoned,
            finalize_results=self.journal.finalize_results,
            coordinator_groups=counts.groups,
        )
        checks.append(check_mutations(sessions, report.continued, self.journal.replies))
        checks.append(check_rewards(lineage))
        checks.append(check_capture(report.reused_missing_from_capture, report.counts.get("reused", 0)))
        checks.append(check_conserved(accounting.raw.get("prompts") or {}))
        checks.extend(extra_checks or [])

        by_id = {r.snapshot_id: r for r in self.journal.snapshots}
        snaps = []
        for s in sorted(snapshots, key=lambda s: s.raw.get("created_at") or s.snapshot_id):
            rec = by_id.get(s.snapshot_id)
            snaps.append(
                {
                    "snapshot_id": s.snapshot_id,
                    "anchor_step": s.anchor_step,
                    "taken_in_step": rec.taken_in_step if rec else None,
                    "incarnation": rec.incarnation if rec else None,
                    "outcome": s.outcome,
                    "reason": s.reason,
                    "gym_parked_seconds": s.gym_parked_seconds,
                }
            )
        # Snapshots removed by retention are no longer listed; the trainers' records fill in.
        listed = {s["snapshot_id"] for s in snaps}
        for rec in self.journal.snapshots:
            if rec.snapshot_id not in listed:
                snaps.append({**rec.to_json(), "note": "not listed by the coordinator (retention)"})
        taken = {rec.snapshot_id: k for k, rec in enumerate(self.journal.snapshots)}
        snaps.sort(key=lambda s: (taken.get(s["snapshot_id"], len(taken)), s["snapshot_id"]))
        outcomes: dict[str, int] = {}
        reasons: dict[str, int] = {}
        for s in snaps:
            outcomes[s["outcome"] or "unknown"] = outcomes.get(s["outcome"] or "unknown", 0) + 1
            if s["outcome"] != "published" and s["reason"]:
                key = f"{s['outcome']}:{s['reason']}"
                reasons[key] = reasons.get(key, 0) + 1
        parked = sum(s["gym_parked_seconds"] or 0.0 for s in snaps)
        rolled_back = [g for inc, st, g in self.journal.consumed if inc == 1 and st > report.anchor_step]

        ok = all(ch.ok for ch in checks)
        summary: dict[str, Any] = {
            "ok": ok,
            "wall_seconds": round(time.monotonic() - self.started_at, 2),
            "run_id": run_id,
            "scenario": o.scenario,
            "options": {"steps": o.steps, "groups": o.groups, "seed": o.seed, "generations": o.generations, "gym_profile": o.gym_profile},
            **story,
            "groups": {
                "expected": len(expected),
                "admitted": len(self.journal.admitted),
                "finalized": counts.groups.get("finalized", 0),
                "abandoned": counts.groups.get("abandoned", 0),
                "consumed": len(lineage),
                "rolled_back": len(rolled_back),
            },
            "siblings": {
                "sealed_reports": self.journal.sealed_rows,
                "gym_refusals": self.journal.refusals,
                "transport_failures": len(self.journal.failures),
            },
            "restore": {
                "snapshot_id": report.snapshot_id,
                "anchor_step": report.anchor_step,
                "restore_id": report.restore_id,
                "counts": report.counts,
                "plan_counts": report.plan_counts,
                "plan_reasons": report.plan_reasons,
                "gym_installed": bool(report.gym.get("installed")),
                "refused_not_fresh": report.refused_not_fresh,
                "continued_by_instance": _by_instance(report.continued),
            },
            "dispositions": {k: report.counts.get(k, 0) for k in ("reused", "continued", "restarted", "gym_restarted", "rerun", "dispatch")},
            "snapshots": snaps,
            "snapshot_totals": {"outcomes": outcomes, "not_published_reasons": reasons},
            "gym_parked_seconds": round(parked, 3),
            "outbox_pending": counts.outbox_pending,
            "accounting": accounting.raw,
            "checks": [ch.to_json() for ch in checks],
            "processes": self.pids(),
            "workdir": str(self.workdir) if self.workdir else None,
        }
        return summary

    # ------------------------------------------------------------------ progress and cleanup

    async def _tick(self) -> None:
        while True:
            await asyncio.sleep(0.1)
            t = self.trainer
            if t is None or self.phase != "train":
                continue
            p = t.step_progress()
            j = self.journal
            published = sum(1 for s in j.snapshots if s.published)
            lost = sum(1 for s in j.snapshots if s.outcome not in (None, "published"))
            running = sum(1 for s in j.snapshots if s.outcome is None)
            finalized = sum(1 for _ in j.consumed)
            self.progress.status(
                [
                    f"trainer {t.incarnation}: step {t.step}/{self.opts.steps}",
                    f"sealed {bar(p['sealed'], p['rows'], 12)} {p['sealed']}/{p['rows']}",
                    f"groups admitted {len(j.admitted)}, finalized {finalized}",
                    f"snapshots {published} ok {lost} lost" + (" 1 running" if running else ""),
                    f"{p['in_flight']} running, {p['queued']} queued",
                ]
            )

    def pids(self) -> dict[str, Any]:
        """The pids of everything started, with the start time of those still running: pids are
        reused (pid_max is often 32 768 and every database connection forks a backend), so a pid
        alone cannot say later whether *our* process still runs."""
        out: dict[str, Any] = {
            "postgres": self.pg.pid if self.pg else None,
            "coordinator": self.coordinator.pid if self.coordinator else None,
            "gymsim": [g.pid for g in [*self.stopped_gyms, *self.gyms.values()] if g.pid is not None],
        }
        started: dict[str, float] = {}
        for pid in [out["postgres"], out["coordinator"], *out["gymsim"]]:
            t = _create_time(pid)
            if t is not None:
                started[str(pid)] = t
        out["started"] = started
        return out

    def cleanup(self) -> list[str]:
        """Stop everything that was started (newest first); returns what could not be stopped."""
        problems: list[str] = []

        def stop(proc: Any, timeout: float) -> None:
            try:
                proc.stop(timeout)
            except Exception as e:
                problems.append(f"{proc.name}: {e}")

        # Gym instances and the coordinator stop side by side (each may wait out a graceful
        # shutdown); the coordinator stops its database on the way out, and only a database it
        # left running is stopped here.
        procs = [(g, 3.0) for g in [*self.gyms.values(), *self.stopped_gyms]]
        if self.coordinator is not None:
            procs.append((self.coordinator, 20.0))
        threads = [threading.Thread(target=stop, args=pt, daemon=True) for pt in procs]
        for t in threads:
            t.start()
        for t in threads:
            t.join(40)
        if self.pg is not None:
            try:
                self.pg.stop()
            except Exception as e:
                problems.append(f"embedded PostgreSQL: {e}")
        if not self.opts.keep and self.base_dir is not None:
            if self._failed and self.workdir is not None:
                # Logs explain a failure: keep the small work directory, drop the database.
                if self._temp_base and self.pg_dir is not None:
                    shutil.rmtree(self.pg_dir, ignore_errors=True)
            elif self._temp_base:
                shutil.rmtree(self.base_dir, ignore_errors=True)
            elif self.workdir is not None:
                shutil.rmtree(self.workdir, ignore_errors=True)
        return problems


def _crash_json(crash: _Crash) -> dict[str, Any]:
    return {
        "step": crash.step,
        "snapshot_id": crash.snapshot_id,
        "rollouts_in_flight": crash.in_flight,
        "rows_queued": crash.queued,
        "killed_instance": CRASHED_INSTANCE,
        "killed_pid": crash.killed_pid,
        "note": crash.note,
    }


def _reasons_text(reasons: dict[str, dict[str, int]]) -> str:
    return "; ".join(f"{d}: " + ", ".join(f"{r} {n}" for r, n in sorted(by.items())) for d, by in sorted(reasons.items()) if by)


def _by_instance(rows: list[dict[str, Any]]) -> dict[str, int]:
    out: dict[str, int] = {}
    for r in rows:
        out[r["instance_id"]] = out.get(r["instance_id"], 0) + 1
    return dict(sorted(out.items()))


def _missing_dispositions(plan: RestorePlan, loader: DataLoader) -> tuple[list[str], set[str]]:
    """What a restore of this plan would not show, and the turn-level rows the cut holds as
    reserved (sent after the cut they become restarts)."""
    counts = plan.counts
    queued_turn = {r.rollout_id for r in plan.rows if r.disposition == "dispatch" and r.rollout_id and loader.kind_of(r.group_id) == "turn"}
    missing = []
    if not counts.get("reused"):
        missing.append("sealed siblings")
    if not counts.get("continued"):
        missing.append("Gym-exported episodes")
    if not queued_turn:
        missing.append("queued turn-level rows")
    return missing, queued_turn


def _create_time(pid: int | None) -> float | None:
    """When a running process started (None when it does not run or is a zombie)."""
    if not pid:
        return None
    try:
        p = psutil.Process(int(pid))
        if p.status() == psutil.STATUS_ZOMBIE:
            return None
        return float(p.create_time())
    except (psutil.Error, ValueError):
        return None


def pids_alive(pids: dict[str, Any]) -> list[int]:
    """The pids of a summary's processes that still run (for tests).

    A pid counts only while the process holding it is the one the summary recorded (same start
    time): a pid freed by our process and taken by another is not ours left running. Processes
    that had already ended when the summary was taken are judged by pid alone."""
    started: dict[str, float] = pids.get("started") or {}
    alive = []
    for pid in [pids.get("postgres"), pids.get("coordinator"), *(pids.get("gymsim") or [])]:
        if not pid:
            continue
        now = _create_time(pid)
        if now is None:
            continue
        then = started.get(str(pid))
        if then is not None and abs(now - then) > 0.05:
            continue  # the pid was reused by another process
        if then is None and started:
            continue  # it had already ended when recorded: this is a later process
        alive.append(int(pid))
    return alive
