"""Benchmark: a run's accounting read (``GET /v1/runs/{run}/accounting``) over 1 000 000 siblings.

The accounting (docs/accounting.md) is read from the ledger alone, in one read-only snapshot:
the run's admissions, its groups by status, the groups its restores rewound, one aggregate pass
over its attempts (rollout-seconds by fate and reason), the sealed rows of its abandoned groups,
and what its restores recorded (``accounting.store.run_accounting``). It reads every attempt of
the run, so it is compared with the cheapest read that also touches every one of them, measured
in the same run: ``SELECT count(*) FROM attempts WHERE run_id = :r``.

The run is built straight in an embedded PostgreSQL with set-based SQL, then vacuumed and
analysed as autovacuum leaves a live run: 125 000 groups of 8 (a third each turn, sibling and
prompt_group level; inserted group after group, as admits do), one admission per admit batch of
1 000 groups; 25 % of the groups finalized and 10 % ready (all sealed), 5 % abandoned (three
sealed rows, the others abandoned), 60 % generating (five sealed, two dispatched and in flight,
one never sent); dispatch and end times spread over 12 hours; about 23 000 earlier, non-current
attempts (failed on data or transport, sealed and rerun, ended as stragglers or by a restore);
three applied restores with their ``restore_work`` items and 500 rewound groups each (admitted,
so the buckets add up).

Timed alternately, ``--rounds`` rounds after a warm-up, medians and spread: (a) ``run_accounting``
end to end through the service's engine, (b) the reference count on the same engine. The ratio
is (a) ÷ (b). ``--explain`` prints the accounting's statements with EXPLAIN (ANALYZE, BUFFERS).

Target (issue): the accounting read is at most 5x the count(*).

    python bench/accounting_read.py [--siblings 1000000] [--rounds 9] [--explain] [--no-check] [--quick]

Exit status 1 when the target is missed at full size (``--no-check`` only reports).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import Postgres  # noqa: E402

from checkpoint_coordinator.accounting import store as accounting_store  # noqa: E402
from checkpoint_coordinator.accounting.store import run_accounting  # noqa: E402
from checkpoint_coordinator.domain.config import load_recovery_config  # noqa: E402
from checkpoint_coordinator.ledger.db import fetch, make_async_engine  # noqa: E402

GROUP_SIZE = 8
ADMIT_BATCH = 1_000
RESTORES = 3
REWOUND_PER_RESTORE = 500
INSTANCES = 4
TARGET = 5.0
COUNT_SQL = "SELECT count(*) FROM attempts WHERE run_id = %(r)s"


def plain_url(url: str) -> str:
    return url.replace("postgresql+psycopg", "postgresql")


# ------------------------------------------------------------------------------------------------
# Building the run

# Every sibling (g, i), group after group, as admits insert them: a group's rows share a page or
# two (a dispatch and a seal are heap-only updates, so they stay there).
_SIBLINGS = "(SELECT k / 8 AS g, mod(k, 8) AS i FROM generate_series(0, %(n)s * 8 - 1) AS k) AS s"
# Group kind by g % 20: 0-4 finalized, 5-6 ready, 7 abandoned, 8-19 generating.
_GROUP_STATUS = (
    "CASE WHEN mod(g, 20) < 5 THEN 'finalized' WHEN mod(g, 20) < 7 THEN 'ready' WHEN mod(g, 20) = 7 THEN 'abandoned' "
    "ELSE 'generating' END"
)
# The current attempt of sibling i: finalized and ready groups all sealed; abandoned groups three
# sealed (their work is redone/abandoned), four abandoned after dispatch, one never sent;
# generating groups five sealed, two in flight, one never sent.
_CURRENT_STATUS = (
    "CASE WHEN mod(g, 20) < 7 THEN 'sealed' "
    "WHEN mod(g, 20) = 7 THEN CASE WHEN i < 3 THEN 'sealed' ELSE 'abandoned' END "
    "WHEN i < 5 THEN 'sealed' WHEN i < 7 THEN 'dispatched' ELSE 'reserved' END"
)
# Never dispatched: the last sibling of generating (reserved) and abandoned groups.
_NEVER_SENT = "(mod(g, 20) >= 7 AND i = 7)"
# Earlier attempts of a sibling, no longer current: (filter, status, failure_class, end_reason, tag).
_EARLIER = (
    ("mod(g, 10) = 3 AND i = 1", "'failed'", "CASE WHEN mod(g, 20) = 3 THEN 'data' ELSE 'transport' END", "NULL", "f"),
    ("mod(g, 25) = 4 AND i = 2", "'sealed'", "NULL", "NULL", "s"),
    ("mod(g, 50) = 9 AND i = 4", "'abandoned'", "NULL", "'straggler'", "t"),
    ("mod(g, 40) = 11 AND i = 6", "'abandoned'", "NULL", "'retired_by_restore'", "b"),
)


def build(url: str, run_id: str, n_groups: int) -> dict[str, int]:
    """The run, its groups, siblings and attempts, admissions and restores. Returns what the
    accounting must find."""
    import psycopg

    cfg = load_recovery_config({"target_level": "turn"}).public_dict()
    gid = "'g' || lpad(g::text, 7, '0')"
    p: dict[str, Any] = {"r": run_id, "n": n_groups, "k": INSTANCES, "c": json.dumps(cfg)}
    # Dispatch times spread over 12 hours before now, one sibling after the other; an ended
    # attempt ran 20-320 s; an attempt in flight was sent within the last 10 minutes.
    span = "(43200.0 / (%(n)s * 8))"
    with psycopg.connect(plain_url(url)) as conn:
        conn.execute("SET enable_nestloop = off")  # nothing is analysed while building
        conn.execute(
            "INSERT INTO runs (run_id, config, checkpoint_root, token_hash) VALUES (%(r)s, CAST(%(c)s AS jsonb), '/tmp/bench', 'x')", p
        )
        conn.execute(
            "INSERT INTO prompt_groups (run_id, group_id, prompt_ref, task_digest, restore_level, expected_generations, status, "
            "abandon_reason, created_at, ended_at) "
            f"SELECT %(r)s, {gid}, jsonb_build_object('sample_id', g, 'task_name', 'math'), 'sha256:' || g, "
            "(ARRAY['turn', 'sibling', 'prompt_group'])[mod(g, 3) + 1], 8, st, "
            "CASE WHEN st = 'abandoned' THEN CASE WHEN mod(g, 40) < 20 THEN 'trainer' ELSE 'data_attempts_exhausted' END END, "
            f"now() - interval '12 hours' + make_interval(secs => g * 8 * {span}), "
            f"CASE WHEN st IN ('finalized', 'abandoned') THEN now() - interval '12 hours' + make_interval(secs => (g * 8 + 400) * {span}) END "
            f"FROM (SELECT g, {_GROUP_STATUS} AS st FROM generate_series(0, %(n)s - 1) AS g) AS x",
            p,
        )
        conn.execute(
            f"INSERT INTO siblings (run_id, group_id, generation_index, row_attempts_used) SELECT %(r)s, {gid}, i, 1 "
            f"FROM {_SIBLINGS}",
            p,
        )
        # Earlier, non-current attempts (about 2 % of the rows) go after the others.
        earlier = " ".join(
            f"UNION ALL SELECT g, i, {st}, false, {fc}, {er}, '_{tag}' FROM {_SIBLINGS} WHERE {cond}"
            for cond, st, fc, er, tag in _EARLIER
        )
        conn.execute(
            "INSERT INTO attempts (run_id, group_id, generation_index, rollout_id, gym_instance_id, group_attempt, status, is_current, "
            "receipt, reward, staging_keys, failure_class, dispatch_id, policy_version, end_reason, created_at, dispatched_at, ended_at) "
            f"SELECT %(r)s, {gid}, i, rid, CASE WHEN sent THEN 'bench/replica-' || mod(g, %(k)s) END, 0, st, cur, "
            "CASE WHEN st = 'sealed' THEN jsonb_build_object('rollout_id', rid) END, CASE WHEN st = 'sealed' THEN 1.0 END, "
            "CASE WHEN st = 'sealed' THEN ARRAY['tq/' || rid || '/0'] END, fc, "
            "CASE WHEN sent THEN 'd' || (g / 100) END, CASE WHEN sent THEN g / 1000 END, er, t0, "
            "CASE WHEN NOT sent THEN NULL WHEN st = 'dispatched' THEN now() - make_interval(secs => 1 + mod(g * 31 + i * 7, 600)) "
            "ELSE t0 END, "
            "CASE WHEN st IN ('sealed', 'failed', 'abandoned') AND sent THEN t0 + make_interval(secs => 20 + mod(g * 7919 + i * 104729, 300)) END "
            f"FROM (SELECT g, i, st, cur, fc, er, {gid} || '_g' || i || '_a' || md5(%(r)s || '/' || g || '/' || i) || tag AS rid, "
            f"  st <> 'reserved' AND NOT (cur AND {_NEVER_SENT}) AS sent, "
            f"  now() - interval '12 hours' + make_interval(secs => (g * 8 + i) * {span}) - CASE WHEN cur THEN interval '0' ELSE interval '10 minutes' END AS t0 "
            f"  FROM (SELECT g, i, {_CURRENT_STATUS} AS st, true AS cur, NULL::text AS fc, NULL::text AS er, '' AS tag "
            f"        FROM {_SIBLINGS} {earlier}) AS y) AS x",
            p,
        )
        # One admission per admit batch; the groups the restores rewound were admitted too.
        rewound = RESTORES * REWOUND_PER_RESTORE
        conn.execute(
            "INSERT INTO group_admissions (run_id, groups, admitted_at) "
            "SELECT %(r)s, least(%(b)s, %(n)s - b * %(b)s), now() - interval '12 hours' + make_interval(secs => b) "
            "FROM generate_series(0, (%(n)s - 1) / %(b)s) AS b",
            {**p, "b": ADMIT_BATCH},
        )
        for k in range(RESTORES):
            q = {"r": run_id, "rid": f"restore-{k}", "s": f"s{k}", "m": REWOUND_PER_RESTORE, "k": k}
            conn.execute("INSERT INTO group_admissions (run_id, groups, admitted_at) VALUES (%(r)s, %(m)s, now() - interval '6 hours')", q)
            conn.execute(
                "INSERT INTO restores (run_id, restore_id, snapshot_id, state, with_gym_state, result, created_at, ended_at) "
                "VALUES (%(r)s, %(rid)s, %(s)s, 'applied', true, '{\"answer\": {\"accounting\": {}}}'::jsonb, "
                "now() - make_interval(hours => 9 - 3 * %(k)s), now() - make_interval(hours => 9 - 3 * %(k)s))",
                q,
            )
            conn.execute(
                "INSERT INTO restore_rewound_groups (run_id, restore_id, group_id, admitted_at) "
                "SELECT %(r)s, %(rid)s, 'x' || %(k)s || '-' || lpad(j::text, 6, '0'), now() - interval '10 hours' "
                "FROM generate_series(0, %(m)s - 1) AS j",
                q,
            )
            # Per instance and level: carried (kept: the attempts stay in the ledger), and redone
            # for each reason a restore records; the failed ones were already thrown away.
            conn.execute(
                "INSERT INTO restore_work (run_id, restore_id, item, instance_id, restore_level, fate, reason, found, kept, attempts, seconds) "
                "SELECT %(r)s, %(rid)s, row_number() OVER ()::int, 'bench/replica-' || inst, lvl, f.fate, f.reason, f.found, f.kept, "
                "100 + inst * 10 + f.n, 1000.0 * (1 + inst) + 10 * f.n "
                "FROM generate_series(0, 3) AS inst, unnest(ARRAY['turn', 'sibling', 'prompt_group']) AS lvl, "
                "(VALUES ('carried', NULL, true, true, 1), ('redone', 'after_cut', true, false, 2), "
                "('redone', 'retired_by_restore', true, false, 3), ('redone', 'rerun', true, false, 4), "
                "('redone', 'restarted', true, false, 5), ('redone', 'failed', false, false, 6)) AS f(fate, reason, found, kept, n)",
                q,
            )
        ((attempts,),) = conn.execute("SELECT count(*) FROM attempts WHERE run_id = %(r)s", p).fetchall()
        ((in_flight,),) = conn.execute("SELECT count(*) FROM attempts WHERE run_id = %(r)s AND status = 'dispatched'", p).fetchall()
        ((holding,),) = conn.execute(
            "SELECT (SELECT count(*) FROM attempts WHERE run_id = %(r)s AND status <> 'reserved') "
            "+ (SELECT sum(attempts) FROM restore_work WHERE run_id = %(r)s AND NOT kept AND reason IS DISTINCT FROM 'after_cut')",
            p,
        ).fetchall()
    vacuum_analyze(url)
    return {"groups": n_groups, "siblings": n_groups * GROUP_SIZE, "attempts": int(attempts), "in_flight": int(in_flight), "rewound": rewound,
            "with_work": int(holding)}


def vacuum_analyze(url: str) -> None:
    """Steady state for the planner and the visibility map, as autovacuum would leave it."""
    import psycopg

    with psycopg.connect(plain_url(url), autocommit=True) as conn:
        for t in ("prompt_groups", "siblings", "attempts", "group_admissions", "restores", "restore_rewound_groups", "restore_work"):
            conn.execute(f"VACUUM ANALYZE {t}")


def table_sizes(url: str) -> str:
    import psycopg

    with psycopg.connect(plain_url(url)) as conn:
        rows = conn.execute(
            "SELECT c.relname, pg_relation_size(c.oid) FROM pg_class c WHERE c.relname IN ('attempts', 'uq_attempts_run_id_rollout_id', "
            "'uq_attempts_current_per_sibling', 'prompt_groups') ORDER BY 1"
        ).fetchall()
    return ", ".join(f"{name} {size / (1 << 20):.0f} MiB" for name, size in rows)


# ------------------------------------------------------------------------------------------------
# Measuring


async def count_attempts(engine: Any, run_id: str) -> int:
    async with engine.connect() as conn:
        ((n,),) = await fetch(conn, COUNT_SQL, {"r": run_id})
    return int(n)


async def measure(engine: Any, run_id: str, rounds: int) -> dict[str, list[float]]:
    """(a) and (b) alternately, the order swapped every round, after one warm-up of each."""
    await run_accounting(engine, run_id)
    await count_attempts(engine, run_id)
    times: dict[str, list[float]] = {"accounting": [], "count": []}
    for k in range(rounds):
        order = ("accounting", "count") if k % 2 == 0 else ("count", "accounting")
        for name in order:
            t = time.perf_counter()
            if name == "accounting":
                await run_accounting(engine, run_id)
            else:
                await count_attempts(engine, run_id)
            times[name].append(time.perf_counter() - t)
    return times


def explain(url: str, run_id: str) -> None:
    """EXPLAIN (ANALYZE, BUFFERS) of the accounting's two statements over attempts and of the count."""
    import psycopg

    with psycopg.connect(plain_url(url), autocommit=True) as conn:
        for name, sql in (("live work", accounting_store._LIVE_WORK), ("sealed in abandoned", accounting_store._SEALED_IN_ABANDONED),
                          ("count(*)", COUNT_SQL)):
            lines = [r[0] for r in conn.execute("EXPLAIN (ANALYZE, BUFFERS) " + sql, {"r": run_id}).fetchall()]
            print(f"accounting_read: EXPLAIN (ANALYZE, BUFFERS) {name}:", flush=True)
            for line in lines:
                print(f"accounting_read:   {line}", flush=True)


