"""The tables of ``ckpt-coordinator accounting``: a run's prompt groups per bucket and whether they
are conserved, its rollout-seconds by fate, and what each restore kept (the coordinator's
docs/accounting.md). Pure functions of an :class:`~ckpt_client.accounting.Accounting`, so they are
tested without a coordinator."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from .accounting import (
    Accounting,
    PromptAccounting,
    RestoreAccounting,
    WorkAccounting,
    WorkSplit,
)
from .ops import _ordered, table

__all__ = ["render_accounting", "not_conserved_line", "duration", "percent"]

_BUCKETS = ("trained", "abandoned", "live", "rewound")
_FATES = ("trained", "in_flight", "carried", "redone")


def duration(seconds: float) -> str:
    """Seconds as a person reads them: ``0.42s``, ``12.5s``, ``4m 05s``, ``2h 03m``, ``3d 07h``."""
    s = max(0.0, float(seconds))
    if s < 10:
        return f"{s:.2f}s"
    if s < 60:
        return f"{s:.1f}s"
    n = round(s)
    if n < 3600:
        return f"{n // 60}m {n % 60:02d}s"
    if n < 86400:
        return f"{n // 3600}h {n % 3600 // 60:02d}m"
    return f"{n // 86400}d {n % 86400 // 3600:02d}h"


def percent(share: float | None) -> str:
    """A share as a percentage; ``-`` when there was nothing to share."""
    return "-" if share is None else f"{share * 100:.1f}%"


def _counts(d: Mapping[str, int]) -> str:
    return ", ".join(f"{k} {v}" for k, v in d.items() if v) or "-"


def _not_conserved(p: PromptAccounting) -> str:
    gap = (
        f"{p.missing} of {p.admitted} admitted groups are in no bucket"
        if p.missing > 0
        else f"{p.accounted} groups in the buckets, {-p.missing} more than the {p.admitted} admitted"
    )
    return f"NOT CONSERVED: {gap} (docs/accounting.md#prompt-conservation)"


def not_conserved_line(acc: Accounting) -> str:
    """The verdict of a run whose buckets do not add up to its admissions, in one line."""
    return f"run {acc.run_id} is {_not_conserved(acc.prompts)}"


def _prompt_lines(acc: Accounting) -> list[str]:
    p: PromptAccounting = acc.prompts
    detail = {
        "abandoned": _counts(p.abandoned_by_reason),
        "live": _counts(p.live_by_status),
        "rewound": f"by {len(p.rewound_by_restore)} restore{'s' if len(p.rewound_by_restore) != 1 else ''}" if p.rewound_by_restore else "-",
    }
    lines = [f"prompt groups: {p.admitted} admitted, {p.accounted} accounted for, {p.missing} missing"]
    body = [[b, str(p.buckets.get(b, 0)), detail.get(b, "-")] for b in _ordered(p.buckets, _BUCKETS)]
    lines += table([["bucket", "groups", "of which"], *body])
    if p.conserved:
        lines.append(f"CONSERVED: each of the {p.admitted} admitted groups is trained, abandoned, live or rewound")
    else:
        lines.append(_not_conserved(p))
    lines += ["", *_small_table("abandoned by reason", ["reason", "groups"], p.abandoned_by_reason)]
    lines += ["", *_small_table("rewound by restore (the data loader owes these groups again)", ["restore", "groups"], p.rewound_by_restore)]
    return lines


def _small_table(title: str, head: list[str], counts: Mapping[str, int]) -> list[str]:
    if not counts:
        return [f"{title}: none"]
    return [title, *table([head, *[[k, str(v)] for k, v in sorted(counts.items())]])]


def _work_lines(w: WorkAccounting) -> list[str]:
    kept = f"; {percent(w.kept_share)} kept (trained, in flight or carried)" if w.kept_share is not None else ""
    lines = [f"rollout work: {duration(w.total_seconds)} in all{kept}"]
    body = []
    for f in _ordered(w.seconds_by_fate, _FATES):
        sec = w.seconds_by_fate.get(f, 0.0)
        share = sec / w.total_seconds if w.total_seconds > 0 else None
        body.append([f, str(w.attempts_by_fate.get(f, 0)), duration(sec), percent(share)])
    lines += table([["fate", "attempts", "time", "share"], *body])
    lines.append("")
    if w.redone_by_reason:
        lines.append("redone by reason")
        lines += table([["reason", "time"], *[[k, duration(v)] for k, v in sorted(w.redone_by_reason.items(), key=lambda kv: -kv[1])]])
    else:
        lines.append("redone by reason: none")
    return lines


def _split_cells(s: WorkSplit | RestoreAccounting) -> list[str]:
    return [duration(s.found_seconds), duration(s.carried_seconds), duration(s.redone_seconds), percent(s.carried_share)]


def _why(redone: Mapping[str, float]) -> str:
    return ", ".join(f"{k} {duration(v)}" for k, v in sorted(redone.items(), key=lambda kv: -kv[1]) if v > 0) or "-"


def _restore_lines(restores: Sequence[RestoreAccounting], *, by_instance: bool, by_level: bool) -> list[str]:
    if not restores:
        return ["restores: none applied"]
    lines = [f"restores ({len(restores)}): the work each found in flight, carried from Gym state and must redo"]
    head = ["restore", "snapshot", "applied", "found", "carried", "redone", "carried share", "groups rewound", "redone because"]
    body = []
    for r in restores:
        applied = (r.applied_at or "-")[:19]
        if not r.recorded:
            body.append([r.restore_id or "-", r.snapshot_id or "-", applied, "-", "-", "-", "not recorded", str(r.groups_rewound), "-"])
            continue
        body.append([r.restore_id or "-", r.snapshot_id or "-", applied, *_split_cells(r), str(r.groups_rewound), _why(r.redone_by_reason)])
    lines += table([head, *body])
    if any(not r.recorded for r in restores):
        lines.append("  not recorded: applied before the coordinator kept accounting")
    for r in (r for r in restores if r.recorded):  # an unrecorded restore has no figures to split
        parts = ([("instance", r.by_instance)] if by_instance else []) + ([("level", r.by_level)] if by_level else [])
        for what, splits in parts:
            lines += ["", f"  restore {r.restore_id} per {what}"]
            if not splits:
                lines.append("    none")
                continue
            rows = [[(s.instance_id or "(not dispatched)") if what == "instance" else (s.restore_level or "-"), str(s.attempts), *_split_cells(s)] for s in splits]
            lines += table([[what, "attempts", "found", "carried", "redone", "carried share"], *rows], indent="    ")
    return lines


def render_accounting(acc: Accounting, *, by_instance: bool = False, by_level: bool = False) -> str:
    as_of = f" (as of {acc.as_of[:19]})" if acc.as_of else ""
    lines = [f"accounting of run {acc.run_id}{as_of}", ""]
    lines += _prompt_lines(acc)
    lines += ["", *_work_lines(acc.work)]
    lines += ["", *_restore_lines(acc.restores, by_instance=by_instance, by_level=by_level)]
    return "\n".join(lines)
