"""Result models of a run's accounting (``GET /v1/runs/{run}/accounting``) and of the accounting
summary a restore answer and a plan preview carry: what a crash cost and whether any prompt
went missing (the coordinator's docs/accounting.md)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from .models import Json, _dict, _float, _int, _list, _obj, _opt_float, _req, _str


def _floats(v: Any) -> dict[str, float]:
    return {str(k): _float(x) for k, x in _dict(v).items()}


def _ints(v: Any) -> dict[str, int]:
    return {str(k): _int(x) for k, x in _dict(v).items()}


@dataclass(frozen=True)
class WorkSplit:
    """Rollout-seconds a restore found in flight, and how much of it was carried (continued from
    Gym state up to the cut) or must be redone, in all or for one instance or level."""

    attempts: int
    found_seconds: float
    carried_seconds: float
    redone_seconds: float
    carried_share: float | None
    redone_by_reason: dict[str, float]
    instance_id: str | None = None
    restore_level: str | None = None
    raw: Json = field(default_factory=dict, repr=False, compare=False)

    @classmethod
    def parse(cls, doc: Any) -> WorkSplit:
        d = _obj(doc, "work split")
        return cls(
            _int(d.get("attempts")), _float(d.get("found_seconds")), _float(d.get("carried_seconds")),
            _float(d.get("redone_seconds")), _opt_float(d.get("carried_share")), _floats(d.get("redone_by_reason")),
            _str(d.get("instance_id")), _str(d.get("restore_level")), d,
        )


@dataclass(frozen=True)
class RestoreAccounting:
    """What one restore found in flight, carried and must redo, in all and per instance and
    level; ``restore_id``, ``snapshot_id``, ``applied_at`` and ``recorded`` are set in a run's
    accounting, not in a restore's own answer."""

    attempts: int
    found_seconds: float
    carried_seconds: float
    redone_seconds: float
    carried_share: float | None
    redone_by_reason: dict[str, float]
    groups_rewound: int
    already_redone_seconds: float
    by_instance: list[WorkSplit]
    by_level: list[WorkSplit]
    restore_id: str | None = None
    snapshot_id: str | None = None
    applied_at: str | None = None
    recorded: bool = True
    raw: Json = field(default_factory=dict, repr=False, compare=False)

    @classmethod
    def parse(cls, doc: Any) -> RestoreAccounting:
        d = _obj(doc, "restore accounting")
        t = WorkSplit.parse(d)
        return cls(
            t.attempts, t.found_seconds, t.carried_seconds, t.redone_seconds, t.carried_share, t.redone_by_reason,
            _int(d.get("groups_rewound")), _float(d.get("already_redone_seconds")),
            [WorkSplit.parse(x) for x in _list(d.get("by_instance"))], [WorkSplit.parse(x) for x in _list(d.get("by_level"))],
            _str(d.get("restore_id")), _str(d.get("snapshot_id")), _str(d.get("applied_at")), bool(d.get("recorded", True)), d,
        )

    @classmethod
    def of_answer(cls, answer: Json) -> RestoreAccounting | None:
        """The ``accounting`` of a restore answer or plan preview (None: a restore applied before
        the coordinator kept accounting)."""
        doc = answer.get("accounting")
        return cls.parse(doc) if isinstance(doc, dict) else None


@dataclass(frozen=True)
class PromptAccounting:
    """Every admitted group in one bucket (trained, abandoned, live, rewound); ``conserved`` when
    they add up to ``admitted``."""

    admitted: int
    buckets: dict[str, int]
    accounted: int
    missing: int
    conserved: bool
    abandoned_by_reason: dict[str, int]
    live_by_status: dict[str, int]
    rewound_by_restore: dict[str, int]

    @classmethod
    def parse(cls, doc: Any) -> PromptAccounting:
        d = _obj(doc, "prompt accounting")
        return cls(
            _int(_req(d, "admitted", "prompt accounting")), _ints(d.get("buckets")), _int(d.get("accounted")), _int(d.get("missing")),
            bool(_req(d, "conserved", "prompt accounting")), _ints(d.get("abandoned_by_reason")), _ints(d.get("live_by_status")),
            _ints(d.get("rewound_by_restore")),
        )


@dataclass(frozen=True)
class WorkAccounting:
    """The run's rollout-seconds by fate (trained, in_flight, carried, redone), the redone ones
    by reason."""

    seconds_by_fate: dict[str, float]
    attempts_by_fate: dict[str, int]
    redone_by_reason: dict[str, float]
    total_seconds: float
    kept_share: float | None

    @classmethod
    def parse(cls, doc: Any) -> WorkAccounting:
        d = _obj(doc, "work accounting")
        return cls(
            _floats(d.get("seconds_by_fate")), _ints(d.get("attempts_by_fate")), _floats(d.get("redone_by_reason")),
            _float(d.get("total_seconds")), _opt_float(d.get("kept_share")),
        )


@dataclass(frozen=True)
class Accounting:
    """A run's accounting: its prompts, its work, and what each restore kept."""

    run_id: str
    as_of: str | None
    prompts: PromptAccounting
    work: WorkAccounting
    restores: list[RestoreAccounting]
    raw: Json = field(default_factory=dict, repr=False, compare=False)

    @property
    def conserved(self) -> bool:
        return self.prompts.conserved

    @classmethod
    def parse(cls, doc: Any) -> Accounting:
        d = _obj(doc, "accounting")
        return cls(
            str(_req(d, "run_id", "accounting")), _str(d.get("as_of")), PromptAccounting.parse(d.get("prompts")),
            WorkAccounting.parse(d.get("work")), [RestoreAccounting.parse(x) for x in _list(d.get("restores"))], d,
        )
