"""The rows of a restore plan, stored as columns: one byte of disposition and one of reason per
row of the cut, new rollout ids in a list; :class:`PlanRow` objects are built only when read.
Kept apart from the plan itself (``restore_plan``) because this storage is what every bulk
reader (the rewind's columns, the answer's rows, the counts by reason) goes through."""

from __future__ import annotations

import re
from collections.abc import Sequence
from types import MappingProxyType
from typing import Iterator, Mapping, NamedTuple, overload

from .cut import AttemptId, CutAttempt
from .vocabulary import REASON_DISPOSITIONS, Disposition, RowReason

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
    reason: RowReason | None = None  # why the row does what it does (docs/ledger.md#row-reasons)


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
    reason: list[str]


class Placement(NamedTuple):
    """Where the rows go in a restore into another topology (docs/ledger.md#another-gym-topology):
    a continued row to the live instance its saved instance maps to; every other row to send, in
    plan order, to the live instances in turn, so each gets an even share."""

    instance_map: Mapping[str, str]
    live_instances: tuple[str, ...]


# Reason codes: one byte per row beside the disposition code; 0 for a row outside the plan.
REASON_BY_CODE: tuple[RowReason | None, ...] = (None, *RowReason)
REASON_CODES: Mapping[RowReason, int] = MappingProxyType({r: i for i, r in enumerate(REASON_BY_CODE) if r is not None})


class PlanRows(Sequence[PlanRow]):
    """The rows of a plan, in the order of the cut's attempts (skipped groups left out).

    Backed by columns; indexing or iterating builds :class:`PlanRow` objects on the fly."""

    __slots__ = ("_attempts", "_disp", "_new_ids", "_bumped", "_positions", "_reasons", "_placement", "_spread_at")

    def __init__(
        self,
        attempts: Sequence[CutAttempt],
        disp: bytearray,
        new_ids: list[str | None],
        bumped: frozenset[str],
        positions: list[int] | None,
        reasons: bytes | bytearray | None = None,
        placement: Placement | None = None,
    ) -> None:
        self._attempts = attempts
        self._disp = disp
        self._new_ids = new_ids
        self._bumped = bumped
        self._positions = positions
        self._reasons = reasons if reasons is not None else bytes(len(disp))
        self._placement = placement
        self._spread_at: dict[int, str] | None = None

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

    def _spread(self, pos: int) -> str | None:
        """The live instance a non-continued row to send goes to, under a placement."""
        if self._placement is None:
            return None
        if self._spread_at is None:
            live = self._placement.live_instances
            at: dict[int, str] = {}
            codes = self._disp
            k = 0
            for p in range(len(codes)) if self._positions is None else self._positions:
                c = codes[p]
                if c and c != _REUSED and c != _CONTINUED:
                    at[p] = live[k % len(live)]
                    k += 1
            self._spread_at = at
        return self._spread_at.get(pos)

    def _row(self, pos: int) -> PlanRow:
        gid, idx, aid, rid, inst, gatt, gratt = self._attempts[pos][:7]
        sk = self._attempts[pos][8] if len(self._attempts[pos]) > 8 else ()
        code = self._disp[pos]
        why = REASON_BY_CODE[self._reasons[pos]]
        if code == _REUSED:
            ck = rid if gatt == 0 else f"{rid}-a{gatt}"
            return PlanRow(gid, idx, Disposition.reused, rid, gatt, ck, inst, tuple(sk), gratt, aid, None, why)
        if code == _CONTINUED:
            n = gatt + 1
            where = self._placement.instance_map.get(inst, inst) if self._placement is not None and inst is not None else inst
            return PlanRow(gid, idx, Disposition.continued, rid, n, f"{rid}-a{n}", where, (), gratt, aid, None, why)
        if code == _DISPATCH:
            ck = rid if gatt == 0 else f"{rid}-a{gatt}"
            return PlanRow(gid, idx, Disposition.dispatch, rid, gatt, ck, self._spread(pos), (), gratt, aid, None, why)
        new = self._new_ids[pos]
        assert new is not None
        ga = gratt + 1 if gid in self._bumped else gratt
        return PlanRow(gid, idx, _DISP_BY_CODE[code], new, 0, new, self._spread(pos), (), ga, aid, rid, why)  # type: ignore[arg-type]

    def positions(self, disposition: Disposition) -> list[int]:
        """Positions in the cut's attempts of the rows of one disposition, in row order (a scan
        of one byte per row in C; no row is built)."""
        code = _CODE_BY_DISP[Disposition(disposition)]
        return [m.start() for m in re.finditer(re.escape(bytes((code,))), self._disp)]

    def columns(self, disposition: Disposition) -> "PlanColumns":
        """The rows of one disposition as columns (what a bulk write needs), in row order, equal
        field by field to the rows :meth:`with_disposition` yields (instances as in the cut)."""
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
        ``instance_id`` for continued rows, which must go back to their instance, and under a
        placement for every row). No row object is built: at a million siblings this is the
        answer's critical path."""
        cols: SentColumns = SentColumns([], [], [], [], [], [], [], [], [], [])
        gids, idxs, disps, rids, gatts, gratts, insts, reps, aids, whys = cols
        att, codes, new_ids, bumped, reasons = self._attempts, self._disp, self._new_ids, self._bumped, self._reasons
        names = [d.value if d is not None else "" for d in _DISP_BY_CODE]
        why_names = [r.value if r is not None else "" for r in REASON_BY_CODE]
        placement = self._placement
        live = placement.live_instances if placement is not None else ()
        mapped = placement.instance_map if placement is not None else {}
        k = 0
        for p in range(len(codes)) if self._positions is None else self._positions:
            code = codes[p]
            if code == _REUSED or not code:
                continue
            gid, idx, aid, rid, inst, gatt, gratt = att[p][:7]
            gids.append(gid)
            idxs.append(idx)
            disps.append(names[code])
            aids.append(aid)
            whys.append(why_names[reasons[p]])
            if code == _CONTINUED:
                rids.append(rid)
                gatts.append(gatt + 1)
                gratts.append(gratt)
                insts.append(mapped.get(inst, inst) if placement is not None and inst is not None else inst)
                reps.append(None)
                continue
            if placement is not None:
                insts.append(live[k % len(live)])
                k += 1
            else:
                insts.append(None)
            if code == _DISPATCH:
                rids.append(rid)
                gatts.append(gatt)
                gratts.append(gratt)
                reps.append(None)
            else:
                rids.append(new_ids[p])
                gatts.append(0)
                gratts.append(gratt + 1 if gid in bumped else gratt)
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

    def reason_counts(self) -> dict[tuple[int, int], int]:
        """Rows per (disposition code, reason code), counted one byte at a time in C: most
        reasons go with one disposition, so only the rows of the others are looked at."""
        out: dict[tuple[int, int], int] = {}
        reasons = bytes(self._reasons) if self._positions is None else bytes(self._reasons[p] for p in self._positions)
        disp = bytes(self._disp) if self._positions is None else bytes(self._disp[p] for p in self._positions)
        for code, why in enumerate(REASON_BY_CODE):
            n = reasons.count(code)
            if not n:
                continue
            allowed = REASON_DISPOSITIONS[why] if why is not None else ()
            if len(allowed) == 1:
                out[(_CODE_BY_DISP[next(iter(allowed))], code)] = n
                continue
            for m in re.finditer(re.escape(bytes((code,))), reasons):
                key = (disp[m.start()], code)
                out[key] = out.get(key, 0) + 1
        return out
