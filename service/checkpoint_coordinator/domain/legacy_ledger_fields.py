"""Reading a NeMo RL ledger document field by field (``legacy_ledger``): the top level, each group
and each attempt, every problem refused at its document path (up to 50), and the schema rules
that tell schema 4 from schemas 2 and 3. Kept apart from the loader, which checks the version
first and the result as a cut after, so that each field's rule reads on its own."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Mapping, Sequence

from .cut import CutAttempt, CutGroup, PromptRef
from .errors import IssueList, LegacyLedgerError
from .identity import GROUP_ID, INSTANCE_ID, ROLLOUT_ID, SERVER_NAME, TASK_SOURCE
from .json_kinds import json_kind
from .levels import PREFIX_REFUSAL, RestoreLevel
from .vocabulary import AttemptStatus, GroupStatus

Loc = tuple[str | int, ...]

_TOP_KEYS = ("schema_version", "groups", "batch_shortfall", "sampler_stamps_target_steps")
_GROUP_REQUIRED = (
    "group_id",
    "prompt_ref",
    "task_digest",
    "expected_generations",
    "group_attempt",
    "status",
    "attempts",
)
_GROUP_OPTIONAL = ("task_source", "agent_name", "data_attempts_used", "target_step", "weight_version")
_ATTEMPT_REQUIRED = ("generation_index", "rollout_id", "status")
_ATTEMPT_OPTIONAL = ("row_attempts_used", "reward", "mask_sample", "staging_keys")
_GYM_KEYS = ("gym_instance_id", "gym_attempt")
_GROUP_STATUSES = tuple(s.value for s in GroupStatus)
_ATTEMPT_STATUSES = tuple(s.value for s in AttemptStatus)
_MAX_ISSUES = 50


class Refusals(IssueList):
    """The problems found so far (the first 50, then a count), each at its document path."""

    __slots__ = ()

    def __init__(self) -> None:
        super().__init__(_MAX_ISSUES, "refusals")

    def __call__(self, loc: Loc, message: str) -> None:
        self.add(loc, message)

    def __bool__(self) -> bool:
        return bool(self.items)

    def raise_if_any(self) -> None:
        if self.items:
            raise LegacyLedgerError(self.done())

    def unknown_keys(self, obj: Mapping[str, Any], allowed: set[str], loc: Loc, special: Mapping[str, str]) -> bool:
        """Refuse every key of ``obj`` not ``allowed`` (``special``: why, for some); any refused."""
        bad = False
        for key in sorted((k for k in obj if k not in allowed), key=str):
            self(loc + (str(key),), special.get(key, "unknown field"))
            bad = True
        return bad

    def missing_keys(self, obj: Mapping[str, Any], required: Sequence[str], loc: Loc, why: Mapping[str, str] = MappingProxyType({})) -> bool:
        """Refuse every ``required`` key ``obj`` lacks (``why``: the reason, for some); any refused."""
        bad = False
        for key in required:
            if key not in obj:
                self(loc + (key,), "missing" + (f"; {why[key]}" if key in why else ""))
                bad = True
        return bad


def nonneg_int(v: object) -> bool:
    return type(v) is int and v >= 0


@dataclass(frozen=True)
class SchemaRules:
    """What the document's schema version allows and requires of its groups and attempts."""

    version: int
    old: bool  # schema 2 or 3
    level_key: str
    group_allowed: set[str]
    group_special: Mapping[str, str]
    attempt_allowed: set[str]
    attempt_special: Mapping[str, str]
    attempt_required: tuple[str, ...]
    attempt_why: Mapping[str, str]

    @classmethod
    def of(cls, version: int) -> SchemaRules:
        old = version < 4
        level_key = "recovery_granularity" if old else "restore_level"
        group_special = (
            {
                "restore_level": f"schema {version} predates restore levels; a file that carries "
                "one is refused rather than guessed at",
            }
            if old
            else {"recovery_granularity": "schema 4 replaced recovery_granularity by restore_level"}
        )
        attempt_special = (
            {
                k: f"schema {version} predates Gym turn state; a file that carries it is refused "
                "rather than guessed at"
                for k in _GYM_KEYS
            }
            if old
            else {}
        )
        gym_why = {k: "schema 4 attempts record their Gym instance and attempt" for k in _GYM_KEYS}
        return cls(
            version=version,
            old=old,
            level_key=level_key,
            group_allowed=set(_GROUP_REQUIRED) | set(_GROUP_OPTIONAL) | {level_key},
            group_special=group_special,
            attempt_allowed=set(_ATTEMPT_REQUIRED) | set(_ATTEMPT_OPTIONAL) | (set() if old else set(_GYM_KEYS)),
            attempt_special=attempt_special,
            attempt_required=_ATTEMPT_REQUIRED if old else _ATTEMPT_REQUIRED + _GYM_KEYS,
            attempt_why={} if old else gym_why,
        )


