"""The coordinator's Gym control client (docs/gym-protocol.md#operations): a facade over one
module per operation.

One :class:`GymControlClient` owns one httpx connection pool used for nothing but control
calls, so a control call never queues behind a long data-plane ``/run``. Every operation takes
the topology (what discovery returned) explicitly; the client keeps only its book of the ids it
issued and the checkpoints it has open, which it needs to recognise its own orphans and to hold
back a retire while a checkpoint of its own is open.
"""

from __future__ import annotations

import functools
import json
import ssl
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import httpx

from . import commit as _commit
from . import discovery as _discovery
from . import prepare as _prepare
from . import renew as _renew
from . import restore as _restore
from . import resume as _resume
from . import retire as _retire
from .channel import ControlChannel
from .clock import Clock, SystemClock
from .context import ControlBudgets, CheckpointBook, Control
from .egress import EgressPolicy, guarded_transport
from .models import Episode, InstanceSpec, InstanceTopology, Participant, Topology
from .results import (
    BatchResult,
    CommitResult,
    ForgetSettlement,
    InstanceCommit,
    PrepareResult,
    RenewResult,
    RestoreCleanup,
    RestoreResult,
    ResumeReport,
)
from .retire import callers_first

__all__ = ["GymControlClient", "RestoreCleanup", "Topology", "callers_first", "tls_context"]

# The ceiling of any one reply (docs/configuration.md#limits); each operation has its own, lower cap.
DEFAULT_MAX_CONTROL_REPLY_BYTES = 64 * 1024 * 1024


@functools.cache
def tls_context() -> ssl.SSLContext:
    """The TLS context of every Gym client of the process. Loading the CA bundle is slow, and a
    client built for a run's first snapshot paid it while the gate was closed, before Gym's
    prepare; one context, built once, serves them all (contexts are safe to share)."""
    return httpx.create_ssl_context(trust_env=False)


