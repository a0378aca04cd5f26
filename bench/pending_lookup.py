"""Benchmark: "which of these attempts are still pending?" against a run with 200 000 live attempts.

The trainer asks it (``POST /v1/runs/{run}/attempts/pending``, ``ledger.rollouts.pending_attempts``)
and the snapshot drain asks it on every pass (``ledger.snapshots.still_pending``). A drain pass
looks up only the pending attempts, so its cost follows the number asked about, never the number
of live rollouts (docs/ledger.md#phases).

The run is built straight in an embedded PostgreSQL with set-based SQL (25 000 groups of 8, a third
each turn, sibling and prompt_group level; sealed, returned, dispatched and never-sent rows, 4 Gym
instances), vacuumed and analysed. 100 of its live attempts (a fixed pseudo-random sample, every
status) are asked about. Timed, interleaved in random order, median of ``--reps`` repetitions:

* ``pending_attempts``: the ledger function, in this process (same engine settings as the service);
* ``still_pending``: the drain's lookup of the same 100 as (rollout_id, gym_attempt) keys;
* ``HTTP pending``: the endpoint on a coordinator process (adds the HTTP round trip and auth);
* for the analysis: ``SELECT 1`` through the same engine (the fixed cost of any ledger read: pool
  checkout, one round trip), the lookup's statement through SQLAlchemy ``text()`` on an autocommit
  connection, and ``still_pending``'s statement through ``ledger.db.read_rows`` (the driver-level
  read path ``pending_attempts`` uses); plus PostgreSQL's own time per query (EXPLAIN ANALYZE);
* reference ``scan (SQL filter)``: the same question answered by reading every attempt of the run
  and filtering in SQL (index scans disabled, so PostgreSQL reads the run's attempts);
* reference ``scan (Python filter)``: read every live attempt of the run (current, in a generating
  or ready group), then keep the asked ones that are dispatched, in Python.

Targets (issue): lookups >= 20x cheaper than the scan, measured against the cheaper of the two
references; a drain pass over 100 pending attempts costs the same at 20 000 and at 200 000 live
siblings (ratio <= 1.5). The drain runs are separate runs of the same table, measured interleaved
(same table, same moments) and, before that, each right after it was built (the table grows).

    python bench/pending_lookup.py [--live 200000] [--asked 100] [--drain-sizes 20000,200000] [--reps 300] [--quick]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import signal
import statistics
import sys
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import ADMIN, Coordinator, Postgres  # noqa: E402

LOOKUP_TARGET = 20.0
DRAIN_TARGET = 1.5
GROUP_SIZE = 8
INSTANCES = 4


def plain_url(url: str) -> str:
    return url.replace("postgresql+psycopg", "postgresql")


# ------------------------------------------------------------------------------------------------
# Building a live ledger with set-based SQL (also used by bench/snapshot_overhead.py)


def build_ledger(url: str, run_id: str, n_groups: int, *, prefix: str = "g", turn_dispatched: bool = True, instances: int = INSTANCES) -> None:
    """``n_groups`` live groups of 8 in ``run_id`` (which must exist), one current attempt per sibling.

    Levels cycle turn / sibling / prompt_group. Per sibling index: sealed (0-2), dispatched (3-5),
    reserved (6-7); prompt_group cohorts are all sealed (group ready), half returned, all reserved or
    all dispatched. With ``turn_dispatched=False`` turn-level rows are only sealed or never sent, so
    no turn-level row is in flight without a Gym episode behind it (a snapshot would wait for it).
    Turn-level rows dispatched in a group divisible by 5 are restored continuations (gym_attempt 1).
    """
    import psycopg

    turn_status = "CASE WHEN i < 3 THEN 'sealed' WHEN i < 6 THEN 'dispatched' ELSE 'reserved' END" if turn_dispatched else (
        "CASE WHEN i < 4 THEN 'sealed' ELSE 'reserved' END"
    )
    row_status = "CASE WHEN i < 3 THEN 'sealed' WHEN i < 6 THEN 'dispatched' ELSE 'reserved' END"
    pg_status = (
        "CASE mod(g, 4) WHEN 0 THEN 'sealed' WHEN 1 THEN CASE WHEN i < 4 THEN 'returned' ELSE 'dispatched' END "
        "WHEN 2 THEN 'reserved' ELSE 'dispatched' END"
    )
    gid = f"'{prefix}' || lpad(g::text, 7, '0')"
    p = {"r": run_id, "n": n_groups, "k": instances}
    with psycopg.connect(plain_url(url)) as conn:
        conn.execute(
            "INSERT INTO prompt_groups (run_id, group_id, prompt_ref, task_digest, restore_level, expected_generations, status) "
            f"SELECT %(r)s, {gid}, jsonb_build_object('sample_id', g, 'task_name', 'bench'), 'sha256:' || g, "
            "(ARRAY['turn', 'sibling', 'prompt_group'])[mod(g, 3) + 1], 8, "
            "CASE WHEN mod(g, 3) = 2 AND mod(g, 4) = 0 THEN 'ready' ELSE 'generating' END FROM generate_series(0, %(n)s - 1) AS g",
            p,
        )
        conn.execute(
            f"INSERT INTO siblings (run_id, group_id, generation_index) SELECT %(r)s, {gid}, i "
            "FROM generate_series(0, %(n)s - 1) AS g, generate_series(0, 7) AS i",
            p,
        )
        conn.execute(
            "INSERT INTO attempts (run_id, group_id, generation_index, rollout_id, gym_instance_id, gym_attempt, status, receipt, "
            "reward, staging_keys, gym_owned, dispatch_id, dispatched_at, ended_at) "
            "SELECT %(r)s, gid, i, rid, CASE WHEN st <> 'reserved' THEN 'bench/replica-' || (mod(g, %(k)s)) END, ga, st, "
            "CASE WHEN st IN ('sealed', 'returned') THEN jsonb_build_object('rollout_id', ck) END, "
            "CASE WHEN st IN ('sealed', 'returned') THEN 1.0 END, "
            "CASE WHEN st IN ('sealed', 'returned') THEN ARRAY['tq/' || ck || '/0'] END, ga > 0, "
            "CASE WHEN st <> 'reserved' THEN 'bulk-' || (g / 100) END, CASE WHEN st <> 'reserved' THEN now() END, "
            "CASE WHEN st = 'sealed' THEN now() END "
            "FROM (SELECT g, i, gid, rid, st, ga, CASE WHEN ga = 0 THEN rid ELSE rid || '-a' || ga END AS ck FROM ("
            f"  SELECT g, i, {gid} AS gid, {gid} || '_g' || i || '_a' || md5(%(r)s || '/' || g || '/' || i) AS rid, "
            f"  CASE mod(g, 3) WHEN 0 THEN {turn_status} WHEN 1 THEN {row_status} ELSE {pg_status} END AS st, "
            "  CASE WHEN mod(g, 3) = 0 AND mod(g, 5) = 0 THEN 1 ELSE 0 END AS ga0 "
            "  FROM generate_series(0, %(n)s - 1) AS g, generate_series(0, 7) AS i) AS y "
            "  CROSS JOIN LATERAL (SELECT CASE WHEN y.st = 'dispatched' THEN y.ga0 ELSE 0 END AS ga) AS z) AS x",
            p,
        )
    vacuum_analyze(url)


def vacuum_analyze(url: str) -> None:
    """Steady state for the planner and the visibility map, as autovacuum would leave it."""
    import psycopg

    with psycopg.connect(plain_url(url), autocommit=True) as conn:
        for t in ("prompt_groups", "siblings", "attempts"):
            conn.execute(f"VACUUM ANALYZE {t}")


def create_run(base: str, run_id: str, root: str, **recovery: Any) -> str:
    r = httpx.post(
        f"{base}/v1/runs", json={"run_id": run_id, "checkpoint_root": root, "recovery": {"target_level": "turn", **recovery}},
        headers={"Authorization": f"Bearer {ADMIN}"}, timeout=60,
    )
    r.raise_for_status()
    return str(r.json()["run_token"])


def plan_summary(url: str, sql: str, params: dict[str, Any]) -> str:
    """The plan's nodes, outermost first (node type and index), for the report."""
    import psycopg

    with psycopg.connect(plain_url(url)) as conn:
        plan = conn.execute("EXPLAIN (FORMAT JSON) " + sql, params).fetchone()[0][0]["Plan"]
    out: list[str] = []

    def walk(node: dict[str, Any]) -> None:
        label = node["Node Type"]
        if "Index Name" in node:
            label += f" using {node['Index Name']}"
        elif "Relation Name" in node:
            label += f" on {node['Relation Name']}"
        out.append(label)
        for child in node.get("Plans", []):
            walk(child)

    walk(plan)
    return " > ".join(out)


