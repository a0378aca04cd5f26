"""The summary table printed at the end of the demo."""

from __future__ import annotations

from typing import Any

from ckpt_client.ops_accounting import duration, percent

__all__ = ["render_summary", "render_accounting"]

_DISPOSITIONS = ("reused", "continued", "restarted", "gym_restarted", "rerun", "dispatch")
_WHAT = {
    "reused": "sealed at the cut: kept, result read from the data-plane capture",
    "continued": "turn episode exported by Gym: gym_attempt+1 on its own instance",
    "restarted": "turn level, ran without saved Gym state (e.g. sent after the cut): new attempt",
    "gym_restarted": "turn episode Gym could not save (restart-only server): new attempt",
    "rerun": "sibling or prompt_group level: new attempt (a prompt_group: its whole cohort)",
    "dispatch": "never sent before the crash: sent under its own id",
}


def _table(rows: list[list[str]], indent: str = "  ") -> list[str]:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    out = []
    for k, r in enumerate(rows):
        out.append(indent + "  ".join(c.ljust(widths[i]) if i < len(r) - 1 else c for i, c in enumerate(r)).rstrip())
        if k == 0:
            out.append(indent + "  ".join("-" * w for w in widths))
    return out


def render_summary(s: dict[str, Any]) -> str:
    o, g, r = s["options"], s["groups"], s["restore"]
    lines = [
        "",
        f"ckpt-coordinator demo: run {s['run_id']} (seed {o['seed']}), {o['steps']} steps x {o['groups']} groups x {o['generations']} siblings, "
        f"Gym {o.get('gym_profile', 'published')}" + (f", scenario {s['scenario']}" if s.get("scenario", "crash") != "crash" else ""),
    ]
    if "allocation_end" in s:
        a = s["allocation_end"]
        honoured = {True: "honoured", False: "not honoured: Gym refused it, the commit went without it", None: "not reported"}[a.get("stop_honoured")]
        why = f" ({a['reason']})" if a.get("outcome") != "published" and a.get("reason") else ""
        lines += [
            f"  allocation ends in step {a['stop_step']}: {a['signal']} -> stopping snapshot {a['snapshot_id']} within {a['deadline_s']:.0f}s: "
            f"{a['outcome']}{why}; stop {honoured}",
            f"  next allocation: Gym {', '.join(a['live_instances'])} (saved: {', '.join(a['saved_instances'])}); "
            "instance map " + ", ".join(f"{k} -> {v}" for k, v in a["instance_map"].items()),
        ]
    else:
        c = s["crash"]
        lines.append(
            f"  crash in step {c['step']} after snapshot {c['snapshot_id']}: trainer killed with {c['rollouts_in_flight']} rollouts in flight "
            f"and {c['rows_queued']} queued, gymsim {c['killed_instance']} SIGKILLed"
        )
        if c.get("note"):
            lines.append(f"  note: {c['note']}")
    if r["refused_not_fresh"]:
        named = ", ".join(sorted({i for names in r["refused_not_fresh"] for i in names}))
        lines.append(f"  first restore refused (gym_not_fresh: {named} kept running); restarted it fresh and restored again")
    lines += ["", "groups"]
    lines += _table(
        [
            ["expected", "admitted", "finalized", "abandoned", "consumed", "rolled back by the restore"],
            [str(g["expected"]), str(g["admitted"]), str(g["finalized"]), str(g["abandoned"]), str(g["consumed"]), str(g["rolled_back"])],
        ]
    )
    lines += ["", f"restore {r['restore_id']} from snapshot {r['snapshot_id']} (anchor step {r['anchor_step']}, Gym state installed: {'yes' if r['gym_installed'] else 'no'})"]
    rows = [["siblings", "count", "meaning"]]
    for d in _DISPOSITIONS:
        rows.append([d, str(r["counts"].get(d, 0)), _WHAT[d]])
    lines += _table(rows)
    if r.get("continued_by_instance"):
        lines.append("  continued per instance: " + ", ".join(f"{k} {v}" for k, v in r["continued_by_instance"].items()))
    reasons = r.get("plan_reasons") or {}
    if reasons:
        lines += ["", "why (the plan's reason for each row)"]
        rows = [["disposition", "reason", "rows"]]
        rows += [[d, why, str(n)] for d in _DISPOSITIONS for why, n in sorted(reasons.get(d, {}).items())]
        rows += [[d, why, str(n)] for d in sorted(set(reasons) - set(_DISPOSITIONS)) for why, n in sorted(reasons[d].items())]
        lines += _table(rows)

    lines += ["", "snapshots"]
    rows = [["snapshot", "anchor", "in step", "outcome", "reason", "gym parked"]]
    for sn in s["snapshots"]:
        parked = sn.get("gym_parked_seconds")
        rows.append(
            [
                sn["snapshot_id"],
                str(sn.get("anchor_step")),
                str(sn.get("taken_in_step") or "-"),
                str(sn.get("outcome")),
                str(sn.get("reason") or "-"),
                f"{parked:.2f}s" if parked is not None else "-",
            ]
        )
    lines += _table(rows)
    t = s["snapshot_totals"]
    outcome_text = ", ".join(f"{k} {v}" for k, v in sorted(t["outcomes"].items()))
    reason_text = ", ".join(f"{k.split(':', 1)[1]} x{v}" for k, v in sorted(t["not_published_reasons"].items()))
    lines.append(f"  {outcome_text}" + (f" (reasons: {reason_text})" if reason_text else "") + f"; Gym parked {s['gym_parked_seconds']:.2f}s in all")

    if s.get("accounting"):
        lines += ["", *render_accounting(s["accounting"])]

    sib = s["siblings"]
    lines += [
        "",
        f"rows: {sib['sealed_reports']} sealed, {sib['gym_refusals']} refused by a parked Gym and re-sent, {sib['transport_failures']} failed",
        "",
        "checks",
    ]
    for ch in s["checks"]:
        lines.append(f"  [{'ok' if ch['ok'] else 'FAILED'}] {ch['name']}: {ch['detail']}")
    lines += ["", f"{'OK' if s['ok'] else 'FAILED'} in {s['wall_seconds']:.1f}s"]
    return "\n".join(lines)


