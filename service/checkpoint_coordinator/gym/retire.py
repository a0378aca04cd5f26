"""Retire and forget (docs/gym-protocol.md#retire, docs/gym-protocol.md#forget,
docs/gym-protocol.md#marks-retire-and-forget): callers before callees, in batches of at most 1024,
each batch reporting its own outcome so that a durable outbox keeps exactly the failed ones."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

from ..domain.vocabulary import FORGET_CHECKPOINT_ID, RETIRE_CHECKPOINT_ID, GymOperation
from .channel import CallFailed, encode_body
from .context import Control
from .errors import (
    INSTANCE_WIDE,
    FailureClass,
    GymControlError,
    ServerFailure,
    parts_summary,
    sample,
    server_failure,
)
from .models import (
    AGENT,
    ENVIRONMENT,
    MODEL,
    RESOURCES,
    Episode,
    ForgetReply,
    InstanceTopology,
    Participant,
    RetireReply,
    is_valid_checkpoint_id,
    is_valid_rollout_id,
)
from .results import BatchResult, ForgetSettlement

__all__ = ["MAX_BATCH", "callers_first", "forget", "forget_settling_refusals", "retire", "retire_then_forget"]

MAX_BATCH = 1024


def callers_first(inst: InstanceTopology) -> list[list[Participant]]:
    """Retire and forget order: environment, then agent, then model and resources together.

    Public so that a durable outbox can record its progress stage by stage.
    """
    order = {ENVIRONMENT: 0, AGENT: 1, MODEL: 2, RESOURCES: 2}
    groups: dict[int, list[Participant]] = {}
    for p in inst.participants:
        groups.setdefault(order[p.kind], []).append(p)
    return [groups[k] for k in sorted(groups)]


async def retire(
    ctl: Control, instance: InstanceTopology, episodes: Iterable[Episode], checkpoint_id: str = RETIRE_CHECKPOINT_ID, *,
    deadline_ts: float | None = None,
) -> list[BatchResult]:
    eps = sorted(set(episodes))
    for ep in eps:
        Episode.checked(ep.rollout_id, ep.attempt)
    return await _batched(
        ctl, instance, GymOperation.retire, checkpoint_id, eps,
        lambda batch: {"episode_ids": [e.to_wire() for e in batch]}, RetireReply, _check_retired, deadline_ts,
    )


async def forget(
    ctl: Control, instance: InstanceTopology, rollout_ids: Iterable[str], checkpoint_id: str = FORGET_CHECKPOINT_ID, *,
    deadline_ts: float | None = None,
) -> list[BatchResult]:
    ids = sorted(set(rollout_ids))
    for rid in ids:
        if not is_valid_rollout_id(rid):
            raise ValueError(f"invalid rollout id {rid!r}")
    return await _batched(
        ctl, instance, GymOperation.forget, checkpoint_id, ids,
        lambda batch: {"rollout_ids": list(batch)}, ForgetReply, _check_forgotten, deadline_ts,
    )


async def retire_then_forget(
    ctl: Control, instance: InstanceTopology, episodes: Iterable[Episode]
) -> tuple[list[BatchResult], list[BatchResult]]:
    """For rollouts that will never be dispatched again: each is forgotten right after its
    retire succeeded on every participant."""
    retired = await retire(ctl, instance, episodes)
    done = sorted({e.rollout_id for b in retired if b.ok for e in b.episodes})
    forgotten = await forget(ctl, instance, done) if done else []
    return retired, forgotten


async def forget_settling_refusals(
    ctl: Control, instance: InstanceTopology, last_retired: Mapping[str, Episode]
) -> ForgetSettlement:
    """Forget; where a participant refuses, re-send the retire of each rollout's last retired
    attempt and forget again. What still fails stays owed."""
    first = await forget(ctl, instance, last_retired)
    batches: list[BatchResult] = list(first)
    forgotten = [r for b in first if b.ok for r in b.rollout_ids]
    owed_forgets = [r for b in first if not b.ok and not _refused(b.failure) for r in b.rollout_ids]
    owed_retires: list[Episode] = []
    refused = [r for b in first if not b.ok and _refused(b.failure) for r in b.rollout_ids]
    if refused:
        retired = await retire(ctl, instance, (last_retired[r] for r in refused))
        batches.extend(retired)
        owed_retires.extend(e for b in retired if not b.ok for e in b.episodes)
        again = await forget(ctl, instance, refused)
        batches.extend(again)
        forgotten.extend(r for b in again if b.ok for r in b.rollout_ids)
        still = [r for b in again if not b.ok for r in b.rollout_ids]
        owed_forgets.extend(still)
        # A forget refused twice keeps its retire queued too.
        owed_retires.extend(last_retired[r] for r in still)
    return ForgetSettlement(
        instance_id=instance.instance_id,
        forgotten=tuple(sorted(set(forgotten))),
        owed_retires=tuple(sorted(set(owed_retires))),
        owed_forgets=tuple(sorted(set(owed_forgets))),
        batches=tuple(batches),
    )


async def _batched(
    ctl: Control,
    inst: InstanceTopology,
    op: str,
    checkpoint_id: str,
    items: Sequence[Any],
    make_body: Callable[[Sequence[Any]], dict[str, Any]],
    reply_model: type[Any],
    check: Callable[[Sequence[Any], Any], str | None],
    deadline_ts: float | None,
) -> list[BatchResult]:
    if not is_valid_checkpoint_id(checkpoint_id):
        raise ValueError(f"invalid checkpoint id {checkpoint_id!r}")
    iid = inst.instance_id
    open_id = ctl.book.open_on(iid)
    results: list[BatchResult] = []
    for start in range(0, len(items), MAX_BATCH):
        batch = items[start : start + MAX_BATCH]
        if open_id is not None and open_id != checkpoint_id:
            # Participants refuse retire and forget while a checkpoint is open; sending would
            # only earn invalid_phase. The batch stays queued for after the resume.
            failure: GymControlError | None = GymControlError(
                FailureClass.UNAVAILABLE,
                f"{op} on {iid} deferred: checkpoint {open_id} is open",
                instances={iid: {INSTANCE_WIDE: server_failure(FailureClass.UNAVAILABLE, op, f"checkpoint {open_id} open")}},
            )
            ok: list[str] = []
        else:
            ok, failure = await _send_batch(ctl, inst, op, checkpoint_id, make_body(batch), batch, reply_model, check, deadline_ts)
        results.append(
            BatchResult(
                instance_id=iid,
                op=op,
                checkpoint_id=checkpoint_id,
                episodes=tuple(batch) if op == GymOperation.retire else (),
                rollout_ids=tuple(batch) if op == GymOperation.forget else (),
                servers_ok=tuple(sorted(ok)),
                failure=failure,
            )
        )
    return results


async def _send_batch(
    ctl: Control,
    inst: InstanceTopology,
    op: str,
    checkpoint_id: str,
    payload: dict[str, Any],
    batch: Sequence[Any],
    reply_model: type[Any],
    check: Callable[[Sequence[Any], Any], str | None],
    deadline_ts: float | None,
) -> tuple[list[str], GymControlError | None]:
    iid = inst.instance_id
    ok: list[str] = []
    parts: dict[str, ServerFailure] = {}
    for stage in callers_first(inst):
        deadline = deadline_ts if deadline_ts is not None else ctl.deadline()
        body = encode_body({"checkpoint_id": checkpoint_id, "deadline_ts": deadline, **payload})
        replies = await ctl.post_each([(inst, p) for p in stage], op, body, deadline, reply_model)
        # Continue through every stage on failure: a callee still frees what it can.
        for p, reply in zip(stage, replies):
            if isinstance(reply, CallFailed):
                parts[p.server_name] = reply.part
                continue
            problem = check(batch, reply)
            if problem is not None:
                parts[p.server_name] = server_failure(FailureClass.PROTOCOL_ERROR, op, problem, http_status=200)
            else:
                ok.append(p.server_name)
    if not parts:
        return ok, None
    return ok, GymControlError.from_parts({iid: parts}, f"{op} batch on {iid} failed: " + parts_summary({iid: parts}))


def _check_retired(batch: Sequence[Episode], reply: RetireReply) -> str | None:
    expected = {e.capture_key for e in batch}
    got = set(reply.retired)
    if got != expected:
        return f"retired set differs from the request: {len(expected - got)} missing, {len(got - expected)} unexpected"
    return None


def _check_forgotten(batch: Sequence[str], reply: ForgetReply) -> str | None:
    unexpected = set(reply.forgotten) - set(batch)
    if unexpected:
        return f"forgot {len(unexpected)} rollout(s) not asked for, e.g. {sample(unexpected)}"
    return None


def _refused(failure: GymControlError | None) -> bool:
    """A forget refusal in the sense of docs/gym-protocol.md#forget: an HTTP reply, not a lost connection."""
    if failure is None:
        return False
    return any(
        part.get("http_status") is not None and part.get("code") == "checkpoint_error"
        for servers in failure.instances.values()
        for part in servers.values()
    )