PG_SQL = {
    "pending_attempts": "SELECT rollout_id FROM attempts WHERE run_id = %(r)s AND rollout_id = ANY(%(ids)s) AND is_current AND status = 'dispatched'",
    "still_pending": "SELECT a.rollout_id, a.gym_attempt FROM unnest(CAST(%(ids)s AS text[])) AS t(ro) JOIN attempts a ON a.run_id = %(r)s "
    "AND a.rollout_id = t.ro WHERE a.is_current AND a.status = 'dispatched'",
}


def server_times(url: str, params: dict[str, Any], reps: int) -> dict[str, float]:
    """PostgreSQL's own planning + execution time of each query (EXPLAIN ANALYZE), median, in ms.
    The scan is the lookup query with index scans off: it reads the run's attempts and filters."""
    import psycopg

    queries = {"pending_attempts": (PG_SQL["pending_attempts"], False), "still_pending": (PG_SQL["still_pending"], False),
               "scan (SQL filter)": (PG_SQL["pending_attempts"], True)}
    out: dict[str, list[float]] = {k: [] for k in queries}
    with psycopg.connect(plain_url(url), autocommit=True) as conn:
        for _ in range(reps):
            for name, (sql, noindex) in queries.items():
                flag = "off" if noindex else "on"
                for knob in ("enable_indexscan", "enable_bitmapscan", "enable_indexonlyscan"):
                    conn.execute(f"SET {knob} = {flag}")
                plan = conn.execute("EXPLAIN (ANALYZE, FORMAT JSON) " + sql, params).fetchone()[0][0]
                out[name].append(plan["Planning Time"] + plan["Execution Time"])
    return {k: statistics.median(v) for k, v in out.items()}


