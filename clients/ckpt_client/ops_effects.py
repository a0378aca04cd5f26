"""``ckpt-coordinator effects``: a run's effect journal (the coordinator's docs/effects.md), by
default its orphans: effects whose timeline a restore discarded, or that a continuation replaced
with another call. A completed orphan happened in a timeline that no longer exists (what it did
may need compensating); an orphan still in progress was begun and never completed (it may have
happened). The shared options, the token (``CKPTC_RUN_TOKEN``), the failures and the exit status
are those of the other operator commands (``ckpt_client.ops``); the renderer is a pure function of
:class:`~ckpt_client.effects.EffectRecord` rows, tested without a coordinator."""

from __future__ import annotations

import argparse
import json
from collections import Counter
from collections.abc import Sequence
from typing import TextIO

from .effects import EffectRecord
from .ops import _non_negative, _parser, _run, table
from .sync import CoordinatorClient

__all__ = ["effects_main", "effects_parser", "render_effects", "short_result"]

_STATES = ("completed", "in_progress", "abandoned")
_RESULT_WIDTH = 40


def effects_parser() -> argparse.ArgumentParser:
    p = _parser(
        "effects",
        "Print a run's effect journal (docs/effects.md): by default its orphans, the effects of tool calls outside Gym "
        "whose timeline a restore discarded or that a continuation replaced with another call. One line per effect "
        "(id, rollout, seq, name, state, orphan reason, the restore that orphaned it, when, its result) and how many "
        "orphans there are by reason. A completed orphan happened: what it did may need compensating.",
    )
    p.add_argument("--all", action="store_true", help="every effect of the journal, not only the orphans")
    p.add_argument("--rollout-id", metavar="ID", help="only the effects of this rollout")
    p.add_argument("--rows", type=_non_negative, default=50, metavar="N", help="effects shown in the table (default 50, 0: none; --json prints all)")
    return p


def effects_main(argv: Sequence[str] | None = None) -> int:
    """``ckpt-coordinator effects``."""
    parser = effects_parser()

    def body(args: argparse.Namespace, client: CoordinatorClient, out: TextIO) -> None:
        records = client.effects(orphaned=None if args.all else True, rollout_id=args.rollout_id)
        if args.json:
            doc = {"run_id": args.run, "orphaned_only": not args.all, "rollout_id": args.rollout_id, "effects": [r.raw for r in records]}
            out.write(json.dumps(doc, indent=2, sort_keys=True) + "\n")
        else:
            out.write(render_effects(args.run, records, every=args.all, rollout_id=args.rollout_id, rows=args.rows) + "\n")

    return _run(parser.prog, parser, argv, body)


# --------------------------------------------------------------------------------------------
# Rendering


def short_result(r: EffectRecord, width: int = _RESULT_WIDTH) -> str:
    """The recorded result as compact JSON on one line, cut at ``width`` characters; ``-`` before
    the effect completed."""
    if r.state != "completed":
        return "-"
    text = " ".join(json.dumps(r.result, sort_keys=True, separators=(",", ":"), ensure_ascii=False, default=str).split())
    return text if len(text) <= width else text[: width - 1] + "…"


def _when(r: EffectRecord) -> str:
    return (r.orphaned_at or r.completed_at or r.begun_at or "-")[:19]


def _state(r: EffectRecord) -> str:
    return r.state + (f", pending {r.pending_restore}" if r.pending_restore else "")


def _row(r: EffectRecord) -> list[str]:
    return [
        str(r.effect_id), r.rollout_id or "-", str(r.seq), r.effect or "-", _state(r), r.orphan_reason or "-", r.orphaned_by or "-",
        _when(r), short_result(r),
    ]


def _counts(c: Counter[str], order: Sequence[str] = ()) -> str:
    keys = [k for k in order if c.get(k)] + sorted(k for k in c if k not in order)
    return ", ".join(f"{k} {c[k]}" for k in keys)


def _summary(records: Sequence[EffectRecord], every: bool) -> list[str]:
    orphans = [r for r in records if r.orphan_reason]
    lines = []
    if every:
        by_state = f": {_counts(Counter(r.state for r in records), _STATES)}" if records else ""
        lines.append(f"{len(records)} effect{'s' if len(records) != 1 else ''} in all{by_state}")
    by_reason = Counter(str(r.orphan_reason) for r in orphans)
    lines.append(f"{len(orphans)} orphan{'s' if len(orphans) != 1 else ''} in all" + (f", by reason: {_counts(by_reason)}" if orphans else ""))
    states = Counter(r.state for r in orphans)
    what = {
        "completed": "happened in a discarded timeline: compensate if needed",
        "in_progress": "begun, never completed: may have happened",
        "abandoned": "did not happen",
    }
    if orphans:
        order = [*_STATES, *sorted(set(states) - set(_STATES))]
        lines.append("orphans by state: " + ", ".join(f"{s} {states[s]} ({what.get(s, '?')})" for s in order if states.get(s)))
    restores = Counter(str(r.orphaned_by) for r in orphans if r.orphaned_by)
    if restores:
        lines.append(f"orphaned by restore: {_counts(restores)}")
    return ["  " + ln for ln in lines]


def render_effects(run_id: str, records: Sequence[EffectRecord], *, every: bool = False, rollout_id: str | None = None, rows: int = 50) -> str:
    """The summary (effects and orphans by reason), then one line per effect, oldest first."""
    what = "effects" if every else "orphaned effects"
    of = f" of run {run_id}" + (f", rollout {rollout_id}" if rollout_id else "")
    lines = [f"{what}{of}" + ("" if every else " (--all lists every effect)"), *_summary(records, every)]
    if not records:
        return "\n".join([*lines, "", f"{what}: none"])
    if rows <= 0:
        return "\n".join(lines)
    shown = records[:rows]
    lines += ["", f"{what}, {len(shown)} of {len(records)}, oldest first (when: orphaned, else completed, else begun)"]
    head = ["effect id", "rollout id", "seq", "effect", "state", "orphan reason", "orphaned by", "when", "result"]
    lines += table([head, *[_row(r) for r in shown]])
    if len(records) > len(shown):
        lines.append(f"  … {len(records) - len(shown)} more (--rows N shows more, --json all)")
    return "\n".join(lines)
