"""Admit, dispatch and seal 200 000 siblings (25 000 groups of 8) through the HTTP API, and COPY
the same number of rows into a bare table in the same run. Target: transitions/s ÷ COPY rows/s
≥ 0.15, each of the three transitions counted as one row. Also reports the service's peak RSS and
the benchmark client's own CPU time (it shares the machine with the coordinator and PostgreSQL, so
it encodes and decodes with pydantic-core's native JSON, as a lean trainer client would).

Batches are what a trainer sends: 1 000 prompt groups of 8 (8 000 rows) per admit, and the same
rows in one dispatch and one seal call; two batches in flight.

    python bench/ledger_ingest.py [--groups 25000] [--batch-groups 1000] [--concurrency 2] [--quick]
"""

from __future__ import annotations

import argparse
import asyncio
import io
import os
import signal
import statistics
import sys
import time
from pathlib import Path

import httpx
import psutil
from pydantic_core import from_json, to_json

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import ADMIN, Coordinator, Postgres, mib  # noqa: E402


def cpu_seconds(procs: list[psutil.Process]) -> float:
    total = 0.0
    for p in procs:
        try:
            t = p.cpu_times()
            total += t.user + t.system
        except psutil.Error:
            pass
    return total


def postgres_processes(pgdata: Path) -> list[psutil.Process]:
    """The embedded server's postmaster and its children (backends, WAL writer, checkpointer)."""
    for p in psutil.process_iter(["name", "cmdline"]):
        try:
            if str(pgdata) in " ".join(p.info["cmdline"] or []):
                return [p, *p.children(recursive=True)]
        except psutil.Error:
            continue
    return []


def copy_rate(url: str, rows: int, repeats: int = 3) -> float:
    """Rows/s of COPY into a bare table (no key, no index): the median of ``repeats`` runs, since a
    single COPY lasts a fraction of a second and on a shared machine one run can be far off."""
    import psycopg

    buf = io.StringIO()
    for i in range(rows):
        buf.write(f"run\tg{i // 8}\t{i % 8}\tg{i // 8}_g{i % 8}_a{i:032x}\tsealed\n")
    data = buf.getvalue()
    rates = []
    with psycopg.connect(url.replace("postgresql+psycopg", "postgresql")) as conn:
        for _ in range(repeats):
            conn.execute("CREATE TABLE bench_copy (run_id text, group_id text, generation_index int, rollout_id text, status text)")
            conn.commit()
            t = time.perf_counter()
            with conn.cursor().copy("COPY bench_copy FROM STDIN") as cp:
                cp.write(data)
            conn.commit()
            rates.append(rows / (time.perf_counter() - t))
            conn.execute("DROP TABLE bench_copy")
            conn.commit()
    return statistics.median(rates)


JSON = {"Content-Type": "application/json"}


def register_placeholder(url: str, run_id: str, instance_id: str) -> None:
    """The run's Gym instance, straight in the ledger (dispatch refuses an unregistered one):
    this bench measures the ledger, with no Gym deployment to discover."""
    import psycopg

    with psycopg.connect(url.replace("postgresql+psycopg", "postgresql")) as conn:
        conn.execute(
            "INSERT INTO gym_instances (run_id, instance_id, servers, control_token, discovered_at) VALUES (%s, %s, '{}', 'placeholder', now())",
            (run_id, instance_id),
        )