def read_top_level(doc: Mapping[str, Any], refuse: Refusals) -> tuple[Any, Any, list[Any]]:
    """``(batch_shortfall, sampler_stamps_target_steps, groups)`` of the document; raises the
    refusals when a top-level key is unknown or missing or the groups are not an array."""
    refuse.unknown_keys(doc, set(_TOP_KEYS), (), {})
    refuse.missing_keys(doc, _TOP_KEYS, ())
    refuse.raise_if_any()

    shortfall = doc["batch_shortfall"]
    _nonneg_field(doc, "batch_shortfall", (), refuse)
    stamps = doc["sampler_stamps_target_steps"]
    if isinstance(stamps, list):
        for i, s in enumerate(stamps):
            if not nonneg_int(s):
                refuse(("sampler_stamps_target_steps", i), f"must be an integer >= 0, got {s!r}")
    elif isinstance(stamps, Mapping):
        for k, s in stamps.items():
            if not isinstance(k, str) or not k:
                refuse(("sampler_stamps_target_steps", str(k)), "keys must be non-empty strings")
            elif not nonneg_int(s):
                refuse(("sampler_stamps_target_steps", k), f"must be an integer >= 0, got {s!r}")
    else:
        refuse(
            ("sampler_stamps_target_steps",),
            f"must be an array or an object of integers, got {json_kind(stamps)}",
        )
    raw_groups = doc["groups"]
    if not isinstance(raw_groups, list):
        refuse(("groups",), f"must be an array, got {json_kind(raw_groups)}")
        refuse.raise_if_any()
    return shortfall, stamps, raw_groups


@dataclass
class ReadGroups:
    """The groups and attempts read from the document, and where each stood in it."""

    groups: list[CutGroup] = field(default_factory=list)
    attempts: list[CutAttempt] = field(default_factory=list)
    doc_loc_of_attempt: list[tuple[int, int]] = field(default_factory=list)
    doc_index_of_group: list[int] = field(default_factory=list)
    data_attempts: dict[str, int] = field(default_factory=dict)


def read_groups(raw_groups: list[Any], rules: SchemaRules, refuse: Refusals) -> ReadGroups:
    """Every group of the document with its attempts; what is refused is left out."""
    out = ReadGroups()
    for gi, g in enumerate(raw_groups):
        gloc: Loc = ("groups", gi)
        group = read_group(g, gloc, rules, refuse)
        if group is None:
            continue
        out.groups.append(group)
        out.doc_index_of_group.append(gi)
        out.data_attempts[group.group_id] = g.get("data_attempts_used", 0)
        for ai, a in enumerate(g["attempts"]):
            aloc = gloc + ("attempts", ai)
            if not isinstance(a, Mapping):
                refuse(aloc, f"must be an object, got {json_kind(a)}")
                continue
            broken = refuse.unknown_keys(a, rules.attempt_allowed, aloc, rules.attempt_special)
            broken |= refuse.missing_keys(a, rules.attempt_required, aloc, rules.attempt_why)
            if broken:
                continue
            parsed = _attempt(a, aloc, group.group_id, group.group_attempt, rules.old, refuse)
            if parsed is not None:
                out.attempts.append(parsed)
                out.doc_loc_of_attempt.append((gi, ai))
    return out


