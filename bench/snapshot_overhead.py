"""Benchmark: the coordinator's own time to take a snapshot of a big run with many episodes in flight.

A run with 200 000 live siblings, of which 10 000 turn-level rollouts are in flight on gymsim
instances (subprocesses, zero-latency control calls): admitted and dispatched through the API, their
``/run`` episodes sent by this process over 10 000 concurrent HTTP connections. The issue asks for 4
instances; one gymsim instance holds at most 2 000 parked episodes (its agent reaches the policy
model through one httpx pool of 2 000 connections, and a held call keeps its connection), so
10 000 take 5 instances, and ``--in-flight 8000`` is the largest count 4 instances hold. The other 190 000
live siblings are built with set-based SQL (sealed with a receipt and a staging key, returned,
dispatched at sibling / prompt_group level, or never sent; no turn-level row is in flight without a
Gym episode behind it, so nothing has to drain).

How the episodes are held in flight: every episode's first policy call is answered at once (the
first N chat calls per instance pass through a zero-second delay fault), it works ``--turn-seconds``,
writes its resources session, and its second policy call is held by a long delay fault: it waits on
the policy model, which counts as a turn boundary, so it is exported by every participant (agent
episode, model staging key, resources session) and never blocks readiness. A long ``turn_seconds``
alone would not do: an episode inside a turn's work blocks prepare.

Then ``--snapshots`` snapshots go through the real API, the trainer side driven from here (a long
poll of the record as the client waits, or ``--poll S``; barrier, capture file, captured). Reported per snapshot and as medians:

* the phase timings of the snapshot record (gate, prepare, commit, drain, data_plane, resume, total)
  and ``gym_parked_seconds``;
* the time the coordinator spent with at least one Gym control call in flight (measured inside the
  coordinator process by a thin wrapper around ``ControlChannel.post``, union of intervals), and
  the coordinator's own time = total - trainer's share - Gym calls in flight (the calls the
  snapshot's path waits on: a renew round nothing waits for is left out, ``path_calls``);
* the ledger cut: latency of the barrier POST (``ledger.snapshots.take_cut``), and its ratio to a
  plain ``INSERT ... SELECT`` of the same rows (groups and attempts) into bare tables (no key, no
  index, no foreign key), measured right after each snapshot; the pre-cut (the whole-run copy the
  runner takes beside Gym's prepare and commit, ``phase_timings.pre_cut``) and how many groups the
  barrier copied again; ``take_cut`` of the whole run called in-process (what the barrier costs
  without a pre-cut); with ``--ab`` as many snapshots again without the pre-cut, alternating;
* the cost of reading the snapshot row (what the pending snapshot reads on each handshake event and each fallback poll),
  and of the candidates query (gate phase).

Targets (issue): total coordinator time <= 1.5 s, ledger cut <= 1 s. They are reported, never turned
into an exit status (the machine is shared); the exit status is 1 only if a snapshot did not publish.

    python bench/snapshot_overhead.py [--live 200000] [--in-flight 10000] [--instances 4] [--snapshots 3]
                                      [--turn-seconds 30] [--ab] [--quick]
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import contextlib
import hashlib
import json
import os
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
import psutil
from ckpt_client._api import PRE_CUT_FETCH_PHASES

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import Coordinator, Postgres, free_port, mib  # noqa: E402
from pending_lookup import build_ledger, create_run, plain_url, vacuum_analyze  # noqa: E402

TOTAL_TARGET_S = 1.5
CUT_TARGET_S = 1.0
# The coordinator's own time per snapshot at most half the same-run INSERT ... SELECT.
OWN_RATIO_TARGET = 0.5
GROUP_SIZE = 8
# gymsim's agent reaches the policy model through one httpx pool of 2 000 connections per
# instance; a held policy call keeps its connection, and past 2 000 the queued calls make httpcore
# rescan the pool per queued request on every event (O(queued x connections)): with 2 500 episodes
# per instance it stopped answering for 15 minutes. So an instance holds at most 2 000.
GYMSIM_MAX_PER_INSTANCE = 2_000
GYMSIM_NICE = 10
TURNS = 10_000  # never finishes: the episode stays in flight for the whole benchmark
HOLD_S = 86_400.0
PHASES = ("gate", "prepare", "commit", "drain", "data_plane", "resume", "total")
POLL_S = 0.02  # with --poll: tests/e2e/harness.py polls as often


# ------------------------------------------------------------------------------------------------
# The coordinator, with the time it spends in Gym control calls recorded


def _serve_timed(port: str, timing_file: str) -> int:
    """Runs in the coordinator process: ``ckpt-coordinator serve`` with ``ControlChannel.post``
    wrapped to record every control call (op, start, end on the system-wide monotonic clock)."""
    from checkpoint_coordinator.cli import main as cli_main
    from checkpoint_coordinator.gym import channel

    original = channel.ControlChannel.post
    calls: list[tuple[str, float, float, str]] = []
    in_flight = [0]

    def dump() -> None:
        tmp = timing_file + ".tmp"
        with open(tmp, "w") as f:
            json.dump(calls, f)
        os.replace(tmp, timing_file)

    async def post(self: Any, target: Any, op: str, *args: Any, **kwargs: Any) -> Any:
        start = time.monotonic()
        in_flight[0] += 1
        try:
            return await original(self, target, op, *args, **kwargs)
        finally:
            in_flight[0] -= 1
            calls.append((op, start, time.monotonic(), f"{target.instance_id}/{target.server_name}"))
            if in_flight[0] == 0:
                dump()  # once per burst of calls, never while one is in flight

    channel.ControlChannel.post = post  # type: ignore[method-assign]

    # --ab: while the benchmark holds this file, the runner takes no pre-cut (the barrier then
    # copies the whole run), so both ways are measured in one run on the same ledger.
    from checkpoint_coordinator.snapshots import pending as pending_snapshot

    original_pre_cut = pending_snapshot.PendingSnapshot._take_pre_cut
    no_pre_cut = timing_file + ".no-pre-cut"

    async def pre_cut(self: Any) -> None:
        if not os.path.exists(no_pre_cut):
            await original_pre_cut(self)

    pending_snapshot.PendingSnapshot._take_pre_cut = pre_cut  # type: ignore[method-assign]
    if os.environ.get("CKPTC_BENCH_TRACE"):
        _trace_spans(timing_file + ".trace")
    return cli_main(["serve", "--host", "127.0.0.1", "--port", port, "--no-migrate"])


def _trace_spans(trace_file: str) -> None:
    """``--trace``: record the span of every ledger call and Gym step a snapshot makes (name, start,
    end on the monotonic clock), so that the report can say where the coordinator's own time goes."""
    import functools

    from checkpoint_coordinator.gym.save import GymSave
    from checkpoint_coordinator.snapshots import store as ledger_snapshots
    from checkpoint_coordinator.outbox.worker import OutboxDeliverer

    out = open(trace_file, "a")  # noqa: SIM115 - one line per span, open for the process's life

    def span(label: str, start: float, *, at_least_s: float = 0.0) -> None:
        end = time.monotonic()
        if end - start >= at_least_s:
            out.write(json.dumps((label, start, end)) + "\n")
            out.flush()

    def timed(name: str, fn: Any) -> Any:
        @functools.wraps(fn)
        async def wrapper(*args: Any, **kwargs: Any) -> Any:
            start = time.monotonic()
            try:
                return await fn(*args, **kwargs)
            finally:
                span(f"ledger.move->{args[5]}" if name == "ledger.move" else name, start)
        return wrapper

    for fn in ("get", "close_gate", "move", "publish_phase", "deadline_left_s", "candidates", "still_pending", "poll",
               "take_cut", "pre_cut", "captured", "end", "store_gym_entry"):
        setattr(ledger_snapshots, fn, timed(f"ledger.{fn}", getattr(ledger_snapshots, fn)))
    for fn in ("prepare", "commit", "drain", "manifest", "finish"):
        setattr(GymSave, fn, timed(f"gym.{fn}", getattr(GymSave, fn)))
    OutboxDeliverer.deliver_run = timed("outbox.deliver_run", OutboxDeliverer.deliver_run)  # type: ignore[method-assign]

    # The coordinator's own CPU steps inside Gym's commit (while no call may be in flight).
    from checkpoint_coordinator.gym import commit as gym_commit

    def timed_sync(name: str, fn: Any) -> Any:
        @functools.wraps(fn)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            start = time.monotonic()
            try:
                return fn(*args, **kwargs)
            finally:
                span(name, start, at_least_s=0.001)
        return wrapper

    from checkpoint_coordinator.gym import save as gym_save

    gym_commit.validate_commit = timed_sync("gym.validate_commit", gym_commit.validate_commit)
    gym_commit.make_dirs = timed_sync("gym.make_dirs (thread)", gym_commit.make_dirs)
    gym_save.compute_scope = timed_sync("gym.compute_scope", gym_save.compute_scope)
    gym_commit._Fanout.body = timed_sync("gym.commit_body", gym_commit._Fanout.body)  # type: ignore[method-assign]
    GymSave.build_manifest = timed_sync("gym.build_manifest", GymSave.build_manifest)  # type: ignore[method-assign]

    # Every garbage collection of a millisecond or more: it stops the event loop.
    import gc

    gc_started: list[float] = []

    def _gc(phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            gc_started.append(time.monotonic())
        elif gc_started:
            span(f"gc gen{info.get('generation')} ({info.get('collected')} collected)", gc_started.pop(), at_least_s=0.001)

    gc.callbacks.append(_gc)

    # Every SQL statement of 2 ms or more, named by its first words: what a ledger call spends.
    from sqlalchemy import event
    from sqlalchemy.engine import Engine

    @event.listens_for(Engine, "before_cursor_execute")
    def _sql_start(conn: Any, cursor: Any, statement: str, params: Any, context: Any, executemany: bool) -> None:
        conn.info.setdefault("_trace_start", []).append(time.monotonic())

    @event.listens_for(Engine, "after_cursor_execute")
    def _sql_end(conn: Any, cursor: Any, statement: str, params: Any, context: Any, executemany: bool) -> None:
        span("sql " + " ".join(statement.split())[:90], conn.info["_trace_start"].pop(), at_least_s=0.002)

    @event.listens_for(Engine, "handle_error")
    def _sql_failed(ctx: Any) -> None:
        # A failed statement has no after_cursor_execute: drop its start, or later ones pair wrongly.
        if ctx.connection is not None and ctx.connection.info.get("_trace_start"):
            ctx.connection.info["_trace_start"].pop()

    # ... and every COMMIT of 2 ms or more (a commit waits for the WAL written before it).
    from sqlalchemy.engine.default import DefaultDialect

    do_commit = DefaultDialect.do_commit

    def _timed_commit(self: Any, dbapi_connection: Any) -> None:
        start = time.monotonic()
        try:
            do_commit(self, dbapi_connection)
        finally:
            span("sql COMMIT", start, at_least_s=0.002)

    DefaultDialect.do_commit = _timed_commit  # type: ignore[method-assign]


class TimedCoordinator(Coordinator):
    """The coordinator process (``_common.Coordinator``), started through ``_serve_timed``."""

    def __init__(self, database_url: str, workdir: Path) -> None:
        port = free_port()
        self.timing_file = str(workdir / "gym-calls.json")
        super().__init__(
            database_url,
            argv=[sys.executable, str(Path(__file__).resolve()), "--serve-timed-coordinator", str(port), self.timing_file],
            port=port,
            start_timeout_s=60,
        )

    def spans(self) -> list[tuple[str, float, float]]:
        try:
            lines = Path(self.timing_file + ".trace").read_text().splitlines()
            return [tuple(json.loads(line)) for line in lines if line.endswith("]")]  # type: ignore[misc]
        except FileNotFoundError:
            return []

    def gym_calls(self) -> list[tuple[str, float, float, str]]:
        try:
            return [tuple(c) for c in json.loads(Path(self.timing_file).read_text())]  # type: ignore[misc]
        except FileNotFoundError:
            return []


def path_calls(calls: list[tuple[str, float, float, str]], since: float) -> list[tuple[str, float, float, str]]:
    """The control calls the snapshot's path waited on, from ``since``: every prepare, commit and
    resume; the renew calls only when the whole round sent before the first commit ended before it
    (a coordinator that waits for a round between prepare and commit). A round sent beside or after
    the commit is waited on by nothing: counting it would hide the coordinator's own time under it."""
    calls = [c for c in calls if c[1] >= since]
    first_commit = min((s for op, s, _, _ in calls if op == "commit"), default=float("inf"))
    before = [c for c in calls if c[0] == "renew" and c[1] < first_commit]
    awaited = bool(before) and max(e for _, _, e, _ in before) <= first_commit
    return [c for c in calls if c[0] != "renew" or (awaited and c[1] < first_commit)]


def union_seconds(intervals: list[tuple[float, float]], lo: float, hi: float) -> float:
    """Length of the union of the intervals, clipped to [lo, hi]."""
    total, cur_s, cur_e = 0.0, None, None
    for s, e in sorted((max(s, lo), min(e, hi)) for s, e in intervals if e > lo and s < hi):
        if cur_e is None or s > cur_e:
            if cur_e is not None:
                total += cur_e - cur_s  # type: ignore[operator]
            cur_s, cur_e = s, e
        else:
            cur_e = max(cur_e, e)
    if cur_e is not None:
        total += cur_e - cur_s  # type: ignore[operator]
    return total


# ------------------------------------------------------------------------------------------------
# gymsim instances and the in-flight episodes


@contextlib.contextmanager
def stderr_to(path: Path) -> Any:
    """Child processes started inside inherit this file as their stderr (gymsim logs every episode
    it cancels at shutdown; that belongs in a log, not in the report)."""
    sys.stderr.flush()
    saved = os.dup(2)
    with open(path, "ab") as f:
        os.dup2(f.fileno(), 2)
    try:
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)


