"""The restore plan (ledger spec section 6.1) as a pure function of a snapshot's cut.

Inputs: a :class:`~.cut.Cut` (groups and the current attempt of every sibling), the snapshot's
:class:`~.gym_manifest.GymManifest` (or ``None`` when the snapshot has none) and an injected
``new_rollout_id(group_id, generation_index) -> str`` (see
:func:`~.identity.rollout_id_minter`).

Dispositions, per sibling of every live group (status ``generating`` or ``ready``):

=====================================  =====================  =============================
state of the current attempt in cut    turn / sibling level   prompt_group level
=====================================  =====================  =============================
sealed                                 ``reused``             ``reused`` if the whole cohort
                                                              is sealed, else the group reruns
turn level, exported (manifest         ``continued``          --
episodes)
turn level, in the manifest restarts   ``gym_restarted``      --
dispatched (or a Gym-owned reserved    ``restarted`` (turn)   whole group reruns
continuation) with no Gym state;       ``rerun`` (sibling)
failed or abandoned
reserved, never sent (gym_attempt 0)   ``dispatch``           ``dispatch`` if the whole
                                                              cohort was never sent, else
                                                              the group reruns
=====================================  =====================  =============================

What each row carries (:class:`PlanRow`):

* ``reused``: the attempt as it is (rollout id, Gym attempt, staging keys kept).
* ``continued``: same attempt and rollout id, ``gym_attempt + 1``, capture key of that new Gym
  attempt, and the instance that owns the Gym state (it must be sent there and nowhere else).
* ``dispatch``: the attempt as it is (same rollout id; it never ran), any instance.
* ``restarted`` / ``gym_restarted`` / ``rerun``: a new attempt (``attempt_id`` names the attempt
  it replaces, ``replaces_rollout_id`` its rollout id) under a NEW rollout id, Gym attempt 0,
  any instance. A prompt_group cohort that reruns gets ``group_attempt + 1`` on every row, so a
  cohort verifier never sees rows of the failed cohort again.

Groups ``finalized`` or ``abandoned`` are not planned (``RestorePlan.skipped_groups``).

The plan refuses (:class:`~.errors.ManifestLedgerMismatch`, naming the instances) a manifest
that disagrees with the cut: every manifest episode must be the current attempt of a live
turn-level sibling, on that instance, at that Gym attempt, and (for saved episodes) still a
Gym candidate (dispatched, or reserved with ``gym_attempt > 0``). An inconsistent cut raises
:class:`~.errors.CutError`; a generated rollout id that is already taken raises
:class:`~.errors.PlanError`.

Performance: the plan is two tight passes over the attempts (validation + disposition, then
prompt_group fix-up and rollout-id minting) and stores its result columnar (one byte of
disposition per row, new rollout ids in a list); :class:`PlanRow` objects are built only when
read. See ``RestorePlan.rows``.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from operator import itemgetter
from types import MappingProxyType
from typing import Callable, Iterable, Iterator, Mapping, NamedTuple, overload

from .cut import AttemptId, Cut, CutAttempt, CutGroup
from .errors import (
    CutError,
    FieldIssue,
    ManifestLedgerMismatch,
    PlanError,
    TopologyMismatch,
)
from .gym_manifest import Episode, GymManifest
from .identity import MAX_GENERATIONS
from .levels import RestoreLevel
from .vocabulary import Disposition, GroupDisposition, GroupStatus

__all__ = [
    "Disposition",
    "GroupDisposition",
    "PlanRow",
    "GroupOutcome",
    "RetireItem",
    "RestorePlan",
    "PlanRows",
    "PlanColumns",
    "NewRolloutId",
    "plan_restore",
    "assemble_plan",
    "DISPOSITION_CODES",
    "restore_without_gym_state",
    "demote_continuations",
    "validate_cut",
    "cut_issues",
    "retire_items",
    "may_run_in_gym",
    "mint_needs_check",
    "RetireList",
    "check_manifest_against_cut",
    "manifest_disagreements",
    "InstanceSetDiff",
    "compare_instance_sets",
    "missing_participants",
    "require_restorable_topology",
]

NewRolloutId = Callable[[str, int], str]



# One byte per row in the plan; 0 marks a row outside the plan (a skipped group).
_REUSED, _CONTINUED, _RESTARTED, _GYM_RESTARTED, _RERUN, _DISPATCH = 1, 2, 3, 4, 5, 6
_DISP_BY_CODE = (
    None,
    Disposition.reused,
    Disposition.continued,
    Disposition.restarted,
    Disposition.gym_restarted,
    Disposition.rerun,
    Disposition.dispatch,
)
_CODE_BY_DISP = {d: i for i, d in enumerate(_DISP_BY_CODE) if d is not None}

# Attempt status codes for the hot loop.
_S_RESERVED, _S_DISPATCHED, _S_RETURNED, _S_SEALED, _S_FAILED, _S_ABANDONED = range(6)
_STATUS_CODE = {
    "reserved": _S_RESERVED,
    "dispatched": _S_DISPATCHED,
    "returned": _S_RETURNED,
    "sealed": _S_SEALED,
    "failed": _S_FAILED,
    "abandoned": _S_ABANDONED,
}
_L_TURN, _L_SIBLING, _L_PG = 0, 1, 2
_LEVEL_CODE = {"turn": _L_TURN, "sibling": _L_SIBLING, "prompt_group": _L_PG}
_LIVE_GROUP = frozenset({"generating", "ready"})
_GROUP_STATUSES = frozenset(s.value for s in GroupStatus)

_MAX_ISSUES = 50


class PlanRow(NamedTuple):
    group_id: str
    generation_index: int
    disposition: Disposition
    rollout_id: str
    gym_attempt: int
    capture_key: str
    instance_id: str | None  # set: the row must go to this instance (continued); else any
    staging_keys: tuple[str, ...]  # kept keys of a reused row, else ()
    group_attempt: int
    attempt_id: AttemptId  # the cut's attempt: kept, or (new_attempt) the one it replaces
    replaces_rollout_id: str | None  # the old rollout id of a new attempt, else None


class GroupOutcome(NamedTuple):
    group_id: str
    restore_level: RestoreLevel
    disposition: GroupDisposition
    group_attempt: int  # after the plan
    previous_group_attempt: int


class RetireItem(NamedTuple):
    """An attempt the cut knows as running in Gym, to retire on its instance.

    ``instance_id is None``: the cut does not know where it ran (a non-turn attempt dispatched
    without an instance); retire it on every instance (a retire of an unknown rollout only
    raises a mark)."""

    instance_id: str | None
    rollout_id: str
    gym_attempt: int
    attempt_id: AttemptId

    @property
    def episode(self) -> Episode:
        return Episode(self.rollout_id, self.gym_attempt)


class PlanColumns(NamedTuple):
    """Rows of one disposition as parallel tuples (:meth:`PlanRows.columns`); each field is
    the :class:`PlanRow` field of the same name, row by row."""

    group_id: tuple[str, ...]
    generation_index: tuple[int, ...]
    attempt_id: tuple[AttemptId, ...]
    rollout_id: tuple[str, ...]
    gym_attempt: tuple[int, ...]
    group_attempt: tuple[int, ...]
    instance_id: tuple[str | None, ...]
    replaces_rollout_id: tuple[str | None, ...]


class SentColumns(NamedTuple):
    """The rows a restore sends (:meth:`PlanRows.sent_columns`) as parallel lists."""

    group_id: list[str]
    generation_index: list[int]
    disposition: list[str]
    rollout_id: list[str]
    gym_attempt: list[int]
    group_attempt: list[int]
    instance_id: list[str | None]
    replaces_rollout_id: list[str | None]
    attempt_id: list[AttemptId]


class PlanRows(Sequence[PlanRow]):
    """The rows of a plan, in the order of the cut's attempts (skipped groups left out).

    Backed by columns; indexing or iterating builds :class:`PlanRow` objects on the fly."""

    __slots__ = ("_attempts", "_disp", "_new_ids", "_bumped", "_positions")

    def __init__(
        self,
        attempts: Sequence[CutAttempt],
        disp: bytearray,
        new_ids: list[str | None],
        bumped: frozenset[str],
        positions: list[int] | None,
    ) -> None:
        self._attempts = attempts
        self._disp = disp
        self._new_ids = new_ids
        self._bumped = bumped
        self._positions = positions

    def __len__(self) -> int:
        return len(self._disp) if self._positions is None else len(self._positions)

    @overload
    def __getitem__(self, i: int) -> PlanRow: ...

    @overload
    def __getitem__(self, i: slice) -> list[PlanRow]: ...

    def __getitem__(self, i: int | slice) -> PlanRow | list[PlanRow]:
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(len(self)))]
        if i < 0:
            i += len(self)
        if not 0 <= i < len(self):
            raise IndexError("plan row index out of range")
        pos = i if self._positions is None else self._positions[i]
        return self._row(pos)

    def __iter__(self) -> Iterator[PlanRow]:
        row = self._row
        if self._positions is None:
            return (row(p) for p in range(len(self._disp)))
        return (row(p) for p in self._positions)

    def _row(self, pos: int) -> PlanRow:
        gid, idx, aid, rid, inst, gatt, gratt = self._attempts[pos][:7]
        sk = self._attempts[pos][8] if len(self._attempts[pos]) > 8 else ()
        code = self._disp[pos]
        if code == _REUSED:
            ck = rid if gatt == 0 else f"{rid}-a{gatt}"
            return PlanRow(gid, idx, Disposition.reused, rid, gatt, ck, inst, tuple(sk), gratt, aid, None)
        if code == _CONTINUED:
            n = gatt + 1
            return PlanRow(gid, idx, Disposition.continued, rid, n, f"{rid}-a{n}", inst, (), gratt, aid, None)
        if code == _DISPATCH:
            ck = rid if gatt == 0 else f"{rid}-a{gatt}"
            return PlanRow(gid, idx, Disposition.dispatch, rid, gatt, ck, None, (), gratt, aid, None)
        new = self._new_ids[pos]
        assert new is not None
        ga = gratt + 1 if gid in self._bumped else gratt
        return PlanRow(gid, idx, _DISP_BY_CODE[code], new, 0, new, None, (), ga, aid, rid)  # type: ignore[arg-type]

    def positions(self, disposition: Disposition) -> list[int]:
        """Positions in the cut's attempts of the rows of one disposition, in row order (a scan
        of one byte per row in C; no row is built)."""
        code = _CODE_BY_DISP[Disposition(disposition)]
        return [m.start() for m in re.finditer(re.escape(bytes((code,))), self._disp)]

    def columns(self, disposition: Disposition) -> "PlanColumns":
        """The rows of one disposition as columns (what a bulk write needs), in row order, equal
        field by field to the rows :meth:`with_disposition` yields."""
        pos = self.positions(disposition)
        if not pos:
            return PlanColumns((), (), (), (), (), (), (), ())
        code = self._disp[pos[0]]
        att = self._attempts
        picked = [att[p] for p in pos]
        gid, idx, aid, rid, inst, gatt, gratt = list(zip(*picked))[:7]
        if code == _CONTINUED:
            return PlanColumns(gid, idx, aid, rid, tuple(n + 1 for n in gatt), gratt, inst, (None,) * len(pos))
        if code == _REUSED or code == _DISPATCH:
            where = inst if code == _REUSED else (None,) * len(pos)
            return PlanColumns(gid, idx, aid, rid, gatt, gratt, where, (None,) * len(pos))
        new_ids = self._new_ids
        bumped = self._bumped
        new = tuple(new_ids[p] for p in pos)
        ga = tuple(a + 1 if g in bumped else a for g, a in zip(gid, gratt)) if bumped else gratt
        return PlanColumns(gid, idx, aid, new, (0,) * len(pos), ga, (None,) * len(pos), rid)

    def sent_columns(self) -> "SentColumns":
        """Every row but the reused ones, in row order, as columns: the fields of the rows a
        restore answers (equal, row by row, to the :class:`PlanRow` fields of the same name;
        ``instance_id`` only for continued rows, which must go back to their instance). No row
        object is built: at a million siblings this is the answer's critical path."""
        cols: SentColumns = SentColumns([], [], [], [], [], [], [], [], [])
        gids, idxs, disps, rids, gatts, gratts, insts, reps, aids = cols
        att, codes, new_ids, bumped = self._attempts, self._disp, self._new_ids, self._bumped
        names = [d.value if d is not None else "" for d in _DISP_BY_CODE]
        for p in range(len(codes)) if self._positions is None else self._positions:
            code = codes[p]
            if code == _REUSED or not code:
                continue
            gid, idx, aid, rid, inst, gatt, gratt = att[p][:7]
            gids.append(gid)
            idxs.append(idx)
            disps.append(names[code])
            aids.append(aid)
            if code == _CONTINUED:
                rids.append(rid)
                gatts.append(gatt + 1)
                gratts.append(gratt)
                insts.append(inst)
                reps.append(None)
            elif code == _DISPATCH:
                rids.append(rid)
                gatts.append(gatt)
                gratts.append(gratt)
                insts.append(None)
                reps.append(None)
            else:
                rids.append(new_ids[p])
                gatts.append(0)
                gratts.append(gratt + 1 if gid in bumped else gratt)
                insts.append(None)
                reps.append(rid)
        return cols

    def with_disposition(self, disposition: Disposition) -> Iterator[PlanRow]:
        """Rows of one disposition, without building the others."""
        code = _CODE_BY_DISP[Disposition(disposition)]
        disp = self._disp
        positions = range(len(disp)) if self._positions is None else self._positions
        for p in positions:
            if disp[p] == code:
                yield self._row(p)


