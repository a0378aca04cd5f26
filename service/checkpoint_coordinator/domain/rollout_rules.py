"""The rules of the live ledger as pure functions (docs/ledger.md#fencing-and-concurrency,
docs/ledger.md#live-rollouts, docs/ledger.md#the-outbox).

Every trainer report (dispatch, refuse, seal, fail, stream end, finalize, abandon) is decided
here from the rows it touches, already locked and read by ``ledger/``: the decision is a
:class:`ChangePlan` (attempt updates, attempts to mint, group updates, retires to queue) plus the
answer and the rows refused. Each allowed move of one row is a small named rule, chosen by the
row's current status (the manner of Prefect's orchestration rules); a row no rule accepts is
refused with a stable code. Nothing here does I/O: the ledger applies the plan set-based and
writes nothing the plan does not name.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, Protocol

from . import levels
from .change_plan import (
    _PROMPT_GROUP,
    MINTED_ID,
    AttemptRow,
    Budgets,
    ChangePlan,
    Decision,
    GroupRow,
    GroupState,
    Mint,
    Refusal,
    _minted_view,
    _no_mint,
    _refused,
    granularity,
    send_row,
)
from .vocabulary import AttemptStatus as A
from .vocabulary import AbandonReason, AttemptFailureClass, GroupStatus as G, LIVE_ATTEMPT_STATUSES, WorkReason

__all__ = [
    "Budgets",
    "AttemptRow",
    "GroupRow",
    "GroupState",
    "ChangePlan",
    "Refusal",
    "granularity",
    "send_row",
    "decide_dispatch",
    "decide_refused",
    "decide_seal",
    "decide_fail",
    "decide_stream_end",
    "decide_finalize",
    "decide_abandon",
    "admit_conflicts",
    "Decision",
]


# --------------------------------------------------------------------------------------------
# Failure rules (docs/ledger.md#failure): a row fails, its sibling or its cohort is replaced or
# gives up


def replace_cohort(plan: ChangePlan, st: GroupState, budgets: Budgets, *, data: bool) -> None:
    """End the group's current cohort; mint a fresh one under group_attempt + 1, or abandon the
    group when its budget (data failures, or group attempts) is spent."""
    for a in list(st.current.values()):
        if a.attempt_id == MINTED_ID and plan.unmint(a):
            continue  # a sibling replaced earlier in this report: its replacement goes with the cohort
        if a.status in LIVE_ATTEMPT_STATUSES:
            plan.end_attempt(a, A.abandoned.value)
        else:
            plan.set_attempt(a, is_current=False)
    st.current.clear()
    g = st.g
    if data:
        g.data_attempts_used += 1
        plan.set_group(g.group_id, data_attempts_used=g.data_attempts_used)
        exhausted = g.data_attempts_used >= budgets.max_data_attempts
    else:
        exhausted = g.group_attempt + 1 >= budgets.max_group_attempts
    if exhausted:
        g.status = G.abandoned.value
        reason = AbandonReason.data_attempts_exhausted if data else AbandonReason.group_attempts_exhausted
        plan.set_group(g.group_id, status=G.abandoned.value, abandon_reason=reason.value)
        return
    g.group_attempt += 1
    plan.set_group(g.group_id, group_attempt=g.group_attempt)
    for i in range(g.expected_generations):
        row = plan.mint(g.group_id, i, g.group_attempt)
        plan.row_attempts[(g.group_id, i)] = 0
        st.current[i] = _minted_view(row)


def transport_failure(plan: ChangePlan, st: GroupState, a: AttemptRow, budgets: Budgets) -> None:
    """The answer never came: the row may still run in Gym (retired). A cohort is replaced
    whole; a sibling is replaced alone until its row budget is spent, then the cohort is."""
    plan.end_attempt(a, A.abandoned.value, AttemptFailureClass.transport.value)
    if st.granularity == _PROMPT_GROUP:
        st.current.pop(a.generation_index, None)
        replace_cohort(plan, st, budgets, data=False)
        return
    used = a.row_attempts_used + 1
    del st.current[a.generation_index]
    if used >= budgets.max_row_attempts:
        replace_cohort(plan, st, budgets, data=False)
        return
    plan.row_attempts[(a.group_id, a.generation_index)] = used
    row = plan.mint(a.group_id, a.generation_index, st.g.group_attempt)
    view = _minted_view(row)
    view.row_attempts_used = used
    st.current[a.generation_index] = view


def data_failure(plan: ChangePlan, st: GroupState, a: AttemptRow, budgets: Budgets) -> None:
    """Gym answered with bad data: the row ended in Gym (failed, no retire) and the cohort is
    replaced, within the group's data budget. Its siblings may still run."""
    plan.set_attempt(a, status=A.failed.value, is_current=False, failure_class=AttemptFailureClass.data.value)
    st.current.pop(a.generation_index, None)
    replace_cohort(plan, st, budgets, data=True)


