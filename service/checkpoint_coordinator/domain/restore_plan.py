"""The restore plan (docs/ledger.md#restore-plans-and-dispositions): its rows, dispositions and
counts.

The dispositions are decided by the ledger's planner (``ledger.restore_plan_sql``, set-based);
this module holds the plan it yields (:func:`assemble_plan`) and what is done with it. The pure
reference planner the differential tests compare it with is ``tests/oracles/restore_plan.py``.

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

An exported episode whose attempt was dispatched under a policy version older than the run's
``max_continue_staleness`` allows is ``restarted`` instead of continued, reason ``too_stale``
(:func:`too_stale`; docs/ledger.md#stale-continuations).

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

A manifest must agree with the cut: every manifest episode is the current attempt of a live
turn-level sibling, on that instance, at that Gym attempt, and (for saved episodes) still a Gym
candidate (dispatched, or reserved with ``gym_attempt > 0``); ``domain.cut_checks`` names what
disagrees. The plan is stored columnar (one byte of disposition per row, new rollout ids in a
list); :class:`PlanRow` objects are built only when read.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from operator import itemgetter
from types import MappingProxyType
from typing import Callable, Iterator, Mapping, NamedTuple, overload

from .cut import AttemptId, Cut, CutAttempt, CutGroup
from .errors import FieldIssue, PlanError
from .gym_manifest import ManifestEpisode
from .levels import RestoreLevel
from .plan_rows import (
    _CODE_BY_DISP,
    _CONTINUED,
    _DISP_BY_CODE,
    _GYM_RESTARTED,
    _RERUN,
    _RESTARTED,
    REASON_BY_CODE,
    REASON_CODES,
    Placement,
    PlanColumns,
    PlanRow,
    PlanRows,
)
from .vocabulary import LIVE_GROUP_STATUSES, Disposition, GroupDisposition, RowReason

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
    "assemble_plan",
    "DISPOSITION_CODES",
    "REASON_BY_CODE",
    "REASON_CODES",
    "Placement",
    "demote_continuations",
    "retire_items",
    "may_run_in_gym",
    "mint_needs_check",
    "oldest_continuable_version",
    "too_stale",
    "RetireList",
]

NewRolloutId = Callable[[str, int], str]




_LIVE_GROUP = frozenset(s.value for s in LIVE_GROUP_STATUSES)




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
    def episode(self) -> ManifestEpisode:
        return ManifestEpisode(self.rollout_id, self.gym_attempt)





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

    def continued_by_instance(self) -> dict[str, list[ManifestEpisode]]:
        """Per instance, the continued episodes at their NEW Gym attempt (N+1), sorted."""
        out: dict[str, list[ManifestEpisode]] = {}
        for r in self.rows.with_disposition(Disposition.continued):
            out.setdefault(r.instance_id or "", []).append(ManifestEpisode(r.rollout_id, r.gym_attempt))
        for v in out.values():
            v.sort()
        return out

    def reasons(self) -> dict[str, dict[str, int]]:
        """Rows per disposition and reason (docs/ledger.md#row-reasons), reused rows left out of
        ``rows`` included (all of them ``sealed_at_cut``)."""
        out: dict[str, dict[str, int]] = {}
        for (dcode, rcode), n in sorted(self.rows.reason_counts().items()):
            d, why = _DISP_BY_CODE[dcode], REASON_BY_CODE[rcode]
            if d is None or why is None:
                continue
            out.setdefault(d.value, {})[why.value] = n
        if self.reused_omitted:
            got = out.setdefault(Disposition.reused.value, {})
            got[RowReason.sealed_at_cut.value] = got.get(RowReason.sealed_at_cut.value, 0) + self.reused_omitted
        return out

    def placed(self, placement: Placement | None) -> RestorePlan:
        """The same plan with its rows placed on the instances of another topology
        (docs/ledger.md#another-gym-topology)."""
        r = self.rows
        rows = PlanRows(r._attempts, r._disp, r._new_ids, r._bumped, r._positions, r._reasons, placement)
        return RestorePlan(
            rows, self.counts, self.cohort_reruns, self.skipped_groups, self.retire, self.with_gym_state, self._groups,
            self._gdisp, self.reused_omitted,
        )

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


def may_run_in_gym(status: str, gym_attempt: int) -> bool:
    """Whether the cut knows an attempt as possibly running in Gym
    (docs/ledger.md#without-gym-state): it was ``dispatched``, or it is a reserved Gym-owned
    continuation (``gym_attempt > 0``)."""
    return status == "dispatched" or (status == "reserved" and gym_attempt > 0)


def oldest_continuable_version(anchor_step: int, max_continue_staleness: int | None) -> int | None:
    """The oldest policy version a continuation may have been dispatched under and still continue
    from a snapshot anchored at ``anchor_step`` (docs/ledger.md#stale-continuations): a version of
    exactly ``anchor_step - max_continue_staleness`` continues, one older restarts. ``None``: no
    limit (``max_continue_staleness`` unset)."""
    return None if max_continue_staleness is None else anchor_step - max_continue_staleness


def too_stale(policy_version: int | None, oldest: int | None) -> bool:
    """Whether a continuation dispatched under ``policy_version`` restarts (``too_stale``) below the
    limit ``oldest`` (:func:`oldest_continuable_version`). An attempt with no recorded version
    (none announced at its dispatch, or dispatched before versions were recorded) is never stale."""
    return oldest is not None and policy_version is not None and policy_version < oldest


def retire_items(cut: Cut) -> list[RetireItem]:
    """Attempts of live groups that the cut knows as possibly running in Gym: ``dispatched``,
    or a reserved Gym-owned continuation (``gym_attempt > 0``). The same rule as
    :func:`restore_without_gym_state`, for callers that need only the list
    (docs/ledger.md#without-gym-state)."""
    live = {g.group_id for g in cut.groups if g.status in _LIVE_GROUP}
    out = []
    for a in cut.attempts:
        gid, _idx, aid, rid, inst, gym_att, _ga, st = a[:8]
        if gid in live and may_run_in_gym(st, gym_att):
            out.append(RetireItem(inst, rid, gym_att, aid))
    return out


_ATTEMPT_FIELDS = len(CutAttempt._fields)
_ROLLOUT_ID_OF = itemgetter(3)


def mint_needs_check(new_rollout_id: object) -> bool:
    """Whether the plan must check generated ids for collisions.

    Generators made by :func:`~.identity.rollout_id_minter` draw 128 fresh random bits per id
    (a collision is negligible at any plan size, and the ledger's unique
    constraint on rollout ids is the final guard), so their ids are not re-checked; any other
    generator's ids are (one set over the new ids, one disjointness test against the cut)."""
    return getattr(new_rollout_id, "random_bits", 0) < 128


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

    def by_instance(self) -> dict[str | None, list[ManifestEpisode]]:
        """Per instance (``None``: unknown, retire everywhere), the episodes to retire."""
        out: dict[str | None, list[ManifestEpisode]] = {}
        for p in self._positions:
            a = self._attempts[p]
            out.setdefault(a[4], []).append(ManifestEpisode(a[3], a[5]))
        return out


def _level_name(code: int) -> str:
    return ("turn", "sibling", "prompt_group")[code]


def demote_continuations(plan: RestorePlan, new_rollout_id: NewRolloutId) -> RestorePlan:
    """The plan after a failed (or discarded) Gym restore (docs/ledger.md#row-reasons): every
    ``continued`` row becomes ``restarted`` under a new rollout id (reason ``gym_restore_failed``).
    The retire of N+1 of every manifest episode is the Gym client's cleanup and is not part of the
    plan."""
    rows = plan.rows
    disp = bytearray(rows._disp)
    reasons = bytearray(rows._reasons)
    new_ids = list(rows._new_ids)
    taken: set[str] = {a[3] for a in rows._attempts}
    taken.update(x for x in new_ids if x is not None)
    failed = REASON_CODES[RowReason.gym_restore_failed]
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
            reasons[p] = failed
    new_rows = PlanRows(rows._attempts, disp, new_ids, rows._bumped, rows._positions, reasons, rows._placement)
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
    reasons: bytes | bytearray | None = None,
    placement: Placement | None = None,
) -> RestorePlan:
    """The plan of dispositions decided by the ledger's planner (``ledger.restore_plan_sql``):
    ``attempts`` are the rows of live groups the planner returned, in cut order (reused rows
    only when asked for), ``codes`` their disposition codes (:data:`DISPOSITION_CODES`),
    ``reused`` how many reused rows were left out, ``reasons`` the reason code of each row
    (:data:`REASON_CODES`), ``placement`` where the rows go in another topology. New rollout ids are minted here, sibling by
    sibling; rows of a rerunning cohort carry ``group_attempt + 1``. ``retire`` (without Gym
    state) lists the rows the cut knows as running in Gym (:func:`may_run_in_gym`)."""
    disp = bytearray(codes)
    if len(disp) != len(attempts) or disp.count(0):
        raise ValueError("assemble_plan takes one disposition code per row")
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
    if reasons is not None and len(reasons) != len(disp):
        raise ValueError("assemble_plan takes one reason code per row")
    rows = PlanRows(attempts, disp, new_ids, frozenset(cohort_reruns), None, reasons, placement)
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