class GymControlClient:
    def __init__(
        self,
        *,
        control_timeout_s: float = 60.0,
        prepare_timeout_s: float | None = 300.0,
        discovery_timeout_s: float = 60.0,
        max_control_reply_bytes: int = DEFAULT_MAX_CONTROL_REPLY_BYTES,
        clock: Clock | None = None,
        transport: httpx.AsyncBaseTransport | None = None,
        owns_checkpoint_id: Callable[[str], bool] | None = None,
        max_connections: int = 256,
        egress: EgressPolicy | None = None,
        run_id: str | None = None,
    ) -> None:
        """
        ``owns_checkpoint_id`` tells whether an id found on a participant was issued by this
        coordinator (for example, by looking it up in the ledger after a restart); ids this
        client issued itself are always recognised. ``transport`` replaces the network layer in
        tests. ``egress``: where Gym servers may be (connections elsewhere are refused as they
        connect); ignored with a ``transport``. ``run_id``: the run the calls are for (its
        per-run call counts).
        """
        for name, value in (("control_timeout_s", control_timeout_s), ("discovery_timeout_s", discovery_timeout_s)):
            if not value > 0:
                raise ValueError(f"{name} must be positive, got {value!r}")
        if prepare_timeout_s is not None and not prepare_timeout_s > 0:
            raise ValueError(f"prepare_timeout_s must be positive, got {prepare_timeout_s!r}")
        if max_control_reply_bytes < 1:
            raise ValueError("max_control_reply_bytes must be positive")
        self.control_timeout_s = float(control_timeout_s)
        self.prepare_timeout_s = float(prepare_timeout_s or control_timeout_s)
        self.discovery_timeout_s = float(discovery_timeout_s)
        self.max_control_reply_bytes = max_control_reply_bytes
        self.clock: Clock = clock or SystemClock()
        limits = httpx.Limits(max_connections=max_connections, max_keepalive_connections=max_connections)
        if transport is None and egress is not None:
            transport = guarded_transport(egress, verify=tls_context(), limits=limits)
        self._http = httpx.AsyncClient(
            transport=transport,
            verify=tls_context(),
            timeout=None,
            follow_redirects=False,
            # Control calls go straight to the registered base URLs, never through a proxy
            # picked up from the environment.
            trust_env=False,
            limits=limits,
        )
        # The participants whose lease grace a renew has shown, as (instance, server): the
        # grace is checked, and a bad one warned of, once per run (``LeaseRenewer``).
        self.grace_checked: set[tuple[str, str]] = set()
        self._ctl = Control(
            channel=ControlChannel(
                self._http, self.clock, control_timeout_s=self.control_timeout_s, max_reply_bytes=max_control_reply_bytes,
                run_id=run_id,
            ),
            clock=self.clock,
            budgets=ControlBudgets(self.control_timeout_s, self.prepare_timeout_s, self.discovery_timeout_s),
            book=CheckpointBook(owns_checkpoint_id),
        )

    # --- lifecycle -----------------------------------------------------------------------------

    async def __aenter__(self) -> GymControlClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        await self._http.aclose()

    @property
    def lease_renew_interval_s(self) -> float:
        return self._ctl.budgets.renew_interval_s

    # --- ids and open checkpoints --------------------------------------------------------------

    def new_checkpoint_id(self, snapshot_id: str | int | None = None) -> str:
        """A fresh save id, ``snap-<snapshot_id>-<8 hex>``; never one this client issued before."""
        return self._ctl.book.new_checkpoint_id(snapshot_id)

    def new_restore_id(self, source_checkpoint_id: str) -> str:
        return self._ctl.book.new_restore_id(source_checkpoint_id)

    def issued(self, checkpoint_id: str) -> bool:
        return self._ctl.book.issued(checkpoint_id)

    def open_checkpoint(self, instance_id: str) -> str | None:
        """The id this client has open on an instance (prepared or restored, not yet resumed)."""
        return self._ctl.book.open_on(instance_id)

    def release(self, checkpoint_id: str, topology: Iterable[str]) -> None:
        """Stop driving ``checkpoint_id`` on these instances without resuming it (a stopping
        snapshot leaves Gym parked); from now on it counts as an orphan of this coordinator."""
        self._ctl.book.release(checkpoint_id, topology)

    # --- discovery (docs/gym-protocol.md#discover) ---------------------------------------------

    async def discover(self, spec: InstanceSpec) -> list[Participant]:
        """The participants of one instance, sorted by ``(stage, server_name)``; all or nothing."""
        return list((await self.discover_instance(spec)).participants)

    async def discover_all(self, specs: Iterable[InstanceSpec], *, log_warnings: bool = True) -> dict[str, InstanceTopology]:
        """``log_warnings=False`` leaves the topology's warnings to the caller: registration logs
        them once per run, and the discovery before a restore does not repeat them."""
        return await _discovery.discover_all(self._ctl, specs, log_warnings=log_warnings)

    async def discover_instance(self, spec: InstanceSpec, *, log_warnings: bool = True) -> InstanceTopology:
        return await _discovery.discover_instance(self._ctl, spec, log_warnings=log_warnings)

    async def status_document(self, inst: InstanceTopology, participant: Participant) -> dict[str, Any] | None:
        """A participant's status reply as plain JSON, with the optional fields this client does
        not model; ``None`` unless it answered 200 with an object. Raises ``CallFailed`` when no
        reply came."""
        status, content = await self._ctl.channel.get_status(Control.target(inst, participant), self.discovery_timeout_s)
        if status != 200:
            return None
        try:
            body = json.loads(content)
        except ValueError:
            return None
        return body if isinstance(body, dict) else None

    async def recover_orphans(self, topology: Topology) -> list[str]:
        """Resume checkpoints this coordinator left open, on every participant of an instance.
        A foreign id raises ``conflict`` naming its holders, before anything is resumed."""
        return await _discovery.recover_orphans(self._ctl, topology)

    # --- save: prepare, renew, commit, resume (docs/gym-protocol.md#the-save-choreography) -----

    async def prepare(self, checkpoint_id: str, topology: Topology) -> PrepareResult:
        """Prepare every instance stage by stage, instances in parallel.

        On any failure (not ready, a reply saying ``idle``, an error) every participant of every
        instance gets resume before the failure is raised, with any resume failure attached.
        """
        return await _prepare.prepare(self._ctl, checkpoint_id, topology)

    async def renew(self, checkpoint_id: str, topology: Topology) -> RenewResult:
        """Renew every participant's lease once; raises on any failure.

        ``stale_checkpoint`` becomes ``lease_lost``: the participant already reopened.
        """
        result = await self.renew_round(checkpoint_id, topology)
        if result.failure is not None:
            raise result.failure
        return result

    async def renew_round(self, checkpoint_id: str, topology: Topology) -> RenewResult:
        """Like :meth:`renew`, but reports the failure alongside the leases that were renewed."""
        return await _renew.renew_round(self._ctl, checkpoint_id, topology)

    async def commit(
        self, checkpoint_id: str, topology: Topology, checkpoint_dirs: Mapping[str, str], scopes: Mapping[str, Iterable[Episode]],
        stop: bool = False, restarts: Mapping[str, Iterable[Episode]] | None = None,
        on_instance: Callable[[str, InstanceCommit], None] | None = None, *, make_directories: bool = True,
    ) -> CommitResult:
        """Commit every participant of every instance and validate the replies.

        ``scopes`` must already exclude every restart (see :func:`policy.compute_scope`);
        ``restarts`` only travels into the result. The caller resumes on failure.
        ``on_instance`` hears of each instance whose replies validated at the first try, while
        the others may still commit. ``make_directories=False``: the caller made them.
        """
        return await _commit.commit(
            self._ctl, checkpoint_id, topology, checkpoint_dirs, scopes, stop, restarts, on_instance, make_directories=make_directories
        )

    async def resume(self, checkpoint_id: str, topology: Topology, *, raise_on_failure: bool = True) -> ResumeReport:
        """Resume in reverse stage order on every instance, retrying transient failures on the
        failed instances only.

        Before the snapshot cut a final failure is raised (``raise_on_failure=True``); after a
        successful cut it is reported, not raised, since the lease reopens the participant.
        """
        report = await _resume.resume_all(self._ctl, checkpoint_id, topology)
        if raise_on_failure:
            report.raise_for_failure()
        return report

    # --- restore (docs/gym-protocol.md#restore) ------------------------------------------------

    async def restore(
        self, manifest: Mapping[str, Any], topology: Mapping[str, InstanceSpec | InstanceTopology], snapshot_dir: str, *,
        resume: bool = True, instance_dirs: Mapping[str, str] | None = None,
    ) -> RestoreResult:
        """Restore a snapshot's Gym state into fresh instances, all or nothing.

        ``manifest`` is the validated Gym manifest v2 (a plain dict), keyed by live instance;
        ``instance_dirs`` maps a live instance to the saved instance whose checkpoint directory
        it restores from (another topology), else each restores its own. With ``resume=False`` the
        participants stay ``restored`` (admission closed) until :meth:`finish_restore` or
        :meth:`discard_restore`. Any failure after the first restore call runs the cleanup and
        raises, naming in ``extra["rollouts_to_restart"]`` the rollouts that must start over.
        """
        return await _restore.restore(self._ctl, manifest, topology, snapshot_dir, resume=resume, instance_dirs=instance_dirs)

    async def finish_restore(self, result: RestoreResult) -> RestoreResult:
        """Resume with the restore id; a resume failure is reported, not raised."""
        return await _restore.finish_restore(self._ctl, result)

    async def discard_restore(self, result: RestoreResult) -> RestoreCleanup:
        """Give up a successful restore (for example, the ledger disagrees): retire every N+1 and
        resume, so none of those continuations can run. The caller restarts the rollouts."""
        return await _restore.discard_restore(self._ctl, result)

    # --- retire and forget (docs/gym-protocol.md#marks-retire-and-forget) ----------------------

    async def retire(
        self, instance: InstanceTopology, episodes: Iterable[Episode], checkpoint_id: str = _retire.RETIRE_CHECKPOINT_ID, *,
        deadline_ts: float | None = None,
    ) -> list[BatchResult]:
        """Retire episodes on every participant, callers before callees, in batches of 1024.

        Never raises for a participant failure: each batch reports its own, so a durable outbox
        keeps exactly the failed batches queued.
        """
        return await _retire.retire(self._ctl, instance, episodes, checkpoint_id, deadline_ts=deadline_ts)

    async def forget(
        self, instance: InstanceTopology, rollout_ids: Iterable[str], checkpoint_id: str = _retire.FORGET_CHECKPOINT_ID, *,
        deadline_ts: float | None = None,
    ) -> list[BatchResult]:
        """Drop the marks of rollouts that can no longer send anything; same order as retire."""
        return await _retire.forget(self._ctl, instance, rollout_ids, checkpoint_id, deadline_ts=deadline_ts)

    async def retire_then_forget(
        self, instance: InstanceTopology, episodes: Iterable[Episode]
    ) -> tuple[list[BatchResult], list[BatchResult]]:
        """For rollouts that will never be dispatched again: forget each right after its retire
        succeeded on every participant. Returns (retire batches, forget batches)."""
        return await _retire.retire_then_forget(self._ctl, instance, episodes)

    async def forget_settling_refusals(
        self, instance: InstanceTopology, last_retired: Mapping[str, Episode]
    ) -> ForgetSettlement:
        """Forget the given rollouts; if a participant refuses, re-send the retire of each
        rollout's last retired attempt and forget again. What still fails stays owed."""
        return await _retire.forget_settling_refusals(self._ctl, instance, last_retired)