def start_gyms(per_instance: list[int], turn_seconds: float, log: Path) -> list[Any]:
    from gymsim.testing import GymsimInstance, default_instance_config

    gyms: list[Any] = []
    try:
        for k, n_eps in enumerate(per_instance):
            faults = [
                # the first policy call of each episode is answered at once, the next ones are held
                {"server_name": "policy_model", "op": "chat", "type": "delay", "seconds": 0.0, "times": max(1, n_eps)},
                {"server_name": "policy_model", "op": "chat", "type": "delay", "seconds": HOLD_S},
            ]
            cfg = default_instance_config(f"bench/replica-{k}", token=f"tok-bench-{k}", turn_seconds=turn_seconds, faults=faults)
            with stderr_to(log):
                gyms.append(GymsimInstance.start(cfg, subprocess=True))
            with contextlib.suppress(psutil.Error, AttributeError):
                psutil.Process(gyms[-1]._process.pid).nice(GYMSIM_NICE)
    except BaseException:
        stop_gyms(gyms)
        raise
    return gyms


def stop_gyms(gyms: list[Any]) -> None:
    if not gyms:
        return
    with concurrent.futures.ThreadPoolExecutor(len(gyms)) as ex:
        for f in [ex.submit(g.stop) for g in gyms]:
            with contextlib.suppress(Exception):
                f.result()


