"""Stragglers (docs/ledger.md#stragglers): an episode that blocked ``max_blocking_snapshots``
snapshots in a row is given up by the next snapshot and replaced, following its level's rules.

Pure rules over the locked rows, as ``rollout_rules`` decides the trainer's reports: the store
finds the stragglers (``snapshots/store/stragglers.py``), locks their groups, lets
:func:`decide_stragglers` plan the change and applies it set-based.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from .change_plan import AttemptRow, Budgets, ChangePlan, Decision, GroupState, Mint
from .rollout_rules import transport_failure
from .vocabulary import AttemptStatus as A
from .vocabulary import GroupStatus as G
from .vocabulary import WorkReason

__all__ = ["STRAGGLER", "decide_stragglers", "name_replacements"]

#: ``attempts.end_reason`` of an attempt given up as a straggler.
STRAGGLER = WorkReason.straggler.value


def decide_stragglers(
    states: Mapping[str, GroupState], blocked_on: Mapping[str, str | None], budgets: Budgets, mint: Mint
) -> Decision:
    """Give up on the current, dispatched attempts named in ``blocked_on`` (rollout id ->
    the instance that reported it): each is abandoned, queued for retirement on that instance,
    and replaced like a row whose answer never came (a fresh attempt for its sibling; the whole
    cohort at ``group_attempt + 1`` under ``prompt_group``), which spends the same budgets: an
    episode that hangs on every try ends with its group abandoned, not replaced for ever. The
    trainer reported no failure, so none is recorded; ``end_reason`` says why it ended.
    ``extra``: the rollout ids given up."""
    d = Decision(ChangePlan(mint))
    for gid in sorted(states):
        st = states[gid]
        if st.g.status != G.generating:
            continue
        named = sorted((a for a in st.current.values() if a.rollout_id in blocked_on and a.status == A.dispatched), key=lambda x: x.generation_index)
        for a in named:
            if a.gym_instance_id is None and blocked_on[a.rollout_id] is not None:
                # Sent without an instance (sibling level): its retire goes where Gym named it.
                a.gym_instance_id = blocked_on[a.rollout_id]
                d.plan.set_attempt(a, gym_instance_id=a.gym_instance_id)
        for a in named:
            if st.current.get(a.generation_index) is a:  # else ended by an earlier one's cohort replacement
                transport_failure(d.plan, st, a, budgets)
            d.plan.set_attempt(a, failure_class=None, end_reason=STRAGGLER)
            d.extra.append(a.rollout_id)
        if named:
            d.touched.append(gid)
    return d


def name_replacements(results: Sequence[dict[str, Any]], atts: Mapping[str, AttemptRow], states: Mapping[str, GroupState]) -> None:
    """Add to each answered row whose attempt was replaced already (a late failure report of a
    straggler, for one) why it ended (``end_reason``, when the coordinator ended it) and the
    rollout id of its sibling's current attempt (``replaced_by``): the row to send instead."""
    for r in results:
        a = atts.get(r["rollout_id"])
        if a is None or a.is_current:
            continue
        if a.end_reason is not None:
            r["end_reason"] = a.end_reason
        st = states.get(a.group_id)
        cur = st.current.get(a.generation_index) if st is not None else None
        if cur is not None and cur.rollout_id != a.rollout_id:
            r["replaced_by"] = cur.rollout_id