def read_group(g: Any, gloc: Loc, rules: SchemaRules, refuse: Refusals) -> CutGroup | None:
    """One group of the document (its attempts are read by the caller), or None when refused."""
    if not isinstance(g, Mapping):
        refuse(gloc, f"must be an object, got {json_kind(g)}")
        return None
    broken = refuse.unknown_keys(g, rules.group_allowed, gloc, rules.group_special)
    broken |= refuse.missing_keys(g, _GROUP_REQUIRED + (rules.level_key,), gloc)
    if broken:
        return None
    gid = g["group_id"]
    ok = _id_field(GROUP_ID, gid, gloc + ("group_id",), refuse, nullable=False)
    level = _level(g[rules.level_key], rules.old, rules.version, gloc + (rules.level_key,), refuse)
    ok &= level is not None
    ok = _prompt_ref(g["prompt_ref"], gloc + ("prompt_ref",), refuse, ok)
    ok &= _group_fields(g, gloc, refuse)
    if not ok:
        return None
    pref = g["prompt_ref"]
    return CutGroup(
        group_id=gid,
        restore_level=level,  # type: ignore[arg-type]
        expected_generations=g["expected_generations"],
        group_attempt=g["group_attempt"],
        status=GroupStatus(g["status"]),
        task_digest=g["task_digest"],
        prompt_ref=PromptRef(pref["sample_id"], pref["task_name"]),
        agent_name=g.get("agent_name"),
        task_source=g.get("task_source"),
        target_step=g.get("target_step"),
        weight_version=g.get("weight_version"),
    )


def _prompt_ref(pref: Any, loc: Loc, refuse: Refusals, ok: bool) -> bool:
    """``ok`` and the group's prompt_ref checks; its values are checked only while ``ok``."""
    if not isinstance(pref, Mapping):
        refuse(loc, f"must be an object, got {json_kind(pref)}")
        return False
    ok &= not refuse.unknown_keys(pref, {"sample_id", "task_name"}, loc, {})
    ok &= not refuse.missing_keys(pref, ("sample_id", "task_name"), loc)
    if ok:
        sid = pref["sample_id"]
        if not (type(sid) is int or (isinstance(sid, str) and sid)):
            refuse(
                loc + ("sample_id",),
                f"must be an integer or a non-empty string, got {json_kind(sid)}",
            )
            ok = False
        if not isinstance(pref["task_name"], str) or not pref["task_name"]:
            refuse(loc + ("task_name",), "must be a non-empty string")
            ok = False
    return ok


def _group_fields(g: Mapping[str, Any], gloc: Loc, refuse: Refusals) -> bool:
    """The group's other fields, each refused on its own; whether all passed."""
    ok = True
    if not isinstance(g["task_digest"], str) or not g["task_digest"]:
        refuse(gloc + ("task_digest",), "must be a non-empty string")
        ok = False
    n = g["expected_generations"]
    if type(n) is not int or n < 1:
        refuse(gloc + ("expected_generations",), f"must be an integer >= 1, got {n!r}")
        ok = False
    ok &= _nonneg_field(g, "group_attempt", gloc, refuse)
    status = g["status"]
    if status not in _GROUP_STATUSES:
        refuse(
            gloc + ("status",),
            f"must be one of {', '.join(_GROUP_STATUSES)}, got {status!r}",
        )
        ok = False
    ok &= _nonneg_field(g, "data_attempts_used", gloc, refuse, default=0)
    ok &= _id_field(TASK_SOURCE, g.get("task_source"), gloc + ("task_source",), refuse)
    ok &= _id_field(SERVER_NAME, g.get("agent_name"), gloc + ("agent_name",), refuse)
    step = g.get("target_step")
    if step is not None and not nonneg_int(step):
        refuse(gloc + ("target_step",), f"must be an integer >= 0 or null, got {step!r}")
        ok = False
    wv = g.get("weight_version")
    if wv is not None and not (type(wv) is int or isinstance(wv, str)):
        refuse(
            gloc + ("weight_version",),
            f"must be an integer, a string or null, got {json_kind(wv)}",
        )
        ok = False
    raw_attempts = g["attempts"]
    if not isinstance(raw_attempts, list):
        refuse(gloc + ("attempts",), f"must be an array, got {json_kind(raw_attempts)}")
        ok = False
    return ok


_REQUIRED: Any = object()