class Episodes:
    """Concurrent ``/run`` calls over raw HTTP/1.1 connections (an httpx pool of 10 000
    connections spends its time scanning the pool; a socket per episode is all this needs)."""

    def __init__(self) -> None:
        self.tasks: list[asyncio.Task[None]] = []
        self.writers: list[asyncio.StreamWriter] = []
        self.ended: list[str] = []
        self.sent = 0

    def start(self, agent_url: str, rows: list[dict[str, Any]], sem: asyncio.Semaphore) -> None:
        u = httpx.URL(agent_url)
        for row in rows:
            body = json.dumps({"_ng_rollout_id": row["rollout_id"], "_ng_attempt_index": row["gym_attempt"],
                               "task": {"group": row["group_id"], "i": row["generation_index"]}, "turns": TURNS}).encode()
            head = (f"POST {u.path}/run HTTP/1.1\r\nHost: {u.host}:{u.port}\r\nContent-Type: application/json\r\n"
                    f"Content-Length: {len(body)}\r\n\r\n").encode()
            self.tasks.append(asyncio.create_task(self._one(u.host, int(u.port or 80), head + body, row["rollout_id"], sem)))

    async def _one(self, host: str, port: int, request: bytes, rollout_id: str, sem: asyncio.Semaphore) -> None:
        async with sem:  # bounds the connection burst (listen backlogs), not the episodes
            reader, writer = await asyncio.open_connection(host, port)
            self.writers.append(writer)
            writer.write(request)
            await writer.drain()
            self.sent += 1
        status = await reader.readline()
        # An episode that answers at all has ended (or was refused): it is no longer in flight.
        self.ended.append(f"{rollout_id}: {status.decode(errors='replace').strip()}")

    async def close(self) -> None:
        for t in self.tasks:
            t.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)
        for w in self.writers:
            w.close()


async def wait_parked(gyms: list[Any], expected: dict[str, int], episodes: Episodes, timeout: float) -> dict[str, dict[str, int]]:
    """Until every episode is held at a turn boundary: every first policy call answered (the
    instance's free passes are used up), no episode working or on the wire, no resources request
    in flight, and each agent holding exactly its episodes."""
    deadline = time.monotonic() + timeout
    last = 0.0
    total = sum(expected.values())
    while episodes.sent < total and not episodes.ended:
        if time.monotonic() > deadline:
            raise RuntimeError(f"only {episodes.sent:,} of {total:,} /run calls sent after {timeout:.0f} s")
        if time.monotonic() - last > 10:
            print(f"snapshot_overhead:   {episodes.sent:,} /run sent ...", flush=True)
            last = time.monotonic()
        await asyncio.sleep(0.5)
    async with httpx.AsyncClient(timeout=120) as http:
        while True:
            counts, free, in_flight = {}, 0, 0
            try:
                for g in gyms:
                    h = {"Authorization": f"Bearer {g.token}"}
                    r = await http.get(f"{g.servers['workplace_agent']}/ng-control/v1/checkpoint/status", headers=h)
                    r.raise_for_status()
                    counts[g.instance_id] = r.json()["report"]["counts"]
                    r = await http.get(f"{g.servers['calendar_resources']}/ng-control/v1/checkpoint/status", headers=h)
                    r.raise_for_status()
                    in_flight += r.json()["report"]["counts"]["in_flight"]
                    r = await http.get(f"{g.base_url}/admin/faults", headers=h)
                    r.raise_for_status()
                    free += sum(f.get("remaining") or 0 for f in r.json()["faults"] if f.get("seconds") == 0.0)
            except httpx.TimeoutException:
                # an instance still busy taking its episodes in: ask again
                if time.monotonic() > deadline:
                    raise
                continue
            if episodes.ended:
                raise RuntimeError(f"{len(episodes.ended)} episode(s) ended before the snapshot, e.g. {episodes.ended[:3]}")
            parked = all(c["at_boundary"] == expected[i] and c["working"] == 0 and c["on_wire"] == 0 for i, c in counts.items())
            if parked and free == 0 and in_flight == 0:
                return counts
            now = time.monotonic()
            if now > deadline:
                raise RuntimeError(f"episodes not parked after {timeout:.0f} s: {counts} (expected {expected}), "
                                   f"{free} first policy calls to come, {in_flight} resources requests in flight")
            if now - last > 10:
                parked_n = sum(c["at_boundary"] for c in counts.values())
                working = sum(c["working"] for c in counts.values())
                print(f"snapshot_overhead:   {episodes.sent:,} /run sent, {parked_n:,} at a boundary, {working:,} working, "
                      f"{free:,} first policy calls to come ...", flush=True)
                last = now
            await asyncio.sleep(1.0)


