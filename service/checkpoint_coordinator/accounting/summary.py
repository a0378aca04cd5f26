"""The shapes of a run's accounting (docs/accounting.md): pure functions from the figures the
ledger answers to the JSON the API, the CLI and the demo show."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from ..domain.vocabulary import AbandonReason, GroupStatus, PromptBucket, WorkFate, WorkReason


@dataclass(frozen=True)
class WorkItem:
    """Rollout-seconds of the attempts a restore continued, replaced or ended, summed by
    instance, level, fate and reason (one ``restore_work`` row). ``found``: in flight or sealed
    when the restore came; ``kept``: the attempts stay in the ledger."""

    instance_id: str | None
    restore_level: str
    fate: str
    reason: str | None
    found: bool
    kept: bool
    attempts: int
    seconds: float


def _r(x: float) -> float:
    return round(float(x), 3)


def _share(part: float, whole: float) -> float | None:
    return round(part / whole, 4) if whole > 0 else None


def _split(items: Iterable[WorkItem]) -> dict[str, Any]:
    found = carried = 0.0
    attempts = 0
    redone: dict[str, float] = defaultdict(float)
    for w in items:
        if not w.found:
            continue
        found += w.seconds
        if w.fate == WorkFate.carried:
            carried += w.seconds
            attempts += w.attempts
        else:
            redone[w.reason or WorkReason.retired_by_restore.value] += w.seconds
            if w.reason != WorkReason.after_cut:
                attempts += w.attempts
    return {
        "attempts": attempts,
        "found_seconds": _r(found),
        "carried_seconds": _r(carried),
        "redone_seconds": _r(found - carried),
        "carried_share": _share(carried, found),
        "redone_by_reason": {k: _r(v) for k, v in sorted(redone.items())},
    }


def restore_summary(items: Iterable[WorkItem], groups_rewound: int) -> dict[str, Any]:
    """What a restore found in flight, carried and must redo, in all, per instance and per level
    (docs/accounting.md#what-a-restore-kept)."""
    items = list(items)
    by_instance: dict[str | None, list[WorkItem]] = defaultdict(list)
    by_level: dict[str, list[WorkItem]] = defaultdict(list)
    for w in items:
        by_instance[w.instance_id].append(w)
        by_level[w.restore_level].append(w)
    already = sum(w.seconds for w in items if not w.found)
    return {
        **_split(items),
        "groups_rewound": groups_rewound,
        "already_redone_seconds": _r(already),
        "by_instance": [{"instance_id": k, **_split(v)} for k, v in sorted(by_instance.items(), key=lambda kv: (kv[0] is not None, kv[0] or ""))],
        "by_level": [{"restore_level": k, **_split(v)} for k, v in sorted(by_level.items())],
    }


def prompt_buckets(admitted: int, groups: Iterable[tuple[str, str | None, int]], rewound: Mapping[str, int]) -> dict[str, Any]:
    """Every admitted group in one bucket (docs/accounting.md#prompt-conservation): ``groups``
    is (status, abandon reason, count) of the ledger's groups, ``rewound`` the groups each restore
    rewound. ``conserved``: the buckets add up to the admissions."""
    buckets = {b.value: 0 for b in PromptBucket}
    live: dict[str, int] = {GroupStatus.generating.value: 0, GroupStatus.ready.value: 0}
    abandoned: dict[str, int] = {}
    for status, reason, n in groups:
        if status == GroupStatus.finalized:
            buckets[PromptBucket.trained] += n
        elif status == GroupStatus.abandoned:
            buckets[PromptBucket.abandoned] += n
            key = reason or AbandonReason.unrecorded.value
            abandoned[key] = abandoned.get(key, 0) + n
        else:
            buckets[PromptBucket.live] += n
            live[status] = live.get(status, 0) + n
    buckets[PromptBucket.rewound] = sum(rewound.values())
    accounted = sum(buckets.values())
    return {
        "admitted": admitted,
        "buckets": buckets,
        "accounted": accounted,
        "missing": admitted - accounted,
        "conserved": accounted == admitted,
        "abandoned_by_reason": dict(sorted(abandoned.items())),
        "live_by_status": live,
        "rewound_by_restore": dict(rewound),
    }


def work_totals(rows: Iterable[tuple[str, str | None, int, float]]) -> dict[str, Any]:
    """The run's rollout-seconds by fate, and the redone ones by reason, from (fate, reason,
    attempts, seconds) rows (docs/accounting.md#rollout-seconds)."""
    seconds = {f.value: 0.0 for f in WorkFate}
    attempts = {f.value: 0 for f in WorkFate}
    redone: dict[str, float] = defaultdict(float)
    for fate, reason, n, sec in rows:
        seconds[fate] += sec
        if fate == WorkFate.redone:
            redone[reason or WorkReason.abandoned.value] += sec
            if reason != WorkReason.after_cut:
                attempts[fate] += n
        else:
            attempts[fate] += n
    total = sum(seconds.values())
    return {
        "seconds_by_fate": {k: _r(v) for k, v in seconds.items()},
        "attempts_by_fate": attempts,
        "redone_by_reason": {k: _r(v) for k, v in sorted(redone.items())},
        "total_seconds": _r(total),
        "kept_share": _share(seconds[WorkFate.trained] + seconds[WorkFate.carried] + seconds[WorkFate.in_flight], total),
    }