def _nonneg_field(obj: Mapping[str, Any], key: str, loc: Loc, refuse: Refusals, default: Any = _REQUIRED) -> bool:
    """Refuse ``obj[key]`` (``default`` when absent, for an optional key) unless an integer >= 0."""
    v = obj[key] if default is _REQUIRED else obj.get(key, default)
    if nonneg_int(v):
        return True
    refuse(loc + (key,), f"must be an integer >= 0, got {v!r}")
    return False


def _id_field(rule: Any, value: Any, loc: Loc, refuse: Refusals, *, nullable: bool = True) -> bool:
    """Refuse an identifier ``value`` that breaks ``rule`` (``None`` passes when ``nullable``)."""
    reason = None if nullable and value is None else rule.problem(value)
    if not reason:
        return True
    refuse(loc, reason)
    return False


def _level(
    value: Any, old: bool, version: int, loc: Loc, refuse: Refusals
) -> RestoreLevel | None:
    if value == "prefix":
        refuse(loc, PREFIX_REFUSAL)
        return None
    if old:
        if value == "turn":
            refuse(
                loc,
                f"the turn level did not exist in schema {version}; a file that carries it is "
                "refused rather than guessed at",
            )
            return None
        if value not in ("sibling", "prompt_group"):
            refuse(loc, f"must be 'sibling' or 'prompt_group', got {value!r}")
            return None
    elif value not in ("turn", "sibling", "prompt_group"):
        refuse(loc, f"must be 'turn', 'sibling' or 'prompt_group', got {value!r}")
        return None
    return RestoreLevel(value)


def _attempt(
    a: Mapping[str, Any],
    loc: Loc,
    gid: str,
    group_attempt: int,
    old: bool,
    refuse: Refusals,
) -> CutAttempt | None:
    ok = _nonneg_field(a, "generation_index", loc, refuse)
    ok &= _id_field(ROLLOUT_ID, a["rollout_id"], loc + ("rollout_id",), refuse, nullable=False)
    status = a["status"]
    if status not in _ATTEMPT_STATUSES:
        refuse(loc + ("status",), f"must be one of {', '.join(_ATTEMPT_STATUSES)}, got {status!r}")
        ok = False
    ok &= _nonneg_field(a, "row_attempts_used", loc, refuse, default=0)
    reward = a.get("reward")
    if reward is not None and (
        isinstance(reward, bool) or not isinstance(reward, (int, float)) or not math.isfinite(reward)
    ):
        refuse(loc + ("reward",), f"must be a finite number or null, got {reward!r}")
        ok = False
    mask = a.get("mask_sample", False)
    if not isinstance(mask, bool):
        refuse(loc + ("mask_sample",), f"must be a boolean, got {json_kind(mask)}")
        ok = False
    keys = a.get("staging_keys", [])
    ok &= _staging_keys(keys, loc + ("staging_keys",), refuse)
    if not old:
        ok &= _id_field(INSTANCE_ID, a["gym_instance_id"], loc + ("gym_instance_id",), refuse)
        ok &= _nonneg_field(a, "gym_attempt", loc, refuse)
    if not ok:
        return None
    idx = a["generation_index"]
    return CutAttempt(
        group_id=gid,
        generation_index=idx,
        attempt_id=f"import:{gid}:{idx}",
        rollout_id=a["rollout_id"],
        gym_instance_id=None if old else a["gym_instance_id"],
        gym_attempt=0 if old else a["gym_attempt"],
        group_attempt=group_attempt,
        status=AttemptStatus(status),
        staging_keys=tuple(keys),
        row_attempts_used=a.get("row_attempts_used", 0),
        reward=None if reward is None else float(reward),
        mask_sample=mask,
    )


def _staging_keys(keys: Any, loc: Loc, refuse: Refusals) -> bool:
    """Refuse staging keys that are not an array of unique non-empty strings."""
    if not isinstance(keys, list):
        refuse(loc, f"must be an array of strings, got {json_kind(keys)}")
        return False
    ok = True
    seen: set[str] = set()
    for i, k in enumerate(keys):
        if not isinstance(k, str) or not k:
            refuse(loc + (i,), "must be a non-empty string")
            ok = False
        elif k in seen:
            refuse(loc + (i,), f"duplicate staging key {k!r}")
            ok = False
        else:
            seen.add(k)
    return ok