async def gymsim_idle_cpu(gyms: list[Any], seconds: float) -> float:
    """CPU the gymsim processes use while nothing happens (cores, summed), sampled over ``seconds``."""
    procs = []
    for g in gyms:
        with contextlib.suppress(psutil.Error, AttributeError):
            procs.append(psutil.Process(g._process.pid))
    for p in procs:
        p.cpu_percent(None)
    await asyncio.sleep(seconds)
    return sum(p.cpu_percent(None) for p in procs) / 100.0


# ------------------------------------------------------------------------------------------------
# The benchmark


async def admit_and_dispatch(base: str, run_id: str, token: str, gyms: list[Any], in_flight: int) -> dict[str, list[dict[str, Any]]]:
    """Admit the in-flight groups and dispatch them, group k to instance k mod N, through the API."""
    h = {"Authorization": f"Bearer {token}"}
    n_groups = in_flight // GROUP_SIZE
    by_inst: dict[str, list[dict[str, Any]]] = {g.instance_id: [] for g in gyms}
    order = [g.instance_id for g in gyms]
    async with httpx.AsyncClient(base_url=base, timeout=300, headers=h) as c:
        for start in range(0, n_groups, 1000):
            body = {"groups": [{"group_id": f"f{k:07d}", "prompt_ref": {"sample_id": k, "task_name": "bench"}, "task_digest": f"sha256:f{k}",
                                "expected_generations": GROUP_SIZE} for k in range(start, min(start + 1000, n_groups))]}
            r = await c.post(f"/v1/runs/{run_id}/groups/admit", json=body)
            r.raise_for_status()
            for g in r.json()["groups"]:
                by_inst[order[int(g["group_id"][1:]) % len(order)]].extend(g["rows"])
        for iid, rows in by_inst.items():
            for k in range(0, len(rows), 20_000):
                chunk = rows[k : k + 20_000]
                r = await c.post(f"/v1/runs/{run_id}/attempts/dispatch",
                                 json={"dispatch_id": f"live-{iid.replace('/', '-')}-{k}", "instance_id": iid, "rollout_ids": [x["rollout_id"] for x in chunk]})
                r.raise_for_status()
    return by_inst


async def drive_snapshot(
    base: str, run_id: str, token: str, sid: str, capture_dir: Path, timeout: float, delta: bool = True, poll_s: float | None = None
) -> dict[str, Any]:
    """The trainer's side of a snapshot (docs/ledger.md#phases), timed: request, wait (a long
    poll, as the client does; a poll every ``poll_s`` if given), barrier (the cut), capture,
    captured."""
    h = {"Authorization": f"Bearer {token}"}
    out: dict[str, Any] = {}
    marks: dict[str, float] = {}
    async with httpx.AsyncClient(base_url=f"{base}/v1/runs/{run_id}", timeout=timeout, headers=h) as c:
        t_request = time.monotonic()
        r = await c.post("/snapshots", json={"snapshot_id": sid, "anchor_step": 0})
        r.raise_for_status()
        deadline = t_request + timeout
        trainer_s = 0.0
        base: list[str] | None = None
        s = (await c.get(f"/snapshots/{sid}")).json()
        while True:
            if s["outcome"] is not None:
                break
            if delta and base is None and s["phase"] in PRE_CUT_FETCH_PHASES and s["counts"].get("cut_pre_cut_keys") is not None:
                # As the client does: the pre-cut's keys while Gym commits, the barrier's delta later.
                t = time.monotonic()
                k = (await c.get(f"/snapshots/{sid}/staging-keys")).json()
                if k["as_of"] == "pre_cut":
                    base = k["staging_keys"]
                    out.update(base_keys=len(base), base_fetch_s=time.monotonic() - t)
            if s["awaiting"] == "barrier" and "cut_s" not in out:
                t_seen = time.monotonic()
                t0 = time.monotonic()
                marks["saw barrier"] = t0
                b = await c.post(f"/snapshots/{sid}/barrier", params={"staging_keys": "delta"} if base is not None else None)
                t1 = time.monotonic()
                b.raise_for_status()
                answer = b.json()
                if "staging_keys_delta" in answer:
                    d = answer["staging_keys_delta"]
                    keys = sorted((set(base or []) - set(d["removed"])) | set(d["added"]))
                    out.update(delta_added=len(d["added"]), delta_removed=len(d["removed"]))
                else:
                    keys = answer["staging_keys"]
                capture_dir.mkdir(parents=True, exist_ok=True)
                f = capture_dir / f"{sid}.json"
                f.write_text(json.dumps(keys))
                digest = hashlib.sha256(f.read_bytes()).hexdigest()
                t2 = time.monotonic()
                cap = await c.post(f"/snapshots/{sid}/captured", json={"reference": {"path": str(f), "digest": digest}})
                t3 = time.monotonic()
                marks.update({"barrier answered": t1, "captured sent": t2, "captured answered": t3})
                cap.raise_for_status()
                trainer_s = (t0 - t_seen) + (t2 - t1)  # the trainer's own share of the data-plane phase
                out.update(cut_s=t1 - t0, captured_s=t3 - t2, staging_keys=len(keys), barrier_body_bytes=len(b.content))
                s = (await c.get(f"/snapshots/{sid}")).json()
                continue
            if time.monotonic() > deadline:
                raise RuntimeError(f"snapshot {sid} still in phase {s['phase']} after {timeout:.0f} s")
            if poll_s is None and s.get("watch_token"):
                s = (await c.get(f"/snapshots/{sid}", params={"wait_s": "10", "watch_token": s["watch_token"]})).json()
            else:
                await asyncio.sleep(poll_s or POLL_S)
                s = (await c.get(f"/snapshots/{sid}")).json()
        t_done = time.monotonic()
        marks["saw outcome"] = t_done
        full = (await c.get(f"/snapshots/{sid}", params={"manifest": "true"})).json()
    out.update(record=full, t_request=t_request, t_done=t_done, trainer_s=trainer_s, marks=marks)
    return out


