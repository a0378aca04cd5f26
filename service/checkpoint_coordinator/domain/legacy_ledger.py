"""NeMo RL's rollout-recovery ledger in its JSON form, schemas 2, 3 and 4 (ledger spec 9).

The reference text names the top level (``schema_version``, ``groups``, ``batch_shortfall``,
``sampler_stamps_target_steps``), the schema 4 fields (``restore_level`` per group,
``gym_instance_id`` and ``gym_attempt`` per attempt, both required) and the schema 2/3 field
``recovery_granularity``. Everything else below is this project's explicit shape, chosen to
mirror the ledger tables (``domain.cut``) one to one:

Schema 4 document (every key shown; ``?`` marks optional keys and their defaults)::

    {
      "schema_version": 4,
      "groups": [
        {
          "group_id": "g41",                                   # group id rule
          "prompt_ref": {"sample_id": 41, "task_name": "math"},  # sample_id: int or string
          "task_digest": "sha256:...",                         # non-empty string
          "task_source"?: null,                                # task source rule, or null
          "agent_name"?: null,                                 # server name rule, or null
          "restore_level": "turn",                             # schema 4 only
          "expected_generations": 2,                           # int >= 1
          "group_attempt": 0,                                  # int >= 0
          "data_attempts_used"?: 0,                            # int >= 0
          "status": "generating",                              # generating|ready|finalized|abandoned
          "target_step"?: null,                                # int >= 0, or null
          "weight_version"?: null,                             # int, string, or null
          "attempts": [                                        # the CURRENT attempt of each sibling
            {
              "generation_index": 0,                           # 0 .. expected_generations-1
              "rollout_id": "g41_g0_a5d1e9c0f2b3a4d5e6f708192a3b4c5d",
              "status": "dispatched",                          # reserved|dispatched|returned|
                                                               # sealed|failed|abandoned
              "row_attempts_used"?: 0,                         # int >= 0
              "reward"?: null,                                 # finite number, or null
              "mask_sample"?: false,                           # boolean
              "staging_keys"?: [],                             # unique non-empty strings
              "gym_instance_id": "math/replica-0",             # schema 4, required; may be null
              "gym_attempt": 0                                 # schema 4, required; int >= 0
            }
          ]
        }
      ],
      "batch_shortfall": 0,                                    # int >= 0
      "sampler_stamps_target_steps": [12, 12, 13]              # array of int >= 0, or an object
                                                               # of name -> int >= 0
    }

Schemas 2 and 3 have the same shape except that a group carries ``recovery_granularity``
(``sibling`` or ``prompt_group``) instead of ``restore_level`` and an attempt has no
``gym_instance_id``/``gym_attempt``. The reference does not say how 2 and 3 differ from each
other; this importer reads them identically. They are rewritten in the schema 4 shape:
``recovery_granularity`` becomes ``restore_level`` (same values) and every attempt starts with
no Gym turn state (``gym_instance_id: null``, ``gym_attempt: 0``). An old file that already
carries ``restore_level``, ``gym_instance_id``, ``gym_attempt`` or the ``turn`` level is
refused, not guessed at.

Loading reads ``schema_version`` first (:class:`~.errors.LegacyLedgerVersionError` for any
version but the integers 2, 3, 4), then reports every other problem at once (up to 50) as a
:class:`~.errors.LegacyLedgerError` whose issues name the document path, e.g.
``groups[3].attempts[1].gym_attempt``. Unknown fields are refused at every level. The result
is then checked as a cut (:func:`~.restore_plan.cut_issues`), with cut locations mapped back
onto the document.

An imported attempt gets the placeholder ``attempt_id`` ``"import:<group_id>:<i>"``; the ledger
assigns real ids when it stores the cut. Export writes schema 4 with every optional key present
(``null``/defaults), attempts sorted by generation index, groups in cut order.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Mapping, Sequence

from .cut import Cut, CutAttempt, CutGroup, PromptRef
from .errors import FieldIssue, LegacyLedgerError, LegacyLedgerVersionError
from .identity import GROUP_ID, INSTANCE_ID, ROLLOUT_ID, SERVER_NAME, TASK_SOURCE
from .levels import PREFIX_REFUSAL, RestoreLevel
from .cut_checks import cut_issues
from .vocabulary import AttemptStatus, GroupStatus

__all__ = [
    "SUPPORTED_VERSIONS",
    "EXPORT_VERSION",
    "LegacyLedger",
    "load_legacy_ledger",
    "export_legacy_ledger",
    "legacy_ledger_to_json_bytes",
    "legacy_ledger_from_json_bytes",
]

SUPPORTED_VERSIONS = (2, 3, 4)
EXPORT_VERSION = 4

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


@dataclass(frozen=True)
class LegacyLedger:
    """An imported ledger: the cut plus the top-level fields NeMo RL keeps beside it."""

    source_version: int
    cut: Cut
    data_attempts_used: Mapping[str, int]
    batch_shortfall: int
    sampler_stamps_target_steps: Any
    # How an old schema was rewritten, for the operator.
    notes: tuple[str, ...] = field(default_factory=tuple)


class _Refusals:
    def __init__(self) -> None:
        self.items: list[FieldIssue] = []
        self.more = 0

    def __call__(self, loc: tuple[str | int, ...], message: str) -> None:
        if len(self.items) < _MAX_ISSUES:
            self.items.append(FieldIssue(loc, message))
        else:
            self.more += 1

    def __bool__(self) -> bool:
        return bool(self.items)

    def raise_if_any(self) -> None:
        if self.items:
            items = list(self.items)
            if self.more:
                items.append(FieldIssue((), f"... and {self.more} more refusals"))
            raise LegacyLedgerError(items)


def _kind(v: object) -> str:
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
    if isinstance(v, (list, tuple)):
        return "array"
    if isinstance(v, Mapping):
        return "object"
    return type(v).__name__


def _nonneg_int(v: object) -> bool:
    return type(v) is int and v >= 0


def _check_version(doc: Any) -> int:
    if not isinstance(doc, Mapping):
        raise LegacyLedgerVersionError(
            [FieldIssue((), f"a NeMo RL ledger must be a JSON object, got {_kind(doc)}")]
        )
    if "schema_version" not in doc:
        raise LegacyLedgerVersionError(
            [FieldIssue(("schema_version",), "missing; expected 2, 3 or 4")]
        )
    v = doc["schema_version"]
    if type(v) is not int:
        raise LegacyLedgerVersionError(
            [
                FieldIssue(
                    ("schema_version",),
                    f"must be the integer 2, 3 or 4, got the {_kind(v)} {v!r}",
                )
            ]
        )
    if v not in SUPPORTED_VERSIONS:
        raise LegacyLedgerVersionError(
            [
                FieldIssue(
                    ("schema_version",),
                    f"unsupported schema version {v}; this importer reads 2, 3 and 4",
                )
            ]
        )
    return v


def _unknown_keys(
    obj: Mapping[str, Any],
    allowed: set[str],
    loc: tuple[str | int, ...],
    refuse: _Refusals,
    special: Mapping[str, str],
) -> bool:
    bad = False
    for key in sorted((k for k in obj if k not in allowed), key=str):
        refuse(loc + (str(key),), special.get(key, "unknown field"))
        bad = True
    return bad


def _missing_keys(
    obj: Mapping[str, Any],
    required: Sequence[str],
    loc: tuple[str | int, ...],
    refuse: _Refusals,
    why: Mapping[str, str] = MappingProxyType({}),
) -> bool:
    bad = False
    for key in required:
        if key not in obj:
            refuse(loc + (key,), "missing" + (f"; {why[key]}" if key in why else ""))
            bad = True
    return bad


def load_legacy_ledger(doc: Any) -> LegacyLedger:
    """Import a NeMo RL ledger document (decoded JSON); see the module docstring."""
    version = _check_version(doc)
    old = version < 4
    refuse = _Refusals()

    _unknown_keys(doc, set(_TOP_KEYS), (), refuse, {})
    _missing_keys(doc, _TOP_KEYS, (), refuse)
    refuse.raise_if_any()

    shortfall = doc["batch_shortfall"]
    if not _nonneg_int(shortfall):
        refuse(("batch_shortfall",), f"must be an integer >= 0, got {shortfall!r}")
    stamps = doc["sampler_stamps_target_steps"]
    if isinstance(stamps, list):
        for i, s in enumerate(stamps):
            if not _nonneg_int(s):
                refuse(("sampler_stamps_target_steps", i), f"must be an integer >= 0, got {s!r}")
    elif isinstance(stamps, Mapping):
        for k, s in stamps.items():
            if not isinstance(k, str) or not k:
                refuse(("sampler_stamps_target_steps", str(k)), "keys must be non-empty strings")
            elif not _nonneg_int(s):
                refuse(("sampler_stamps_target_steps", k), f"must be an integer >= 0, got {s!r}")
    else:
        refuse(
            ("sampler_stamps_target_steps",),
            f"must be an array or an object of integers, got {_kind(stamps)}",
        )
    raw_groups = doc["groups"]
    if not isinstance(raw_groups, list):
        refuse(("groups",), f"must be an array, got {_kind(raw_groups)}")
        refuse.raise_if_any()

    level_key = "recovery_granularity" if old else "restore_level"
    group_special = (
        {
            "restore_level": f"schema {version} predates restore levels; a file that carries "
            "one is refused rather than guessed at",
        }
        if old
        else {"recovery_granularity": "schema 4 replaced recovery_granularity by restore_level"}
    )
    group_allowed = set(_GROUP_REQUIRED) | set(_GROUP_OPTIONAL) | {level_key}
    attempt_allowed = set(_ATTEMPT_REQUIRED) | set(_ATTEMPT_OPTIONAL) | (set() if old else set(_GYM_KEYS))
    attempt_special = (
        {
            k: f"schema {version} predates Gym turn state; a file that carries it is refused "
            "rather than guessed at"
            for k in _GYM_KEYS
        }
        if old
        else {}
    )
    attempt_required = _ATTEMPT_REQUIRED if old else _ATTEMPT_REQUIRED + _GYM_KEYS
    gym_why = {k: "schema 4 attempts record their Gym instance and attempt" for k in _GYM_KEYS}

    groups: list[CutGroup] = []
    attempts: list[CutAttempt] = []
    doc_loc_of_attempt: list[tuple[int, int]] = []
    doc_index_of_group: list[int] = []
    data_attempts: dict[str, int] = {}

    for gi, g in enumerate(raw_groups):
        gloc: tuple[str | int, ...] = ("groups", gi)
        if not isinstance(g, Mapping):
            refuse(gloc, f"must be an object, got {_kind(g)}")
            continue
        broken = _unknown_keys(g, group_allowed, gloc, refuse, group_special)
        broken |= _missing_keys(g, _GROUP_REQUIRED + (level_key,), gloc, refuse)
        if broken:
            continue
        ok = True
        gid = g["group_id"]
        reason = GROUP_ID.problem(gid)
        if reason:
            refuse(gloc + ("group_id",), reason)
            ok = False
        level = _level(g[level_key], old, version, gloc + (level_key,), refuse)
        ok &= level is not None
        pref = g["prompt_ref"]
        if not isinstance(pref, Mapping):
            refuse(gloc + ("prompt_ref",), f"must be an object, got {_kind(pref)}")
            ok = False
        else:
            ok &= not _unknown_keys(pref, {"sample_id", "task_name"}, gloc + ("prompt_ref",), refuse, {})
            ok &= not _missing_keys(pref, ("sample_id", "task_name"), gloc + ("prompt_ref",), refuse)
            if ok:
                sid = pref["sample_id"]
                if not (type(sid) is int or (isinstance(sid, str) and sid)):
                    refuse(
                        gloc + ("prompt_ref", "sample_id"),
                        f"must be an integer or a non-empty string, got {_kind(sid)}",
                    )
                    ok = False
                if not isinstance(pref["task_name"], str) or not pref["task_name"]:
                    refuse(gloc + ("prompt_ref", "task_name"), "must be a non-empty string")
                    ok = False
        if not isinstance(g["task_digest"], str) or not g["task_digest"]:
            refuse(gloc + ("task_digest",), "must be a non-empty string")
            ok = False
        n = g["expected_generations"]
        if type(n) is not int or n < 1:
            refuse(gloc + ("expected_generations",), f"must be an integer >= 1, got {n!r}")
            ok = False
        ga = g["group_attempt"]
        if not _nonneg_int(ga):
            refuse(gloc + ("group_attempt",), f"must be an integer >= 0, got {ga!r}")
            ok = False
        status = g["status"]
        if status not in _GROUP_STATUSES:
            refuse(
                gloc + ("status",),
                f"must be one of {', '.join(_GROUP_STATUSES)}, got {status!r}",
            )
            ok = False
        dau = g.get("data_attempts_used", 0)
        if not _nonneg_int(dau):
            refuse(gloc + ("data_attempts_used",), f"must be an integer >= 0, got {dau!r}")
            ok = False
        ts = g.get("task_source")
        if ts is not None and TASK_SOURCE.problem(ts):
            refuse(gloc + ("task_source",), TASK_SOURCE.problem(ts) or "")
            ok = False
        an = g.get("agent_name")
        if an is not None and SERVER_NAME.problem(an):
            refuse(gloc + ("agent_name",), SERVER_NAME.problem(an) or "")
            ok = False
        step = g.get("target_step")
        if step is not None and not _nonneg_int(step):
            refuse(gloc + ("target_step",), f"must be an integer >= 0 or null, got {step!r}")
            ok = False
        wv = g.get("weight_version")
        if wv is not None and not (type(wv) is int or isinstance(wv, str)):
            refuse(
                gloc + ("weight_version",),
                f"must be an integer, a string or null, got {_kind(wv)}",
            )
            ok = False
        raw_attempts = g["attempts"]
        if not isinstance(raw_attempts, list):
            refuse(gloc + ("attempts",), f"must be an array, got {_kind(raw_attempts)}")
            ok = False
        if not ok:
            continue
        groups.append(
            CutGroup(
                group_id=gid,
                restore_level=level,  # type: ignore[arg-type]
                expected_generations=n,
                group_attempt=ga,
                status=GroupStatus(status),
                task_digest=g["task_digest"],
                prompt_ref=PromptRef(pref["sample_id"], pref["task_name"]),
                agent_name=an,
                task_source=ts,
                target_step=step,
                weight_version=wv,
            )
        )
        doc_index_of_group.append(gi)
        data_attempts[gid] = dau
        for ai, a in enumerate(raw_attempts):
            aloc = gloc + ("attempts", ai)
            if not isinstance(a, Mapping):
                refuse(aloc, f"must be an object, got {_kind(a)}")
                continue
            broken = _unknown_keys(a, attempt_allowed, aloc, refuse, attempt_special)
            broken |= _missing_keys(a, attempt_required, aloc, refuse, {} if old else gym_why)
            if broken:
                continue
            parsed = _attempt(a, aloc, gid, ga, old, refuse)
            if parsed is not None:
                attempts.append(parsed)
                doc_loc_of_attempt.append((gi, ai))
    refuse.raise_if_any()

    cut = Cut(groups=tuple(groups), attempts=tuple(attempts))
    problems = cut_issues(cut)
    if problems:
        raise LegacyLedgerError(
            [_onto_document(i, doc_index_of_group, doc_loc_of_attempt) for i in problems]
        )
    notes: tuple[str, ...] = ()
    if old:
        notes = (
            f"schema {version} rewritten as schema 4: recovery_granularity became restore_level "
            "and every attempt starts with no Gym turn state",
        )
    return LegacyLedger(
        source_version=version,
        cut=cut,
        data_attempts_used=MappingProxyType(data_attempts),
        batch_shortfall=shortfall,
        sampler_stamps_target_steps=stamps,
        notes=notes,
    )


def _level(
    value: Any, old: bool, version: int, loc: tuple[str | int, ...], refuse: _Refusals
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
    loc: tuple[str | int, ...],
    gid: str,
    group_attempt: int,
    old: bool,
    refuse: _Refusals,
) -> CutAttempt | None:
    ok = True
    idx = a["generation_index"]
    if not _nonneg_int(idx):
        refuse(loc + ("generation_index",), f"must be an integer >= 0, got {idx!r}")
        ok = False
    rid = a["rollout_id"]
    reason = ROLLOUT_ID.problem(rid)
    if reason:
        refuse(loc + ("rollout_id",), reason)
        ok = False
    status = a["status"]
    if status not in _ATTEMPT_STATUSES:
        refuse(loc + ("status",), f"must be one of {', '.join(_ATTEMPT_STATUSES)}, got {status!r}")
        ok = False
    used = a.get("row_attempts_used", 0)
    if not _nonneg_int(used):
        refuse(loc + ("row_attempts_used",), f"must be an integer >= 0, got {used!r}")
        ok = False
    reward = a.get("reward")
    if reward is not None and (
        isinstance(reward, bool) or not isinstance(reward, (int, float)) or not math.isfinite(reward)
    ):
        refuse(loc + ("reward",), f"must be a finite number or null, got {reward!r}")
        ok = False
    mask = a.get("mask_sample", False)
    if not isinstance(mask, bool):
        refuse(loc + ("mask_sample",), f"must be a boolean, got {_kind(mask)}")
        ok = False
    keys = a.get("staging_keys", [])
    if not isinstance(keys, list):
        refuse(loc + ("staging_keys",), f"must be an array of strings, got {_kind(keys)}")
        ok = False
    else:
        seen: set[str] = set()
        for i, k in enumerate(keys):
            if not isinstance(k, str) or not k:
                refuse(loc + ("staging_keys", i), "must be a non-empty string")
                ok = False
            elif k in seen:
                refuse(loc + ("staging_keys", i), f"duplicate staging key {k!r}")
                ok = False
            else:
                seen.add(k)
    inst: str | None = None
    gym_attempt = 0
    if not old:
        inst = a["gym_instance_id"]
        if inst is not None and INSTANCE_ID.problem(inst):
            refuse(loc + ("gym_instance_id",), INSTANCE_ID.problem(inst) or "")
            ok = False
        gym_attempt = a["gym_attempt"]
        if not _nonneg_int(gym_attempt):
            refuse(loc + ("gym_attempt",), f"must be an integer >= 0, got {gym_attempt!r}")
            ok = False
    if not ok:
        return None
    return CutAttempt(
        group_id=gid,
        generation_index=idx,
        attempt_id=f"import:{gid}:{idx}",
        rollout_id=rid,
        gym_instance_id=inst,
        gym_attempt=gym_attempt,
        group_attempt=group_attempt,
        status=AttemptStatus(status),
        staging_keys=tuple(keys),
        row_attempts_used=used,
        reward=None if reward is None else float(reward),
        mask_sample=mask,
    )


def _onto_document(
    issue: FieldIssue,
    doc_index_of_group: Sequence[int],
    doc_loc_of_attempt: Sequence[tuple[int, int]],
) -> FieldIssue:
    """Map a cut location (``groups[k].x`` / ``attempts[j].x``) onto the document."""
    loc = issue.loc
    if len(loc) >= 2 and isinstance(loc[1], int):
        if loc[0] == "attempts" and loc[1] < len(doc_loc_of_attempt):
            gi, ai = doc_loc_of_attempt[loc[1]]
            return FieldIssue(("groups", gi, "attempts", ai) + tuple(loc[2:]), issue.message)
        if loc[0] == "groups" and loc[1] < len(doc_index_of_group):
            field_map = {"expected_generations": "attempts"}
            rest = tuple(field_map.get(x, x) if isinstance(x, str) else x for x in loc[2:])
            return FieldIssue(("groups", doc_index_of_group[loc[1]]) + rest, issue.message)
    return issue


def export_legacy_ledger(
    cut: Cut,
    *,
    data_attempts_used: Mapping[str, int] | None = None,
    batch_shortfall: int = 0,
    sampler_stamps_target_steps: Any = None,
) -> dict[str, Any]:
    """The schema 4 document of a cut (attempt ids are not part of NeMo RL's format)."""
    by_group: dict[str, list[Any]] = {}
    for a in cut.attempts:
        by_group.setdefault(a[0], []).append(a)
    dau = data_attempts_used or {}
    groups_out = []
    for g in cut.groups:
        rows = sorted(by_group.get(g.group_id, ()), key=lambda a: a[1])
        groups_out.append(
            {
                "group_id": g.group_id,
                "prompt_ref": {
                    "sample_id": g.prompt_ref.sample_id,
                    "task_name": g.prompt_ref.task_name,
                },
                "task_digest": g.task_digest,
                "task_source": g.task_source,
                "agent_name": g.agent_name,
                "restore_level": str(RestoreLevel(g.restore_level).value),
                "expected_generations": g.expected_generations,
                "group_attempt": g.group_attempt,
                "data_attempts_used": int(dau.get(g.group_id, 0)),
                "status": GroupStatus(g.status).value,
                "target_step": g.target_step,
                "weight_version": g.weight_version,
                "attempts": [_export_attempt(a) for a in rows],
            }
        )
    return {
        "schema_version": EXPORT_VERSION,
        "groups": groups_out,
        "batch_shortfall": batch_shortfall,
        "sampler_stamps_target_steps": (
            [] if sampler_stamps_target_steps is None else sampler_stamps_target_steps
        ),
    }


def _export_attempt(a: Sequence[Any]) -> dict[str, Any]:
    (_gid, idx, _aid, rid, inst, gym_attempt, _ga, status, keys, used, reward, mask) = a
    return {
        "generation_index": idx,
        "rollout_id": rid,
        "status": AttemptStatus(status).value,
        "row_attempts_used": used,
        "reward": reward,
        "mask_sample": bool(mask),
        "staging_keys": list(keys),
        "gym_instance_id": inst,
        "gym_attempt": gym_attempt,
    }


def legacy_ledger_to_json_bytes(doc: Mapping[str, Any]) -> bytes:
    """Compact UTF-8 JSON with sorted keys; NaN and Infinity refused."""
    return json.dumps(
        doc, sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False
    ).encode("utf-8")


def _pairs_no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in pairs:
        if k in out:
            raise LegacyLedgerError([FieldIssue((), f"duplicate JSON object key {k!r}")])
        out[k] = v
    return out


def _refuse_constant(name: str) -> Any:
    raise LegacyLedgerError([FieldIssue((), f"{name} is not valid JSON")])


def legacy_ledger_from_json_bytes(data: bytes | str) -> LegacyLedger:
    """Decode and import a ledger file."""
    try:
        doc = json.loads(data, object_pairs_hook=_pairs_no_duplicates, parse_constant=_refuse_constant)
    except LegacyLedgerError:
        raise
    except (ValueError, UnicodeDecodeError) as exc:
        raise LegacyLedgerError([FieldIssue((), f"not valid JSON: {exc}")]) from None
    return load_legacy_ledger(doc)