def check_answer(acct: dict[str, Any], built: dict[str, int]) -> None:
    """The read found what was built (a read that skipped rows would be fast and wrong)."""
    p, w = acct["prompts"], acct["work"]
    assert p["conserved"] and p["admitted"] == built["groups"] + built["rewound"], p
    assert p["buckets"]["rewound"] == built["rewound"], p
    n_attempts = sum(w["attempts_by_fate"].values())
    assert w["attempts_by_fate"]["in_flight"] == built["in_flight"], w
    assert n_attempts == built["with_work"], (n_attempts, built)
    assert len(acct["restores"]) == RESTORES, acct["restores"]


def ms(x: float) -> str:
    return f"{x * 1000:.1f} ms"


async def main_async(siblings: int, rounds: int, check: bool, show_plans: bool) -> int:
    pg = Postgres()
    engine = make_async_engine(pg.url)
    run_id = f"bench-acct-{siblings}"
    try:
        print(f"accounting_read: load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores", flush=True)
        print(f"accounting_read: building a run of {siblings:,} siblings ...", flush=True)
        t = time.perf_counter()
        built = build(pg.url, run_id, siblings // GROUP_SIZE)  # synchronous: nothing else runs meanwhile
        print(
            f"accounting_read: built {built['siblings']:,} siblings ({built['groups']:,} groups, {built['attempts']:,} attempts, "
            f"{built['in_flight']:,} in flight), vacuumed and analysed in {time.perf_counter() - t:.1f}s; {table_sizes(pg.url)}",
            flush=True,
        )
        acct = await run_accounting(engine, run_id)
        check_answer(acct, built)
        n = await count_attempts(engine, run_id)
        assert n == built["attempts"], (n, built)
        print(
            f"accounting_read: answer: prompts {acct['prompts']['buckets']}, attempts by fate {acct['work']['attempts_by_fate']}",
            flush=True,
        )
        times = await measure(engine, run_id, rounds)
        if show_plans:
            explain(pg.url, run_id)
    finally:
        await engine.dispose()
        pg.close()
    med = {k: statistics.median(v) for k, v in times.items()}
    for name, label in (("accounting", "run_accounting (the accounting read)"), ("count", "SELECT count(*) of the run's attempts")):
        v = times[name]
        print(f"accounting_read: {label:<40} median {ms(med[name])}  (min {ms(min(v))}, max {ms(max(v))}, {len(v)} rounds)", flush=True)
    ratio = med["accounting"] / med["count"]
    per_round = [a / c for a, c in zip(times["accounting"], times["count"])]
    print(
        f"accounting_read: ratio accounting / count(*) = {ratio:.2f} (per round {min(per_round):.2f}-{max(per_round):.2f}; "
        f"target <= {TARGET:.0f}); load average {os.getloadavg()[0]:.1f}",
        flush=True,
    )
    ok = ratio <= TARGET
    full = siblings >= 1_000_000
    print("accounting_read: " + ("target met" if ok else "TARGET MISSED") + ("" if check and full else " (not checked: small size / --no-check)"))
    summary = {"siblings": siblings, "attempts": built["attempts"], "median_s": med, "times_s": times, "ratio": ratio}
    print("accounting_read: json " + json.dumps(summary, sort_keys=True))
    return 0 if ok or not (check and full) else 1


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--siblings", type=int, default=1_000_000, help="siblings in the run (a multiple of 8)")
    ap.add_argument("--rounds", type=int, default=9, help="alternating rounds of both measurements")
    ap.add_argument("--explain", action="store_true", help="also print EXPLAIN (ANALYZE, BUFFERS) of the statements over attempts")
    ap.add_argument("--no-check", action="store_true", help="report the target without turning a miss into exit status 1")
    ap.add_argument("--quick", action="store_true", help="a small run for a smoke test (24 000 siblings, 3 rounds); nothing checked")
    args = ap.parse_args(argv)
    if args.quick:
        args.siblings, args.rounds = 24_000, 3
    if args.siblings <= 0 or args.siblings % GROUP_SIZE or args.siblings // GROUP_SIZE < 200:
        ap.error("--siblings must be a multiple of 8, at least 1 600")
    if args.rounds < 1:
        ap.error("--rounds must be at least 1")
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # run the finally blocks: stop PostgreSQL
    return asyncio.run(main_async(args.siblings, args.rounds, check=not (args.quick or args.no_check), show_plans=args.explain))


if __name__ == "__main__":
    raise SystemExit(main())
