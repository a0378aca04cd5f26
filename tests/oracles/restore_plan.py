"""The restore plan (docs/ledger.md#restore-plans-and-dispositions) as a pure function of a
snapshot's cut: the test oracle of the planner the service runs (``ledger.restore_plan_sql``),
which the differential property tests compare with it on generated ledgers.

Inputs: a :class:`Cut`, the snapshot's :class:`GymManifest` (or ``None``) and an injected
``new_rollout_id(group_id, generation_index) -> str``. The dispositions are the table in
``domain/restore_plan.py``. A manifest that disagrees with the cut raises
:class:`ManifestLedgerMismatch`, an inconsistent cut :class:`CutError`, a generated rollout id
that is already taken :class:`PlanError`.
"""

from __future__ import annotations

from collections.abc import Sequence
from types import MappingProxyType

from checkpoint_coordinator.domain.cut import Cut, CutAttempt, CutGroup
from checkpoint_coordinator.domain.cut_checks import cut_issues, manifest_disagreements
from checkpoint_coordinator.domain.errors import CutError, FieldIssue, ManifestLedgerMismatch, PlanError
from checkpoint_coordinator.domain.gym_manifest import GymManifest
from checkpoint_coordinator.domain.identity import MAX_GENERATIONS
from checkpoint_coordinator.domain.restore_plan import (
    NewRolloutId,
    PlanRows,
    RestorePlan,
    RetireList,
    _raise_collision,
    mint_needs_check,
)
from checkpoint_coordinator.domain.plan_rows import (
    _CODE_BY_DISP,
    _CONTINUED,
    _DISPATCH,
    _GYM_RESTARTED,
    _RERUN,
    _RESTARTED,
    _REUSED,
    REASON_CODES,
)
from checkpoint_coordinator.domain.restore_plan import (
    _G_DISPATCH,
    _G_RERUN,
    _G_REUSED,
    _G_SKIPPED,
    _LIVE_GROUP,
    _ROLLOUT_ID_OF,
    Disposition,
)
from checkpoint_coordinator.domain.vocabulary import GroupStatus, RowReason

# Attempt status and level codes for the hot loop.
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
_GROUP_STATUSES = frozenset(s.value for s in GroupStatus)

__all__ = ["plan_restore", "restore_without_gym_state"]


def plan_restore(
    cut: Cut,
    manifest: GymManifest | None,
    new_rollout_id: NewRolloutId,
    *,
    verify_unique_rollout_ids: bool = True,
    mapped: frozenset[str] | None = None,
    too_stale: frozenset[int] = frozenset(),
) -> RestorePlan:
    """The restore plan of a snapshot with Gym state from ``manifest``
    (docs/ledger.md#restore-plans-and-dispositions).

    ``too_stale``: the attempt ids whose policy version is too old to continue
    (docs/ledger.md#stale-continuations); an exported episode of one restarts, reason ``too_stale``.

    ``manifest`` may be ``None`` for a snapshot without Gym state (every turn-level attempt
    that is not sealed or unsent then restarts).

    ``verify_unique_rollout_ids=False`` skips the check that the cut's rollout ids are unique
    (one set of every rollout id, the single most expensive step at a million rows); pass it
    only for a cut read from the ledger, whose unique constraint already guarantees it."""
    return _plan(
        cut, manifest, new_rollout_id, with_gym_state=True, verify_ids=verify_unique_rollout_ids, mapped=mapped, too_stale=too_stale
    )


def restore_without_gym_state(
    cut: Cut, new_rollout_id: NewRolloutId, *, verify_unique_rollout_ids: bool = True
) -> RestorePlan:
    """The plan when Gym survived the crash and nothing is installed on it
    (docs/ledger.md#without-gym-state).

    Every continuation becomes ``restarted``; ``plan.retire`` lists every attempt the cut
    knows as running in Gym (``dispatched``, and reserved Gym-owned continuations, which hold
    restored state), each on its instance, to retire before anything is dispatched."""
    return _plan(
        cut, None, new_rollout_id, with_gym_state=False, verify_ids=verify_unique_rollout_ids
    )



class _Broken(Exception):
    """The fast path found something wrong; the slow path says what."""


def _plan(
    cut: Cut,
    manifest: GymManifest | None,
    new_rollout_id: NewRolloutId,
    *,
    with_gym_state: bool,
    verify_ids: bool,
    mapped: frozenset[str] | None = None,
    too_stale: frozenset[int] = frozenset(),
) -> RestorePlan:
    groups = cut.groups
    attempts = cut.attempts
    try:
        return _plan_fast(groups, attempts, manifest, new_rollout_id, with_gym_state, verify_ids, mapped, too_stale)
    except (_Broken, ManifestLedgerMismatch, TypeError, ValueError, LookupError, AttributeError):
        # A broken cut wins over a manifest that disagrees with it, as the service checks the
        # cut first: the manifest is compared with a ledger that is not what it claims.
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
    mapped: frozenset[str] | None = None,
    too_stale: frozenset[int] = frozenset(),
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
    unmapped: set[int] = set()
    stale: set[int] = set()

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
                    if mapped is not None and inst not in mapped:
                        unmapped.add(pos)
                    elif aid in too_stale:
                        stale.add(pos)  # exported, but its policy is too old to continue
                    if pos in unmapped or pos in stale:
                        disp[pos] = _RESTARTED
                        new_ids[pos] = new = mint(gid, idx)
                        if check_minted:
                            minted_append(new)
                    else:
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
    reasons = _reasons(groups, attempts, disp, frozenset(bumped), with_gym_state, unmapped, stale)
    rows = PlanRows(attempts, disp, new_ids, frozenset(bumped), positions_kept, reasons)
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


def _reason(disposition: int, level: str, status: str, bumped: bool, with_gym_state: bool, unmapped: bool, stale: bool = False) -> RowReason:
    """Why a row does what it does, read off the row as docs/ledger.md#row-reasons words it."""
    failed = status in ("failed", "abandoned")
    if disposition == _REUSED:
        return RowReason.sealed_at_cut
    if disposition == _CONTINUED:
        return RowReason.exported_by_gym
    if disposition == _GYM_RESTARTED:
        return RowReason.restart_only_server
    if disposition == _DISPATCH:
        return RowReason.never_sent
    if disposition == _RERUN:
        if bumped:
            return RowReason.cohort_incomplete
        return RowReason.failed_at_cut if failed else RowReason.in_flight_at_cut
    assert disposition == _RESTARTED and level == "turn"
    if failed:
        return RowReason.failed_at_cut
    if not with_gym_state:
        return RowReason.gym_not_restored
    if unmapped:
        return RowReason.instance_not_mapped
    if stale:
        return RowReason.too_stale
    return RowReason.no_gym_state


def _reasons(
    groups: Sequence[CutGroup], attempts: Sequence[CutAttempt], disp: bytearray, bumped: frozenset[str], with_gym_state: bool,
    unmapped: set[int],
    stale: set[int] | frozenset[int] = frozenset(),
) -> bytearray:
    level = {g.group_id: str(g.restore_level) for g in groups}
    out = bytearray(len(disp))
    for pos, a in enumerate(attempts):
        if disp[pos]:
            why = _reason(disp[pos], level[a[0]], str(a[7]), a[0] in bumped, with_gym_state, pos in unmapped, pos in stale)
            out[pos] = REASON_CODES[why]
    return out