# ------------------------------------------------------------------------------------------------
# Measuring


async def interleaved(fns: dict[str, Callable[[], Awaitable[Any]]], reps: int, warmup: int = 5) -> dict[str, list[float]]:
    """Each function ``reps`` times, in a fresh random order per round, so that a change of load on
    the machine hits every figure alike. Returns seconds per call."""
    for _ in range(warmup):
        for fn in fns.values():
            await fn()
    times: dict[str, list[float]] = {k: [] for k in fns}
    order = list(fns)
    rnd = random.Random(7)
    for _ in range(reps):
        rnd.shuffle(order)
        for name in order:
            t = time.perf_counter()
            await fns[name]()
            times[name].append(time.perf_counter() - t)
    return times


def med(xs: list[float]) -> float:
    return statistics.median(xs)


def ms(s: float) -> str:
    return f"{s * 1000:.3f} ms"


async def pick(engine: Any, run_id: str, n: int, *, only_dispatched: bool) -> list[tuple[str, int, str, str | None]]:
    """A fixed pseudo-random sample of live attempts: (rollout_id, gym_attempt, status, instance)."""
    from sqlalchemy import text

    extra = "AND a.status = 'dispatched' " if only_dispatched else ""
    async with engine.connect() as conn:
        rows = (
            await conn.execute(
                text(
                    "SELECT a.rollout_id, a.gym_attempt, a.status, a.gym_instance_id FROM attempts a JOIN prompt_groups g "
                    "ON g.run_id = a.run_id AND g.group_id = a.group_id WHERE a.run_id = :r AND a.is_current "
                    f"AND g.status IN ('generating', 'ready') {extra}ORDER BY md5(a.rollout_id) LIMIT :n"
                ),
                {"r": run_id, "n": n},
            )
        ).all()
    return [tuple(r) for r in rows]  # type: ignore[misc]


SCAN_SQL = (
    "SELECT a.rollout_id, a.gym_attempt, a.status FROM attempts a JOIN prompt_groups g ON g.run_id = a.run_id AND g.group_id = a.group_id "
    "WHERE a.run_id = :r AND a.is_current AND g.status IN ('generating', 'ready')"
)
LOOKUP_SQL = "SELECT rollout_id FROM attempts WHERE run_id = :r AND rollout_id = ANY(:ids) AND is_current AND status = 'dispatched'"


