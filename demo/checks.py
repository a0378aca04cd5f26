"""The demo's verdict: was any group lost or trained twice, was any mutation applied twice, does
the coordinator's own accounting find every prompt group in a bucket.

Pure functions over what the run left behind (the trainers' journal and final checkpoint, the
coordinator's counts, gymsim's resources session histories), so they can be tested on their own.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

__all__ = [
    "Check",
    "check_groups",
    "check_mutations",
    "check_rewards",
    "check_capture",
    "check_instance_map",
    "check_conserved",
    "check_mails_twice",
    "check_mails_once",
    "check_orphans_replaced",
]


@dataclass(frozen=True)
class Check:
    name: str
    ok: bool
    detail: str

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "ok": self.ok, "detail": self.detail}


def _sample(items: Iterable[str], n: int = 5) -> str:
    items = sorted(items)
    more = f" (+{len(items) - n} more)" if len(items) > n else ""
    return ", ".join(items[:n]) + more


def check_groups(
    *,
    expected: Iterable[str],
    lineage: list[dict[str, Any]],
    abandoned: Iterable[str],
    finalize_results: Iterable[tuple[str, str]],
    coordinator_groups: Mapping[str, int],
) -> list[Check]:
    """Every group the data loader handed out is consumed exactly once in the trainer's final
    lineage (its last checkpoint, which continues the checkpoint the restore went back to), or
    was explicitly abandoned; and the coordinator agrees."""
    expected = set(expected)
    abandoned = set(abandoned)
    consumed = [c["group_id"] for c in lineage]
    twice = {g for g, n in Counter(consumed).items() if n > 1}
    lost = expected - set(consumed) - abandoned
    unknown = set(consumed) - expected
    out = [
        Check(
            "no group lost",
            not lost,
            f"{len(set(consumed))} of {len(expected)} groups consumed, {len(abandoned)} abandoned"
            + (f"; never consumed nor abandoned: {_sample(lost)}" if lost else ""),
        ),
        Check(
            "no group trained twice",
            not twice and not unknown,
            "each consumed group appears once in the final trainer checkpoint"
            if not twice and not unknown
            else f"consumed more than once: {_sample(twice)}; not from the data loader: {_sample(unknown)}",
        ),
    ]
    repeats = sorted(g for g, result in finalize_results if result != "finalized")
    out.append(
        Check(
            "every finalize handed a group over for the first time",
            not repeats,
            "every finalize answered 'finalized'" if not repeats else f"finalize answered otherwise for {_sample(repeats)}",
        )
    )
    live = {k: v for k, v in coordinator_groups.items() if k not in ("finalized", "abandoned") and v}
    agree = not live and coordinator_groups.get("finalized", 0) == len(set(consumed)) and coordinator_groups.get("abandoned", 0) == len(abandoned)
    out.append(
        Check(
            "the coordinator agrees",
            agree,
            f"ledger groups by status: {dict(sorted(coordinator_groups.items()))}",
        )
    )
    return out


def check_mutations(
    sessions_by_instance: Mapping[str, Mapping[str, Any]],
    continued: Iterable[Mapping[str, Any]],
    replies: Mapping[str, Mapping[str, Any]],
) -> Check:
    """No (rollout, turn) mutation twice in any resources session of the live Gym instances; each
    continued episode's session holds every turn exactly once: the saved turns from the
    checkpoint, then the rest from the continuation."""
    doubled: list[str] = []
    sessions = 0
    for iid, by_key in sessions_by_instance.items():
        for key, sess in by_key.items():
            sessions += 1
            seen = Counter((h.get("rollout_id"), h.get("turn")) for h in sess.get("history", []))
            doubled.extend(f"{iid}:{key} turn {turn}" for (_, turn), n in seen.items() if n > 1)
    bad_continued: list[str] = []
    resumed_mid = 0
    continued = list(continued)
    for c in continued:
        key, iid = c["capture_key"], c["instance_id"]
        reply = replies.get(key)
        sess = sessions_by_instance.get(iid, {}).get(key)
        if reply is None or sess is None:
            bad_continued.append(f"{key}: {'no sealed row' if reply is None else 'no resources session'}")
            continue
        turns = [h.get("turn") for h in sess.get("history", [])]
        total = int(reply.get("turns_completed", -1))
        if turns != list(range(total)):
            bad_continued.append(f"{key}: turns {turns}, expected 0..{total - 1} once each")
        if (reply.get("resumed_from_turn") or 0) > 0:
            resumed_mid += 1
    ok = not doubled and not bad_continued
    detail = (
        f"{sessions} resources sessions checked, none with a turn applied twice; {len(continued)} continued episodes "
        f"each hold every turn once ({resumed_mid} resumed after turn 0)"
    )
    if not ok:
        detail = "; ".join(x for x in (f"doubled: {_sample(doubled)}" if doubled else "", f"continued: {_sample(bad_continued)}" if bad_continued else "") if x)
    return Check("no mutation applied twice", ok, detail)


def check_rewards(lineage: list[dict[str, Any]]) -> Check:
    """gymsim's reward is the session counter over the turns: a lost or doubled mutation in a
    row the trainer consumed shows as a reward other than 1."""
    off = [f"{c['group_id']}: {r}" for c in lineage for r in c.get("rewards", []) if abs(float(r) - 1.0) > 1e-9]
    n = sum(len(c.get("rewards", [])) for c in lineage)
    return Check("every consumed row has all its turns once", not off, f"{n} rows, reward 1.0 each" if not off else f"rewards off: {_sample(off)}")


def check_capture(reused_missing: list[str], reused: int) -> Check:
    return Check(
        "reused siblings come from the data-plane capture",
        not reused_missing,
        f"{reused} reused rows found in the snapshot's capture (sha256 verified)"
        if not reused_missing
        else f"missing from the capture: {_sample(reused_missing)}",
    )


def check_instance_map(
    exported: Mapping[str, int],
    instance_map: Mapping[str, str],
    continued_by_live: Mapping[str, int],
    reasons: Mapping[str, Mapping[str, int]],
) -> Check:
    """A restore into another topology (docs/ledger.md#another-gym-topology): every episode a mapped saved instance
    exported continues on the live instance it is mapped to, none continues anywhere else, and
    every episode of an unmapped saved instance restarts with reason ``instance_not_mapped``."""
    problems = []
    if not exported:
        problems.append("the stopping snapshot reports no per-instance Gym figures")
    for saved, live in sorted(instance_map.items()):
        want, got = exported.get(saved, 0), continued_by_live.get(live, 0)
        if want != got:
            problems.append(f"{saved} exported {want} episodes, {live} continues {got}")
    stray = sorted(set(continued_by_live) - set(instance_map.values()))
    if stray:
        problems.append(f"continuations on instances nothing maps to: {', '.join(stray)}")
    unmapped = sorted(set(exported) - set(instance_map))
    left = sum(exported[i] for i in unmapped)
    restarted = int(reasons.get("restarted", {}).get("instance_not_mapped", 0))
    if not reasons:
        problems.append("the plan carries no reasons")
    elif restarted != left:
        problems.append(f"{left} episodes exported by unmapped {', '.join(unmapped) or '-'}, {restarted} restarted instance_not_mapped")
    continued = sum(continued_by_live.values())
    detail = (
        f"{continued} exported episodes continue on the instance their saved instance maps to "
        f"({', '.join(f'{k} -> {v}: {continued_by_live.get(v, 0)}' for k, v in sorted(instance_map.items()))}); "
        f"{restarted} of unmapped {', '.join(unmapped) or '-'} restart (instance_not_mapped)"
    )
    return Check("episodes follow the instance map", not problems, detail if not problems else "; ".join(problems))


def check_conserved(prompts: Mapping[str, Any]) -> Check:
    """The coordinator's accounting of the run (``prompts`` of ``GET .../accounting``,
    docs/accounting.md#prompt-conservation): every admitted group is trained, abandoned, live or
    rewound. The trainer-side checks above see only what this trainer kept; this one is the
    ledger's own word, and what a resume that drops prompts silently would fail."""
    buckets = prompts.get("buckets") or {}
    admitted, accounted = int(prompts.get("admitted", 0)), int(prompts.get("accounted", 0))
    ok = prompts.get("conserved") is True
    spread = ", ".join(f"{k} {v}" for k, v in buckets.items())
    detail = f"{admitted} admissions (a rewound group admitted again counts again), all in a bucket: {spread}"
    if not ok:
        detail = f"{admitted} admissions, {accounted} in the buckets ({spread}): {admitted - accounted} unaccounted for"
    return Check("every prompt group accounted for (conserved)", ok, detail)


def _mail_counts(mails: Iterable[Mapping[str, Any]]) -> Counter[tuple[str, int]]:
    """Mails per place: (rollout id, seq)."""
    return Counter((str(m.get("rollout_id")), int(m.get("seq", -1))) for m in mails)


def check_mails_twice(mails: list[Mapping[str, Any]]) -> Check:
    """Without the journal (the scenario side-effects): the continuations re-run the turns after
    the cut and mail again. The demo stages the crash so that they must; no doubled mail would
    mean it showed nothing."""
    counts = _mail_counts(mails)
    twice = sorted(k for k, n in counts.items() if n > 1)
    detail = (
        f"{len(twice)} of {len(counts)} turns mailed twice, in {len({r for r, _ in twice})} episodes: "
        "the turns after the cut, run again by the continuations"
        if twice
        else f"none of {len(counts)} turns mailed twice: the crash did not fall after mails past the cut"
    )
    return Check("without the journal, the restore sends mails again", bool(twice), detail)


def check_mails_once(mails: list[Mapping[str, Any]], effects: Iterable[Mapping[str, Any]], *, expected: int) -> Check:
    """With the journal: no mail went out twice (the same episode, place and body), across both
    Gym processes; every episode mailed each of its places 0..expected-1; and each mail has the
    completed journal record of the call that sent it."""
    counts = _mail_counts(mails)
    same = Counter((str(m.get("rollout_id")), m.get("seq"), m.get("body")) for m in mails)
    twice = sorted(f"{r} seq {s}" for (r, s, _), n in same.items() if n > 1)
    gaps = sorted(r for r in {r for r, _ in counts} if sorted(s for r2, s in counts if r2 == r) != list(range(expected)))
    # A mail whose process died before completing its record is still recorded: reconciled by
    # the continuation (completed), or an orphan when the continuation asked for another mail.
    done = {(e.get("rollout_id"), e.get("gym_attempt"), e.get("seq")) for e in effects if e.get("state") == "completed" or e.get("orphaned_at")}
    unrecorded = sorted(f"{m.get('rollout_id')} seq {m.get('seq')}" for m in mails if (m.get("rollout_id"), m.get("attempt"), m.get("seq")) not in done)
    ok = bool(counts) and not twice and not gaps and not unrecorded
    detail = f"{len(mails)} mails of {len({r for r, _ in counts})} episodes, none sent twice, each recorded in the journal"
    if not ok:
        parts = [f"sent twice: {_sample(twice)}" if twice else "", f"not every place mailed: {_sample(gaps)}" if gaps else "",
                 f"sent without a completed record: {_sample(unrecorded)}" if unrecorded else "", "" if counts else "no mail sent"]
        detail = "; ".join(x for x in parts if x)
    return Check("with the journal, no mail sent twice", ok, detail)


def check_orphans_replaced(mails: list[Mapping[str, Any]], effects: Iterable[Mapping[str, Any]]) -> Check:
    """With the journal: a place that got more than one mail (a continuation asked for another
    one) has one live record, and every other mail there is an orphan the journal lists; a place
    with one mail has no orphan of a mail that went out."""
    effects = list(effects)
    live = Counter((e.get("rollout_id"), e.get("seq")) for e in effects if e.get("orphaned_at") is None and e.get("state") == "completed")
    orphaned = {(e.get("rollout_id"), e.get("gym_attempt"), e.get("seq")) for e in effects if e.get("orphaned_at") is not None}
    problems: list[str] = []
    for (r, s), n in _mail_counts(mails).items():
        if live[(r, s)] != 1:
            problems.append(f"{r} seq {s}: {live[(r, s)]} live records")
        listed = sum(1 for m in mails if (m.get("rollout_id"), m.get("seq")) == (r, s) and (r, m.get("attempt"), s) in orphaned)
        if listed != n - 1:
            problems.append(f"{r} seq {s}: {n} mails, {listed} listed as orphans")
    replaced = sum(n - 1 for n in _mail_counts(mails).values())
    detail = f"{replaced} mails replaced by a continuation that asked for another one, each listed as an orphan; one live mail per place"
    return Check("with the journal, every replaced mail is listed as an orphan", not problems, detail if not problems else _sample(problems))
