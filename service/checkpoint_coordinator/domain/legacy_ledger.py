"""NeMo RL's rollout-recovery ledger in its JSON form, schemas 2, 3 and 4
(docs/ledger.md#importing-a-nemo-rl-ledger).

NeMo RL's format fixes the top level (``schema_version``, ``groups``, ``batch_shortfall``,
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
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Mapping, Sequence

from .cut import Cut
from .cut_checks import cut_issues
from .errors import FieldIssue, LegacyLedgerError, LegacyLedgerVersionError
from .json_kinds import json_kind
from .legacy_ledger_fields import Refusals, SchemaRules, read_groups, read_top_level
from .levels import RestoreLevel
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


def _check_version(doc: Any) -> int:
    if not isinstance(doc, Mapping):
        raise LegacyLedgerVersionError.at((), f"a NeMo RL ledger must be a JSON object, got {json_kind(doc)}")
    if "schema_version" not in doc:
        raise LegacyLedgerVersionError.at(("schema_version",), "missing; expected 2, 3 or 4")
    v = doc["schema_version"]
    if type(v) is not int:
        raise LegacyLedgerVersionError.at(("schema_version",), f"must be the integer 2, 3 or 4, got the {json_kind(v)} {v!r}")
    if v not in SUPPORTED_VERSIONS:
        raise LegacyLedgerVersionError.at(("schema_version",), f"unsupported schema version {v}; this importer reads 2, 3 and 4")
    return v


def load_legacy_ledger(doc: Any) -> LegacyLedger:
    """Import a NeMo RL ledger document (decoded JSON); see the module docstring."""
    version = _check_version(doc)
    refuse = Refusals()
    shortfall, stamps, raw_groups = read_top_level(doc, refuse)
    read = read_groups(raw_groups, SchemaRules.of(version), refuse)
    refuse.raise_if_any()

    cut = Cut(groups=tuple(read.groups), attempts=tuple(read.attempts))
    problems = cut_issues(cut)
    if problems:
        raise LegacyLedgerError(
            [_onto_document(i, read.doc_index_of_group, read.doc_loc_of_attempt) for i in problems]
        )
    notes: tuple[str, ...] = ()
    if version < 4:
        notes = (
            f"schema {version} rewritten as schema 4: recovery_granularity became restore_level "
            "and every attempt starts with no Gym turn state",
        )
    return LegacyLedger(
        source_version=version,
        cut=cut,
        data_attempts_used=MappingProxyType(read.data_attempts),
        batch_shortfall=shortfall,
        sampler_stamps_target_steps=stamps,
        notes=notes,
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
