"""What a trainer report is decided over and what the decision yields: the locked rows
(:class:`AttemptRow`, :class:`GroupRow`, :class:`GroupState`), the plan of writes
(:class:`ChangePlan`) and the decided report (:class:`Decision`). Kept apart from the rules
(``rollout_rules``) that fill them in, so that the ledger's store and the rules share one shape.
Nothing here does I/O."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from . import levels
from .identity import capture_key
from .vocabulary import AttemptStatus as A
from .vocabulary import GroupStatus as G
from .vocabulary import RetirementState

Mint = Callable[[str, int], str]

_GRANULARITY = {lv.value: levels.live_granularity(lv).value for lv in levels.RestoreLevel}
_PROMPT_GROUP = levels.LiveGranularity.prompt_group.value


def granularity(level: str) -> str:
    # A dict lookup: it is asked once per row of every batch.
    g = _GRANULARITY.get(level)
    return g if g is not None else levels.live_granularity(levels.RestoreLevel(level)).value


@dataclass(frozen=True)
class Budgets:
    max_row_attempts: int
    max_group_attempts: int
    max_data_attempts: int

    @classmethod
    def of(cls, config: Mapping[str, Any]) -> Budgets:
        return cls(
            max_row_attempts=int(config.get("max_row_attempts", 3)),
            max_group_attempts=int(config.get("max_group_attempts", 3)),
            max_data_attempts=int(config.get("max_data_attempts", 2)),
        )


@dataclass(slots=True)
class AttemptRow:
    attempt_id: int
    group_id: str
    generation_index: int
    rollout_id: str
    gym_instance_id: str | None
    gym_attempt: int
    group_attempt: int
    status: str
    is_current: bool
    refusals: int
    receipt: dict[str, Any] | None
    reward: float | None
    mask_sample: bool | None
    staging_keys: list[str] | None
    gym_owned: bool
    dispatch_id: str | None
    retirement: str
    # Why it ended when the trainer did not end it (docs/ledger.md#stragglers); None otherwise.
    end_reason: str | None = None
    row_attempts_used: int = 0

    @property
    def capture_key(self) -> str:
        return capture_key(self.rollout_id, self.gym_attempt)


@dataclass
class GroupRow:
    group_id: str
    restore_level: str
    expected_generations: int
    group_attempt: int
    data_attempts_used: int
    status: str
    fields: dict[str, Any] = field(default_factory=dict)


class Refusal(NamedTuple):
    code: str
    detail: str


def _refused(key: str, value: str, r: Refusal) -> dict[str, Any]:
    return {key: value, "code": r.code, "detail": r.detail}


def send_row(a: AttemptRow, level: str, instance_id: str | None = None) -> dict[str, Any]:
    return {
        "group_id": a.group_id,
        "generation_index": a.generation_index,
        "rollout_id": a.rollout_id,
        "capture_key": a.capture_key,
        "gym_attempt": a.gym_attempt,
        "group_attempt": a.group_attempt,
        "status": a.status,
        "restore_level": level,
        # A Gym-owned continuation must go back to the instance holding its state.
        "instance_id": instance_id if instance_id is not None else (a.gym_instance_id if a.gym_owned else None),
    }


class ChangePlan:
    """The writes one report decides, collected row by row and applied by ``ledger/`` at once.

    ``status_updates``: attempt id -> changed columns; ``new_attempts``: rollout id -> attempt to
    mint (group, sibling, rollout id, group attempt); ``retires``: attempts to retire on Gym
    (docs/ledger.md#the-outbox); ``group_updates``: group id -> changed columns; ``row_attempts``: sibling -> row
    attempts used; ``transitions``: target state -> count, for metrics."""

    __slots__ = ("mint_id", "status_updates", "new_attempts", "retires", "group_updates", "row_attempts", "transitions")

    def __init__(self, mint_id: Mint) -> None:
        self.mint_id = mint_id
        self.status_updates: dict[int, dict[str, Any]] = {}
        self.new_attempts: dict[str, dict[str, Any]] = {}  # by rollout id, in minting order
        self.retires: list[AttemptRow] = []
        self.group_updates: dict[str, dict[str, Any]] = {}
        self.row_attempts: dict[tuple[str, int], int] = {}
        self.transitions: dict[str, int] = defaultdict(int)

    def set_attempt(self, a: AttemptRow, **changes: Any) -> None:
        self.status_updates.setdefault(a.attempt_id, {}).update(changes)
        if "status" in changes:
            self.transitions[changes["status"]] += 1

    def end_attempt(self, a: AttemptRow, status: str, failure_class: str | None = None) -> None:
        """Abandon or fail an attempt; one that may still run in Gym gets a retire."""
        needs_retire = a.status == A.dispatched or (a.gym_owned and a.gym_instance_id is not None)
        changes: dict[str, Any] = {"status": status, "is_current": False}
        if failure_class:
            changes["failure_class"] = failure_class
        if needs_retire and a.gym_instance_id is not None and a.retirement == RetirementState.none:
            changes["retirement"] = RetirementState.retire_pending.value
            self.retires.append(a)
        self.set_attempt(a, **changes)

    def unmint(self, a: AttemptRow) -> bool:
        """Drop an attempt this plan minted and has not written: a cohort replaced later in the
        same report supersedes it, and it must never have existed (two current attempts of one
        sibling otherwise)."""
        if self.new_attempts.pop(a.rollout_id, None) is None:
            return False
        self.transitions[A.reserved.value] -= 1
        return True

    def mint(self, group_id: str, generation_index: int, group_attempt: int) -> dict[str, Any]:
        row = {
            "group_id": group_id,
            "generation_index": generation_index,
            "rollout_id": self.mint_id(group_id, generation_index),
            "group_attempt": group_attempt,
        }
        self.new_attempts[row["rollout_id"]] = row
        self.transitions[A.reserved.value] += 1
        return row

    def set_group(self, group_id: str, **changes: Any) -> None:
        self.group_updates.setdefault(group_id, {}).update(changes)
        if "status" in changes:
            st = changes["status"]
            self.transitions["group_abandoned" if st == G.abandoned else st] += 1


class GroupState:
    """One locked group and its current attempts while a report decides its fate."""

    __slots__ = ("g", "current")

    def __init__(self, g: GroupRow, current: Iterable[AttemptRow]) -> None:
        self.g = g
        self.current = {a.generation_index: a for a in current}

    @property
    def granularity(self) -> str:
        return granularity(self.g.restore_level)

    def answer(self) -> dict[str, Any]:
        """The group as a failure report answers it: its rows to send, if it still generates."""
        g = self.g
        send = (
            [send_row(a, g.restore_level) for _, a in sorted(self.current.items()) if a.status == A.reserved]
            if g.status == G.generating
            else []
        )
        return {"group_id": g.group_id, "status": g.status, "group_attempt": g.group_attempt, "rows_to_send": send}


# The attempt id of an attempt a plan minted and has not written yet.
MINTED_ID = -1


def _minted_view(row: dict[str, Any]) -> AttemptRow:
    return AttemptRow(
        attempt_id=MINTED_ID, group_id=row["group_id"], generation_index=row["generation_index"], rollout_id=row["rollout_id"],
        gym_instance_id=None, gym_attempt=0, group_attempt=row["group_attempt"], status=A.reserved.value, is_current=True,
        refusals=0, receipt=None, reward=None, mask_sample=None, staging_keys=None, gym_owned=False, dispatch_id=None,
        retirement=RetirementState.none.value,
    )



@dataclass
class Decision:
    """A decided report: the plan to apply, the rows refused (non-empty: nothing is applied)
    and what the answer needs."""

    plan: ChangePlan
    refused: list[dict[str, Any]] = field(default_factory=list)
    results: list[dict[str, Any]] = field(default_factory=list)
    touched: list[str] = field(default_factory=list)
    rows: list[dict[str, Any]] = field(default_factory=list)
    extra: list[Any] = field(default_factory=list)


def _no_mint(group_id: str, generation_index: int) -> str:
    raise AssertionError("this report mints no attempt")
