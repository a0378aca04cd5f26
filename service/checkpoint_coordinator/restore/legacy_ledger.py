"""NeMo RL's rollout-recovery ledger (JSON), schemas 2, 3 and 4, to and from a ledger cut
(ledger spec section 9). Pure: no I/O.

Document::

    {
      "schema_version": 4,
      "groups": [
        {
          "group_id": "g41",
          "prompt_ref": {"sample_id": 41, "task_name": "math"},
          "task_digest": "sha256:...",
          "task_source": null,            # optional
          "agent_name": null,             # optional
          "restore_level": "turn",        # schema 4; schemas 2/3: "recovery_granularity"
          "expected_generations": 4,
          "group_attempt": 0,
          "data_attempts_used": 0,        # optional, default 0
          "status": "generating",
          "target_step": 12,              # optional
          "weight_version": "w12",        # optional
          "attempts": [                   # the current attempt of every sibling
            {
              "generation_index": 0,
              "rollout_id": "g41_g0_a...",
              "status": "dispatched",
              "row_attempts_used": 0,     # optional, default 0
              "reward": null,             # optional
              "mask_sample": false,       # optional, default false
              "staging_keys": [],         # optional, default []
              "gym_instance_id": "math/replica-0",   # schema 4, required (null: no instance)
              "gym_attempt": 0                       # schema 4, required
            }
          ]
        }
      ],
      "batch_shortfall": 0,
      "sampler_stamps_target_steps": [12, 12, 13]
    }

Loading reads ``schema_version`` before anything else (another version is refused by version),
refuses unknown fields at every level, and names the offending field of every refusal.
Schemas 2 and 3 are rewritten in the schema 4 shape: ``recovery_granularity`` becomes
``restore_level`` (same values) and each attempt starts with no Gym turn state. An old file that
already carries a restore level, Gym attempt state or the turn level is refused rather than
guessed at. The result is then checked as a cut (``domain.restore_plan.validate_cut``), with
the cut's locations mapped back onto the document.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from ..domain.cut import Cut, CutAttempt, CutGroup, PromptRef
from ..domain.errors import CutError, FieldIssue, LegacyLedgerError, LegacyLedgerVersionError
from ..domain.identity import GROUP_ID, INSTANCE_ID, ROLLOUT_ID, TASK_SOURCE, SERVER_NAME
from ..domain.restore_plan import validate_cut

__all__ = ["SUPPORTED_VERSIONS", "EXPORT_VERSION", "LegacyLedger", "load_legacy_ledger", "export_legacy_ledger"]

SUPPORTED_VERSIONS = (2, 3, 4)
EXPORT_VERSION = 4

_TOP = frozenset({"schema_version", "groups", "batch_shortfall", "sampler_stamps_target_steps"})
_GROUP_REQUIRED = ("group_id", "prompt_ref", "task_digest", "expected_generations", "group_attempt", "status", "attempts")
_GROUP_OPTIONAL = ("task_source", "agent_name", "data_attempts_used", "target_step", "weight_version")
_ATTEMPT_REQUIRED = ("generation_index", "rollout_id", "status")
_ATTEMPT_OPTIONAL = ("row_attempts_used", "reward", "mask_sample", "staging_keys")
_GYM_FIELDS = ("gym_instance_id", "gym_attempt")
_LEVELS = ("turn", "sibling", "prompt_group")
_OLD_GRANULARITIES = ("sibling", "prompt_group")
_GROUP_STATUSES = ("generating", "ready", "finalized", "abandoned")
_ATTEMPT_STATUSES = ("reserved", "dispatched", "returned", "sealed", "failed", "abandoned")
_MAX_ISSUES = 50


@dataclass(frozen=True)
class LegacyLedger:
    source_version: int
    cut: Cut
    data_attempts_used: Mapping[str, int]
    batch_shortfall: int
    sampler_stamps_target_steps: Any
    # The rewriting applied to an old schema, for the operator.
    notes: tuple[str, ...] = field(default_factory=tuple)


class _Issues:
    def __init__(self) -> None:
        self.items: list[FieldIssue] = []

    def add(self, loc: tuple[str | int, ...], message: str) -> None:
        if len(self.items) < _MAX_ISSUES:
            self.items.append(FieldIssue(loc, message))

    def raise_if_any(self) -> None:
        if self.items:
            raise LegacyLedgerError(self.items)


def _type(v: object) -> str:
    if v is None:
        return "null"
    if isinstance(v, bool):
        return "boolean"
    if isinstance(v, int):
        return "integer"
    if isinstance(v, float):
        return "number"
    if isinstance(v, str):
        return "string"
    if isinstance(v, list):
        return "array"
    if isinstance(v, dict):
        return "object"
    return type(v).__name__


def _int(v: object) -> bool:
    return type(v) is int


def load_legacy_ledger(doc: Any) -> LegacyLedger:
    if not isinstance(doc, Mapping):
        raise LegacyLedgerError([FieldIssue((), f"the ledger must be a JSON object, got {_type(doc)}")])
    if "schema_version" not in doc:
        raise LegacyLedgerVersionError([FieldIssue(("schema_version",), "missing; expected 2, 3 or 4")])
    version = doc["schema_version"]
    if not _int(version) or version not in SUPPORTED_VERSIONS:
        raise LegacyLedgerVersionError(
            [FieldIssue(("schema_version",), f"unsupported schema version {version!r}; this importer reads 2, 3 and 4")]
        )
    issues = _Issues()
    for k in sorted(set(doc) - _TOP, key=str):
        issues.add((str(k),), "unknown field")
    for k in sorted(_TOP - set(doc)):
        issues.add((k,), "missing")
    issues.raise_if_any()
    shortfall = doc["batch_shortfall"]
    if not _int(shortfall) or shortfall < 0:
        issues.add(("batch_shortfall",), f"must be an integer >= 0, got {shortfall!r}")
    stamps = doc["sampler_stamps_target_steps"]
    if isinstance(stamps, list):
        for i, s in enumerate(stamps):
            if not _int(s) or s < 0:
                issues.add(("sampler_stamps_target_steps", i), f"must be an integer >= 0, got {s!r}")
    elif isinstance(stamps, Mapping):
        for k, s in stamps.items():
            if not _int(s) or s < 0:
                issues.add(("sampler_stamps_target_steps", str(k)), f"must be an integer >= 0, got {s!r}")
    else:
        issues.add(("sampler_stamps_target_steps",), f"must be an array or an object of integers, got {_type(stamps)}")
    groups_raw = doc["groups"]
    if not isinstance(groups_raw, list):
        issues.add(("groups",), f"must be an array, got {_type(groups_raw)}")
        issues.raise_if_any()
    old = version < 4
    level_key = "recovery_granularity" if old else "restore_level"
    groups: list[CutGroup] = []
    attempts: list[CutAttempt] = []
    where: list[tuple[int, int]] = []  # cut attempt index -> (group index, attempt index)
    dau: dict[str, int] = {}
    for gi, g in enumerate(groups_raw):
        loc = ("groups", gi)
        if not isinstance(g, Mapping):
            issues.add(loc, f"must be an object, got {_type(g)}")
            continue
        allowed = set(_GROUP_REQUIRED) | set(_GROUP_OPTIONAL) | {level_key}
        for k in sorted(set(g) - allowed, key=str):
            if old and k == "restore_level":
                issues.add(loc + (k,), f"schema {version} predates restore levels; a file that carries one is refused rather than guessed at")
            elif not old and k == "recovery_granularity":
                issues.add(loc + (k,), "schema 4 replaced recovery_granularity by restore_level")
            else:
                issues.add(loc + (str(k),), "unknown field")
        for k in (*_GROUP_REQUIRED, level_key):
            if k not in g:
                issues.add(loc + (k,), "missing")
        if any(k not in g for k in (*_GROUP_REQUIRED, level_key)) or set(g) - allowed:
            continue
        gid = g["group_id"]
        reason = GROUP_ID.problem(gid)
        if reason is not None:
            issues.add(loc + ("group_id",), reason)
            continue
        level = g[level_key]
        if old:
            if level == "turn":
                issues.add(loc + (level_key,), f"the turn level did not exist in schema {version}; refused rather than guessed at")
                continue
            if level not in _OLD_GRANULARITIES:
                issues.add(loc + (level_key,), f"must be one of {', '.join(_OLD_GRANULARITIES)}, got {level!r}")
                continue
        elif level not in _LEVELS:
            issues.add(loc + (level_key,), f"must be one of {', '.join(_LEVELS)}, got {level!r}")
            continue
        pref = g["prompt_ref"]
        if not isinstance(pref, Mapping) or set(pref) != {"sample_id", "task_name"}:
            issues.add(loc + ("prompt_ref",), "must be an object with exactly sample_id and task_name")
            continue
        if not (isinstance(pref["sample_id"], str) or _int(pref["sample_id"])):
            issues.add(loc + ("prompt_ref", "sample_id"), f"must be a string or an integer, got {_type(pref['sample_id'])}")
            continue
        if not isinstance(pref["task_name"], str) or not pref["task_name"]:
            issues.add(loc + ("prompt_ref", "task_name"), "must be a non-empty string")
            continue
        if not isinstance(g["task_digest"], str) or not g["task_digest"]:
            issues.add(loc + ("task_digest",), "must be a non-empty string")
            continue
        n = g["expected_generations"]
        if not _int(n) or n < 1:
            issues.add(loc + ("expected_generations",), f"must be an integer >= 1, got {n!r}")
            continue
        ga = g["group_attempt"]
        if not _int(ga) or ga < 0:
            issues.add(loc + ("group_attempt",), f"must be an integer >= 0, got {ga!r}")
            continue
        st = g["status"]
        if st not in _GROUP_STATUSES:
            issues.add(loc + ("status",), f"must be one of {', '.join(_GROUP_STATUSES)}, got {st!r}")
            continue
        d = g.get("data_attempts_used", 0)
        if not _int(d) or d < 0:
            issues.add(loc + ("data_attempts_used",), f"must be an integer >= 0, got {d!r}")
            continue
        ts, an = g.get("task_source"), g.get("agent_name")
        if ts is not None and TASK_SOURCE.problem(ts) is not None:
            issues.add(loc + ("task_source",), str(TASK_SOURCE.problem(ts)))
            continue
        if an is not None and SERVER_NAME.problem(an) is not None:
            issues.add(loc + ("agent_name",), str(SERVER_NAME.problem(an)))
            continue
        tstep = g.get("target_step")
        if tstep is not None and (not _int(tstep) or tstep < 0):
            issues.add(loc + ("target_step",), f"must be an integer >= 0 or null, got {tstep!r}")
            continue
        wv = g.get("weight_version")
        if wv is not None and not (isinstance(wv, str) or _int(wv)):
            issues.add(loc + ("weight_version",), f"must be a string, an integer or null, got {_type(wv)}")
            continue
        atts = g["attempts"]
        if not isinstance(atts, list):
            issues.add(loc + ("attempts",), f"must be an array, got {_type(atts)}")
            continue
        groups.append(
            CutGroup(
                group_id=gid,
                restore_level=level,
                expected_generations=n,
                group_attempt=ga,
                status=st,
                task_digest=g["task_digest"],
                prompt_ref=PromptRef(pref["sample_id"], pref["task_name"]),
                agent_name=an,
                task_source=ts,
                target_step=tstep,
                weight_version=None if wv is None else str(wv),
            )
        )
        dau[gid] = d
        for ai, a in enumerate(atts):
            parsed = _attempt(a, loc + ("attempts", ai), gid, ga, old, version, issues)
            if parsed is not None:
                where.append((gi, ai))
                attempts.append(parsed)
    issues.raise_if_any()
    cut = Cut(groups=groups, attempts=attempts)
    try:
        validate_cut(cut)
    except CutError as e:
        raise LegacyLedgerError([_doc_issue(i, groups, where) for i in e.issues]) from None
    notes: tuple[str, ...] = ()
    if old:
        notes = (
            f"schema {version} rewritten as schema 4: recovery_granularity became restore_level; "
            "every attempt starts with no Gym turn state",
        )
    return LegacyLedger(version, cut, dau, shortfall, stamps, notes)


def _attempt(
    a: Any, loc: tuple[str | int, ...], gid: str, group_attempt: int, old: bool, version: int, issues: _Issues
) -> CutAttempt | None:
    if not isinstance(a, Mapping):
        issues.add(loc, f"must be an object, got {_type(a)}")
        return None
    allowed = set(_ATTEMPT_REQUIRED) | set(_ATTEMPT_OPTIONAL) | (set() if old else set(_GYM_FIELDS))
    bad = False
    for k in sorted(set(a) - allowed, key=str):
        if old and k in _GYM_FIELDS:
            issues.add(loc + (k,), f"schema {version} predates Gym turn state; a file that carries it is refused rather than guessed at")
        else:
            issues.add(loc + (str(k),), "unknown field")
        bad = True
    required = _ATTEMPT_REQUIRED if old else (*_ATTEMPT_REQUIRED, *_GYM_FIELDS)
    for k in required:
        if k not in a:
            issues.add(loc + (k,), "missing" + ("; schema 4 attempts record their Gym instance and attempt" if k in _GYM_FIELDS else ""))
            bad = True
    if bad:
        return None
    idx = a["generation_index"]
    if not _int(idx) or idx < 0:
        issues.add(loc + ("generation_index",), f"must be an integer >= 0, got {idx!r}")
        return None
    rid = a["rollout_id"]
    reason = ROLLOUT_ID.problem(rid)
    if reason is not None:
        issues.add(loc + ("rollout_id",), reason)
        return None
    st = a["status"]
    if st not in _ATTEMPT_STATUSES:
        issues.add(loc + ("status",), f"must be one of {', '.join(_ATTEMPT_STATUSES)}, got {st!r}")
        return None
    rau = a.get("row_attempts_used", 0)
    if not _int(rau) or rau < 0:
        issues.add(loc + ("row_attempts_used",), f"must be an integer >= 0, got {rau!r}")
        return None
    reward = a.get("reward")
    if reward is not None and (isinstance(reward, bool) or not isinstance(reward, (int, float)) or not math.isfinite(reward)):
        issues.add(loc + ("reward",), f"must be a finite number or null, got {reward!r}")
        return None
    mask = a.get("mask_sample", False)
    if not isinstance(mask, bool):
        issues.add(loc + ("mask_sample",), f"must be a boolean, got {_type(mask)}")
        return None
    keys = a.get("staging_keys", [])
    if not isinstance(keys, list) or not all(isinstance(k, str) and k for k in keys):
        issues.add(loc + ("staging_keys",), "must be an array of non-empty strings")
        return None
    inst, gatt = None, 0
    if not old:
        inst, gatt = a["gym_instance_id"], a["gym_attempt"]
        if inst is not None and INSTANCE_ID.problem(inst) is not None:
            issues.add(loc + ("gym_instance_id",), str(INSTANCE_ID.problem(inst)))
            return None
        if not _int(gatt) or gatt < 0:
            issues.add(loc + ("gym_attempt",), f"must be an integer >= 0, got {gatt!r}")
            return None
    # The attempt id is the ledger's; an imported cut gets its ids when stored.
    return CutAttempt(
        gid, idx, f"import:{gid}:{idx}", rid, inst, gatt, group_attempt, st, tuple(keys), rau,
        None if reward is None else float(reward), mask,
    )


def _doc_issue(issue: FieldIssue, groups: Sequence[CutGroup], where: Sequence[tuple[int, int]]) -> FieldIssue:
    """Map a cut location (``attempts[j].x`` / ``groups[k].x``) onto the document."""
    loc = issue.loc
    if len(loc) >= 2 and loc[0] == "attempts" and isinstance(loc[1], int) and loc[1] < len(where):
        gi, ai = where[loc[1]]
        return FieldIssue(("groups", gi, "attempts", ai, *loc[2:]), issue.message)
    return FieldIssue(loc, issue.message)


def export_legacy_ledger(
    cut: Cut,
    *,
    data_attempts_used: Mapping[str, int] | None = None,
    batch_shortfall: int = 0,
    sampler_stamps_target_steps: Any = None,
) -> dict[str, Any]:
    """The schema 4 document of a cut (``cut.attempts`` as :class:`CutAttempt`)."""
    by_group: dict[str, list[CutAttempt]] = {}
    for a in cut.attempts:
        by_group.setdefault(a[0], []).append(a if isinstance(a, CutAttempt) else CutAttempt(*a))
    groups = []
    for g in cut.groups:
        atts = sorted(by_group.get(g.group_id, []), key=lambda a: a.generation_index)
        groups.append(
            {
                "group_id": g.group_id,
                "prompt_ref": {"sample_id": g.prompt_ref.sample_id, "task_name": g.prompt_ref.task_name},
                "task_digest": g.task_digest,
                "task_source": g.task_source,
                "agent_name": g.agent_name,
                "restore_level": str(g.restore_level),
                "expected_generations": g.expected_generations,
                "group_attempt": g.group_attempt,
                "data_attempts_used": int((data_attempts_used or {}).get(g.group_id, 0)),
                "status": str(g.status),
                "target_step": g.target_step,
                "weight_version": g.weight_version,
                "attempts": [
                    {
                        "generation_index": a.generation_index,
                        "rollout_id": a.rollout_id,
                        "status": str(a.status),
                        "row_attempts_used": a.row_attempts_used,
                        "reward": a.reward,
                        "mask_sample": bool(a.mask_sample),
                        "staging_keys": list(a.staging_keys),
                        "gym_instance_id": a.gym_instance_id,
                        "gym_attempt": a.gym_attempt,
                    }
                    for a in atts
                ],
            }
        )
    return {
        "schema_version": EXPORT_VERSION,
        "groups": groups,
        "batch_shortfall": batch_shortfall,
        "sampler_stamps_target_steps": [] if sampler_stamps_target_steps is None else sampler_stamps_target_steps,
    }