async def measure_lookup(pg_url: str, coord_url: str, run_id: str, token: str, asked: int, reps: int, slow_reps: int) -> dict[str, Any]:
    from sqlalchemy import text
    from sqlalchemy.ext.asyncio import create_async_engine

    from checkpoint_coordinator.rollouts import views as rollout_views
    from checkpoint_coordinator.snapshots import store as snapshots
    from checkpoint_coordinator.ledger.db import make_async_engine, read_rows, sqlalchemy_url

    engine = make_async_engine(pg_url, pool_size=2)
    # The reference scan filtered in SQL: the same question with index scans off, so PostgreSQL
    # reads the run's attempts and filters them (the "scan the run's live attempts" baseline).
    # On a lean connection (autocommit, no pre-ping) like the service's reads, so the ratio compares
    # the work, not connection overheads of one side only.
    noindex = create_async_engine(
        sqlalchemy_url(pg_url), pool_size=1, pool_pre_ping=False, isolation_level="AUTOCOMMIT",
        connect_args={"options": "-c enable_indexscan=off -c enable_bitmapscan=off -c enable_indexonlyscan=off"},
    )
    # What the lookup costs on a connection that skips the pool's pre-ping and the implicit
    # BEGIN/ROLLBACK around a single read: the same statement, two round trips fewer.
    lean = create_async_engine(sqlalchemy_url(pg_url), pool_size=1, pool_pre_ping=False, isolation_level="AUTOCOMMIT")
    http = httpx.AsyncClient(base_url=coord_url, timeout=60, headers={"Authorization": f"Bearer {token}"})
    try:
        sample = await pick(engine, run_id, asked, only_dispatched=False)
        ids = [r[0] for r in sample]
        keys = [(r[0], r[1]) for r in sample]
        wanted = set(ids)
        expect = sorted(r[0] for r in sample if r[2] == "dispatched")

        async def lookup() -> list[str]:
            return await rollout_views.pending_attempts(engine, run_id, ids)

        async def drain() -> set[tuple[str, int]]:
            return await snapshots.still_pending(engine, run_id, keys)

        async def drain_read_rows() -> set[tuple[str, int]]:
            # still_pending's own statement through ledger.db.read_rows (driver-level, binary
            # parameters, autocommit): what still_pending would cost on the lookup's read path.
            rows = await read_rows(engine, PG_SQL["still_pending"].replace("CAST(%(ids)s AS text[])", "%(ids)s::text[]"), {"r": run_id, "ids": ids})
            return {(r[0], r[1]) for r in rows} & set(keys)

        async def over_http() -> list[str]:
            r = await http.post(f"/v1/runs/{run_id}/attempts/pending", json={"rollout_ids": ids})
            r.raise_for_status()
            return list(r.json()["pending"])

        async def scan_sql() -> list[str]:
            async with noindex.connect() as conn:
                return sorted((await conn.execute(text(LOOKUP_SQL), {"r": run_id, "ids": ids})).scalars().all())

        async def lean_lookup() -> list[str]:
            async with lean.connect() as conn:
                return sorted((await conn.execute(text(LOOKUP_SQL), {"r": run_id, "ids": ids})).scalars().all())

        async def scan_python() -> list[str]:
            async with engine.connect() as conn:
                rows = (await conn.execute(text(SCAN_SQL), {"r": run_id})).all()
            return sorted(r[0] for r in rows if r[0] in wanted and r[2] == "dispatched")

        # Every method gives the same answer (a benchmark of a wrong answer proves nothing).
        answers = {"lookup": await lookup(), "http": await over_http(), "lean": await lean_lookup(), "scan_sql": await scan_sql(),
                   "scan_python": await scan_python(), "drain": sorted(k[0] for k in await drain()),
                   "drain_read_rows": sorted(k[0] for k in await drain_read_rows())}
        for name, got in answers.items():
            assert got == expect, (name, len(got), len(expect))

        async def floor() -> None:
            async with engine.connect() as conn:
                await conn.execute(text("SELECT 1"))

        times = await interleaved(
            {"pending_attempts": lookup, "still_pending": drain, "HTTP pending": over_http, "scan (SQL filter)": scan_sql,
             "SELECT 1 (floor)": floor, "lookup, lean connection": lean_lookup, "still_pending via read_rows": drain_read_rows},
            reps,
        )
        # Reading 200 000 rows into Python is much slower still; a few
        # repetitions on their own are enough, and keep its garbage out of the other figures.
        times.update(await interleaved({"scan (Python filter)": scan_python}, slow_reps, warmup=1))
        async with engine.connect() as conn:
            live = (await conn.execute(text("SELECT count(*) FROM (" + SCAN_SQL + ") s"), {"r": run_id})).scalar()
        return {"times": times, "pending": len(expect), "asked": len(ids), "live": live, "ids": ids}
    finally:
        await http.aclose()
        await engine.dispose()
        await noindex.dispose()
        await lean.dispose()