class RestorePlan:
    """The result of :func:`plan_restore` / :func:`restore_without_gym_state`.

    * ``rows``: every sibling of every live group, exactly once (:class:`PlanRows`); a plan
      built by :func:`assemble_plan` leaves the ``reused`` rows out (``reused_omitted`` of
      them, still counted in ``counts`` and ``total``);
    * ``counts``: siblings per :class:`Disposition`, all six keys present, summing to
      ``len(rows)``;
    * ``cohort_reruns``: prompt_group groups that rerun (their rows carry ``group_attempt + 1``);
    * ``skipped_groups``: finalized or abandoned groups, not planned;
    * ``retire``: attempts to retire before anything is dispatched (only without Gym state);
    * ``with_gym_state``: whether continuations are installed on Gym;
    * ``group_outcomes()``: one :class:`GroupOutcome` per group of the cut (empty for a plan
      built by :func:`assemble_plan`).
    """

    __slots__ = (
        "rows",
        "counts",
        "cohort_reruns",
        "skipped_groups",
        "retire",
        "with_gym_state",
        "_groups",
        "_gdisp",
        "reused_omitted",
    )

    def __init__(
        self,
        rows: PlanRows,
        counts: Mapping[Disposition, int],
        cohort_reruns: tuple[str, ...],
        skipped_groups: tuple[str, ...],
        retire: Sequence[RetireItem],
        with_gym_state: bool,
        groups: Sequence[CutGroup],
        gdisp: bytes,
        reused_omitted: int = 0,
    ) -> None:
        self.rows = rows
        self.counts = counts
        self.cohort_reruns = cohort_reruns
        self.skipped_groups = skipped_groups
        self.retire = retire
        self.with_gym_state = with_gym_state
        self._groups = groups
        self._gdisp = gdisp
        # Reused rows counted in ``counts`` and ``total`` but not carried in ``rows`` (a plan
        # computed in the ledger, see :func:`assemble_plan`); 0 for the pure function's plans.
        self.reused_omitted = reused_omitted

    def __len__(self) -> int:
        return len(self.rows) + self.reused_omitted

    @property
    def total(self) -> int:
        return len(self.rows) + self.reused_omitted

    def group_outcomes(self) -> tuple[GroupOutcome, ...]:
        bumped = set(self.cohort_reruns)
        out = []
        for g, code in zip(self._groups, self._gdisp):
            gd = _GDISP_BY_CODE[code]
            ga = g.group_attempt + 1 if g.group_id in bumped else g.group_attempt
            out.append(
                GroupOutcome(g.group_id, RestoreLevel(g.restore_level), gd, ga, g.group_attempt)
            )
        return tuple(out)

    def continued_by_instance(self) -> dict[str, list[Episode]]:
        """Per instance, the continued episodes at their NEW Gym attempt (N+1), sorted."""
        out: dict[str, list[Episode]] = {}
        for r in self.rows.with_disposition(Disposition.continued):
            out.setdefault(r.instance_id or "", []).append(Episode(r.rollout_id, r.gym_attempt))
        for v in out.values():
            v.sort()
        return out

    def summary(self) -> dict[str, object]:
        """Small JSON-ready summary (counts and group-level facts, no per-row data)."""
        return {
            "siblings": self.total,
            "counts": {d.value: n for d, n in self.counts.items()},
            "cohort_reruns": len(self.cohort_reruns),
            "skipped_groups": len(self.skipped_groups),
            "retire": len(self.retire),
            "with_gym_state": self.with_gym_state,
        }