def bare_copy(url: str, run_id: str, sid: str) -> tuple[float, int]:
    """A plain INSERT ... SELECT of the cut's rows (groups and attempts) into bare tables, one
    transaction, timed with its commit. Returns (seconds, rows). The cut stores one row per group
    since perf3-cut, read as rows through the views ``snapshot_groups`` and ``snapshot_attempts``:
    those rows are first put into plain tables (not timed), so the reference stays what it was, a
    row-per-row copy of the same logical rows from a plain table into a bare one."""
    import psycopg

    with psycopg.connect(plain_url(url)) as conn:
        conn.execute("CREATE TABLE IF NOT EXISTS bench_bare_groups (LIKE snapshot_groups)")
        conn.execute("CREATE TABLE IF NOT EXISTS bench_bare_attempts (LIKE snapshot_attempts)")
        conn.execute("CREATE TABLE IF NOT EXISTS bench_src_groups (LIKE snapshot_groups)")
        conn.execute("CREATE TABLE IF NOT EXISTS bench_src_attempts (LIKE snapshot_attempts)")
        conn.execute("TRUNCATE bench_bare_groups, bench_bare_attempts, bench_src_groups, bench_src_attempts")
        p = {"r": run_id, "s": sid}
        conn.execute("INSERT INTO bench_src_groups SELECT * FROM snapshot_groups WHERE run_id = %(r)s AND snapshot_id = %(s)s", p)
        conn.execute("INSERT INTO bench_src_attempts SELECT * FROM snapshot_attempts WHERE run_id = %(r)s AND snapshot_id = %(s)s", p)
        conn.commit()
        t = time.perf_counter()
        n = conn.execute("INSERT INTO bench_bare_groups SELECT * FROM bench_src_groups").rowcount
        n += conn.execute("INSERT INTO bench_bare_attempts SELECT * FROM bench_src_attempts").rowcount
        conn.commit()
        return time.perf_counter() - t, n


def explain_cut(url: str, run_id: str) -> list[str]:
    """EXPLAIN ANALYZE of the whole-run copy (the pre-cut's, or take_cut's without a pre-cut;
    rolled back) with its settings: its total, the copy with its plan, and any per-row trigger."""
    import psycopg

    from checkpoint_coordinator.snapshots.store import _cut_insert

    sql = _cut_insert(only_named_groups=False).replace(":r", "%(r)s").replace(":s", "%(s)s")
    lines = []
    with psycopg.connect(plain_url(url)) as conn:
        conn.execute("INSERT INTO snapshots (run_id, snapshot_id, anchor_step, phase, owner) "
                     "VALUES (%(r)s, 'explain', 0, 'data_plane', 'bench')", {"r": run_id})
        conn.execute("SET LOCAL enable_nestloop = off")
        conn.execute("SET LOCAL enable_sort = off")
        conn.execute("SET LOCAL work_mem = '128MB'")
        plan = conn.execute("EXPLAIN (ANALYZE, FORMAT JSON) " + sql, {"r": run_id, "s": "explain"}).fetchone()[0][0]
        trig = "; ".join(f"{t['Trigger Name']} {t['Time']:.0f} ms x{t['Calls']}" for t in plan.get("Triggers", []))
        lines.append(f"cut statement: {plan['Execution Time']:.0f} ms" + (f"; triggers: {trig}" if trig else ""))

        def label(node: dict[str, Any]) -> str:
            out = node["Node Type"]
            if "Index Name" in node:
                out += f"({node['Index Name']})"
            elif "Relation Name" in node and node["Node Type"] != "ModifyTable":
                out += f"({node['Relation Name']})"
            return out

        def walk(node: dict[str, Any]) -> None:
            if node["Node Type"] == "ModifyTable" and node.get("Operation") == "Insert":
                nodes: list[str] = []

                def sub(n: dict[str, Any]) -> None:
                    nodes.append(label(n))
                    for ch in n.get("Plans", []):
                        sub(ch)

                for ch in node.get("Plans", []):
                    sub(ch)
                lines.append(f"{node['Relation Name']} copy: {node['Actual Total Time']:.0f} ms, of which its SELECT "
                             f"{node['Plans'][0]['Actual Total Time']:.0f} ms; plan {' > '.join(nodes)}")
                return
            for ch in node.get("Plans", []):
                walk(ch)

        walk(plan["Plan"])
        conn.rollback()
    return lines


async def direct_cut(url: str, run_id: str, manifest: dict[str, Any]) -> tuple[float, int]:
    """``take_cut`` called in this process on a snapshot record set up in phase data_plane with the
    same Gym manifest and no pre-cut, so it copies the whole run (what the barrier costs when the
    pre-cut did not run): the ledger function alone, without HTTP, the JSON answer or the runner's
    polling beside it. The record is deleted afterwards (with its cut). Returns (seconds, keys)."""
    from sqlalchemy import text

    from checkpoint_coordinator.snapshots import store as repo
    from checkpoint_coordinator.ledger.db import make_async_engine

    engine = make_async_engine(url, pool_size=2)
    p = {"r": run_id, "s": "direct-cut"}
    try:
        async with engine.begin() as conn:
            await conn.execute(text("INSERT INTO snapshots (run_id, snapshot_id, anchor_step, phase, owner, gym_manifest) "
                                    "VALUES (:r, :s, 0, 'data_plane', 'bench', CAST(:m AS jsonb))"), {**p, "m": json.dumps(manifest)})
        t = time.perf_counter()
        row = await repo.take_cut(engine, run_id, "direct-cut")
        dt = time.perf_counter() - t
        return dt, len(row.cut_staging_keys or [])
    finally:
        async with engine.begin() as conn:
            await conn.execute(text("DELETE FROM snapshots WHERE run_id = :r AND snapshot_id = :s"), p)
            # The cut tables have no foreign key to snapshots: their rows go explicitly.
            await repo.delete_cut_rows(conn, run_id, ["direct-cut"])
        await engine.dispose()


