"""The summary table printed at the end of the demo."""

from __future__ import annotations

from typing import Any

from ckpt_client.ops_accounting import duration, percent

__all__ = ["render_summary", "render_accounting", "render_side_effects"]

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
    return render_side_effects(s) if "side_effects" in s else _render_restore(s)


def _render_restore(s: dict[str, Any]) -> str:
    """The crash and allocation-end scenarios."""
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


def _seqs(seqs: list[int]) -> str:
    """1, 2, 3, 5 -> "1-3, 5"."""
    runs: list[list[int]] = []
    for n in seqs:
        if runs and n == runs[-1][1] + 1:
            runs[-1][1] = n
        else:
            runs.append([n, n])
    return ", ".join(f"{a}-{b}" if a != b else str(a) for a, b in runs)


def _mails_cell(e: dict[str, Any] | None, journal: bool) -> str:
    if e is None:
        return "-"
    text = f"saved at turn {e['saved_turn']}: {e['mails']} mails"
    if not journal:
        twice = e["mailed_twice"]
        return text + (f", {len(twice)} turns mailed twice (seq {_seqs(twice)})" if twice else ", none twice")
    if e["sent_twice"]:
        text += f", {len(e['sent_twice'])} SENT TWICE (seq {_seqs(e['sent_twice'])})"
    orphaned = e["orphaned"]
    return text + (f", {len(orphaned)} replaced, listed as orphans (seq {_seqs(orphaned)})" if orphaned else ", none twice")


def render_side_effects(s: dict[str, Any]) -> str:
    """The side-effects scenario: mails per episode of both runs side by side, the journal's
    orphans, each run's accounting, the checks."""
    o, runs = s["options"], s["side_effects"]
    off, on = runs["without_journal"], runs["with_journal"]
    lines = [
        "",
        f"ckpt-coordinator demo: scenario side-effects, Gym {o.get('gym_profile', 'published')}",
        f"  each run: {o['groups']} groups x {o['generations']} episodes of {o['turns']} turns, a mail per turn to a file outside Gym;",
        f"  snapshot once every episode did {o['saved_after']} turns, Gym SIGKILLed {o['lost_after']} turns later, "
        + "a fresh Gym restored, episodes continued to the end",
        f"  without the journal: run {off['run_id']}; with it: run {on['run_id']}",
        "",
        "mails per episode (every turn mails once: seq = the episode's mail count, kept in its checkpointed session)",
    ]
    rows = [["episode", "without the journal", "with the journal"]]
    for name in sorted(set(off["episodes"]) | set(on["episodes"])):
        rows.append([name, _mails_cell(off["episodes"].get(name), False), _mails_cell(on["episodes"].get(name), True)])
    a, b = off["episodes"].values(), on["episodes"].values()
    rows.append([
        "all",
        f"{sum(e['mails'] for e in a)} mails, {sum(len(e['mailed_twice']) for e in a)} turns mailed twice, none listed",
        f"{sum(e['mails'] for e in b)} mails, {sum(len(e['sent_twice']) for e in b)} sent twice, {len(on['orphans'])} orphans listed",
    ])
    lines += _table(rows)
    how = {"same": "the same on every attempt", "names_attempt": "naming the attempt"}
    tools = ", ".join(f"{g} {agent} ({res}, mails {how.get(v, v)})" for g, (agent, res, v) in (o.get("tools") or {}).items())
    lines.append(f"  {tools}")
    stats = on.get("continuation_mail_tool") or {}
    skipped = sum(int(x.get("done_before", 0)) for x in stats.values())
    lines.append(f"  with the journal the continuations asked before each mail: {skipped} answered done (sent before the crash) and were not sent again")
    at = on["restore"].get("effects") or {}
    if at:
        lines.append(f"  restore {on['restore']['restore_id']} left {at.get('pending', 0)} effects made after the cut pending (kept if made again)")

    lines += ["", f"orphans (effects of a discarded timeline, to compensate): {len(on['orphans'])}"]
    if on["orphans"]:
        rows = [["episode", "seq", "effect", "state", "reason", "orphaned by"]]
        rows += [[x["episode"], str(x["seq"]), x["effect"], x["state"], str(x.get("orphan_reason")), str(x.get("orphaned_by") or "-")] for x in on["orphans"]]
        lines += _table(rows)
    else:
        lines.append("  none: the continuations asked for the very mails the discarded timelines sent, and the journal kept them")

    lines += ["", "accounting (the coordinator's, per run)"]
    for r in (off, on):
        p = r["accounting"]["prompts"]
        lines.append(f"  {r['label']}: " + ", ".join(f"{k} {v}" for k, v in p["buckets"].items()) + f"; conserved {'yes' if p['conserved'] else 'NO'}")
    lines += ["", "checks"]
    lines += [f"  [{'ok' if ch['ok'] else 'FAILED'}] {ch['name']}: {ch['detail']}" for ch in s["checks"]]
    lines += ["", f"{'OK' if s['ok'] else 'FAILED'} in {s['wall_seconds']:.1f}s"]
    return "\n".join(lines)