async def ingest(base: str, db_url: str, groups: int, batch: int, concurrency: int) -> tuple[float, int, float]:
    """Returns (wall seconds, transitions, CPU seconds this client process used meanwhile)."""
    async with httpx.AsyncClient(base_url=base, timeout=300) as c:
        r = await c.post("/v1/runs", json={"run_id": "bench", "checkpoint_root": "/tmp/bench", "recovery": {"target_level": "sibling"}},
                         headers={"Authorization": f"Bearer {ADMIN}"})
        r.raise_for_status()
        await asyncio.to_thread(register_placeholder, db_url, "bench", "bench/replica-0")
        h = {"Authorization": f"Bearer {r.json()['run_token']}", **JSON}
        sem = asyncio.Semaphore(concurrency)
        transitions = 0

        async def post(path: str, body: object) -> object:
            resp = await c.post(path, content=to_json(body), headers=h)
            if resp.status_code != 200:
                raise RuntimeError(f"{path}: {resp.status_code} {resp.text[:500]}")
            return from_json(resp.content)

        async def one(start: int) -> None:
            nonlocal transitions
            async with sem:
                body = {"groups": [{"group_id": f"g{k}", "prompt_ref": {"sample_id": k, "task_name": "bench"}, "task_digest": f"d{k}",
                                    "expected_generations": 8} for k in range(start, min(start + batch, groups))]}
                a = await post("/v1/runs/bench/groups/admit", body)
                rows = [row for g in a["groups"] for row in g["rows"]]
                await post("/v1/runs/bench/attempts/dispatch", {"dispatch_id": f"d{start}", "instance_id": "bench/replica-0",
                                                                "rollout_ids": [x["rollout_id"] for x in rows]})
                s = await post("/v1/runs/bench/attempts/sealed", {"rows": [
                    {"rollout_id": x["rollout_id"], "receipt": {"rollout_id": x["capture_key"]}, "staging_keys": [], "reward": 1.0} for x in rows]})
                assert len(s["rows"]) == len(rows) and len(s["ready_groups"]) == len(a["groups"]), "every group must be ready"
                transitions += 3 * len(rows)

        cpu = time.process_time()
        t = time.perf_counter()
        await asyncio.gather(*(one(s) for s in range(0, groups, batch)))
        return time.perf_counter() - t, transitions, time.process_time() - cpu


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--groups", type=int, default=25_000)
    ap.add_argument("--batch-groups", type=int, default=1000)
    ap.add_argument("--concurrency", type=int, default=2)
    ap.add_argument("--quick", action="store_true", help="tiny size for a smoke test; the target is reported, not checked")
    args = ap.parse_args()
    if args.quick:
        args.groups, args.batch_groups = 400, 100
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # run the finally block below
    pg = Postgres()
    coord = None
    try:
        coord = Coordinator(pg.url)
        service = psutil.Process(coord.proc.pid)
        load0 = os.getloadavg()[0]
        cpu0, pg_cpu0 = cpu_seconds([service]), cpu_seconds(postgres_processes(pg.dir))
        dt, transitions, client_cpu = asyncio.run(ingest(coord.url, pg.url, args.groups, args.batch_groups, args.concurrency))
        # Backends started meanwhile count in full (they started at zero).
        service_cpu = cpu_seconds([service]) - cpu0
        pg_cpu = cpu_seconds(postgres_processes(pg.dir)) - pg_cpu0
        siblings = args.groups * 8
        api_rate = transitions / dt
        ref = copy_rate(pg.url, siblings)
        print(f"ledger_ingest: {siblings} siblings, {transitions} transitions in {dt:.2f} s = {api_rate:,.0f} transitions/s")
        print(f"ledger_ingest: COPY of {siblings} rows into a bare table = {ref:,.0f} rows/s (median of 3)")
        print(f"ledger_ingest: ratio = {api_rate / ref:.3f} (target >= 0.15)")
        print(f"ledger_ingest: CPU during the {dt:.2f} s: coordinator {service_cpu:.2f} s, PostgreSQL {pg_cpu:.2f} s, "
              f"benchmark client {client_cpu:.2f} s (uptime load {load0:.2f} at start, {os.getloadavg()[0]:.2f} at the end)")
        samples = coord.rss_samples
        early = max(samples[: max(1, len(samples) // 4)]) if samples else 0
        print(f"ledger_ingest: service peak RSS {mib(coord.peak_rss)} (first quarter peak {mib(early)})")
        return 0 if api_rate / ref >= 0.15 or args.quick else 1
    finally:
        if coord is not None:
            coord.close()
        pg.close()


if __name__ == "__main__":
    raise SystemExit(main())