_FAILURE_RULES = {AttemptFailureClass.data.value: data_failure, AttemptFailureClass.transport.value: transport_failure}
_FAIL_RESULT = {AttemptFailureClass.data.value: A.failed.value, AttemptFailureClass.transport.value: A.abandoned.value}


class FailReport(Protocol):
    rollout_id: str
    failure_class: str




_UNKNOWN_ROLLOUT = Refusal("unknown_rollout", "no attempt with this rollout id")
_UNKNOWN_GROUP = Refusal("unknown_group", "no such group")


def _fail_ended(a: AttemptRow, st: GroupState) -> Refusal | str:
    return "unchanged"  # already failed or replaced: a repeat


def _fail_sealed(a: AttemptRow, st: GroupState) -> Refusal | str:
    return Refusal("attempt_sealed", "a sealed row cannot fail")


def _fail_reserved(a: AttemptRow, st: GroupState) -> Refusal | str:
    return Refusal("attempt_not_dispatched", "a reserved row never reached Gym; dispatch it")


def _fail_in_flight(a: AttemptRow, st: GroupState) -> Refusal | str:
    return "unchanged" if st.g.status != G.generating else "fail"


# Fail: the rule for each current status of the named attempt.
FAIL_RULES: Mapping[str, Callable[[AttemptRow, GroupState], Refusal | str]] = {
    A.failed.value: _fail_ended,
    A.abandoned.value: _fail_ended,
    A.sealed.value: _fail_sealed,
    A.returned.value: _fail_sealed,
    A.reserved.value: _fail_reserved,
    A.dispatched.value: _fail_in_flight,
}


def decide_fail(
    reports: Sequence[FailReport], atts: Mapping[str, AttemptRow], states: Mapping[str, GroupState], budgets: Budgets, mint: Mint
) -> Decision:
    d = Decision(ChangePlan(mint))
    for r in reports:
        a = atts.get(r.rollout_id)
        if a is None:
            d.refused.append(_refused("rollout_id", r.rollout_id, _UNKNOWN_ROLLOUT))
            continue
        st = states[a.group_id]
        cur = st.current.get(a.generation_index)
        verdict = "unchanged" if cur is not None and cur.rollout_id != a.rollout_id else FAIL_RULES[a.status](a, st)
        if isinstance(verdict, Refusal):
            d.refused.append(_refused("rollout_id", r.rollout_id, verdict))
            continue
        if verdict == "fail":
            a.row_attempts_used = cur.row_attempts_used if cur else 0
            _FAILURE_RULES[r.failure_class](d.plan, st, a, budgets)
            d.results.append({"rollout_id": r.rollout_id, "result": _FAIL_RESULT[r.failure_class]})
        else:
            d.results.append({"rollout_id": r.rollout_id, "result": "unchanged"})
        if a.group_id not in d.touched:
            d.touched.append(a.group_id)
    return d