async def read_costs(url: str, run_id: str, sid: str, reps: int) -> dict[str, Any]:
    """The runner's poll of the snapshot row, and the candidates query of the gate phase."""
    from sqlalchemy import text

    from checkpoint_coordinator.snapshots import store as repo
    from checkpoint_coordinator.ledger.db import make_async_engine

    engine = make_async_engine(url, pool_size=2)
    try:
        polls, cands, narrow = [], [], []
        for _ in range(reps):
            t = time.perf_counter()
            await repo.poll(engine, run_id, sid)
            polls.append(time.perf_counter() - t)
            t = time.perf_counter()
            async with engine.connect() as conn:
                await conn.execute(text("SELECT outcome, abort_requested, data_plane_ref IS NOT NULL, cut_at FROM snapshots "
                                        "WHERE run_id = :r AND snapshot_id = :s"), {"r": run_id, "s": sid})
            narrow.append(time.perf_counter() - t)
            t = time.perf_counter()
            c = await repo.candidates(engine, run_id)
            cands.append(time.perf_counter() - t)
        async with engine.connect() as conn:
            plan = list((await conn.exec_driver_sql("EXPLAIN (ANALYZE, BUFFERS) " + repo._CANDIDATES_SQL, {"r": run_id})).scalars())
            sizes = (await conn.execute(text("SELECT pg_column_size(gym_manifest), pg_column_size(cut_staging_keys), "
                                             "octet_length(gym_manifest::text), cardinality(cut_staging_keys) FROM snapshots "
                                             "WHERE run_id = :r AND snapshot_id = :s"), {"r": run_id, "s": sid})).one()
        return {"poll_s": statistics.median(polls), "narrow_poll_s": statistics.median(narrow), "candidates_s": statistics.median(cands),
                "candidates": sum(len(v) for v in c.values()), "manifest_stored": sizes[0], "keys_stored": sizes[1],
                "manifest_text": sizes[2], "keys": sizes[3], "candidates_plan": plan}
    finally:
        await engine.dispose()


def fmt_s(x: float) -> str:
    return f"{x:.3f} s"


