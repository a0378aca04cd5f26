"""Checks that name what is wrong with a snapshot's ledger cut or its Gym manifest.

The restore planner (``ledger.restore_plan_sql``) only detects that a cut breaks one of its
invariants or that the manifest disagrees with it; these functions, run then, say what and
where. A NeMo RL ledger being imported is checked the same way.
"""

from __future__ import annotations

from .cut import Cut, CutAttempt
from .errors import CutError, FieldIssue, IssueList
from .gym_manifest import GymManifest
from .identity import MAX_GENERATIONS
from .restore_plan import may_run_in_gym
from .vocabulary import AttemptStatus, GroupStatus, LIVE_GROUP_STATUSES

__all__ = ["validate_cut", "cut_issues", "manifest_disagreements", "check_manifest_against_cut"]

_MAX_ISSUES = 50
_ATTEMPT_FIELDS = len(CutAttempt._fields)
_L_TURN, _L_SIBLING, _L_PG = 0, 1, 2
_LEVEL_CODE = {"turn": _L_TURN, "sibling": _L_SIBLING, "prompt_group": _L_PG}
_STATUS_CODE = frozenset(s.value for s in AttemptStatus)
_GROUP_STATUSES = frozenset(s.value for s in GroupStatus)
_LIVE_GROUP = frozenset(s.value for s in LIVE_GROUP_STATUSES)


def _level_name(code: int) -> str:
    return ("turn", "sibling", "prompt_group")[code]


def validate_cut(cut: Cut) -> None:
    """Check the invariants of a cut (see :mod:`.cut`); :class:`CutError` lists every
    broken one."""
    issues = cut_issues(cut)
    if issues:
        raise CutError(issues)


def cut_issues(cut: Cut) -> list[FieldIssue]:
    """Every broken invariant of a cut (at most 50, then a count), in input order.

    This is the careful, slow path; the plan's fast path only detects that something is wrong
    and then asks this function what."""
    issues = IssueList(_MAX_ISSUES)
    groups = _check_groups(cut, issues)
    _check_attempts(cut, groups, issues)
    _check_every_sibling_has_an_attempt(cut, groups, issues)
    return issues.done()


class _Groups:
    """What the attempts are checked against, by group id: the expected generations, the level
    code, the group attempt, and which siblings have a current attempt so far."""

    __slots__ = ("size", "level", "attempt", "slots")

    def __init__(self) -> None:
        self.size: dict[str, int] = {}
        self.level: dict[str, int] = {}
        self.attempt: dict[str, object] = {}
        self.slots: dict[str, bytearray] = {}


def _check_groups(cut: Cut, issues: IssueList) -> _Groups:
    out = _Groups()
    gsize, glevel, gatt, gslot = out.size, out.level, out.attempt, out.slots
    for k, g in enumerate(cut.groups):
        gid = g.group_id
        if not isinstance(gid, str) or not gid:
            issues.add(("groups", k, "group_id"), f"must be a non-empty string, got {gid!r}")
        elif gid in gsize:
            issues.add(("groups", k, "group_id"), f"duplicate group id {gid!r}")
            continue
        lvl = _LEVEL_CODE.get(g.restore_level)  # type: ignore[arg-type]
        if lvl is None:
            issues.add(("groups", k, "restore_level"), f"unknown restore level {g.restore_level!r}")
        n = g.expected_generations
        if type(n) is not int or not 1 <= n < MAX_GENERATIONS:
            issues.add(
                ("groups", k, "expected_generations"),
                f"must be an int in [1, {MAX_GENERATIONS}), got {n!r}",
            )
            n = 0
        ga = g.group_attempt
        if type(ga) is not int or ga < 0:
            issues.add(("groups", k, "group_attempt"), f"must be an int >= 0, got {ga!r}")
        if g.status not in _GROUP_STATUSES:
            issues.add(("groups", k, "status"), f"unknown group status {g.status!r}")
        gsize[gid] = n
        glevel[gid] = _L_SIBLING if lvl is None else lvl
        gatt[gid] = ga
        gslot[gid] = bytearray(n)
    return out