_G_PER_ROW, _G_REUSED, _G_RERUN, _G_DISPATCH, _G_SKIPPED = 0, 1, 2, 3, 4
_GDISP_BY_CODE = (
    GroupDisposition.per_row,
    GroupDisposition.reused,
    GroupDisposition.rerun,
    GroupDisposition.dispatch,
    GroupDisposition.skipped,
)


# -- the plan ---------------------------------------------------------------------------------


def plan_restore(
    cut: Cut,
    manifest: GymManifest | None,
    new_rollout_id: NewRolloutId,
    *,
    verify_unique_rollout_ids: bool = True,
) -> RestorePlan:
    """The restore plan of a snapshot (section 6.1) with Gym state from ``manifest``.

    ``manifest`` may be ``None`` for a snapshot without Gym state (every turn-level attempt
    that is not sealed or unsent then restarts).

    ``verify_unique_rollout_ids=False`` skips the check that the cut's rollout ids are unique
    (one set of every rollout id, the single most expensive step at a million rows); pass it
    only for a cut read from the ledger, whose unique constraint already guarantees it."""
    return _plan(
        cut, manifest, new_rollout_id, with_gym_state=True, verify_ids=verify_unique_rollout_ids
    )


def restore_without_gym_state(
    cut: Cut, new_rollout_id: NewRolloutId, *, verify_unique_rollout_ids: bool = True
) -> RestorePlan:
    """The plan when Gym survived the crash and nothing is installed on it (section 6.6).

    Every continuation becomes ``restarted``; ``plan.retire`` lists every attempt the cut
    knows as running in Gym (``dispatched``, and reserved Gym-owned continuations, which hold
    restored state), each on its instance, to retire before anything is dispatched."""
    return _plan(
        cut, None, new_rollout_id, with_gym_state=False, verify_ids=verify_unique_rollout_ids
    )