async def measure_drain(pg_url: str, runs: dict[int, str], pending_n: int, reps: int) -> dict[int, list[float]]:
    """One drain pass exactly as the snapshot runner does it, per run, interleaved."""
    from checkpoint_coordinator.gym.models import Episode
    from checkpoint_coordinator.snapshots import store as snapshots
    from checkpoint_coordinator.ledger.db import make_async_engine

    engine = make_async_engine(pg_url, pool_size=2)
    try:
        fns: dict[str, Callable[[], Awaitable[Any]]] = {}
        for size, run_id in runs.items():
            sample = await pick(engine, run_id, pending_n, only_dispatched=True)
            pending: dict[str, set[Episode]] = {}
            for rid, ga, _, inst in sample:
                pending.setdefault(str(inst), set()).add(Episode(rid, ga))

            async def one_pass(run_id: str = run_id, pending: dict[str, set[Episode]] = pending) -> int:
                keys = [(e.rollout_id, e.attempt) for eps in pending.values() for e in eps]
                still = await snapshots.still_pending(engine, run_id, keys)
                for eps in pending.values():
                    for e in list(eps):
                        if (e.rollout_id, e.attempt) not in still:
                            eps.discard(e)
                return len(still)

            got = await one_pass()
            assert got == len(sample) == pending_n, (size, got, len(sample))
            fns[str(size)] = one_pass
        times = await interleaved(fns, reps)
        return {int(k): v for k, v in times.items()}
    finally:
        await engine.dispose()


# ------------------------------------------------------------------------------------------------


