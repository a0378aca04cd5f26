"""Benchmark: the effect journal's ``begin`` + ``complete`` per effect (docs/effects.md), the two
round trips a tool pays around every call that acts outside Gym.

A coordinator process (``ckpt-coordinator serve`` on an embedded PostgreSQL in a temporary
directory) holds a run of ``--rows`` dispatched rows (groups of 8, admitted and dispatched through
the API to a placeholder Gym instance), so every begin passes the attempt fence. Each effect is
``begin_effect`` (answer ``proceed``) then ``complete_effect`` with a small result, through the thin
client with the run's token, on a fresh ``(rollout_id, seq)`` key.

Measured alternately, ``--rounds`` rounds of ``--effects`` effects each after a warm-up, the order
rotated every round, medians and spread:

- **HTTP, sequential**: one client, one effect after the other; wall time per effect, effects/s.
- **HTTP, concurrent**: ``--workers`` clients in threads; effects/s.
- **the coordinator's own time** per effect: the sums of its ``ckptc_http_request_seconds``
  histogram for the begin and complete routes (read from ``/metrics`` before and after the
  sequential block), divided by the effects. The server-side time of both requests, from the
  request's arrival in the app to its answer: auth, validation, the SQL and its round trips to
  PostgreSQL, encoding. Not the client's share, nor the loopback HTTP.
- **in-process**: ``effects.store.begin`` + ``effects.store.complete`` on the service's own engine
  in this process, same database (the journal's SQL without the HTTP layer).
- **the SQL alone**: the journal's two statements (``effects.store._BEGIN`` and the complete's
  ``UPDATE``) on the reference's connection: what PostgreSQL and psycopg cost without the
  service's engine and routes.
- **reference**: a plain single-row ``INSERT ... ON CONFLICT DO NOTHING`` into a bare table with a
  primary key, autocommit, on a psycopg async connection to the same PostgreSQL with the service's
  connection options (the kind of connection the coordinator uses); one round trip per row.
- **the reference without its flush**: the same insert on a connection with
  ``synchronous_commit = off``, which answers before the write-ahead log reaches the disk: the
  reference less this is what one durable commit costs, the floor each of the journal's two
  calls pays (docs/effects.md#cost).

Target (issue): begin + complete cost the coordinator at most 3x the reference round trip (own
time ÷ reference, ratio of the medians).

    python bench/effects_journal.py [--rows 2000] [--effects 200] [--rounds 7] [--workers 4] [--no-check] [--quick]

Exit status 1 when the target is missed at full size (``--no-check`` only reports).
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import re
import signal
import statistics
import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import ADMIN, Coordinator, Postgres  # noqa: E402

from ckpt_client import CoordinatorClient, GroupSpec  # noqa: E402
from checkpoint_coordinator.effects import store as effects_store  # noqa: E402
from checkpoint_coordinator.ledger.db import client_options, make_async_engine  # noqa: E402

TARGET = 3.0
GROUP_SIZE = 8
RUN = "bench-effects"
INSTANCE = "bench/gym-0"
ROUTES = {"begin": "/v1/runs/{run_id}/effects/begin", "complete": "/v1/runs/{run_id}/effects/{effect_id}/complete"}
# store.complete's statement, as it runs there.
COMPLETE_SQL = (
    "UPDATE effects SET state = 'completed', result = %(res)s::jsonb, completed_at = now() "
    f"WHERE run_id = %(r)s AND effect_id = %(id)s AND state = 'in_progress' RETURNING {effects_store._COLS}"
)
REF_SQL = "INSERT INTO bench_effects_ref (k, v) VALUES (%(k)s, %(v)s) ON CONFLICT DO NOTHING"
RESULT = {"ok": True, "message_id": "m-0123456789"}
DIGEST = "sha256:" + "ab" * 32


def plain_url(url: str) -> str:
    return url.replace("postgresql+psycopg", "postgresql")


def log(text: str) -> None:
    print(f"effects_journal: {text}", flush=True)


# ------------------------------------------------------------------------------------------------
# The run


def build_run(pg_url: str, coord_url: str, rows: int) -> tuple[str, list[tuple[str, int]]]:
    """A run of ``rows`` dispatched rows; answers its token and the rows (rollout id, Gym attempt)."""
    import psycopg

    with CoordinatorClient(coord_url, ADMIN, retries=2, backoff=0.05) as admin:
        run = admin.create_run(RUN, "/tmp/bench-effects", {"target_level": "turn"})
    with psycopg.connect(plain_url(pg_url), autocommit=True) as conn:
        # A Gym instance without participants: dispatch only needs the run to know the instance.
        conn.execute(
            "INSERT INTO gym_instances (run_id, instance_id, servers, control_token, discovered_at) "
            "VALUES (%s, %s, '{}'::jsonb, 'placeholder', now())", (RUN, INSTANCE),
        )
        conn.execute("CREATE TABLE bench_effects_ref (k bigint PRIMARY KEY, v text NOT NULL)")
    sent: list[tuple[str, int]] = []
    with CoordinatorClient(coord_url, str(run.run_token), run_id=RUN, retries=2, backoff=0.05) as c:
        groups = [GroupSpec(f"g{g:06d}", f"g{g:06d}", "math", f"sha256:{g}", GROUP_SIZE) for g in range(rows // GROUP_SIZE)]
        for k in range(0, len(groups), 1000):
            admitted = c.admit_groups(groups[k:k + 1000])
            ids = [r.rollout_id for r in admitted.rows]
            sent += [(r.rollout_id, r.gym_attempt) for r in c.dispatch(ids, instance_id=INSTANCE).rows]
    assert len(sent) == rows, (len(sent), rows)
    return str(run.run_token), sent


class Keys:
    """Fresh ``(rollout_id, gym_attempt, seq)`` keys: every row, then every row again at the next seq."""

    def __init__(self, rows: list[tuple[str, int]]) -> None:
        self._it = ((ro, ga, seq) for seq in itertools.count() for ro, ga in rows)
        self._lock = threading.Lock()

    def take(self, n: int) -> list[tuple[str, int, int]]:
        with self._lock:
            return list(itertools.islice(self._it, n))


# ------------------------------------------------------------------------------------------------
# What is timed


def http_effects(client: CoordinatorClient, keys: list[tuple[str, int, int]]) -> None:
    for ro, ga, seq in keys:
        ans = client.begin_effect(ro, ga, seq, "send_mail", DIGEST)
        if ans.answer != "proceed":
            raise RuntimeError(f"begin answered {ans.answer} for {ro} seq {seq}")
        client.complete_effect(ans.effect_id, RESULT)


def http_concurrent(clients: list[CoordinatorClient], pool: ThreadPoolExecutor, keys: Keys, n: int) -> float:
    """``n`` effects split over the clients, each in its own thread; answers the wall time."""
    share = [keys.take(n // len(clients) + (1 if i < n % len(clients) else 0)) for i in range(len(clients))]
    t = time.perf_counter()
    for f in [pool.submit(http_effects, c, s) for c, s in zip(clients, share)]:
        f.result()
    return time.perf_counter() - t


# Greedy: a route template has braces of its own.
_SAMPLE = re.compile(r'^ckptc_http_request_seconds_(sum|count)\{(.*)\} (\S+)$')


def server_seconds(coord_url: str) -> dict[str, tuple[float, float]]:
    """``{begin|complete: (sum of seconds, count)}`` of the 200 answers, from ``/metrics``."""
    text = httpx.get(f"{coord_url}/metrics", headers={"Authorization": f"Bearer {ADMIN}"}, timeout=30).text
    out = {name: [0.0, 0.0] for name in ROUTES}
    for line in text.splitlines():
        m = _SAMPLE.match(line)
        if not m:
            continue
        labels = dict(re.findall(r'(\w+)="([^"]*)"', m.group(2)))
        for name, route in ROUTES.items():
            if labels.get("route") == route and labels.get("status") == "200" and labels.get("method") == "POST":
                out[name][0 if m.group(1) == "sum" else 1] += float(m.group(3))
    return {k: (v[0], v[1]) for k, v in out.items()}


class InProcess:
    """The journal's store calls on the service's engine, and the reference, on their own loop."""

    def __init__(self, pg_url: str) -> None:
        self.loop = asyncio.new_event_loop()
        self.engine = make_async_engine(pg_url, pool_size=2)
        self.ref_conn: Any = None
        self.lazy_conn: Any = None
        self.ref_key = itertools.count()
        self.loop.run_until_complete(self._connect(pg_url))

    async def _connect(self, pg_url: str) -> None:
        import psycopg

        self.ref_conn = await psycopg.AsyncConnection.connect(plain_url(pg_url), autocommit=True, **client_options(pg_url))
        self.lazy_conn = await psycopg.AsyncConnection.connect(plain_url(pg_url), autocommit=True, **client_options(pg_url))
        await self.lazy_conn.execute("SET synchronous_commit = off")

    async def _store(self, keys: list[tuple[str, int, int]]) -> None:
        for ro, ga, seq in keys:
            ans = await effects_store.begin(self.engine, RUN, effects_store.BeginCall(ro, ga, seq, "send_mail", DIGEST))
            if ans["answer"] != "proceed":
                raise RuntimeError(f"begin answered {ans['answer']}")
            await effects_store.complete(self.engine, RUN, ans["effect_id"], RESULT)

    async def _sql(self, keys: list[tuple[str, int, int]]) -> tuple[float, float]:
        """Seconds in the begin's statements and in the complete's."""
        split = [0.0, 0.0]
        cur = self.ref_conn.cursor(binary=True)
        result = json.dumps(RESULT)
        clock = time.perf_counter
        for ro, ga, seq in keys:
            t0 = clock()
            await cur.execute(effects_store._BEGIN, effects_store.BeginCall(ro, ga, seq, "send_mail", DIGEST).params(RUN))
            ((run_ok, att_ok, effect_id, _),) = await cur.fetchall()
            t1 = clock()
            if effect_id is None:
                raise RuntimeError(f"the journal's insert did not insert ({run_ok}, {att_ok})")
            await cur.execute(COMPLETE_SQL, {"r": RUN, "id": effect_id, "res": result})
            assert len(await cur.fetchall()) == 1
            split[0] += t1 - t0
            split[1] += clock() - t1
        return split[0], split[1]

    async def _reference(self, n: int, lazy: bool = False) -> None:
        cur = (self.lazy_conn if lazy else self.ref_conn).cursor(binary=True)
        for _ in range(n):
            await cur.execute(REF_SQL, {"k": next(self.ref_key), "v": "m-0123456789"})

    def store(self, keys: list[tuple[str, int, int]]) -> float:
        t = time.perf_counter()
        self.loop.run_until_complete(self._store(keys))
        return time.perf_counter() - t

    def sql(self, keys: list[tuple[str, int, int]]) -> tuple[float, float, float]:
        """Seconds in all, in the begin's statements, in the complete's."""
        t = time.perf_counter()
        begin, complete = self.loop.run_until_complete(self._sql(keys))
        return time.perf_counter() - t, begin, complete

    def reference(self, n: int, lazy: bool = False) -> float:
        t = time.perf_counter()
        self.loop.run_until_complete(self._reference(n, lazy))
        return time.perf_counter() - t

    def close(self) -> None:
        async def go() -> None:
            for conn in (self.ref_conn, self.lazy_conn):
                if conn is not None:
                    await conn.close()
            await self.engine.dispose()

        self.loop.run_until_complete(go())
        self.loop.close()


# ------------------------------------------------------------------------------------------------
# Measuring


def measure(coord_url: str, token: str, keys: Keys, local: InProcess, effects: int, rounds: int, workers: int) -> dict[str, list[float]]:
    """Per round, each measurement once, in an order rotated every round; seconds per effect
    (``*_per_s``: effects per second)."""
    times: dict[str, list[float]] = {k: [] for k in ("http_seq", "own", "own_begin", "own_complete", "in_process", "sql", "sql_begin", "sql_complete", "reference",
                                                 "reference_unflushed", "http_conc_per_s")}
    seq_client = CoordinatorClient(coord_url, token, run_id=RUN, retries=0)
    conc = [CoordinatorClient(coord_url, token, run_id=RUN, retries=0) for _ in range(workers)]
    pool = ThreadPoolExecutor(max_workers=workers)
    try:
        http_effects(seq_client, keys.take(20))  # warm-up: connections, prepared statements, caches
        http_concurrent(conc, pool, keys, 4 * workers)
        local.store(keys.take(20))
        local.sql(keys.take(20))
        local.reference(20)
        local.reference(20, lazy=True)

        def sequential() -> None:
            before = server_seconds(coord_url)
            t = time.perf_counter()
            http_effects(seq_client, keys.take(effects))
            times["http_seq"].append((time.perf_counter() - t) / effects)
            after = server_seconds(coord_url)
            for name in ROUTES:
                n = after[name][1] - before[name][1]
                assert n == effects, (name, n, effects)
                times[f"own_{name}"].append((after[name][0] - before[name][0]) / effects)
            times["own"].append(times["own_begin"][-1] + times["own_complete"][-1])

        def sql(batch: list[tuple[str, int, int]]) -> None:
            for name, seconds in zip(("sql", "sql_begin", "sql_complete"), local.sql(batch)):
                times[name].append(seconds / effects)

        steps: list[tuple[str, Callable[[], None]]] = [
            ("http_seq", sequential),
            ("http_conc", lambda: times["http_conc_per_s"].append(effects / http_concurrent(conc, pool, keys, effects))),
            ("in_process", lambda: times["in_process"].append(local.store(keys.take(effects)) / effects)),
            ("sql", lambda: sql(keys.take(effects))),
            ("reference", lambda: times["reference"].append(local.reference(effects) / effects)),
            ("reference_unflushed", lambda: times["reference_unflushed"].append(local.reference(effects, lazy=True) / effects)),
        ]
        for k in range(rounds):
            for _, step in steps[k % len(steps):] + steps[:k % len(steps)]:
                step()
    finally:
        pool.shutdown()
        for c in [seq_client, *conc]:
            c.close()
    return times


def ms(x: float) -> str:
    return f"{x * 1000:.3f} ms"


def report(times: dict[str, list[float]], effects: int, workers: int) -> dict[str, Any]:
    med = {k: statistics.median(v) for k, v in times.items()}

    def spread(k: str) -> str:
        return f"(min {ms(min(times[k]))}, max {ms(max(times[k]))}, {len(times[k])} rounds of {effects})"

    log(f"HTTP sequential, begin + complete   median {ms(med['http_seq'])} per effect = {1 / med['http_seq']:,.0f} effects/s {spread('http_seq')}")
    conc = times["http_conc_per_s"]
    log(f"HTTP {workers} concurrent workers        median {statistics.median(conc):,.0f} effects/s (min {min(conc):,.0f}, max {max(conc):,.0f})")
    log(f"coordinator's own time (ckptc_http_request_seconds, begin + complete)  median {ms(med['own'])} per effect "
        f"(begin {ms(med['own_begin'])}, complete {ms(med['own_complete'])}) {spread('own')}")
    log(f"in-process store.begin + store.complete   median {ms(med['in_process'])} per effect {spread('in_process')}")
    log(f"the SQL alone (begin's statement + complete's UPDATE)   median {ms(med['sql'])} per effect {spread('sql')}")
    log(f"  of which the begin's statement {ms(med['sql_begin'])} ({med['sql_begin'] / med['reference']:.2f}x the reference), "
        f"the complete's {ms(med['sql_complete'])} ({med['sql_complete'] / med['reference']:.2f}x)")
    log(f"reference INSERT ... ON CONFLICT DO NOTHING round trip   median {ms(med['reference'])} {spread('reference')}")
    flush = med["reference"] - med["reference_unflushed"]
    log(f"  the same insert without waiting for its flush (synchronous_commit = off)   median {ms(med['reference_unflushed'])}: "
        f"a durable commit's flush is {ms(flush)}, {flush / med['reference']:.0%} of the reference; begin + complete flush twice")
    ratio = med["own"] / med["reference"]
    per_round = [o / r for o, r in zip(times["own"], times["reference"])]
    log(
        f"ratio own time / reference = {ratio:.2f} (per round {min(per_round):.2f}-{max(per_round):.2f}; target <= {TARGET:.0f}); "
        f"in-process / reference = {med['in_process'] / med['reference']:.2f}; SQL alone / reference = {med['sql'] / med['reference']:.2f}; "
        f"HTTP wall / reference = {med['http_seq'] / med['reference']:.2f}"
    )
    log(f"where the own time goes, per effect: SQL {ms(med['sql'])}, the service's engine {ms(med['in_process'] - med['sql'])}, "
        f"the two requests' HTTP layer {ms(med['own'] - med['in_process'])}")
    return {
        "median_s": med, "times_s": times, "ratio": ratio, "ratio_in_process": med["in_process"] / med["reference"],
        "ratio_sql": med["sql"] / med["reference"],
    }


def check_journal(pg_url: str, expected: int) -> None:
    """Every effect begun was completed with its result (a begin that did nothing would be fast)."""
    import psycopg

    with psycopg.connect(plain_url(pg_url)) as conn:
        rows = conn.execute("SELECT state, count(*) FROM effects WHERE run_id = %s GROUP BY 1", (RUN,)).fetchall()
    assert dict(rows) == {"completed": expected}, (rows, expected)


def main_run(rows: int, effects: int, rounds: int, workers: int, check: bool) -> int:
    pg = Postgres()
    coord: Coordinator | None = None
    local: InProcess | None = None
    try:
        log(f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores")
        coord = Coordinator(pg.url)
        t = time.perf_counter()
        token, sent = build_run(pg.url, coord.url, rows)
        log(f"run of {rows:,} dispatched rows ready in {time.perf_counter() - t:.1f}s")
        keys = Keys(sent)
        local = InProcess(pg.url)
        times = measure(coord.url, token, keys, local, effects, rounds, workers)
        total = 20 + 4 * workers + 20 + 20 + rounds * 4 * effects
        check_journal(pg.url, total)
        log(f"{total:,} effects journalled, each begun (proceed) and completed; coordinator peak RSS {coord.peak_rss / (1 << 20):.0f} MiB")
    finally:
        if local is not None:
            local.close()
        if coord is not None:
            coord.close()
        pg.close()
    summary = report(times, effects, workers)
    ok = summary["ratio"] <= TARGET
    log(("target met" if ok else "TARGET MISSED") + ("" if check else " (not checked: --quick / --no-check)") + f"; load average {os.getloadavg()[0]:.1f}")
    print("effects_journal: json " + json.dumps({"rows": rows, "effects": effects, "rounds": rounds, "workers": workers, **summary}, sort_keys=True))
    return 0 if ok or not check else 1


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=2000, help="dispatched rows in the run (a multiple of 8)")
    ap.add_argument("--effects", type=int, default=200, help="effects per measurement and round")
    ap.add_argument("--rounds", type=int, default=7, help="alternating rounds of every measurement")
    ap.add_argument("--workers", type=int, default=4, help="concurrent clients of the concurrent measurement")
    ap.add_argument("--no-check", action="store_true", help="report the target without turning a miss into exit status 1")
    ap.add_argument("--quick", action="store_true", help="a small run for a smoke test (80 rows, 20 effects, 2 rounds); nothing checked")
    args = ap.parse_args(argv)
    if args.quick:
        args.rows, args.effects, args.rounds, args.workers = 80, 20, 2, 2
    if args.rows < GROUP_SIZE or args.rows % GROUP_SIZE:
        ap.error("--rows must be a positive multiple of 8")
    if args.effects < 1 or args.rounds < 1 or args.workers < 1:
        ap.error("--effects, --rounds and --workers must be at least 1")
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # run the finally blocks: stop the coordinator and PostgreSQL
    return main_run(args.rows, args.effects, args.rounds, args.workers, check=not (args.quick or args.no_check))


if __name__ == "__main__":
    raise SystemExit(main())