def may_run_in_gym(status: str, gym_attempt: int) -> bool:
    """Whether the cut knows an attempt as possibly running in Gym (ledger spec 6.6): it was
    ``dispatched``, or it is a reserved Gym-owned continuation (``gym_attempt > 0``)."""
    return status == "dispatched" or (status == "reserved" and gym_attempt > 0)


def retire_items(cut: Cut) -> list[RetireItem]:
    """Attempts of live groups that the cut knows as possibly running in Gym: ``dispatched``,
    or a reserved Gym-owned continuation (``gym_attempt > 0``). The same rule as
    :func:`restore_without_gym_state`, for callers that need only the list (ledger spec 6.6)."""
    live = {g.group_id for g in cut.groups if g.status in _LIVE_GROUP}
    out = []
    for a in cut.attempts:
        gid, _idx, aid, rid, inst, gym_att, _ga, st = a[:8]
        if gid in live and may_run_in_gym(st, gym_att):
            out.append(RetireItem(inst, rid, gym_att, aid))
    return out


def validate_cut(cut: Cut) -> None:
    """Check the invariants of a cut (see :mod:`.cut`); :class:`CutError` lists every
    broken one."""
    issues = cut_issues(cut)
    if issues:
        raise CutError(issues)


class _Issues:
    __slots__ = ("items", "extra")

    def __init__(self) -> None:
        self.items: list[FieldIssue] = []
        self.extra = 0

    def add(self, loc: tuple, message: str) -> None:
        if len(self.items) < _MAX_ISSUES:
            self.items.append(FieldIssue(loc, message))
        else:
            self.extra += 1

    def done(self) -> list[FieldIssue]:
        items = list(self.items)
        if self.extra:
            items.append(FieldIssue((), f"... and {self.extra} more issues"))
        return items