def decide_stream_end(
    states: Mapping[str, GroupState], dispatch_id: str, returned: Iterable[str] | None, missing: Iterable[str] | None,
    budgets: Budgets, mint: Mint,
) -> Decision:
    """A dispatch's stream ended: its rows still in flight that did not come back (or that the
    trainer names as missing) are transport failures. ``extra``: the lost rollout ids."""
    d = Decision(ChangePlan(mint))
    back = set(returned or ())
    named_missing = set(missing) if missing is not None else None
    for gid in sorted(states):
        st = states[gid]
        if st.g.status != G.generating:
            continue
        lost = [
            a for a in st.current.values()
            if a.dispatch_id == dispatch_id and a.status == A.dispatched
            and (a.rollout_id in named_missing if named_missing is not None else a.rollout_id not in back)
        ]
        for a in sorted(lost, key=lambda x: x.generation_index):
            if st.current.get(a.generation_index) is not a:
                continue  # replaced by an earlier row's cohort replacement in this report
            d.extra.append(a.rollout_id)
            transport_failure(d.plan, st, a, budgets)
    return d


# --------------------------------------------------------------------------------------------
# Group rules


def _finalize_rule(g: GroupRow) -> Refusal | str:
    if g.status == G.finalized:
        return "unchanged"
    if g.status != G.ready:
        return Refusal("group_not_ready", f"group is {g.status}; every sibling must be sealed")
    return "finalized"


def decide_finalize(group_ids: Sequence[str], groups: Mapping[str, GroupRow]) -> Decision:
    """The trainer consumed these ready groups; they leave the live ledger."""
    d = Decision(ChangePlan(_no_mint))
    for gid in group_ids:
        g = groups.get(gid)
        verdict = _UNKNOWN_GROUP if g is None else _finalize_rule(g)
        if isinstance(verdict, Refusal):
            d.refused.append(_refused("group_id", gid, verdict))
            continue
        if verdict == "finalized":
            d.plan.set_group(gid, status=G.finalized.value)
        d.results.append({"group_id": gid, "result": verdict})
    return d


def _abandon_rule(g: GroupRow) -> Refusal | str:
    if g.status == G.abandoned:
        return "unchanged"
    if g.status == G.finalized:
        return Refusal("group_finalized", "the trainer already consumed this group")
    return "abandoned"


def decide_abandon(group_ids: Sequence[str], states: Mapping[str, GroupState]) -> Decision:
    """Give up on groups; every attempt that may still run in Gym is retired."""
    d = Decision(ChangePlan(_no_mint))
    for gid in group_ids:
        st = states.get(gid)
        verdict = _UNKNOWN_GROUP if st is None else _abandon_rule(st.g)
        if isinstance(verdict, Refusal):
            d.refused.append(_refused("group_id", gid, verdict))
            continue
        if verdict == "abandoned":
            assert st is not None
            for a in st.current.values():
                if a.status in LIVE_ATTEMPT_STATUSES:
                    d.plan.end_attempt(a, A.abandoned.value)
            d.plan.set_group(gid, status=G.abandoned.value, abandon_reason=AbandonReason.trainer.value)
        d.results.append({"group_id": gid, "result": verdict})
    return d




def admit_conflicts(wanted: Sequence[Any], existing: Mapping[str, GroupRow]) -> list[dict[str, Any]]:
    """Groups admitted before with other fields (a repeat with the same fields is fine)."""
    refused = []
    for g in wanted:
        ex = existing.get(g.group_id)
        if ex is None:
            continue
        want = {
            "prompt_ref": g.prompt_ref, "task_digest": g.task_digest, "task_source": g.task_source,
            "agent_name": g.agent_name, "target_step": g.target_step, "weight_version": g.weight_version,
            "expected_generations": g.expected_generations,
        }
        diff = sorted(k for k, v in want.items() if ex.fields.get(k) != v)
        if diff:
            refused.append({"group_id": g.group_id, "code": "group_conflict", "detail": f"admitted before with other {', '.join(diff)}"})
    return refused


# --------------------------------------------------------------------------------------------
# Dispatch and refusal