def _check_attempts(cut: Cut, groups: _Groups, issues: IssueList) -> None:
    gsize, glevel, gatt, gslot = groups.size, groups.level, groups.attempt, groups.slots
    rids: set[str] = set()
    for pos, a in enumerate(cut.attempts):
        if not isinstance(a, tuple) or len(a) != _ATTEMPT_FIELDS:
            issues.add(("attempts", pos), f"must be a CutAttempt ({_ATTEMPT_FIELDS} fields)")
            continue
        gid, idx, _aid, rid, inst, gym_att, grp_att, st = a[:8]
        if gid not in gsize:
            issues.add(("attempts", pos, "group_id"), f"unknown group {gid!r}")
            continue
        n = gsize[gid]
        if type(idx) is not int or not 0 <= idx < n:
            issues.add(
                ("attempts", pos, "generation_index"),
                f"must be an int in [0, {n}) for group {gid!r}, got {idx!r}",
            )
        elif gslot[gid][idx]:
            issues.add(
                ("attempts", pos, "generation_index"),
                f"sibling {gid}_g{idx} has more than one current attempt",
            )
        else:
            gslot[gid][idx] = 1
        if not isinstance(rid, str) or not rid:
            issues.add(("attempts", pos, "rollout_id"), f"must be a non-empty string, got {rid!r}")
        elif rid in rids:
            issues.add(("attempts", pos, "rollout_id"), f"rollout id {rid!r} is used twice")
        else:
            rids.add(rid)
        if st not in _STATUS_CODE:
            issues.add(("attempts", pos, "status"), f"unknown attempt status {st!r}")
        lvl = glevel[gid]
        if type(gym_att) is not int or gym_att < 0:
            issues.add(("attempts", pos, "gym_attempt"), f"must be an int >= 0, got {gym_att!r}")
        elif gym_att > 0:
            if lvl != _L_TURN:
                issues.add(
                    ("attempts", pos, "gym_attempt"),
                    f"Gym turn state (gym_attempt {gym_att}) on a {_level_name(lvl)}-level group",
                )
            elif inst is None:
                issues.add(
                    ("attempts", pos, "gym_instance_id"),
                    "an attempt with Gym turn state needs the instance that owns it",
                )
        if inst is not None and (not isinstance(inst, str) or not inst):
            issues.add(
                ("attempts", pos, "gym_instance_id"), "must be null or a non-empty string"
            )
        if type(grp_att) is not int or grp_att != gatt[gid]:
            issues.add(
                ("attempts", pos, "group_attempt"),
                f"{grp_att!r} differs from its group's group_attempt {gatt[gid]!r}",
            )
        if st == "returned" and lvl != _L_PG:
            issues.add(
                ("attempts", pos, "status"),
                f"'returned' exists only under prompt_group recovery; group {gid!r} is "
                f"{_level_name(lvl)}-level",
            )


def _check_every_sibling_has_an_attempt(cut: Cut, groups: _Groups, issues: IssueList) -> None:
    gslot = groups.slots
    for k, g in enumerate(cut.groups):
        slots = gslot.get(g.group_id)
        if slots is None or not isinstance(g.group_id, str):
            continue
        missing = [i for i, s in enumerate(slots) if not s]
        if missing:
            sample = ", ".join(str(i) for i in missing[:10])
            issues.add(
                ("groups", k, "expected_generations"),
                f"group {g.group_id!r} lacks the current attempt of {len(missing)} sibling(s) "
                f"(generation index {sample}{', ...' if len(missing) > 10 else ''})",
            )


def manifest_disagreements(
    manifest: GymManifest, cut: Cut, sample: int = 10
) -> dict[str, list[str]]:
    """Instances whose manifest disagrees with the cut, each with up to ``sample`` reasons.

    A saved episode ``(r, N)`` of instance ``I`` agrees when ``r`` is the rollout id of the
    current attempt of a live turn-level sibling whose ``gym_instance_id`` is ``I``, whose
    ``gym_attempt`` is ``N``, and which is still a Gym candidate (dispatched, or reserved with
    ``gym_attempt > 0``). A restart agrees on the same terms, whatever its status."""
    turn_groups = {
        g.group_id
        for g in cut.groups
        if g.restore_level == "turn" and g.status in _LIVE_GROUP
    }
    other_groups = {g.group_id: str(g.restore_level) for g in cut.groups}
    owner: dict[str, CutAttempt] = {}
    for a in cut.attempts:
        owner[a[3]] = a
    out: dict[str, list[str]] = {}

    def bad(iid: str, why: str) -> None:
        lst = out.setdefault(iid, [])
        if len(lst) < sample:
            lst.append(why)

    for iid, inst in manifest.instances.items():
        for saved, entries in ((True, inst.episodes), (False, inst.restarts)):
            kind = "saved episode" if saved else "restart"
            for rid, n in entries:
                a = owner.get(rid)
                if a is None:
                    bad(iid, f"{kind} {rid!r} is not a current attempt in the ledger cut")
                    continue
                gid, _idx, _aid, _rid, a_inst, a_gatt, _ga, st = a[:8]
                if gid not in turn_groups:
                    bad(
                        iid,
                        f"{kind} {rid!r} belongs to group {gid!r}, which is not a live "
                        f"turn-level group (level {other_groups.get(gid, '?')})",
                    )
                elif a_inst != iid:
                    bad(iid, f"{kind} {rid!r} is owned by instance {a_inst!r} in the ledger")
                elif a_gatt != n:
                    bad(iid, f"{kind} {rid!r} is at Gym attempt {n}, the ledger has {a_gatt}")
                elif saved and not may_run_in_gym(st, a_gatt):
                    bad(iid, f"saved episode {rid!r} is {st} in the ledger, not a Gym candidate")
    return out


def check_manifest_against_cut(manifest: GymManifest, cut: Cut) -> list[str]:
    """Sorted ids of the instances whose manifest disagrees with the ledger cut (empty: all
    agree). :func:`manifest_disagreements` gives the reasons."""
    return sorted(manifest_disagreements(manifest, cut, sample=1))