def cut_issues(cut: Cut) -> list[FieldIssue]:
    """Every broken invariant of a cut (at most 50, then a count), in input order.

    This is the careful, slow path; the plan's fast path only detects that something is wrong
    and then asks this function what."""
    issues = _Issues()
    gsize: dict[str, int] = {}
    glevel: dict[str, int] = {}
    gatt: dict[str, object] = {}
    gslot: dict[str, bytearray] = {}
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
    return issues.done()


_ATTEMPT_FIELDS = len(CutAttempt._fields)
_ROLLOUT_ID_OF = itemgetter(3)


def mint_needs_check(new_rollout_id: object) -> bool:
    """Whether the plan must check generated ids for collisions.

    Generators made by :func:`~.identity.rollout_id_minter` draw 128 fresh random bits per id
    (a collision among a million ids has probability ~1e-27, and the ledger's unique
    constraint on rollout ids is the final guard), so their ids are not re-checked; any other
    generator's ids are (one set over the new ids, one disjointness test against the cut)."""
    return getattr(new_rollout_id, "random_bits", 0) < 128


class _Broken(Exception):
    """The fast path found something wrong; the slow path says what."""


def _plan(
    cut: Cut,
    manifest: GymManifest | None,
    new_rollout_id: NewRolloutId,
    *,
    with_gym_state: bool,
    verify_ids: bool,
) -> RestorePlan:
    groups = cut.groups
    attempts = cut.attempts
    try:
        return _plan_fast(groups, attempts, manifest, new_rollout_id, with_gym_state, verify_ids)
    except (_Broken, TypeError, ValueError, LookupError, AttributeError):
        issues = cut_issues(cut)
        if issues:
            raise CutError(issues) from None
        raise