def _dispatch_rule(a: AttemptRow, g: GroupRow, dispatch_id: str, instance_id: str | None) -> Refusal | str:
    if a.status == A.dispatched and a.is_current:
        if a.dispatch_id == dispatch_id and a.gym_instance_id == instance_id:
            return "repeat"
        return Refusal("already_dispatched", f"dispatched in {a.dispatch_id} to {a.gym_instance_id}")
    if not a.is_current or a.status != A.reserved:
        return Refusal("attempt_not_current", f"attempt is {a.status}; send its replacement")
    if g.status != G.generating:
        return Refusal("group_not_generating", f"group is {g.status}")
    if g.restore_level == levels.RestoreLevel.turn.value and instance_id is None:
        return Refusal("instance_required", "turn-level attempts need a Gym instance")
    if a.gym_owned and a.gym_instance_id != instance_id:
        return Refusal("wrong_instance", f"restored continuation lives on {a.gym_instance_id}")
    return "dispatch"


def decide_dispatch(
    rollout_ids: Sequence[str], atts: Mapping[str, AttemptRow], groups: Mapping[str, GroupRow], dispatch_id: str,
    instance_id: str | None,
) -> Decision:
    """Reserved rows sent to Gym. ``extra``: the attempts to mark dispatched (every one gets the
    same values, so the ledger writes them as one array of ids); ``rows``: the answer."""
    d = Decision(ChangePlan(_no_mint))
    for rid in rollout_ids:
        a = atts.get(rid)
        if a is None:
            d.refused.append(_refused("rollout_id", rid, _UNKNOWN_ROLLOUT))
            continue
        g = groups[a.group_id]
        verdict = _dispatch_rule(a, g, dispatch_id, instance_id)
        if isinstance(verdict, Refusal):
            d.refused.append(_refused("rollout_id", rid, verdict))
            continue
        if verdict == "dispatch":
            d.extra.append(a)
        d.rows.append(send_row(a, g.restore_level, instance_id))
    for r in d.rows:
        r["status"] = A.dispatched.value
    if d.extra:
        d.plan.transitions[A.dispatched.value] += len(d.extra)
    return d


def decide_refused(rollout_ids: Sequence[str], atts: Mapping[str, AttemptRow], groups: Mapping[str, GroupRow]) -> Decision:
    """Gym refused these rows at admission: back to reserved, same identity, no attempt spent."""
    d = Decision(ChangePlan(_no_mint))
    for rid in rollout_ids:
        a = atts.get(rid)
        if a is None:
            d.refused.append(_refused("rollout_id", rid, _UNKNOWN_ROLLOUT))
        elif a.is_current and a.status == A.reserved:
            d.rows.append(send_row(a, groups[a.group_id].restore_level))  # a repeat: already back
        elif a.is_current and a.status == A.dispatched:
            changes: dict[str, Any] = {"status": A.reserved.value, "refusals": a.refusals + 1, "dispatch_id": None}
            if not a.gym_owned:
                changes["gym_instance_id"] = None  # it never ran: any instance may take it
            d.plan.set_attempt(a, **changes)
            a.status = A.reserved.value
            d.rows.append(send_row(a, groups[a.group_id].restore_level))
        else:
            d.refused.append(_refused("rollout_id", rid, Refusal("attempt_not_current", f"attempt is {a.status}")))
    return d


# --------------------------------------------------------------------------------------------
# Seal


class SealReport(Protocol):
    rollout_id: str
    receipt: dict[str, Any]
    staging_keys: list[str]
    reward: float | None
    mask_sample: bool | None


def _seal_repeat(a: AttemptRow, row: SealReport, g: GroupRow) -> Refusal | str:
    same = (
        a.receipt == row.receipt and list(a.staging_keys or []) == list(row.staging_keys)
        and a.reward == row.reward and a.mask_sample == row.mask_sample
    )
    return "unchanged" if same else Refusal("seal_conflict", "sealed before with a different receipt or payload")