def render_accounting(acc: dict[str, Any]) -> list[str]:
    """The coordinator's accounting of the run (docs/accounting.md): groups per bucket and whether
    they add up, then per restore the rollout-seconds it found in flight, carried and must redo."""
    p, w = acc["prompts"], acc["work"]
    buckets = p["buckets"]
    lines = ["accounting (the coordinator's, from its ledger)"]
    lines += _table(
        [
            ["admitted", *buckets, "missing", "conserved"],
            [str(p["admitted"]), *(str(n) for n in buckets.values()), str(p["missing"]), "yes" if p["conserved"] else "NO"],
        ]
    )
    fates = w["seconds_by_fate"]
    lines.append("  rollout work " + duration(w["total_seconds"]) + ": " + ", ".join(f"{k} {duration(v)}" for k, v in fates.items()))
    rows = [["restore", "snapshot", "found", "carried", "redone", "carried share", "groups rewound"]]
    for r in acc.get("restores") or []:
        rows.append(
            [
                r["restore_id"], r["snapshot_id"], duration(r["found_seconds"]), duration(r["carried_seconds"]),
                duration(r["redone_seconds"]), percent(r["carried_share"]) if r.get("recorded", True) else "not recorded",
                str(r["groups_rewound"]),
            ]
        )
    lines += _table(rows) if len(rows) > 1 else ["  no restore applied"]
    for r in acc.get("restores") or []:
        if r.get("carried_share") is not None:
            lines.append(f"  restore {r['restore_id']} kept {percent(r['carried_share'])} of the work it found in flight")
    return lines