def _plan_fast(
    groups: Sequence[CutGroup],
    attempts: Sequence[CutAttempt],
    manifest: GymManifest | None,
    new_rollout_id: NewRolloutId,
    with_gym_state: bool,
    verify_ids: bool,
) -> RestorePlan:
    # -- groups: gid -> (index, level, size, slot offset, group attempt, live) ----------------
    ginfo: dict[str, tuple[int, int, int, int, int, bool]] = {}
    pg_groups: list[int] = []
    total = 0
    for k, g in enumerate(groups):
        lvl = _LEVEL_CODE[g.restore_level]  # KeyError -> slow path
        n = g.expected_generations
        ga = g.group_attempt
        if (
            type(n) is not int
            or not 1 <= n < MAX_GENERATIONS
            or type(ga) is not int
            or ga < 0
            or g.status not in _GROUP_STATUSES
            or g.group_id in ginfo
        ):
            raise _Broken
        live = g.status in _LIVE_GROUP
        ginfo[g.group_id] = (k, lvl, n, total, ga, live)
        if lvl == _L_PG and live:
            pg_groups.append(k)
        total += n

    # -- manifest, indexed per instance -------------------------------------------------------
    saved_by_inst: dict[str, dict[str, int]] = {}
    restart_by_inst: dict[str, dict[str, int]] = {}
    use_manifest = manifest is not None and with_gym_state
    if use_manifest:
        for iid, inst in manifest.instances.items():  # type: ignore[union-attr]
            saved_by_inst[iid] = dict(inst.episodes)
            restart_by_inst[iid] = dict(inst.restarts)
    empty: dict[str, int] = {}
    use_manifest = bool(saved_by_inst)
    matched_saved = 0
    matched_restarts = 0
    mismatch = False

    # -- pass 1: check each row and decide its disposition ------------------------------------
    # Per-row work is kept to a few local operations: no object is built for a row that keeps
    # its attempt, and checks that can run in C over the whole cut run after the loop.
    n_rows = len(attempts)
    disp = bytearray(n_rows)
    seen = bytearray(total)
    slotpos = [0] * total if pg_groups else None  # slot -> row position, prompt_group only
    pg_state = bytearray(len(groups))  # first code seen, 255 when mixed
    new_ids: list[str | None] = [None] * n_rows
    check_minted = mint_needs_check(new_rollout_id)
    minted: list[str] = []
    minted_append = minted.append
    retire_pos: list[int] = []
    skipped_rows = 0
    status_code = _STATUS_CODE
    ginfo_get = ginfo.get
    mint = new_rollout_id
    retiring = not with_gym_state
    last_gid: object = None
    k = lvl = n = off = ga = 0
    live = False

    for pos, (gid, idx, aid, rid, inst, gym_att, grp_att, st, _sk, _u, _rw, _ms) in enumerate(
        attempts
    ):
        if gid != last_gid:
            gi = ginfo_get(gid)
            if gi is None:
                raise _Broken
            k, lvl, n, off, ga, live = gi
            last_gid = gid
        if idx.__class__ is not int or not 0 <= idx < n or grp_att != ga:
            raise _Broken
        slot = off + idx
        seen[slot] = 1  # duplicates show up as a slot left unseen (pigeonhole), checked below
        s = status_code[st]  # KeyError -> slow path
        if gym_att.__class__ is not int:
            raise _Broken
        if gym_att and (gym_att < 0 or lvl != _L_TURN or inst is None):
            raise _Broken
        if not live:
            skipped_rows += 1
            continue
        if retiring and (s == _S_DISPATCHED or (s == _S_RESERVED and gym_att)):
            retire_pos.append(pos)

        if lvl == _L_SIBLING:
            if s == _S_SEALED:
                disp[pos] = _REUSED
            elif s == _S_RESERVED:
                disp[pos] = _DISPATCH
            elif s == _S_RETURNED:
                raise _Broken
            else:
                disp[pos] = _RERUN
                new_ids[pos] = new = mint(gid, idx)
                if check_minted:
                    minted_append(new)
        elif lvl == _L_TURN:
            if s == _S_RETURNED:
                raise _Broken
            if use_manifest and inst is not None:
                n_saved = saved_by_inst.get(inst, empty).get(rid)
                if n_saved is not None:
                    if n_saved != gym_att or not (
                        s == _S_DISPATCHED or (s == _S_RESERVED and gym_att)
                    ):
                        mismatch = True
                        continue
                    matched_saved += 1
                    disp[pos] = _CONTINUED
                    continue
                n_restart = restart_by_inst.get(inst, empty).get(rid)
                if n_restart is not None:
                    if n_restart != gym_att:
                        mismatch = True
                        continue
                    matched_restarts += 1
                    if s == _S_SEALED:
                        disp[pos] = _REUSED
                    elif s == _S_RESERVED and not gym_att:
                        disp[pos] = _DISPATCH
                    else:
                        disp[pos] = _GYM_RESTARTED
                        new_ids[pos] = new = mint(gid, idx)
                        if check_minted:
                            minted_append(new)
                    continue
            if s == _S_SEALED:
                disp[pos] = _REUSED
            elif s == _S_RESERVED and not gym_att:
                disp[pos] = _DISPATCH
            else:
                disp[pos] = _RESTARTED
                new_ids[pos] = new = mint(gid, idx)
                if check_minted:
                    minted_append(new)
        else:
            code = _REUSED if s == _S_SEALED else _DISPATCH if s == _S_RESERVED else _RERUN
            disp[pos] = code
            slotpos[slot] = pos  # type: ignore[index]
            prev = pg_state[k]
            if prev != code:
                pg_state[k] = code if prev == 0 else 255

    # Each sibling has exactly one current attempt: as many rows as slots, and every slot seen.
    if n_rows != total or seen.count(0):
        raise _Broken
    # Rollout ids are unique across the cut (one set, built in C).
    old_ids: set[str] | None = None
    if verify_ids:
        old_ids = set(map(_ROLLOUT_ID_OF, attempts))
        if len(old_ids) != n_rows:
            raise _Broken

    if use_manifest and (
        mismatch
        or matched_saved != manifest.episode_count  # type: ignore[union-attr]
        or matched_restarts != manifest.restart_count  # type: ignore[union-attr]
    ):
        bad = manifest_disagreements(manifest, Cut(groups, attempts))  # type: ignore[arg-type]
        raise ManifestLedgerMismatch(
            [
                FieldIssue(("instances", iid), "; ".join(reasons))
                for iid, reasons in sorted(bad.items())
            ]
            or [FieldIssue(("instances",), "the manifest disagrees with the ledger cut")],
            sorted(bad),
        )

    # -- pass 2: prompt_group cohorts ---------------------------------------------------------
    gdisp = bytearray(len(groups))
    bumped: list[str] = []
    for k in pg_groups:
        state = pg_state[k]
        if state == 255 or state == _RERUN:
            g = groups[k]
            gid = g.group_id
            _k, _l, n, off, _ga, _live = ginfo[gid]
            for idx in range(n):
                p = slotpos[off + idx]  # type: ignore[index]
                disp[p] = _RERUN
                new_ids[p] = new = mint(gid, idx)
                if check_minted:
                    minted_append(new)
            gdisp[k] = _G_RERUN
            bumped.append(gid)
        else:
            gdisp[k] = _G_REUSED if state == _REUSED else _G_DISPATCH
    if minted:
        minted_set = set(minted)
        if old_ids is None:
            old_ids = set(map(_ROLLOUT_ID_OF, attempts))
        if len(minted_set) != len(minted) or not minted_set.isdisjoint(old_ids):
            _raise_collision(attempts, new_ids)

    skipped: list[str] = []
    if len(ginfo) != len(pg_groups):
        for k, g in enumerate(groups):
            if g.status not in _LIVE_GROUP:
                gdisp[k] = _G_SKIPPED
                skipped.append(g.group_id)

    positions_kept: list[int] | None = None
    if skipped_rows:
        positions_kept = [p for p in range(n_rows) if disp[p]]
    counts = MappingProxyType({d: disp.count(_CODE_BY_DISP[d]) for d in Disposition})
    rows = PlanRows(attempts, disp, new_ids, frozenset(bumped), positions_kept)
    return RestorePlan(
        rows=rows,
        counts=counts,
        cohort_reruns=tuple(bumped),
        skipped_groups=tuple(skipped),
        retire=RetireList(attempts, retire_pos),
        with_gym_state=with_gym_state,
        groups=groups,
        gdisp=bytes(gdisp),
    )