async def run(args: argparse.Namespace, pg: Postgres, coord: TimedCoordinator, gyms: list[Any], workdir: Path) -> int:
    base = coord.url
    run_id = "bench-snap"
    token = create_run(base, run_id, str(workdir / "root"), drain_timeout_s=120, data_plane_timeout_s=600)
    async with httpx.AsyncClient(base_url=base, timeout=120, headers={"Authorization": f"Bearer {token}"}) as c:
        r = await c.post(f"/v1/runs/{run_id}/gym-instances", json={"instances": [
            {"instance_id": g.instance_id, "control_token": g.token, "servers": g.servers} for g in gyms]})
        r.raise_for_status()
    bulk_groups = (args.live - args.in_flight) // GROUP_SIZE
    t = time.perf_counter()
    build_ledger(pg.url, run_id, bulk_groups, prefix="b", turn_dispatched=False, instances=len(gyms))
    by_inst = await admit_and_dispatch(base, run_id, token, gyms, args.in_flight)
    vacuum_analyze(pg.url)
    print(f"snapshot_overhead: ledger of {args.live:,} live siblings built in {time.perf_counter() - t:.1f} s "
          f"({bulk_groups * GROUP_SIZE:,} by SQL, {args.in_flight:,} admitted and dispatched through the API)", flush=True)

    episodes = Episodes()
    sem = asyncio.Semaphore(args.connect_burst)
    t = time.perf_counter()
    for g in gyms:
        episodes.start(g.servers["workplace_agent"], by_inst[g.instance_id], sem)
    expected = {iid: len(rows) for iid, rows in by_inst.items()}
    try:
        counts = await wait_parked(gyms, expected, episodes, args.park_timeout)
        print(f"snapshot_overhead: {sum(expected.values()):,} episodes in flight, parked at a turn boundary, after "
              f"{time.perf_counter() - t:.1f} s: " + ", ".join(f"{i} {c['at_boundary']}" for i, c in counts.items()), flush=True)
        busy = await gymsim_idle_cpu(gyms, 3.0)
        print(f"snapshot_overhead: gymsim processes while their episodes are parked: {busy:.0%} of a core in all "
              f"(every held episode wakes once a second); they run at nice {GYMSIM_NICE} so that this does not take "
              f"the coordinator's or PostgreSQL's CPU", flush=True)

        results = []
        no_pre_cut = Path(coord.timing_file + ".no-pre-cut")
        for k in range(1, (2 if args.ab else 1) * args.snapshots + 1):
            sid = f"s{k}"
            with_pre_cut = not (args.ab and k % 2 == 0)
            if with_pre_cut:
                no_pre_cut.unlink(missing_ok=True)
            else:
                no_pre_cut.touch()
            res = await drive_snapshot(base, run_id, token, sid, workdir / "capture", args.snapshot_timeout, delta=not args.full_keys, poll_s=args.poll)
            rec = res["record"]
            if args.show_calls:
                for o, s0, e0, tgt in coord.gym_calls():
                    if s0 >= res["t_request"]:
                        print(f"  call {o:8} {tgt:40} +{s0 - res['t_request']:.3f} {e0 - s0:.3f} s")
            if args.trace:
                for name, s0, e0 in sorted(coord.spans(), key=lambda x: x[1]):
                    if res["t_request"] <= s0 <= res["t_done"]:
                        print(f"  span {name:32} +{s0 - res['t_request']:.3f} {e0 - s0:.3f} s")
                for name, at in sorted(res["marks"].items(), key=lambda x: x[1]):
                    print(f"  trainer {name:29} +{at - res['t_request']:.3f}")
            if rec["outcome"] != "published":
                print(f"snapshot_overhead: snapshot {sid} ended {rec['outcome']}/{rec['reason']}: {json.dumps(rec['detail'])[:2000]}")
                return 1
            calls = [(s, e) for op, s, e, _ in path_calls(coord.gym_calls(), res["t_request"])]
            gym_busy = union_seconds(calls, res["t_request"], res["t_done"])
            by_op = {}
            for op in ("prepare", "renew", "commit", "resume"):
                by_op[op] = union_seconds([(s, e) for o, s, e, _ in coord.gym_calls() if o == op], res["t_request"], res["t_done"])
            ref_s, ref_rows = bare_copy(pg.url, run_id, sid)
            direct_s, _ = await direct_cut(pg.url, run_id, rec["gym_manifest"])
            pt = rec["phase_timings"]
            manifest = rec["gym_manifest"]["instances"]
            exported = sum(len(i["episodes"]) for i in manifest.values())
            own = pt["total"] - res["trainer_s"] - gym_busy
            results.append({"sid": sid, "pt": pt, "parked": rec["gym_parked_seconds"], "gym_busy": gym_busy, "by_op": by_op, "own": own,
                            "coord_total": pt["total"] - res["trainer_s"], "cut": res["cut_s"], "captured": res["captured_s"],
                            "ref": ref_s, "ref_rows": ref_rows, "direct": direct_s, "exported": exported, "drained": rec["detail"].get("drained"),
                            "cut_groups": rec["counts"].get("cut_groups"), "cut_siblings": rec["counts"].get("cut_siblings"),
                            "pre_cut": pt.get("pre_cut"), "recopied": rec["counts"].get("cut_recopied_groups"), "with_pre_cut": with_pre_cut,
                            "keys": res["staging_keys"], "body": res["barrier_body_bytes"], "trainer": res["trainer_s"]})
            x = results[-1]
            print(f"snapshot_overhead: {sid} published: cut {x['cut_groups']:,} groups + {x['cut_siblings']:,} siblings, "
                  f"{x['exported']:,} episodes exported, {x['drained']} drained, {x['keys']:,} staging keys"
                  + (f" (the barrier answered {res['delta_added']:,} added and {res['delta_removed']:,} removed against the pre-cut's "
                     f"{res['base_keys']:,}, fetched while Gym committed in {fmt_s(res['base_fetch_s'])})" if "delta_added" in res else
                     " (the barrier answered them all)"))
            print("snapshot_overhead:   phases " + ", ".join(f"{k} {pt[k]:.3f}" for k in PHASES if k in pt) + f" s; gym_parked_seconds {x['parked']:.3f}")
            print(f"snapshot_overhead:   Gym control calls in flight {fmt_s(gym_busy)} (" + ", ".join(f"{k} {v:.3f}" for k, v in by_op.items())
                  + f"); trainer's share {fmt_s(x['trainer'])}; coordinator's own time {fmt_s(own)}")
            print(f"snapshot_overhead:   ledger cut (barrier POST) {fmt_s(x['cut'])}, captured POST {fmt_s(x['captured'])}; "
                  f"INSERT ... SELECT of the same {ref_rows:,} rows into bare tables {fmt_s(ref_s)}; ratio {x['cut'] / ref_s:.2f}; "
                  f"whole-run take_cut called in-process {fmt_s(direct_s)} (ratio {direct_s / ref_s:.2f})", flush=True)
            print("snapshot_overhead:   pre-cut (whole-run copy beside prepare and commit) "
                  + (f"{fmt_s(x['pre_cut'])}; the barrier copied {x['recopied']:,} groups again" if x["pre_cut"] is not None
                     else "not taken: the barrier copied the whole run"), flush=True)
            await wait_parked(gyms, expected, episodes, 120)  # resumed, still in flight, for the next one

        costs = await read_costs(pg.url, run_id, results[-1]["sid"], 20)
    finally:
        await episodes.close()

    without = [r for r in results if not r["with_pre_cut"]]
    results = [r for r in results if r["with_pre_cut"]]

    def m(key: str, rs: list[dict[str, Any]] | None = None) -> float:
        return statistics.median(r[key] for r in (results if rs is None else rs))

    def mp(key: str) -> float:
        return statistics.median(r["pt"].get(key, 0.0) for r in results)

    n = len(results)
    print(f"snapshot_overhead: ---- medians over {n} snapshot(s): {args.live:,} live siblings, {args.in_flight:,} in flight on {len(gyms)} instances")
    print("snapshot_overhead: phase timings " + ", ".join(f"{k} {mp(k):.3f}" for k in PHASES if k in results[0]["pt"]) + " s")
    print(f"snapshot_overhead: gym_parked_seconds {m('parked'):.3f} s")
    print(f"snapshot_overhead: Gym control calls in flight {fmt_s(m('gym_busy'))}; trainer's share {fmt_s(m('trainer'))}")
    print(f"snapshot_overhead: coordinator total (phase total - trainer's share) {fmt_s(m('coord_total'))} "
          f"[{'within' if m('coord_total') <= TOTAL_TARGET_S else 'over'} target <= {TOTAL_TARGET_S} s]")
    print(f"snapshot_overhead: coordinator's own time (also minus Gym calls in flight) {fmt_s(m('own'))} "
          f"[{'within' if m('own') <= TOTAL_TARGET_S else 'over'} target <= {TOTAL_TARGET_S} s]")
    # Own time against the same-run reference. Both move with the machine's load, so the median
    # of the per-snapshot ratios is printed beside the ratio of the medians.
    own_ratios = [r["own"] / r["ref"] for r in results]
    print(f"snapshot_overhead: own / reference: coordinator's own time / INSERT ... SELECT reference = {m('own') / m('ref'):.2f} (ratio of medians); "
          f"median of the per-snapshot ratios {statistics.median(own_ratios):.2f} [{'within' if m('own') / m('ref') <= OWN_RATIO_TARGET else 'over'} "
          f"target <= {OWN_RATIO_TARGET}]; per snapshot " + ", ".join(f"{x:.2f}" for x in own_ratios))
    print(f"snapshot_overhead: ledger cut {fmt_s(m('cut'))} [{'within' if m('cut') <= CUT_TARGET_S else 'over'} target <= {CUT_TARGET_S} s]; "
          f"INSERT ... SELECT reference {fmt_s(m('ref'))}; ratio cut / reference = {m('cut') / m('ref'):.2f}")
    pre = [r["pre_cut"] for r in results if r["pre_cut"] is not None]
    if pre:
        print(f"snapshot_overhead: pre-cut (whole-run copy while Gym prepares and commits; not on the barrier's path) "
              f"{fmt_s(statistics.median(pre))} in {len(pre)} of {n} snapshot(s); groups copied again at the barrier: "
              + ", ".join(str(r["recopied"]) for r in results))
    else:
        print("snapshot_overhead: no pre-cut was taken: every barrier copied the whole run")
    print(f"snapshot_overhead: whole-run take_cut called in this process (no pre-cut, no HTTP, no JSON answer, no runner polling beside it) {fmt_s(m('direct'))}; "
          f"ratio to the reference = {m('direct') / m('ref'):.2f}")
    if without:
        print(f"snapshot_overhead: A/B, the {len(without)} snapshot(s) taken in between without a pre-cut (medians): ledger cut "
              f"{fmt_s(m('cut', without))}, coordinator's own time {fmt_s(m('own', without))}, gym_parked_seconds {m('parked', without):.3f} s, "
              f"Gym calls in flight {fmt_s(m('gym_busy', without))}; with the pre-cut: {fmt_s(m('cut'))}, {fmt_s(m('own'))}, "
              f"{m('parked'):.3f} s, {fmt_s(m('gym_busy'))}")
    print(f"snapshot_overhead: snapshot row read by the runner's polls {costs['poll_s'] * 1000:.1f} ms "
          f"(manifest {costs['manifest_text'] / 1e6:.1f} MB as text, {costs['keys']:,} cut staging keys, {(costs['manifest_stored'] + costs['keys_stored']) / 1e6:.1f} MB stored) "
          f"vs {costs['narrow_poll_s'] * 1000:.1f} ms for the columns the polls look at; candidates query {costs['candidates_s'] * 1000:.1f} ms "
          f"({costs['candidates']:,} candidates)")
    for line in costs.pop("candidates_plan"):
        print("snapshot_overhead: candidates EXPLAIN ANALYZE " + line)
    print(f"snapshot_overhead: coordinator peak RSS {mib(coord.peak_rss)}")
    summary = {"live": args.live, "in_flight": args.in_flight, "instances": len(gyms), "snapshots": results, "read_costs": costs,
               "medians": {"coord_total": m("coord_total"), "own": m("own"), "gym_busy": m("gym_busy"), "cut": m("cut"), "ref": m("ref"),
                           "ratio": m("cut") / m("ref"), "parked": m("parked"), "own_ratio": m("own") / m("ref"),
                           "own_ratio_per_snapshot": statistics.median(own_ratios),
                           "direct": m("direct"), "direct_ratio": m("direct") / m("ref"),
                           "pre_cut": statistics.median(pre) if pre else None},
               "without_pre_cut": without}
    print("snapshot_overhead: json " + json.dumps(summary, sort_keys=True, default=str))
    if args.explain:
        for line in explain_cut(pg.url, run_id):
            print("snapshot_overhead: cut EXPLAIN ANALYZE " + line)
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["--serve-timed-coordinator"]:
        return _serve_timed(argv[1], argv[2])
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--live", type=int, default=200_000, help="live siblings of the run (multiple of 8)")
    ap.add_argument("--in-flight", type=int, default=10_000, help="turn-level rollouts in flight in Gym (multiple of 8)")
    ap.add_argument("--instances", type=int, default=4,
                    help="gymsim instances (one process each); raised to hold at most %d episodes per instance" % GYMSIM_MAX_PER_INSTANCE)
    ap.add_argument("--snapshots", type=int, default=3, help="snapshots taken one after the other (medians reported)")
    ap.add_argument("--turn-seconds", type=float, default=30.0,
                    help="gymsim turn work; the /run burst must fit in it for every episode to finish exactly one turn")
    ap.add_argument("--connect-burst", type=int, default=200, help="/run connections being opened at once")
    ap.add_argument("--park-timeout", type=float, default=900.0, help="seconds to wait for every episode to park")
    ap.add_argument("--snapshot-timeout", type=float, default=600.0)
    ap.add_argument("--poll", type=float, default=None, metavar="S",
                    help=f"the trainer polls the snapshot every S seconds (the harness polls every {POLL_S}) instead of waiting on it (long poll)")
    ap.add_argument("--show-calls", action="store_true", help="list every Gym control call of each snapshot with its timing")
    ap.add_argument("--full-keys", action="store_true",
                    help="the trainer asks the barrier for every staging key (as a client before the delta did), not the delta against the pre-cut's")
    ap.add_argument("--trace", action="store_true",
                    help="list the span of every ledger call and Gym step of each snapshot, and the trainer's marks")
    ap.add_argument("--ab", action="store_true",
                    help="also take --snapshots snapshots without the pre-cut, alternating (A/B in the same run; medians reported apart)")
    ap.add_argument("--no-explain", dest="explain", action="store_false", help="skip EXPLAIN ANALYZE of the cut's statements")
    ap.add_argument("--slow-plans", type=float, default=None, metavar="MS",
                    help="log the EXPLAIN ANALYZE of every statement of MS milliseconds or more (PostgreSQL's auto_explain; "
                         "timing every plan node slows all statements a little) and copy the server log to --slow-plans-log")
    ap.add_argument("--slow-plans-log", type=Path, default=Path("snapshot_overhead-slow-plans.log"), metavar="FILE")
    ap.add_argument("--quick", action="store_true", help="tiny sizes for a smoke test")
    args = ap.parse_args(argv)
    if args.quick:
        args.live, args.in_flight, args.instances, args.snapshots, args.turn_seconds, args.explain = 4000, 160, 2, 1, 1.0, False
    if args.live % GROUP_SIZE or args.in_flight % GROUP_SIZE or not 0 < args.in_flight <= args.live:
        ap.error("--live and --in-flight must be multiples of 8 with 0 < in-flight <= live")
    need = -(-(args.in_flight // GROUP_SIZE) // (GYMSIM_MAX_PER_INSTANCE // GROUP_SIZE))
    if need > args.instances:
        print(f"snapshot_overhead: note: {args.in_flight:,} episodes in flight need {need} gymsim instances "
              f"(at most {GYMSIM_MAX_PER_INSTANCE:,} parked episodes each); using {need} instead of {args.instances}", flush=True)
        args.instances = need
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # run the finally blocks below
    if args.trace:
        os.environ["CKPTC_BENCH_TRACE"] = "1"  # read by the coordinator process (_serve_timed)
    workdir = Path(tempfile.mkdtemp(prefix="ckptc-bench-snap-"))
    pg = coord = None
    gyms: list[Any] = []
    try:
        pg = Postgres(settings=None if args.slow_plans is None else {
            "session_preload_libraries": "auto_explain", "auto_explain.log_min_duration": f"{args.slow_plans:g}ms",
            "auto_explain.log_analyze": "on", "auto_explain.log_buffers": "on", "auto_explain.log_nested_statements": "on"})
        coord = TimedCoordinator(pg.url, workdir)
        # group k goes to instance k mod N (admit_and_dispatch)
        per_instance = [len(range(k, args.in_flight // GROUP_SIZE, args.instances)) * GROUP_SIZE for k in range(args.instances)]
        gyms = start_gyms(per_instance, args.turn_seconds, workdir / "gymsim.log")
        return asyncio.run(run(args, pg, coord, gyms, workdir))
    except BaseException:
        log = workdir / "gymsim.log"
        if log.exists():
            tail = log.read_text(errors="replace")[-4000:]
            print(f"snapshot_overhead: failed; last lines of the gymsim log:\n{tail}", file=sys.stderr)
        raise
    finally:
        stop_gyms(gyms)
        if coord is not None:
            coord.close()
        import shutil

        if pg is not None:
            if args.slow_plans is not None:
                with contextlib.suppress(OSError):
                    shutil.copyfile(pg.dir / "pgdata" / "log", args.slow_plans_log)
                    print(f"snapshot_overhead: plans of the statements of {args.slow_plans:g} ms or more: {args.slow_plans_log}")
            pg.close()

        shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    raise SystemExit(main())
