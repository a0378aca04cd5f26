"""Restore levels, their rank, and how a group's level is resolved.

A restore level says from how fine a point an unfinished rollout continues after a restore:

* ``turn``: from the last turn boundary Gym exported (needs Gym participants that export state);
* ``sibling``: each sibling (one generation of a prompt) starts over on its own;
* ``prompt_group``: the whole cohort of N siblings starts over together.

Ranks go finer to coarser: ``turn (0) < sibling (1) < prompt_group (2)``. Comparisons between
levels (``<``, ``<=``...) follow the rank, not the spelling.

``prefix`` (finer than ``turn``: continuing a partly generated model call) needs generation cuts
in the policy model, which this coordinator does not implement; it is refused with that reason.

Enum members are spelt exactly like their values (``RestoreLevel.turn == "turn"``), so a member
and its plain string are interchangeable as dict keys.
"""

from __future__ import annotations

from typing import Mapping, Protocol

from .errors import FieldIssue, LevelError
from .vocabulary import StrEnum

__all__ = [
    "RestoreLevel",
    "LiveGranularity",
    "PREFIX_REFUSAL",
    "parse_level",
    "live_granularity",
    "resolve_level",
    "LevelConfig",
]

PREFIX_REFUSAL = (
    "restore level 'prefix' is finer than 'turn': continuing a partly generated model call needs "
    "generation cuts in the policy model, which this coordinator does not implement (out of "
    "scope); use 'turn', 'sibling' or 'prompt_group'"
)


class RestoreLevel(StrEnum):
    turn = "turn"
    sibling = "sibling"
    prompt_group = "prompt_group"

    @property
    def rank(self) -> int:
        return _RANK[self]

    def is_coarser_than(self, other: "RestoreLevel") -> bool:
        return _RANK[self] > _RANK[other]

    # Order by rank; the str mixin would otherwise order by spelling.
    def __lt__(self, other: object) -> bool:
        if isinstance(other, RestoreLevel):
            return _RANK[self] < _RANK[other]
        return NotImplemented

    def __le__(self, other: object) -> bool:
        if isinstance(other, RestoreLevel):
            return _RANK[self] <= _RANK[other]
        return NotImplemented

    def __gt__(self, other: object) -> bool:
        if isinstance(other, RestoreLevel):
            return _RANK[self] > _RANK[other]
        return NotImplemented

    def __ge__(self, other: object) -> bool:
        if isinstance(other, RestoreLevel):
            return _RANK[self] >= _RANK[other]
        return NotImplemented

    __hash__ = str.__hash__

    def __str__(self) -> str:
        return self.value


_RANK = {RestoreLevel.turn: 0, RestoreLevel.sibling: 1, RestoreLevel.prompt_group: 2}


class LiveGranularity(StrEnum):
    """How live failures are recovered: one sibling at a time, or the whole cohort."""

    sibling = "sibling"
    prompt_group = "prompt_group"

    __hash__ = str.__hash__

    def __str__(self) -> str:
        return self.value


def parse_level(value: object, loc: tuple[str | int, ...] = ()) -> RestoreLevel:
    """The level named by ``value``; ``prefix`` and anything unknown raise :class:`LevelError`."""
    if isinstance(value, RestoreLevel):
        return value
    if not isinstance(value, str):
        raise LevelError(
            [FieldIssue(loc, f"a restore level must be a string, got {type(value).__name__}")]
        )
    if value == "prefix":
        raise LevelError([FieldIssue(loc, PREFIX_REFUSAL)])
    try:
        return RestoreLevel(value)
    except ValueError:
        raise LevelError(
            [
                FieldIssue(
                    loc,
                    f"unknown restore level {value!r}; expected one of 'turn', 'sibling', "
                    "'prompt_group'",
                )
            ]
        ) from None


def live_granularity(level: RestoreLevel) -> LiveGranularity:
    """``prompt_group`` for prompt_group groups, ``sibling`` for sibling and turn groups."""
    if level is RestoreLevel.prompt_group or level == "prompt_group":
        return LiveGranularity.prompt_group
    return LiveGranularity.sibling


class LevelConfig(Protocol):
    """What :func:`resolve_level` reads from a run's config (``RecoveryConfig`` has it)."""

    @property
    def target_level(self) -> RestoreLevel: ...

    @property
    def agent_target_level_overrides(self) -> Mapping[str, RestoreLevel]: ...

    @property
    def task_source_target_level_overrides(self) -> Mapping[str, RestoreLevel]: ...


def resolve_level(
    config: LevelConfig, agent_name: str | None, task_source: str | None
) -> RestoreLevel:
    """The level a newly admitted group gets: agent override, then task-source override, then
    the run's target level. The result is stored on the group and never re-resolved."""
    if agent_name is not None:
        level = config.agent_target_level_overrides.get(agent_name)
        if level is not None:
            return RestoreLevel(level)
    if task_source is not None:
        level = config.task_source_target_level_overrides.get(task_source)
        if level is not None:
            return RestoreLevel(level)
    return RestoreLevel(config.target_level)