def _raise_collision(attempts: Sequence[CutAttempt], new_ids: list[str | None]) -> None:
    taken = {a[3] for a in attempts}
    for p, new in enumerate(new_ids):
        if new is None:
            continue
        if new in taken:
            a = attempts[p]
            raise PlanError(
                [
                    FieldIssue(
                        ("attempts", p, "rollout_id"),
                        f"generated rollout id {new!r} for sibling {a[0]}_g{a[1]} is already "
                        "taken",
                    )
                ]
            )
        taken.add(new)
    raise AssertionError("rollout id count mismatch without a collision")


class RetireList(Sequence[RetireItem]):
    """The attempts to retire, built on access from the cut's rows."""

    __slots__ = ("_attempts", "_positions")

    def __init__(self, attempts: Sequence[CutAttempt], positions: list[int]) -> None:
        self._attempts = attempts
        self._positions = positions

    def __len__(self) -> int:
        return len(self._positions)

    @overload
    def __getitem__(self, i: int) -> RetireItem: ...

    @overload
    def __getitem__(self, i: slice) -> list[RetireItem]: ...

    def __getitem__(self, i: int | slice) -> RetireItem | list[RetireItem]:
        if isinstance(i, slice):
            return [self._item(p) for p in self._positions[i]]
        return self._item(self._positions[i])

    def _item(self, pos: int) -> RetireItem:
        a = self._attempts[pos]
        return RetireItem(a[4], a[3], a[5], a[2])

    def __iter__(self) -> Iterator[RetireItem]:
        return (self._item(p) for p in self._positions)

    def by_instance(self) -> dict[str | None, list[Episode]]:
        """Per instance (``None``: unknown, retire everywhere), the episodes to retire."""
        out: dict[str | None, list[Episode]] = {}
        for p in self._positions:
            a = self._attempts[p]
            out.setdefault(a[4], []).append(Episode(a[3], a[5]))
        return out


def _level_name(code: int) -> str:
    return ("turn", "sibling", "prompt_group")[code]


def demote_continuations(plan: RestorePlan, new_rollout_id: NewRolloutId) -> RestorePlan:
    """The plan after a failed (or discarded) Gym restore (section 6.3): every ``continued``
    row becomes ``restarted`` under a new rollout id. The retire of N+1 of every manifest
    episode is the Gym client's cleanup and is not part of the plan."""
    rows = plan.rows
    disp = bytearray(rows._disp)
    new_ids = list(rows._new_ids)
    taken: set[str] = {a[3] for a in rows._attempts}
    taken.update(x for x in new_ids if x is not None)
    for p, code in enumerate(disp):
        if code == _CONTINUED:
            a = rows._attempts[p]
            new = new_rollout_id(a[0], a[1])
            if new in taken:
                raise PlanError(
                    [
                        FieldIssue(
                            ("attempts", p, "rollout_id"),
                            f"generated rollout id {new!r} for sibling {a[0]}_g{a[1]} is "
                            "already taken",
                        )
                    ]
                )
            taken.add(new)
            new_ids[p] = new
            disp[p] = _RESTARTED
    new_rows = PlanRows(rows._attempts, disp, new_ids, rows._bumped, rows._positions)
    counts = _counts(disp, plan.reused_omitted)
    return RestorePlan(
        rows=new_rows,
        counts=counts,
        cohort_reruns=plan.cohort_reruns,
        skipped_groups=plan.skipped_groups,
        retire=plan.retire,
        with_gym_state=False,
        groups=plan._groups,
        gdisp=plan._gdisp,
        reused_omitted=plan.reused_omitted,
    )


