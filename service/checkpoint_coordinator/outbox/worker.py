"""Delivers the durable retire/forget outbox to Gym (docs/ledger.md#the-outbox).

Retires go stage by stage (callers before callees); each stage's acknowledgements are recorded
before the next stage is sent, so after a crash only the stages still owed are sent again. A
retire acknowledged by every participant is followed at once by a forget of that rollout (it is
never dispatched again under its id). A refused forget gets the retire again, then the forget;
one still refused stays queued. Failures back off exponentially.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

from sqlalchemy.ext.asyncio import AsyncEngine

from ..domain.vocabulary import OutboxOp
from ..gym.client import GymControlClient, callers_first
from ..gym.models import Episode, InstanceTopology
from ..gym_runtime import GymClients, load_topology
from ..ledger.leases import Fence, Fenced
from ..ledger.runs import get_run
from ..observability import metrics
from . import store as repo

log = logging.getLogger(__name__)


@dataclasses.dataclass(eq=False)
class OutboxDeliverer:
    engine: AsyncEngine
    gym: GymClients
    owner: str
    _: dataclasses.KW_ONLY
    base_backoff_s: float = 0.5
    max_backoff_s: float = 60.0
    claim_s: float = 120.0
    # One delivery per run at a time in this process: the background loop and a snapshot's
    # pre-prepare delivery would otherwise split one run's items between two passes.
    _locks: dict[str, asyncio.Lock] = dataclasses.field(default_factory=dict, init=False, repr=False)

    async def deliver_run(
        self, run_id: str, epoch: int, *, ignore_schedule: bool = False, instance_ids: Sequence[str] | None = None
    ) -> dict[str, int]:
        """Deliver under the run's lease held at ``epoch``; raises :class:`Fenced` at the first
        claim or acknowledgement once the lease is gone."""
        lock = self._locks.setdefault(run_id, asyncio.Lock())
        async with lock:
            return await self._deliver_run(run_id, Fence(self.owner, epoch), ignore_schedule=ignore_schedule, instance_ids=instance_ids)

    async def _deliver_run(
        self, run_id: str, fence: Fence, *, ignore_schedule: bool = False, instance_ids: Sequence[str] | None = None
    ) -> dict[str, int]:
        """Deliver everything owed for one run (retires, then forgets). Returns counts delivered.

        ``ignore_schedule`` sends items still in backoff too: before a prepare, every queued retire
        gets another try (failed retires are retried again before the next prepare,
        docs/ledger.md#the-outbox).
        """
        delivered = {"retire": 0, "forget": 0}
        # Before every prepare this runs while Gym waits: with nothing owed it is one query, not
        # two claim transactions per instance.
        owed = await repo.owed(self.engine, run_id, ignore_schedule=ignore_schedule)
        if instance_ids is not None:
            owed = {(iid, op) for iid, op in owed if iid in instance_ids}
        if not owed:
            return delivered
        async with self.engine.connect() as conn:
            run = await get_run(conn, run_id)
            topology = await load_topology(conn, run_id)
        client = self.gym.for_run(run_id, run.config)
        for iid in instance_ids if instance_ids is not None else sorted(topology):
            inst = topology.get(iid)
            if inst is None or not inst.participants or not ({(iid, OutboxOp.retire), (iid, OutboxOp.forget)} & owed):
                # Items for an unregistered instance wait until it is registered, and those of an
                # instance with no participant known wait for one: acknowledged with nobody told,
                # a retire would be lost.
                continue
            delivered["retire"] += await self._drain(run_id, inst, fence, OutboxOp.retire, ignore_schedule, lambda items: self._retire(run_id, inst, client, fence, items))
            delivered["forget"] += await self._drain(run_id, inst, fence, OutboxOp.forget, ignore_schedule, lambda items: self._forget(run_id, inst, client, fence, items))
        return delivered

    async def _drain(
        self, run_id: str, inst: InstanceTopology, fence: Fence, op: str, ignore_schedule: bool,
        send: Callable[[list[repo.DueOutboxItem]], Awaitable[tuple[int, bool]]],
    ) -> int:
        total = 0
        while True:
            items = await repo.claim(self.engine, run_id, inst.instance_id, op, fence, self.claim_s, ignore_schedule=ignore_schedule)
            if not items:
                return total
            done, failed = await send(items)
            total += done
            if failed or len(items) < repo.MAX_BATCH:
                return total

    async def _retire(
        self, run_id: str, inst: InstanceTopology, client: GymControlClient, fence: Fence, items: list[repo.DueOutboxItem]
    ) -> tuple[int, bool]:
        everyone = {p.server_name for p in inst.participants}
        errors: list[str] = []
        stopped: set[int] = set()
        for stage in callers_first(inst):
            # Participants of a stage are sent their retires side by side, each acknowledgement
            # recorded as it arrives, so a crash re-sends only to those that had not answered.
            results = await asyncio.gather(
                *(self._retire_on(run_id, inst, client, fence, p, [it for it in items if it.item_id not in stopped]) for p in stage)
            )
            for errs in results:
                errors.extend(errs)
            names = {p.server_name for p in stage}
            # Callers before callees: an item a caller did not acknowledge goes no further.
            stopped.update(it.item_id for it in items if not names <= set(it.servers_done))
        done = [it for it in items if everyone <= set(it.servers_done)]
        rest = [it for it in items if it not in done]
        async with repo.acknowledging(self.engine, run_id) as conn:  # the run row before the lease
            await repo.mark_delivered(conn, run_id, done, fence)
            await repo.set_retirement(conn, [it.attempt_id for it in done], "forget_pending")
            await repo.enqueue_forgets(conn, run_id, inst.instance_id, [(it.rollout_id, it.gym_attempt, it.attempt_id) for it in done])
            await repo.mark_failed(
                conn, run_id, rest, fence, "; ".join(errors) or "retire not acknowledged", base_backoff_s=self.base_backoff_s, max_backoff_s=self.max_backoff_s
            )
        if rest:
            log.warning("retire on %s failed for %d episode(s); kept queued: %s", inst.instance_id, len(rest), "; ".join(errors)[:500])
        return len(done), bool(rest)

    async def _retire_on(
        self, run_id: str, inst: InstanceTopology, client: GymControlClient, fence: Fence, p: Any, items: list[repo.DueOutboxItem]
    ) -> list[str]:
        errors: list[str] = []
        sub = dataclasses.replace(inst, participants=(p,))
        for cid in sorted({it.checkpoint_id for it in items}):
            owed = [it for it in items if it.checkpoint_id == cid and p.server_name not in it.servers_done]
            by_ep: dict[Episode, list[repo.DueOutboxItem]] = {}
            for it in owed:
                by_ep.setdefault(Episode(it.rollout_id, int(it.gym_attempt or 0)), []).append(it)
            if not by_ep:
                continue
            for b in await client.retire(sub, list(by_ep), cid):
                if b.ok:
                    its = [it for ep in b.episodes for it in by_ep[ep]]
                    await repo.record_progress(self.engine, run_id, its, [p.server_name], fence)
                    for it in its:
                        it.servers_done.append(p.server_name)
                else:
                    errors.append(str(b.failure))
        return errors

    async def _forget(
        self, run_id: str, inst: InstanceTopology, client: GymControlClient, fence: Fence, items: list[repo.DueOutboxItem]
    ) -> tuple[int, bool]:
        last_retired = {it.rollout_id: Episode(it.rollout_id, int(it.gym_attempt or 0)) for it in items}
        settle = await client.forget_settling_refusals(inst, last_retired)
        forgotten = set(settle.forgotten) - set(settle.owed_forgets)
        done = [it for it in items if it.rollout_id in forgotten]
        still = [it for it in items if it.rollout_id not in forgotten]
        async with repo.acknowledging(self.engine, run_id) as conn:  # the run row before the lease
            await repo.mark_delivered(conn, run_id, done, fence)
            await repo.set_retirement(conn, [it.attempt_id for it in done], "forgotten")
            errs = "; ".join(str(b.failure) for b in settle.batches if b.failure is not None) or "forget not acknowledged"
            await repo.mark_failed(conn, run_id, still, fence, errs, base_backoff_s=self.base_backoff_s, max_backoff_s=self.max_backoff_s)
        if still:
            log.warning("forget on %s refused for %d rollout(s); kept queued with their retire", inst.instance_id, len(still))
        return len(done), bool(still)


async def outbox_loop(engine: AsyncEngine, deliverer: OutboxDeliverer, *, poll_s: float, lease_of: Callable[[str], Awaitable[int | None]]) -> None:
    """Background loop: deliver due items of every run this process holds the lease of
    (``lease_of`` takes or renews it and answers its epoch, or None)."""
    await repo.release_claims(engine, deliverer.owner)
    while True:
        try:
            work = await repo.due_work(engine)
            for run_id in sorted({r for r, _ in work}):
                epoch = await lease_of(run_id)
                if epoch is None:
                    continue
                try:
                    await deliverer.deliver_run(run_id, epoch, instance_ids=[i for r, i in work if r == run_id])
                except Fenced as e:
                    metrics.record_fenced_write(metrics.FencedWork.OUTBOX)
                    log.warning("outbox delivery stopped, fenced: %s", e)
            await _publish_backlog(engine)
        except asyncio.CancelledError:
            raise
        except Exception:
            log.exception("outbox delivery pass failed; retrying")
        await asyncio.sleep(poll_s)


async def _publish_backlog(engine: AsyncEngine) -> None:
    for op, (n, age) in (await repo.backlog(engine)).items():
        metrics.set_outbox_backlog(op, n, age)