def _replaced(a: AttemptRow) -> Refusal:
    """A seal of an attempt that was replaced: its result is discarded. The answer names the
    replacement (``replaced_by``, added by the store); a straggler's says the coordinator retired
    it (docs/ledger.md#stragglers)."""
    if a.end_reason == WorkReason.straggler:
        return Refusal(
            "retired_straggler",
            "the coordinator gave this attempt up as a straggler (it blocked max_blocking_snapshots snapshots in a row) and "
            "retired it on Gym; its result is discarded: drop it from the batch and send its replacement (replaced_by)",
        )
    return Refusal("attempt_replaced", f"attempt was {a.status} and replaced; its result is discarded")


def _seal_in_flight(a: AttemptRow, row: SealReport, g: GroupRow) -> Refusal | str:
    if not a.is_current:
        return _replaced(a)
    if g.status != G.generating:
        return Refusal("attempt_not_current", f"attempt is {a.status}, group {g.status}")
    # Sibling recovery seals the row; prompt_group recovery holds it returned until the cohort is.
    return A.returned.value if granularity(g.restore_level) == _PROMPT_GROUP else A.sealed.value


def _seal_other(a: AttemptRow, row: SealReport, g: GroupRow) -> Refusal | str:
    if not a.is_current:
        return _replaced(a)
    return Refusal("attempt_not_current", f"attempt is {a.status}, group {g.status}")


def _seal_reserved(a: AttemptRow, row: SealReport, g: GroupRow) -> Refusal | str:
    if not a.is_current or g.status != G.generating:
        return _seal_other(a, row, g)
    # Admitted (or restored) and never recorded as sent: the trainer skipped the dispatch.
    return Refusal(
        "attempt_not_dispatched",
        "attempt is reserved and was never dispatched: dispatch it first (POST /attempts/dispatch, client.dispatch), "
        "then send it to Gym and seal its reply (a restore's rows to send are dispatched like new ones)",
    )


# Seal: the rule for each current status of the named attempt.
SEAL_RULES: Mapping[str, Callable[[AttemptRow, SealReport, GroupRow], Refusal | str]] = {
    A.sealed.value: _seal_repeat,
    A.returned.value: _seal_repeat,
    A.dispatched.value: _seal_in_flight,
    A.reserved.value: _seal_reserved,
    A.failed.value: _seal_other,
    A.abandoned.value: _seal_other,
}


def decide_seal(by_id: Mapping[str, SealReport], atts: Mapping[str, AttemptRow], groups: Mapping[str, GroupRow]) -> Decision:
    """Finished rows. ``extra``: one record per attempt to write (id, status and result), which
    the ledger sends as one document; ``touched``: the groups whose completion to decide."""
    d = Decision(ChangePlan(_no_mint))
    touched: set[str] = set()
    for rid, row in by_id.items():
        a = atts.get(rid)
        if a is None:
            d.refused.append(_refused("rollout_id", rid, _UNKNOWN_ROLLOUT))
            continue
        got_key = row.receipt.get("rollout_id")
        if got_key != a.capture_key:
            d.refused.append(_refused("rollout_id", rid, Refusal("receipt_mismatch", f"receipt names {got_key!r}, expected capture key {a.capture_key!r}")))
            continue
        verdict = SEAL_RULES[a.status](a, row, groups[a.group_id])
        if isinstance(verdict, Refusal):
            d.refused.append(_refused("rollout_id", rid, verdict))
            continue
        if verdict == "unchanged":
            d.results.append({"rollout_id": rid, "result": "unchanged", "status": a.status})
            continue
        d.extra.append(
            {"id": a.attempt_id, "status": verdict, "receipt": row.receipt, "staging_keys": list(row.staging_keys),
             "reward": row.reward, "mask_sample": row.mask_sample}
        )
        d.plan.transitions[verdict] += 1
        a.status = verdict
        touched.add(a.group_id)
        d.results.append({"rollout_id": rid, "result": verdict, "status": verdict})
    d.touched = sorted(touched)
    return d