def _counts(disp: bytearray, reused_omitted: int = 0) -> Mapping[Disposition, int]:
    out = {d: disp.count(_CODE_BY_DISP[d]) for d in Disposition}
    out[Disposition.reused] += reused_omitted
    return MappingProxyType(out)


DISPOSITION_CODES: Mapping[Disposition, int] = MappingProxyType(dict(_CODE_BY_DISP))
"""The one-byte code of each disposition (what :func:`assemble_plan` takes per row)."""


def assemble_plan(
    attempts: Sequence[CutAttempt],
    codes: bytes | bytearray,
    new_rollout_id: NewRolloutId,
    *,
    cohort_reruns: Sequence[str],
    skipped_groups: Sequence[str],
    reused: int,
    with_gym_state: bool,
) -> RestorePlan:
    """A plan whose dispositions were decided elsewhere (the ledger computes them in SQL, with
    :func:`plan_restore` as the reference it is tested against): ``attempts`` are the rows of
    live groups that are not ``reused``, in cut order, ``codes`` their disposition codes
    (:data:`DISPOSITION_CODES`), ``reused`` how many reused rows were left out. New rollout ids
    are minted here, sibling by sibling, exactly as :func:`plan_restore` mints them; rows of a
    rerunning cohort carry ``group_attempt + 1``. ``retire`` (without Gym state) lists the rows
    the cut knows as running in Gym, by the rule of :func:`restore_without_gym_state`."""
    disp = bytearray(codes)
    if len(disp) != len(attempts) or disp.count(_REUSED) or disp.count(0):
        raise ValueError("assemble_plan takes one non-reused disposition code per row")
    new_ids: list[str | None] = [None] * len(attempts)
    mint = new_rollout_id
    for code in (_RESTARTED, _GYM_RESTARTED, _RERUN):
        for m in re.finditer(re.escape(bytes((code,))), disp):
            p = m.start()
            a = attempts[p]
            new_ids[p] = mint(a[0], a[1])
    if mint_needs_check(new_rollout_id):
        minted = [x for x in new_ids if x is not None]
        minted_set = set(minted)
        if len(minted_set) != len(minted) or not minted_set.isdisjoint(map(_ROLLOUT_ID_OF, attempts)):
            _raise_collision(attempts, new_ids)
    retire_pos: list[int] = []
    if not with_gym_state:
        retire_pos = [
            p for p, a in enumerate(attempts) if may_run_in_gym(a[7], a[5])
        ]
    rows = PlanRows(attempts, disp, new_ids, frozenset(cohort_reruns), None)
    return RestorePlan(
        rows=rows,
        counts=_counts(disp, reused),
        cohort_reruns=tuple(cohort_reruns),
        skipped_groups=tuple(skipped_groups),
        retire=RetireList(attempts, retire_pos),
        with_gym_state=with_gym_state,
        groups=(),
        gdisp=b"",
        reused_omitted=reused,
    )


# -- checks before Gym is touched (section 6.2) -----------------------------------------------


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


class InstanceSetDiff(NamedTuple):
    missing: tuple[str, ...]  # in the manifest, not live
    unknown: tuple[str, ...]  # live, not in the manifest

    @property
    def equal(self) -> bool:
        return not self.missing and not self.unknown


def compare_instance_sets(manifest: GymManifest, live_instance_ids: Iterable[str]) -> InstanceSetDiff:
    live = set(live_instance_ids)
    have = set(manifest.instances)
    return InstanceSetDiff(tuple(sorted(have - live)), tuple(sorted(live - have)))


def missing_participants(
    manifest: GymManifest, live_participants: Mapping[str, Iterable[str]]
) -> dict[str, list[str]]:
    """Per instance, the manifest participants that are not live on it (extra live
    participants are fine: they have nothing to restore)."""
    out: dict[str, list[str]] = {}
    for iid, inst in manifest.instances.items():
        live = set(live_participants.get(iid, ()))
        missing = [p for p in inst.participants if p not in live]
        if missing:
            out[iid] = sorted(missing)
    return out


def require_restorable_topology(
    manifest: GymManifest, live_participants: Mapping[str, Iterable[str]]
) -> None:
    """Raise :class:`TopologyMismatch` naming missing/unknown instances and missing
    participants; ``live_participants`` maps every live instance to its participant names."""
    diff = compare_instance_sets(manifest, live_participants)
    issues: list[FieldIssue] = []
    if diff.missing:
        issues.append(
            FieldIssue(("instances",), f"instances in the manifest but not live: {', '.join(diff.missing)}")
        )
    if diff.unknown:
        issues.append(
            FieldIssue(("instances",), f"live instances unknown to the manifest: {', '.join(diff.unknown)}")
        )
    if not issues:
        for iid, names in sorted(missing_participants(manifest, live_participants).items()):
            issues.append(
                FieldIssue(
                    ("instances", iid, "participants"),
                    f"participants that committed the instance are not live: {', '.join(names)}",
                )
            )
    if issues:
        raise TopologyMismatch(issues)