def parse_sizes(s: str) -> list[int]:
    return sorted({int(x) for x in s.split(",") if x.strip()})


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--live", type=int, default=200_000, help="live attempts of the run the lookups are measured on (multiple of 8)")
    ap.add_argument("--asked", type=int, default=100, help="attempts asked about per lookup, and pending per drain pass")
    ap.add_argument("--drain-sizes", default="20000,200000", help="live siblings of the runs the drain pass is compared across")
    ap.add_argument("--reps", type=int, default=300, help="timed repetitions per figure (medians reported)")
    ap.add_argument("--slow-reps", type=int, default=7, help="repetitions of the (very slow) Python-filter scan")
    ap.add_argument("--quick", action="store_true", help="tiny sizes for a smoke test; targets are reported, not checked")
    ap.add_argument("--no-check", action="store_true", help="report the targets without turning a miss into exit status 1")
    args = ap.parse_args(argv)
    if args.quick:
        args.live, args.drain_sizes, args.reps, args.asked, args.slow_reps = 4000, "800,4000", 15, 40, 3
    sizes = parse_sizes(args.drain_sizes)
    if args.live % GROUP_SIZE or any(s % GROUP_SIZE for s in sizes):
        ap.error("sizes must be multiples of 8 (groups of 8 siblings)")
    check = not (args.quick or args.no_check)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # run the finally blocks below

    import tempfile

    pg = Postgres()
    coord = None
    try:
        coord = Coordinator(pg.url)
        root = tempfile.mkdtemp(prefix="ckptc-bench-root-")
        print(f"pending_lookup: building a run with {args.live:,} live attempts ...", flush=True)
        t = time.perf_counter()
        main_run = "bench-lookup"
        token = create_run(coord.url, main_run, root)
        build_ledger(pg.url, main_run, args.live // GROUP_SIZE)
        print(f"pending_lookup: built in {time.perf_counter() - t:.1f} s", flush=True)

        res = asyncio.run(measure_lookup(pg.url, coord.url, main_run, token, args.asked, args.reps, args.slow_reps))
        tm = {k: med(v) for k, v in res["times"].items()}
        ref = min(tm["scan (SQL filter)"], tm["scan (Python filter)"])
        print(f"pending_lookup: run of {res['live']:,} live attempts; {res['asked']} asked, {res['pending']} of them pending")
        print(f"pending_lookup: wall time per call seen by the caller, median of {args.reps} interleaved repetitions "
              f"({args.slow_reps} for the Python scan):")
        for name in ("pending_attempts", "still_pending", "HTTP pending", "scan (SQL filter)", "scan (Python filter)", "SELECT 1 (floor)",
                     "lookup, lean connection", "still_pending via read_rows"):
            print(f"pending_lookup:   {name:<28} {ms(tm[name]):>12}   scan/this = {ref / tm[name]:8.1f}x")
        r_lookup, r_drain, r_http = ref / tm["pending_attempts"], ref / tm["still_pending"], ref / tm["HTTP pending"]
        print(f"pending_lookup: ratio scan / pending_attempts = {r_lookup:.1f}, scan / still_pending = {r_drain:.1f} "
              f"(target >= {LOOKUP_TARGET:g}; reference = the cheaper scan, {ms(ref)}); scan / HTTP pending = {r_http:.1f}")
        print(f"pending_lookup: the same lookup through SQLAlchemy text() on an autocommit connection without pool pre-ping: scan / lookup = "
              f"{ref / tm['lookup, lean connection']:.1f}; still_pending's statement through ledger.db.read_rows: "
              f"{ref / tm['still_pending via read_rows']:.1f}")
        params = {"r": main_run, "ids": res["ids"]}
        srv = server_times(pg.url, params, max(5, args.reps // 10))
        print("pending_lookup: PostgreSQL's own time (EXPLAIN ANALYZE planning + execution, median):")
        for name, t_ms in srv.items():
            print(f"pending_lookup:   {name:<28} {t_ms:9.3f} ms   scan/this = {srv['scan (SQL filter)'] / t_ms:8.1f}x")
        print("pending_lookup: plan of pending_attempts: " + plan_summary(pg.url, PG_SQL["pending_attempts"], params))
        print("pending_lookup: plan of still_pending:    " + plan_summary(pg.url, PG_SQL["still_pending"], params))

        # Drain pass across live counts: build every other size in ascending order, measuring each
        # right after its build, then all of them interleaved.
        runs: dict[int, str] = {}
        sequential: dict[int, float] = {}
        for size in sizes:
            if size == args.live:
                runs[size] = main_run
            else:
                run_id = f"bench-drain-{size}"
                create_run(coord.url, run_id, root)
                build_ledger(pg.url, run_id, size // GROUP_SIZE)
                runs[size] = run_id
            sequential[size] = med(asyncio.run(measure_drain(pg.url, {size: runs[size]}, args.asked, args.reps))[size])
        both = asyncio.run(measure_drain(pg.url, runs, args.asked, args.reps))
        lo, hi = sizes[0], sizes[-1]
        d_lo, d_hi = med(both[lo]), med(both[hi])
        print(f"pending_lookup: drain pass over {args.asked} pending attempts (runner's loop body, median of {args.reps}):")
        for size in sizes:
            print(f"pending_lookup:   {size:>9,} live siblings: {ms(med(both[size])):>12} interleaved, {ms(sequential[size]):>12} right after its build")
        ratio_il, ratio_seq = d_hi / d_lo, sequential[hi] / sequential[lo]
        print(f"pending_lookup: drain ratio {hi:,} / {lo:,} live = {ratio_il:.2f} interleaved, {ratio_seq:.2f} measured after each build "
              f"(target <= {DRAIN_TARGET:g})")
        ok = min(r_lookup, r_drain) >= LOOKUP_TARGET and ratio_il <= DRAIN_TARGET
        print(f"pending_lookup: {'targets met' if ok else 'TARGET MISSED'}" + ("" if check else " (not checked: --quick / --no-check)"))
        summary = {"live": res["live"], "asked": res["asked"], "pending": res["pending"], "medians_ms": {k: v * 1000 for k, v in tm.items()},
                   "server_ms": srv, "ratio_lean": ref / tm["lookup, lean connection"],
                   "ratio_still_pending_read_rows": ref / tm["still_pending via read_rows"],
                   "ratio_lookup": r_lookup, "ratio_still_pending": r_drain, "ratio_http": r_http,
                   "drain_ms": {s: med(both[s]) * 1000 for s in sizes}, "drain_ratio": ratio_il, "drain_ratio_sequential": ratio_seq}
        print("pending_lookup: json " + json.dumps(summary, sort_keys=True))
        return 0 if ok or not check else 1
    finally:
        if coord is not None:
            coord.close()
        pg.close()


if __name__ == "__main__":
    raise SystemExit(main())
