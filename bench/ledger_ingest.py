"""Admit, dispatch and seal 200 000 siblings (25 000 groups of 8) through the HTTP API, and COPY
the same number of rows into a bare table in the same run. Target: transitions/s ÷ COPY rows/s
≥ 0.15, each of the three transitions counted as one row. Also reports the service's peak RSS.

    python bench/ledger_ingest.py [--groups 25000] [--batch-groups 1000] [--concurrency 2]
"""

from __future__ import annotations

import argparse
import asyncio
import io
import sys
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import ADMIN, Coordinator, Postgres, mib  # noqa: E402


def copy_rate(url: str, rows: int) -> float:
    import psycopg

    buf = io.StringIO()
    for i in range(rows):
        buf.write(f"run\tg{i // 8}\t{i % 8}\tg{i // 8}_g{i % 8}_a{i:032x}\tsealed\n")
    data = buf.getvalue()
    with psycopg.connect(url.replace("postgresql+psycopg", "postgresql")) as conn:
        conn.execute("CREATE TABLE bench_copy (run_id text, group_id text, generation_index int, rollout_id text, status text)")
        t = time.perf_counter()
        with conn.cursor().copy("COPY bench_copy FROM STDIN") as cp:
            cp.write(data)
        conn.commit()
        dt = time.perf_counter() - t
        conn.execute("DROP TABLE bench_copy")
        conn.commit()
    return rows / dt


async def ingest(base: str, groups: int, batch: int, concurrency: int) -> tuple[float, int]:
    async with httpx.AsyncClient(base_url=base, timeout=300) as c:
        r = await c.post("/v1/runs", json={"run_id": "bench", "checkpoint_root": "/tmp/bench", "recovery": {"target_level": "sibling"}},
                         headers={"Authorization": f"Bearer {ADMIN}"})
        r.raise_for_status()
        h = {"Authorization": f"Bearer {r.json()['run_token']}"}
        sem = asyncio.Semaphore(concurrency)
        transitions = 0

        async def one(start: int) -> None:
            nonlocal transitions
            async with sem:
                body = {"groups": [{"group_id": f"g{k}", "prompt_ref": {"sample_id": k, "task_name": "bench"}, "task_digest": f"d{k}",
                                    "expected_generations": 8} for k in range(start, min(start + batch, groups))]}
                a = (await c.post("/v1/runs/bench/groups/admit", json=body, headers=h))
                a.raise_for_status()
                rows = [row for g in a.json()["groups"] for row in g["rows"]]
                d = await c.post("/v1/runs/bench/attempts/dispatch", json={"dispatch_id": f"d{start}", "instance_id": "bench/replica-0",
                                                                            "rollout_ids": [x["rollout_id"] for x in rows]}, headers=h)
                d.raise_for_status()
                s = await c.post("/v1/runs/bench/attempts/sealed", json={"rows": [
                    {"rollout_id": x["rollout_id"], "receipt": {"rollout_id": x["capture_key"]}, "staging_keys": [], "reward": 1.0} for x in rows]}, headers=h)
                s.raise_for_status()
                transitions += 3 * len(rows)

        t = time.perf_counter()
        await asyncio.gather(*(one(s) for s in range(0, groups, batch)))
        return time.perf_counter() - t, transitions


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--groups", type=int, default=25_000)
    ap.add_argument("--batch-groups", type=int, default=1000)
    ap.add_argument("--concurrency", type=int, default=2)
    args = ap.parse_args()
    pg = Postgres()
    coord = Coordinator(pg.url)
    try:
        dt, transitions = asyncio.run(ingest(coord.url, args.groups, args.batch_groups, args.concurrency))
        siblings = args.groups * 8
        api_rate = transitions / dt
        ref = copy_rate(pg.url, siblings)
        print(f"ledger_ingest: {siblings} siblings, {transitions} transitions in {dt:.2f} s = {api_rate:,.0f} transitions/s")
        print(f"ledger_ingest: COPY of {siblings} rows into a bare table = {ref:,.0f} rows/s")
        print(f"ledger_ingest: ratio = {api_rate / ref:.3f} (target >= 0.15)")
        samples = coord.rss_samples
        early = max(samples[: max(1, len(samples) // 4)]) if samples else 0
        print(f"ledger_ingest: service peak RSS {mib(coord.peak_rss)} (first quarter peak {mib(early)})")
        return 0 if api_rate / ref >= 0.15 else 1
    finally:
        coord.close()
        pg.close()


if __name__ == "__main__":
    raise SystemExit(main())
