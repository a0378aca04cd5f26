"""Glue between the restore plan (``domain.restore_plan``) and the service.

* :func:`rollout_minter`: new rollout ids that are a deterministic function of the run, the
  snapshot, the run's epoch and the sibling, so the plan a ``GET`` previews names the same new
  ids the ``POST`` that follows applies (both run at the same epoch), while two restores of the
  same snapshot (each bumps the epoch) never mint the same id twice.
* :func:`live_retire_items`: the attempts a plan's rows know as possibly running in Gym, for
  restores that install no Gym state.
* :func:`row_json` / :func:`plan_summary`: the JSON the API answers.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

from ..domain.restore_plan import Disposition, NewRolloutId, PlanRow, RestorePlan, RetireItem, may_run_in_gym
from .store.records import answer_row_json

# Dispositions that are sent to Gym, in the order the answer lists them.
SEND_DISPOSITIONS = (
    Disposition.continued,
    Disposition.restarted,
    Disposition.gym_restarted,
    Disposition.rerun,
    Disposition.dispatch,
)
NEW_ATTEMPT_DISPOSITIONS = (Disposition.restarted, Disposition.gym_restarted, Disposition.rerun)
# The dispositions of the metric ckptc_restore_siblings_total (never-sent rows are not counted).
METRIC_DISPOSITIONS = ("reused", "rerun", "continued", "restarted", "gym_restarted")


def rollout_minter(run_id: str, snapshot_id: str, epoch: int, purpose: str = "plan") -> NewRolloutId:
    """``new_rollout_id(group_id, generation_index)``: ``<group>_g<i>_a<32 hex>`` with the hex a
    keyed hash of (run, snapshot, epoch, purpose, sibling). Same inputs, same id."""
    material = f"{run_id}\x00{snapshot_id}\x00{epoch}\x00{purpose}".encode()
    base = hashlib.blake2b(key=hashlib.blake2b(material, digest_size=32).digest(), digest_size=16)

    def new_rollout_id(group_id: str, generation_index: int) -> str:
        h = base.copy()
        h.update(f"{group_id}\x00{generation_index}".encode())
        return f"{group_id}_g{generation_index}_a{h.hexdigest()}"

    # 128 bits of keyed hash per id: as collision-free as fresh random ids, so the plan need not
    # re-check them (the ledger's unique constraint on rollout ids stays the final guard).
    new_rollout_id.random_bits = 128  # type: ignore[attr-defined]
    return new_rollout_id


def live_retire_items(attempts: Iterable[Sequence[Any]]) -> list[RetireItem]:
    """The attempts of these rows (of live groups) the cut knows as possibly running in Gym
    (docs/ledger.md#without-gym-state): ``dispatched``, or a reserved Gym-owned continuation."""
    return [
        RetireItem(a[4], a[3], a[5], a[2])
        for a in attempts
        if may_run_in_gym(a[7], a[5])
    ]


def row_json(r: PlanRow, *, include_staging_keys: bool = False) -> dict[str, Any]:
    out = answer_row_json(
        r.group_id,
        r.generation_index,
        r.disposition.value,
        r.rollout_id,
        r.gym_attempt,
        r.group_attempt,
        # Continuations must go to the instance holding their Gym state; under an instance map
        # every other row names the live instance of its even share, else any instance takes it.
        r.instance_id if r.disposition is not Disposition.reused else None,
        r.replaces_rollout_id,
        r.reason.value if r.reason is not None else None,
    )
    if include_staging_keys:
        out["staging_keys"] = list(r.staging_keys)
    return out


def rows_to_send(rows: Iterable[PlanRow]) -> Iterator[PlanRow]:
    return (r for r in rows if r.disposition is not Disposition.reused)


def reasons_json(plan: RestorePlan) -> dict[str, dict[str, int]]:
    return plan.reasons()


def counts_json(plan: RestorePlan) -> dict[str, int]:
    return {d.value: int(plan.counts.get(d, 0)) for d in Disposition}


def plan_summary(plan: RestorePlan) -> dict[str, Any]:
    return {
        "total": plan.total,
        "counts": counts_json(plan),
        "cohort_reruns": sorted(plan.cohort_reruns),
        "skipped_groups": len(plan.skipped_groups),
    }


def page(rows: Sequence[dict[str, Any]], cursor: int, limit: int) -> tuple[list[dict[str, Any]], int | None]:
    chunk = list(rows[cursor : cursor + limit])
    nxt = cursor + limit if cursor + limit < len(rows) else None
    return chunk, nxt
