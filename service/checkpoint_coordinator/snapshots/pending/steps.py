"""What a pending snapshot does in each phase before its cut, as a table of phase -> step.

Each step does its phase's work (a Gym call, a wait, a delivery) and names the move it asks
for; the machine (``machine.PendingSnapshot._drive``) makes that move, one fenced write. The open
step makes its own (the gate's close may take two). After the cut, the finishing sequence
(``_after_cut``: resume beside Gym's resume, publish, end) runs shielded from cancellation.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ...domain.snapshot_state import SnapshotPhase, SnapshotReason, SnapshotTiming
from ...gym.context import checkpoint_id_for
from ...observability import metrics
from .support import SnapshotFailed, all_ended, log

if TYPE_CHECKING:
    from .machine import PendingSnapshot as _Base
else:
    _Base = object

P = SnapshotPhase


@dataclass(frozen=True)
class Move:
    """The transition a step asks for. ``beside``: work run in a thread while the write is on its
    way to the database (in the loop's thread it would hold the write back)."""

    to: SnapshotPhase
    fields: dict[str, Any] = field(default_factory=dict)
    beside: Callable[[], Any] | None = None


class Steps(_Base):
    async def _open(self) -> Move | None:
        """requested: close the gate (or take what the creating request closed), read the run,
        the snapshot, the topology and the deadline; make the Gym save."""
        opened = self._opened
        if opened is not None:
            # Its request closed the gate and read all this in its transaction.
            checkpoint_id, gate, run, snap, topology, left = (
                opened.checkpoint_id, opened.gate, opened.run, opened.row, opened.topology, opened.deadline_left_s,
            )
            if left is not None:  # less what passed since it was read (the request's commit, this task's start)
                left -= self.clock.time() - opened.deadline_read_at
            self._opened = None
            self._entered(P.gate)
            if gate.prepared:
                self._entered(P.prepare)
        else:
            # The close and the reads side by side on their own connections: the close, the
            # longest, sends its statement first (each read yields once before taking its
            # connection). Every one ends before a failure is handled, so none is left in flight.
            # The Gym checkpoint id is drawn now: with nothing owed to Gym, the close's
            # transaction moves on to prepare with it.
            checkpoint_id = checkpoint_id_for(self.snapshot_id)
            store = self.store
            gate, run, snap, topology, left = await all_ended(
                self._write(
                    P.gate,
                    lambda: store.close_gate(self.run_id, self.snapshot_id, self.fence, prepare_as=checkpoint_id),
                    reached=lambda closed: P.prepare if closed.prepared else P.gate,
                ),
                store.run(self.run_id),
                store.snapshot(self.run_id, self.snapshot_id),
                store.topology(self.run_id),
                store.deadline_left_s(self.run_id, self.snapshot_id),
            )
        cfg = self._config = dict(run.config)
        self.stop = snap.stop
        if gate.stragglers:
            # Given up by the gate's close (docs/ledger.md#stragglers); their retires are owed.
            metrics.record_straggler_retirements(len(gate.stragglers))
            log.warning("snapshot %s of run %s: gave up %d straggler(s) that blocked the last %s snapshots, e.g. %s",
                        self.snapshot_id, self.run_id, len(gate.stragglers), cfg.get("max_blocking_snapshots", 3), ", ".join(gate.stragglers[:5]))
        if left is not None:
            self._start_deadline(left)
        # An abort or a lost lease during the close: no Gym call follows.
        self._raise_interrupt()
        if not topology:  # refused at the request; only a registration removed meanwhile gets here
            raise SnapshotFailed(SnapshotReason.gym_invariant, {
                "why": "no Gym instance is registered for this run; register its Gym instances (client.register_gym_instances)",
                "retryable": False,
            })
        self._checkpoint_id = checkpoint_id
        self._snapshot_dir = snap.snapshot_dir or str(Path(run.checkpoint_root) / "snapshots" / self.snapshot_id)
        self._owed = any(iid in topology for iid, _ in gate.owed)
        save = self.save = self.ctx.save_for(
            self.run_id, cfg, topology, snapshot_dir=self._snapshot_dir,
            drain_timeout_s=self._clipped(float(cfg.get("drain_timeout_s", 120))),
            checkpoint_id=checkpoint_id, stop=self.stop, write_manifest_file=True,
        )
        # The gate is closed, no dispatch adds to the candidates: their query, and their sorting
        # into commit scopes, run beside the retire delivery and the prepare calls.
        self._candidates = asyncio.create_task(self._load_candidates(save, topology))
        return None

    def _to_prepare(self) -> Move:
        return Move(P.prepare, {"gym_checkpoint_id": self._checkpoint_id, "snapshot_dir": self._snapshot_dir})

    async def _gate(self) -> Move:
        """gate: Gym refuses retire and forget once a checkpoint is open, so what is owed is
        delivered first (an unregistered instance's items wait for its registration)."""
        return Move(P.retire) if self._owed else self._to_prepare()

    async def _retire(self) -> Move:
        await self._step(self.ctx.outbox.deliver_run(self.run_id, self.fence.lease_epoch, ignore_schedule=True))
        return self._to_prepare()

    async def _prepare(self) -> Move:
        """prepare: park Gym; the ledger's pre-cut copy and the candidates run beside it."""
        save = self.save
        assert save is not None and self._candidates is not None
        self.timings[SnapshotTiming.gate] = self.clock.time() - self._started
        # Copy the ledger now, beside Gym's prepare and commit, so that the barrier (while Gym and
        # the trainer wait) copies only the groups written since.
        self._pre_cut = asyncio.create_task(self._take_pre_cut())
        await self._step(save.prepare())
        self._counts = await self._step(self._candidates)
        if save.plan_is_current():  # computed while prepare was in flight (no restarts since)
            return Move(P.commit, {"counts": self._counts})
        return Move(P.commit, {"counts": self._counts}, beside=save.plan_commit)

    async def _commit(self) -> Move:
        """commit: Gym saves; each instance's manifest entry is stored as it validates."""
        save = self.save
        assert save is not None
        self._commit_result = await self._step(save.commit(on_instance=self._store_entry_soon))
        self._pending = save.pending()
        self._drained_count = sum(len(v) for v in self._pending.values())
        if self._pending:
            return Move(P.drain)
        return await self._toward_data_plane()

    async def _drain(self) -> Move:
        """drain: the /run replies on the wire when Gym committed are reported first."""
        return await self._toward_data_plane()

    async def _toward_data_plane(self) -> Move:
        save, pending = self.save, self._pending
        assert save is not None and self._commit_result is not None
        await self._step(save.drain(self._drained(pending) if pending else None, pending))
        save.build_manifest()
        # The manifest file is needed by the cut, not by the trainer's barrier: it is written
        # beside the phase write and the trainer's handshakes.
        self._manifest_file = asyncio.ensure_future(save.write_manifest_file_now())
        await self._settle_pre_cut()  # the barrier must find it done (or never started)
        await self._step(self._stored_entries(self._commit_result))
        last = self._last_entry
        return Move(P.data_plane, {"gym_entry": self._gym_entry(*last) if last else None})

    async def _data_plane(self) -> None:
        """data_plane: the trainer's barrier takes the ledger's cut and reports its capture."""
        save = self.save
        assert save is not None and self._manifest_file is not None
        self._data_plane_reached = True
        timeout_s = self._clipped(float(self._config.get("data_plane_timeout_s", 600)))
        self._raise_interrupt()  # before the wait's coroutines exist: none is left never awaited
        await self._step(save.within_lease(self._captured(timeout_s)))
        await self._step(self._manifest_file)
        save.cut()
        self.cut_taken = True
        self.pre_cut_keys_json = None  # the fetch answers the cut's keys from the database now

    STEPS: Mapping[SnapshotPhase, Callable[[Any], Awaitable[Move | None]]] = {
        P.requested: _open,
        P.gate: _gate,
        P.retire: _retire,
        P.prepare: _prepare,
        P.commit: _commit,
        P.drain: _drain,
        P.data_plane: _data_plane,
    }
