"""Delivers the durable retire/forget outbox to Gym (recovery-ledger.md section 7).

A retire that succeeds on every participant is followed at once by a forget of that rollout (it
is never dispatched again under its id). A refused forget gets the retire again, then the forget;
one still refused stays queued with its retire. Failures back off exponentially.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence

from sqlalchemy.ext.asyncio import AsyncEngine

from ..gym.models import Episode
from ..gym_runtime import GymClients, load_topology
from ..ledger import outbox as repo
from ..ledger.runs import get_run

log = logging.getLogger(__name__)


class OutboxDeliverer:
    def __init__(self, engine: AsyncEngine, gym: GymClients, *, base_backoff_s: float = 0.5, max_backoff_s: float = 60.0) -> None:
        self.engine = engine
        self.gym = gym
        self.base_backoff_s = base_backoff_s
        self.max_backoff_s = max_backoff_s

    async def deliver_run(self, run_id: str, *, ignore_schedule: bool = False, instance_ids: Sequence[str] | None = None) -> dict[str, int]:
        """Deliver everything owed for one run (retires, then forgets). Returns counts delivered.

        ``ignore_schedule`` sends items still in backoff too: before a prepare, every queued retire
        gets another try (section 7: failed retires are retried again before the next prepare).
        """
        async with self.engine.connect() as conn:
            run = await get_run(conn, run_id)
            topology = await load_topology(conn, run_id)
        client = self.gym.for_run(run_id, run.config)
        delivered = {"retire": 0, "forget": 0}
        targets = instance_ids if instance_ids is not None else sorted(topology)
        for iid in targets:
            inst = topology.get(iid)
            if inst is None:
                continue  # items for an unregistered instance wait until it is registered
            delivered["retire"] += await self._retires(run_id, inst, client, ignore_schedule)
            delivered["forget"] += await self._forgets(run_id, inst, client, ignore_schedule)
        return delivered

    async def _retires(self, run_id: str, inst, client, ignore_schedule: bool) -> int:  # type: ignore[no-untyped-def]
        total = 0
        while True:
            async with self.engine.begin() as conn:
                items = await repo.claim(conn, run_id, inst.instance_id, "retire", ignore_schedule=ignore_schedule)
                if not items:
                    return total
                by_ep = {}
                for it in items:
                    by_ep.setdefault(Episode(it.rollout_id, int(it.gym_attempt or 0)), []).append(it)
                # Retire with the checkpoint id the item was queued with ('retire' while idle).
                results = []
                for cid in sorted({it.checkpoint_id for it in items}):
                    eps = [ep for ep, its in by_ep.items() if its[0].checkpoint_id == cid]
                    results.extend(await client.retire(inst, eps, cid))
                ok_items, failed = [], []
                for b in results:
                    its = [it for ep in b.episodes for it in by_ep[ep]]
                    (ok_items if b.ok else failed).append((its, b.failure))
                done = [it for its, _ in ok_items for it in its]
                await repo.mark_delivered(conn, done)
                await repo.set_retirement(conn, [it.attempt_id for it in done], "forget_pending")
                await repo.enqueue_forgets(conn, run_id, inst.instance_id, [(it.rollout_id, it.gym_attempt, it.attempt_id) for it in done])
                for its, failure in failed:
                    await repo.mark_failed(conn, its, str(failure), base_backoff_s=self.base_backoff_s, max_backoff_s=self.max_backoff_s)
                total += len(done)
                if failed:
                    log.warning("retire on %s failed for %d episode(s); kept queued", inst.instance_id, sum(len(i) for i, _ in failed))
                    return total
                if len(items) < repo.MAX_BATCH:
                    return total

    async def _forgets(self, run_id: str, inst, client, ignore_schedule: bool) -> int:  # type: ignore[no-untyped-def]
        total = 0
        while True:
            async with self.engine.begin() as conn:
                items = await repo.claim(conn, run_id, inst.instance_id, "forget", ignore_schedule=ignore_schedule)
                if not items:
                    return total
                last_retired = {it.rollout_id: Episode(it.rollout_id, int(it.gym_attempt or 0)) for it in items}
                settle = await client.forget_settling_refusals(inst, last_retired)
                owed = set(settle.owed_forgets)
                done = [it for it in items if it.rollout_id in set(settle.forgotten) and it.rollout_id not in owed]
                still = [it for it in items if it not in done]
                await repo.mark_delivered(conn, done)
                await repo.set_retirement(conn, [it.attempt_id for it in done], "forgotten")
                if still:
                    errs = "; ".join(str(b.failure) for b in settle.batches if b.failure is not None) or "forget not acknowledged"
                    await repo.mark_failed(conn, still, errs, base_backoff_s=self.base_backoff_s, max_backoff_s=self.max_backoff_s)
                    log.warning("forget on %s refused for %d rollout(s); kept queued", inst.instance_id, len(still))
                    return total + len(done)
                total += len(done)
                if len(items) < repo.MAX_BATCH:
                    return total


async def outbox_loop(engine: AsyncEngine, deliverer: OutboxDeliverer, *, poll_s: float, owns_run) -> None:  # type: ignore[no-untyped-def]
    """Background loop: deliver due items of every run this process may drive."""
    while True:
        try:
            work = await repo.due_work(engine)
            for run_id in sorted({r for r, _ in work}):
                if not await owns_run(run_id):
                    continue
                await deliverer.deliver_run(run_id, instance_ids=[i for r, i in work if r == run_id])
            await _publish_backlog(engine)
        except asyncio.CancelledError:
            raise
        except Exception:
            log.exception("outbox delivery pass failed; retrying")
        await asyncio.sleep(poll_s)


async def _publish_backlog(engine: AsyncEngine) -> None:
    from ..observability import metrics

    for op, (n, age) in (await repo.backlog(engine)).items():
        metrics.set_outbox_backlog(op, n, age)
