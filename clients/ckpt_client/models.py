"""Typed inputs and results.

Results are parsed leniently: unknown fields are ignored (the server may grow), missing optional
fields take defaults, and every result keeps the document it came from in ``raw`` so a caller can
reach a field this client does not model yet. Only fields a trainer acts on are required; their
absence raises :class:`~ckpt_client.errors.ProtocolError`.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Literal

from .errors import ProtocolError

__all__ = [
    "GroupSpec",
    "SealedRow",
    "FailedRow",
    "DataPlaneRef",
    "SendRow",
    "AdmittedGroup",
    "AdmitResult",
    "DispatchResult",
    "RefusedResult",
    "RowResult",
    "SealResult",
    "GroupNext",
    "Straggler",
    "PendingResult",
    "FailResult",
    "StreamEndedResult",
    "GroupOutcome",
    "GroupsResult",
    "LiveCounts",
    "AttemptInfo",
    "SiblingInfo",
    "GroupDetail",
    "OutboxPage",
    "Run",
    "Snapshot",
    "SnapshotBlockers",
    "BarrierResult",
    "TrainStep",
    "PlanRow",
    "RestorePlan",
    "RestoreResult",
    "GymInstance",
    "GymRegistration",
]

Json = Mapping[str, Any]
FailureClass = Literal["data", "transport"]


# --------------------------------------------------------------------------------------------
# Lenient readers


def _obj(doc: Any, what: str) -> Json:
    if not isinstance(doc, Mapping):
        raise ProtocolError(f"expected a JSON object for {what}, got {type(doc).__name__}")
    return doc


def _req(doc: Json, key: str, what: str) -> Any:
    if doc.get(key) is None:
        raise ProtocolError(f"{what} answer lacks {key!r}")
    return doc[key]


def _str(v: Any) -> str | None:
    return None if v is None else str(v)


def _int(v: Any, default: int = 0) -> int:
    try:
        return int(v)
    except (TypeError, ValueError):
        return default


def _opt_int(v: Any) -> int | None:
    try:
        return None if v is None else int(v)
    except (TypeError, ValueError):
        return None


def _float(v: Any, default: float = 0.0) -> float:
    try:
        return float(v)
    except (TypeError, ValueError):
        return default


def _opt_float(v: Any) -> float | None:
    try:
        return None if v is None else float(v)
    except (TypeError, ValueError):
        return None


def _strs(v: Any) -> list[str]:
    return [str(x) for x in v] if isinstance(v, list) else []


def _dict(v: Any) -> dict[str, Any]:
    return dict(v) if isinstance(v, Mapping) else {}


def _list(v: Any) -> list[Any]:
    return list(v) if isinstance(v, list) else []


# --------------------------------------------------------------------------------------------
# Inputs


@dataclass(frozen=True)
class GroupSpec:
    """One prompt group to admit. ``sample_id``/``task_name`` locate the prompt in the
    trainer's dataset; the prompt itself never goes to the coordinator."""

    group_id: str
    sample_id: str | int
    task_name: str
    task_digest: str
    expected_generations: int
    task_source: str | None = None
    agent_name: str | None = None
    target_step: int | None = None
    weight_version: str | None = None

    def to_json(self) -> dict[str, Any]:
        body: dict[str, Any] = {
            "group_id": self.group_id,
            "prompt_ref": {"sample_id": self.sample_id, "task_name": self.task_name},
            "task_digest": self.task_digest,
            "expected_generations": self.expected_generations,
        }
        # Optional fields are omitted rather than sent as null: an identical re-admit compares
        # stored values, and omission keeps repeats byte-identical whatever the defaults.
        for k in ("task_source", "agent_name", "target_step", "weight_version"):
            v = getattr(self, k)
            if v is not None:
                body[k] = v
        return body


@dataclass(frozen=True)
class SealedRow:
    """A finished row.

    ``receipt`` proves which Gym episode the result comes from: a JSON object whose
    ``rollout_id`` is the **capture key** of the attempt that was sent (``row.capture_key``:
    the rollout id at Gym attempt 0, ``<rollout id>-a<N>`` at attempt N), not the rollout id. A
    reply of an older attempt that arrives after a restore then names another episode than the
    current one, and its seal is refused ``receipt_mismatch`` instead of sealing the wrong
    result. Other keys are stored as they are; a repeated seal must send the same receipt.
    :meth:`from_gym_reply` builds the whole row from a ``/run`` reply and the row it was sent
    for, right at every attempt."""

    rollout_id: str
    receipt: Mapping[str, Any]
    staging_keys: Sequence[str] = ()
    reward: float | None = None
    mask_sample: bool | None = None

    @classmethod
    def from_gym_reply(
        cls,
        row: Any,
        reply: Mapping[str, Any],
        *,
        reward: float | None = None,
        staging_keys: Sequence[str] | None = None,
        mask_sample: bool | None = None,
    ) -> SealedRow:
        """The seal of ``row`` (a :class:`SendRow` or :class:`PlanRow`: what was dispatched and
        sent) from Gym's ``/run`` ``reply``. The receipt is ``{"rollout_id": row.capture_key,
        "gym_attempt": row.gym_attempt}``. ``reward`` and ``staging_keys`` default to the
        reply's fields of those names. A reply that names another episode (its ``capture_key``,
        or its ``rollout_id`` and ``attempt``) raises ValueError: it is not this row's reply."""
        rid, key, attempt = getattr(row, "rollout_id", None), getattr(row, "capture_key", None), getattr(row, "gym_attempt", 0)
        if not rid or not key:
            raise ValueError(f"row {row!r} has no rollout id and capture key: seal the rows that were dispatched")
        said_key = reply.get("capture_key")
        said = (reply.get("rollout_id"), reply.get("attempt"))
        if (said_key is not None and said_key != key) or (said[1] is not None and said != (rid, attempt)):
            raise ValueError(f"the reply names episode {said_key or said!r}, not {key!r} ({rid!r} at Gym attempt {attempt})")
        got = reply.get("reward") if reward is None else reward
        return cls(
            rollout_id=rid,
            receipt={"rollout_id": key, "gym_attempt": attempt},
            staging_keys=list(reply.get("staging_keys") or () if staging_keys is None else staging_keys),
            reward=None if got is None else float(got),
            mask_sample=mask_sample,
        )

    def to_json(self) -> dict[str, Any]:
        body: dict[str, Any] = {"rollout_id": self.rollout_id, "receipt": dict(self.receipt), "staging_keys": list(self.staging_keys)}
        if self.reward is not None:
            body["reward"] = self.reward
        if self.mask_sample is not None:
            body["mask_sample"] = self.mask_sample
        return body


@dataclass(frozen=True)
class FailedRow:
    """A row that failed: ``data`` (Gym replied with a failure: the prompt fails as a whole) or
    ``transport`` (no reply: the row may still run in Gym and is retired and replaced)."""

    rollout_id: str
    failure_class: FailureClass
    detail: str | None = None

    def to_json(self) -> dict[str, Any]:
        body: dict[str, Any] = {"rollout_id": self.rollout_id, "failure_class": self.failure_class}
        if self.detail is not None:
            body["detail"] = self.detail
        return body


@dataclass(frozen=True)
class DataPlaneRef:
    """Where the trainer saved its data plane for a snapshot, and its digest."""

    path: str
    digest: str

    def to_json(self) -> dict[str, str]:
        return {"path": self.path, "digest": self.digest}

    @classmethod
    def coerce(cls, value: Any) -> DataPlaneRef:
        """Accept a DataPlaneRef, a ``{path, digest}`` mapping or a ``(path, digest)`` pair."""
        if isinstance(value, DataPlaneRef):
            return value
        if isinstance(value, Mapping):
            if not value.get("path") or not value.get("digest"):
                raise ValueError(f"capture must return a non-empty path and digest, got {dict(value)!r}")
            return cls(str(value["path"]), str(value["digest"]))
        if isinstance(value, tuple) and len(value) == 2:
            return cls(str(value[0]), str(value[1]))
        raise TypeError(f"capture must return {{path, digest}}, a (path, digest) pair or a DataPlaneRef, not {type(value).__name__}")

    @classmethod
    def parse(cls, doc: Any) -> DataPlaneRef | None:
        if not isinstance(doc, Mapping) or doc.get("path") is None:
            return None
        return cls(str(doc["path"]), str(doc.get("digest", "")))


def row_json(row: Any, what: str) -> dict[str, Any]:
    """A row given as one of the dataclasses above or as a plain mapping (sent as is)."""
    if hasattr(row, "to_json"):
        return dict(row.to_json())
    if isinstance(row, Mapping):
        return dict(row)
    raise TypeError(f"{what} rows must be mappings or {what} dataclasses, not {type(row).__name__}")


# --------------------------------------------------------------------------------------------
# Live rollout results (docs/ledger.md#live-rollouts)


@dataclass(frozen=True)
class SendRow:
    """A row the trainer must send to Gym: under ``rollout_id``, with Gym episode id
    ``capture_key`` and cohort attempt ``group_attempt``; to ``instance_id`` when set (a
    restored continuation must go back to the instance holding its state)."""

    group_id: str
    generation_index: int
    rollout_id: str
    capture_key: str
    gym_attempt: int = 0
    group_attempt: int = 0
    status: str | None = None
    restore_level: str | None = None
    instance_id: str | None = None
    raw: Json = field(default_factory=dict, repr=False, compare=False)

    @classmethod
    def parse(cls, doc: Any) -> SendRow:
        d = _obj(doc, "row")
        rid = str(_req(d, "rollout_id", "row"))
        gym_attempt = _int(d.get("gym_attempt"))
        # The capture key is derivable (docs/ledger.md#identifiers); tolerate an answer that omits it.
        ck = d.get("capture_key") or (rid if gym_attempt == 0 else f"{rid}-a{gym_attempt}")
        return cls(
            group_id=str(d.get("group_id", "")),
            generation_index=_int(d.get("generation_index")),
            rollout_id=rid,
            capture_key=str(ck),
            gym_attempt=gym_attempt,
            group_attempt=_int(d.get("group_attempt")),
            status=_str(d.get("status")),
            restore_level=_str(d.get("restore_level")),
            instance_id=_str(d.get("instance_id")),
            raw=d,
        )


def _rows(v: Any) -> list[SendRow]:
    return [SendRow.parse(r) for r in _list(v)]


@dataclass(frozen=True)
class AdmittedGroup:
    group_id: str
    status: str
    group_attempt: int
    admitted: bool
    rows: list[SendRow]
    restore_level: str | None = None
    granularity: str | None = None
    raw: Json = field(default_factory=dict, repr=False, compare=False)

    @classmethod
    def parse(cls, doc: Any) -> AdmittedGroup:
        d = _obj(doc, "admitted group")
        return cls(
            group_id=str(_req(d, "group_id", "admit")),
            status=str(d.get("status", "")),
            group_attempt=_int(d.get("group_attempt")),
            admitted=bool(d.get("admitted", False)),
            rows=_rows(d.get("rows")),
            restore_level=_str(d.get("restore_level")),
            granularity=_str(d.get("granularity")),
            raw=d,
        )


@dataclass(frozen=True)
class AdmitResult:
    """``admitted`` is False for a group admitted before (an identical repeat): its current
    rows are answered again, so a retried admit never loses the rollout ids."""

    groups: list[AdmittedGroup]

    @property
    def rows(self) -> list[SendRow]:
        """Every row to send, across groups, excluding rows already dispatched or finished."""
        return [r for g in self.groups for r in g.rows if r.status in (None, "reserved")]

    @classmethod
    def parse(cls, doc: Any) -> AdmitResult:
        return cls([AdmittedGroup.parse(g) for g in _list(_obj(doc, "admit").get("groups"))])

    @classmethod
    def merge(cls, parts: Iterable[AdmitResult]) -> AdmitResult:
        return cls([g for p in parts for g in p.groups])


@dataclass(frozen=True)
class DispatchResult:
    dispatch_id: str
    instance_id: str | None
    rows: list[SendRow]

    @classmethod
    def parse(cls, doc: Any) -> DispatchResult:
        d = _obj(doc, "dispatch")
        return cls(str(d.get("dispatch_id", "")), _str(d.get("instance_id")), _rows(d.get("rows")))

    @classmethod
    def merge(cls, parts: Sequence[DispatchResult]) -> DispatchResult:
        first = parts[0]
        return cls(first.dispatch_id, first.instance_id, [r for p in parts for r in p.rows])


@dataclass(frozen=True)
class RefusedResult:
    """Rows back in ``reserved`` with the same identity: re-send them once Gym resumed."""

    rows: list[SendRow]

    @classmethod
    def parse(cls, doc: Any) -> RefusedResult:
        return cls(_rows(_obj(doc, "refused").get("rows")))

    @classmethod
    def merge(cls, parts: Iterable[RefusedResult]) -> RefusedResult:
        return cls([r for p in parts for r in p.rows])


@dataclass(frozen=True)
class RowResult:
    """Per-row outcome: ``result`` is sealed/returned/failed/abandoned, or ``unchanged`` for a
    row the ledger had already handled (an identical repeat, e.g. after a retry). A failure
    report of a row replaced before says what replaced it (``replaced_by``) and, when the
    coordinator ended it itself, why (``end_reason``: ``straggler``)."""

    rollout_id: str
    result: str
    status: str | None = None
    end_reason: str | None = None
    replaced_by: str | None = None

    @classmethod
    def parse(cls, doc: Any) -> RowResult:
        d = _obj(doc, "row result")
        return cls(
            str(_req(d, "rollout_id", "row result")), str(d.get("result", "")), _str(d.get("status")),
            _str(d.get("end_reason")), _str(d.get("replaced_by")),
        )


@dataclass(frozen=True)
class SealResult:
    rows: list[RowResult]
    ready_groups: list[str]
    cohorts_sealed: list[str]

    @classmethod
    def parse(cls, doc: Any) -> SealResult:
        d = _obj(doc, "seal")
        return cls([RowResult.parse(r) for r in _list(d.get("rows"))], _strs(d.get("ready_groups")), _strs(d.get("cohorts_sealed")))

    @classmethod
    def merge(cls, parts: Iterable[SealResult]) -> SealResult:
        ps = list(parts)
        return cls([r for p in ps for r in p.rows], [g for p in ps for g in p.ready_groups], [g for p in ps for g in p.cohorts_sealed])


@dataclass(frozen=True)
class GroupNext:
    """A group's state after a failure report and the rows it now needs sent (fresh attempts
    under new rollout ids). ``status == "abandoned"`` means its retry budget is spent."""

    group_id: str
    status: str
    group_attempt: int
    rows_to_send: list[SendRow]

    @classmethod
    def parse(cls, doc: Any) -> GroupNext:
        d = _obj(doc, "group")
        return cls(str(_req(d, "group_id", "group")), str(d.get("status", "")), _int(d.get("group_attempt")), _rows(d.get("rows_to_send")))


@dataclass(frozen=True)
class Straggler:
    """A row the coordinator gave up as a straggler (it blocked snapshots in a row; retired on
    Gym, docs/ledger.md#stragglers) and its group now: ``group.rows_to_send`` replace it."""

    rollout_id: str
    group: GroupNext

    @classmethod
    def parse(cls, doc: Any) -> Straggler:
        d = _obj(doc, "straggler")
        return cls(str(_req(d, "rollout_id", "straggler")), GroupNext.parse(d.get("group")))


@dataclass(frozen=True)
class PendingResult:
    """The pending read: the asked rows still dispatched without a result, and those given up
    as stragglers with what to send instead."""

    pending: list[str]
    stragglers: list[Straggler] = field(default_factory=list)

    @property
    def rows_to_send(self) -> list[SendRow]:
        return [r for s in self.stragglers for r in s.group.rows_to_send]

    @classmethod
    def parse(cls, doc: Any) -> PendingResult:
        d = _obj(doc, "pending")
        return cls(_strs(d.get("pending")), [Straggler.parse(x) for x in _list(d.get("stragglers"))])

    @classmethod
    def merge(cls, parts: Iterable[PendingResult]) -> PendingResult:
        ps = list(parts)
        return cls(sorted(x for p in ps for x in p.pending), [s for p in ps for s in p.stragglers])


def _merge_groups(parts: Iterable[Sequence[GroupNext]]) -> list[GroupNext]:
    # A group touched by several batches: its last answer is its current state.
    by_id: dict[str, GroupNext] = {}
    for groups in parts:
        for g in groups:
            by_id.pop(g.group_id, None)
            by_id[g.group_id] = g
    return list(by_id.values())


@dataclass(frozen=True)
class FailResult:
    rows: list[RowResult]
    groups: list[GroupNext]

    @property
    def rows_to_send(self) -> list[SendRow]:
        return [r for g in self.groups for r in g.rows_to_send]

    @property
    def abandoned_groups(self) -> list[str]:
        return [g.group_id for g in self.groups if g.status == "abandoned"]

    @classmethod
    def parse(cls, doc: Any) -> FailResult:
        d = _obj(doc, "fail")
        return cls([RowResult.parse(r) for r in _list(d.get("rows"))], [GroupNext.parse(g) for g in _list(d.get("groups"))])

    @classmethod
    def merge(cls, parts: Iterable[FailResult]) -> FailResult:
        ps = list(parts)
        return cls([r for p in ps for r in p.rows], _merge_groups(p.groups for p in ps))


@dataclass(frozen=True)
class StreamEndedResult:
    """``missing``: rows that never came back (now transport failures). On a repeat of the same
    report the ledger already handled them and ``missing`` is empty; ``rows_to_send`` is the
    current truth either way."""

    dispatch_id: str
    missing: list[str]
    groups: list[GroupNext]

    @property
    def rows_to_send(self) -> list[SendRow]:
        return [r for g in self.groups for r in g.rows_to_send]

    @property
    def abandoned_groups(self) -> list[str]:
        return [g.group_id for g in self.groups if g.status == "abandoned"]

    @classmethod
    def parse(cls, doc: Any) -> StreamEndedResult:
        d = _obj(doc, "stream ended")
        return cls(str(d.get("dispatch_id", "")), _strs(d.get("missing")), [GroupNext.parse(g) for g in _list(d.get("groups"))])


@dataclass(frozen=True)
class GroupOutcome:
    group_id: str
    result: str


@dataclass(frozen=True)
class GroupsResult:
    """Answer of finalize/abandon: ``result`` per group (``unchanged`` on a repeat)."""

    groups: list[GroupOutcome]

    @classmethod
    def parse(cls, doc: Any) -> GroupsResult:
        out = []
        for g in _list(_obj(doc, "groups").get("groups")):
            gd = _obj(g, "group")
            out.append(GroupOutcome(str(_req(gd, "group_id", "group")), str(gd.get("result", ""))))
        return cls(out)

    @classmethod
    def merge(cls, parts: Iterable[GroupsResult]) -> GroupsResult:
        return cls([g for p in parts for g in p.groups])


@dataclass(frozen=True)
class LiveCounts:
    """Groups by status (finalized/abandoned included), current attempts of live groups by
    status, pending outbox items by op."""

    groups: dict[str, int]
    live_attempts: dict[str, int]
    outbox_pending: dict[str, int]
    raw: Json = field(default_factory=dict, repr=False, compare=False)

    @classmethod
    def parse(cls, doc: Any) -> LiveCounts:
        d = _obj(doc, "counts")

        def counts(v: Any) -> dict[str, int]:
            return {str(k): _int(n) for k, n in _dict(v).items()}

        return cls(counts(d.get("groups")), counts(d.get("live_attempts")), counts(d.get("outbox_pending")), d)


@dataclass(frozen=True)
class AttemptInfo:
    rollout_id: str
    capture_key: str
    status: str
    is_current: bool
    gym_attempt: int
    group_attempt: int
    refusals: int
    gym_instance_id: str | None
    dispatch_id: str | None
    failure_class: str | None
    retirement: str | None
    reward: float | None
    mask_sample: bool | None
    staging_keys: list[str]
    raw: Json = field(default_factory=dict, repr=False, compare=False)

    @classmethod
    def parse(cls, doc: Any) -> AttemptInfo:
        d = _obj(doc, "attempt")
        rid = str(_req(d, "rollout_id", "attempt"))
        return cls(
            rollout_id=rid,
            capture_key=str(d.get("capture_key") or rid),
            status=str(d.get("status", "")),
            is_current=bool(d.get("is_current", False)),
            gym_attempt=_int(d.get("gym_attempt")),
            group_attempt=_int(d.get("group_attempt")),
            refusals=_int(d.get("refusals")),
            gym_instance_id=_str(d.get("gym_instance_id")),
            dispatch_id=_str(d.get("dispatch_id")),
            failure_class=_str(d.get("failure_class")),
            retirement=_str(d.get("retirement")),
            reward=_opt_float(d.get("reward")),
            mask_sample=d.get("mask_sample") if isinstance(d.get("mask_sample"), bool) else None,
            staging_keys=_strs(d.get("staging_keys")),
            raw=d,
        )


@dataclass(frozen=True)
class SiblingInfo:
    generation_index: int
    row_attempts_used: int
    attempts: list[AttemptInfo]

    @property
    def current(self) -> AttemptInfo | None:
        return next((a for a in self.attempts if a.is_current), None)


@dataclass(frozen=True)
class GroupDetail:
    group_id: str
    status: str
    group_attempt: int
    expected_generations: int
    siblings: list[SiblingInfo]
    restore_level: str | None = None
    granularity: str | None = None
    raw: Json = field(default_factory=dict, repr=False, compare=False)

    @classmethod
    def parse(cls, doc: Any) -> GroupDetail:
        d = _obj(doc, "group")
        sibs = []
        for s in _list(d.get("siblings")):
            sd = _obj(s, "sibling")
            sibs.append(SiblingInfo(_int(sd.get("generation_index")), _int(sd.get("row_attempts_used")), [AttemptInfo.parse(a) for a in _list(sd.get("attempts"))]))
        return cls(
            group_id=str(_req(d, "group_id", "group")),
            status=str(d.get("status", "")),
            group_attempt=_int(d.get("group_attempt")),
            expected_generations=_int(d.get("expected_generations")),
            siblings=sibs,
            restore_level=_str(d.get("restore_level")),
            granularity=_str(d.get("granularity")),
            raw=d,
        )


@dataclass(frozen=True)
class OutboxPage:
    items: list[dict[str, Any]]
    next_after: int | None
    oldest_created_at: str | None = None

    @classmethod
    def parse(cls, doc: Any) -> OutboxPage:
        d = _obj(doc, "outbox")
        return cls([_dict(i) for i in _list(d.get("items"))], _opt_int(d.get("next_after")), _str(d.get("oldest_created_at")))


@dataclass(frozen=True)
class Run:
    """A run. ``run_token`` is only present on the answer to its creation (shown once)."""

    run_id: str
    state: str
    checkpoint_root: str | None = None
    recovery: dict[str, Any] = field(default_factory=dict)
    epoch: int = 0
    dispatch_gate: dict[str, Any] = field(default_factory=dict)
    restored_from_rollout_snapshot: str | None = None
    run_token: str | None = field(default=None, repr=False)
    warnings: list[str] = field(default_factory=list)
    raw: Json = field(default_factory=dict, repr=False, compare=False)

    @classmethod
    def parse(cls, doc: Any) -> Run:
        d = _obj(doc, "run")
        return cls(
            run_id=str(_req(d, "run_id", "run")),
            state=str(d.get("state", "")),
            checkpoint_root=_str(d.get("checkpoint_root")),
            recovery=_dict(d.get("recovery")),
            epoch=_int(d.get("epoch")),
            dispatch_gate=_dict(d.get("dispatch_gate")),
            restored_from_rollout_snapshot=_str(d.get("restored_from_rollout_snapshot")),
            run_token=_str(d.get("run_token")),
            warnings=_strs(d.get("warnings")),
            raw={k: v for k, v in d.items() if k != "run_token"},
        )


# --------------------------------------------------------------------------------------------
# Snapshots (docs/ledger.md#snapshots)

TERMINAL_OUTCOMES = frozenset({"published", "failed", "aborted"})


@dataclass(frozen=True)
class SnapshotBlockers:
    """The episodes that kept an ended snapshot from its cut: how many, and at most 10 rollout
    ids (docs/ledger.md#stragglers)."""

    count: int
    rollout_ids: list[str]

    @classmethod
    def parse(cls, doc: Any) -> SnapshotBlockers | None:
        if not isinstance(doc, Mapping):
            return None
        return cls(_int(doc.get("count")), _strs(doc.get("rollout_ids")))


@dataclass(frozen=True)
class Snapshot:
    """A snapshot document. ``awaiting`` is what the coordinator waits for from the trainer:
    ``"barrier"`` (take the data-plane barrier and call barrier), ``"capture"`` (report the
    data-plane reference) or None."""

    snapshot_id: str
    anchor_step: int | None
    phase: str | None
    outcome: str | None
    reason: str | None
    awaiting: str | None
    staging_keys: list[str] | None
    phase_timings: dict[str, Any]
    gym_parked_seconds: float | None
    counts: dict[str, Any]
    data_plane_ref: DataPlaneRef | None = None
    raw: Json = field(default_factory=dict, repr=False, compare=False)
    #: Opaque: a coordinator that sends it answers ``get_snapshot(..., wait_s=, watch_token=)``
    #: as soon as the snapshot moves on from it (a long poll); None from one that does not.
    watch_token: str | None = None
    #: For a snapshot that did not publish: why it ended and what to do, in one line; and
    #: whether requesting a new snapshot later is expected to work. None otherwise.
    cause: str | None = None
    retryable: bool | None = None
    #: What the snapshot found worth telling while it ran (a Gym lease grace out of range, a
    #: participant whose lease lapsed, a stop not honoured...); a published snapshot may have them.
    warnings: list[str] = field(default_factory=list)
    #: Once it ended, the episodes that blocked it (Gym's prepare blockers, or replies still
    #: pending when the drain gave up); None while it runs, or from an older coordinator.
    blockers: SnapshotBlockers | None = None

    @property
    def terminal(self) -> bool:
        # A phase name is accepted as the outcome too, in case a server reports only the phase.
        return self.outcome in TERMINAL_OUTCOMES or (self.outcome is None and self.phase in TERMINAL_OUTCOMES)

    @property
    def published(self) -> bool:
        return (self.outcome or self.phase) == "published" and self.terminal

    @property
    def gym_figures(self) -> dict[str, dict[str, Any]]:
        """Per Gym instance, the figures the snapshot kept (participants, exported, restarts...)."""
        detail = self.raw.get("detail")
        gym = detail.get("gym") if isinstance(detail, Mapping) else None
        return {str(k): dict(v) for k, v in gym.items() if isinstance(v, Mapping)} if isinstance(gym, Mapping) else {}

    @property
    def stop_honoured(self) -> bool | None:
        """For a stopping snapshot, whether every Gym instance stayed parked (a Gym that refuses
        ``stop`` gets the commit without it and is resumed; one whose lease lapsed resumed on its
        own); None when not a stop or not known."""
        if isinstance(self.raw.get("stop_honoured"), bool):
            return bool(self.raw["stop_honoured"])
        detail = self.raw.get("detail")
        per_instance = detail.get("stop_honoured") if isinstance(detail, Mapping) else None
        if isinstance(per_instance, Mapping) and per_instance and all(isinstance(v, bool) for v in per_instance.values()):
            return all(per_instance.values())
        flags = [f.get("stop_supported") for f in self.gym_figures.values()]
        if not flags or not all(isinstance(f, bool) for f in flags):
            return None
        return all(flags)

    @classmethod
    def parse(cls, doc: Any) -> Snapshot:
        d = _obj(doc, "snapshot")
        d = _obj(d["snapshot"], "snapshot") if isinstance(d.get("snapshot"), Mapping) and "snapshot_id" not in d else d
        keys = d.get("staging_keys")
        return cls(
            snapshot_id=str(_req(d, "snapshot_id", "snapshot")),
            anchor_step=_opt_int(d.get("anchor_step")),
            phase=_str(d.get("phase")),
            outcome=_str(d.get("outcome")),
            reason=_str(d.get("reason")),
            awaiting=_str(d.get("awaiting")),
            staging_keys=_strs(keys) if isinstance(keys, list) else None,
            phase_timings=_dict(d.get("phase_timings")),
            gym_parked_seconds=_opt_float(d.get("gym_parked_seconds")),
            counts=_dict(d.get("counts")),
            data_plane_ref=DataPlaneRef.parse(d.get("data_plane_ref") or d.get("reference")),
            raw=d,
            watch_token=_str(d.get("watch_token")),
            cause=_str(d.get("cause")),
            retryable=d.get("retryable") if isinstance(d.get("retryable"), bool) else None,
            warnings=_strs(detail.get("warnings")) if isinstance(detail := d.get("detail"), Mapping) else [],
            blockers=SnapshotBlockers.parse(d.get("blockers")),
        )


@dataclass(frozen=True)
class BarrierResult:
    """The staging keys that must exist in the trainer's data-plane capture. A barrier asked for
    the delta against the pre-cut's keys answers ``added`` and ``removed`` instead (``delta``);
    :meth:`with_base` turns it into the whole list."""

    staging_keys: list[str]
    raw: Json = field(default_factory=dict, repr=False, compare=False)
    delta: bool = False
    added: list[str] = field(default_factory=list)
    removed: list[str] = field(default_factory=list)

    @classmethod
    def parse(cls, doc: Any) -> BarrierResult:
        d = _obj(doc, "barrier")
        delta = d.get("staging_keys_delta")
        if isinstance(delta, Mapping):
            return cls([], d, True, _strs(delta.get("added")), _strs(delta.get("removed")))
        return cls(_strs(d.get("staging_keys")), d)

    def with_base(self, base: list[str]) -> list[str]:
        """The whole key list: ``staging_keys``, or the pre-cut's ``base`` with the delta applied
        (sorted by code point, as the coordinator sorts them)."""
        if not self.delta:
            return self.staging_keys
        return sorted((set(base) - set(self.removed)) | set(self.added))


@dataclass(frozen=True)
class CutKeys:
    """``GET .../staging-keys``: the cut's keys as they stand (``as_of``: ``pre_cut``, ``cut`` or ``none``)."""

    as_of: str
    staging_keys: list[str]
    raw: Json = field(default_factory=dict, repr=False, compare=False)

    @classmethod
    def parse(cls, doc: Any) -> CutKeys:
        d = _obj(doc, "staging keys")
        return cls(str(d.get("as_of") or "none"), _strs(d.get("staging_keys")), d)


@dataclass(frozen=True)
class TrainStep:
    """An announced train step. ``created`` is False for a repeat; ``aborted_snapshots`` names
    the snapshots this announcement made lose (anchored older, ledger not cut yet)."""

    step: int
    checkpoint_ref: str | None = None
    created: bool | None = None
    aborted_snapshots: list[str] = field(default_factory=list)
    raw: Json = field(default_factory=dict, repr=False, compare=False)

    @classmethod
    def parse(cls, doc: Any, step: int) -> TrainStep:
        d = _obj(doc, "train step") if doc is not None else {}
        inner = d.get("train_step") if isinstance(d.get("train_step"), Mapping) else d
        created = inner.get("created")
        return cls(
            _int(inner.get("step"), step),
            _str(inner.get("checkpoint_ref")),
            created if isinstance(created, bool) else None,
            _strs(d.get("aborted_snapshots")),
            d,
        )


# --------------------------------------------------------------------------------------------
# Restore (docs/ledger.md#restore)


@dataclass(frozen=True)
class PlanRow:
    """One sibling of a restore plan: ``disposition`` is reused, rerun, continued, restarted,
    gym_restarted or dispatch (never sent before); send it under ``rollout_id``/``capture_key``
    to ``instance_id`` when set (continuations only). ``replaces_rollout_id`` names the attempt
    a fresh rollout id replaces; ``staging_keys`` are given for reused rows when asked for."""

    group_id: str
    generation_index: int
    disposition: str
    rollout_id: str | None
    capture_key: str | None
    gym_attempt: int
    group_attempt: int
    instance_id: str | None
    replaces_rollout_id: str | None = None
    staging_keys: list[str] | None = None
    # Why the row does what it does (docs/ledger.md#row-reasons), e.g. ``exported_by_gym``.
    reason: str | None = None
    raw: Json = field(default_factory=dict, repr=False, compare=False)

    @property
    def needs_send(self) -> bool:
        return self.disposition != "reused"

    @classmethod
    def parse(cls, doc: Any) -> PlanRow:
        d = _obj(doc, "plan row")
        return cls(
            group_id=str(d.get("group_id", "")),
            generation_index=_int(d.get("generation_index")),
            disposition=str(d.get("disposition", "")),
            rollout_id=_str(d.get("rollout_id")),
            capture_key=_str(d.get("capture_key")),
            gym_attempt=_int(d.get("gym_attempt")),
            group_attempt=_int(d.get("group_attempt")),
            instance_id=_str(d.get("instance_id")),
            replaces_rollout_id=_str(d.get("replaces_rollout_id")),
            staging_keys=_strs(d.get("staging_keys")) if isinstance(d.get("staging_keys"), list) else None,
            reason=_str(d.get("reason")),
            raw=d,
        )


@dataclass(frozen=True)
class RestorePlan:
    """A restore preview. ``counts`` are per disposition over the whole plan; ``rows`` are all
    pages joined (reused rows only when asked for). ``anchor_step`` is the snapshot's step: the
    trainer checkpoint to load."""

    snapshot_id: str
    data_plane_ref: DataPlaneRef | None
    counts: dict[str, int]
    rows: list[PlanRow]
    anchor_step: int | None = None
    raw: Json = field(default_factory=dict, repr=False, compare=False)

    @property
    def rows_to_send(self) -> list[PlanRow]:
        return [r for r in self.rows if r.needs_send]

    @property
    def accounting(self) -> Any:
        """What this restore would find in flight, carry and redo (a ``RestoreAccounting``)."""
        from .accounting import RestoreAccounting

        return RestoreAccounting.of_answer(self.raw)

    @property
    def reasons(self) -> dict[str, dict[str, int]]:
        """Rows per disposition and reason over the whole plan (docs/ledger.md#row-reasons)."""
        return {str(d): {str(r): _int(n) for r, n in _dict(v).items()} for d, v in _dict(self.raw.get("reasons")).items()}

    @classmethod
    def parse(cls, doc: Any) -> RestorePlan:
        d = _obj(doc, "restore plan")
        d = _obj(d["plan"], "restore plan") if isinstance(d.get("plan"), Mapping) and "snapshot_id" not in d else d
        return cls(
            snapshot_id=str(_req(d, "snapshot_id", "restore plan")),
            data_plane_ref=DataPlaneRef.parse(d.get("data_plane_ref")),
            counts={str(k): _int(v) for k, v in _dict(d.get("counts")).items()},
            rows=[PlanRow.parse(r) for r in _list(d.get("rows"))],
            anchor_step=_opt_int(d.get("anchor_step")),
            raw=d,
        )

    def with_more_rows(self, page: RestorePlan) -> RestorePlan:
        return RestorePlan(self.snapshot_id, self.data_plane_ref, self.counts, self.rows + page.rows, self.anchor_step, self.raw)


@dataclass(frozen=True)
class RestoreResult:
    """The applied restore: ``rows`` are what the trainer sends next (the server leaves reused
    rows out; :attr:`rows_to_send` filters them in case one does not). ``epoch`` is the run's
    new fencing epoch."""

    restore_id: str
    snapshot_id: str | None
    counts: dict[str, int]
    rows: list[PlanRow]
    data_plane_ref: DataPlaneRef | None = None
    anchor_step: int | None = None
    state: str | None = None
    epoch: int | None = None
    raw: Json = field(default_factory=dict, repr=False, compare=False)

    @property
    def rows_to_send(self) -> list[PlanRow]:
        return [r for r in self.rows if r.needs_send]

    @property
    def accounting(self) -> Any:
        """What the restore found in flight, carried and must redo (a ``RestoreAccounting``;
        None for a restore applied before the coordinator kept accounting)."""
        from .accounting import RestoreAccounting

        return RestoreAccounting.of_answer(self.raw)

    @classmethod
    def parse(cls, doc: Any, restore_id: str) -> RestoreResult:
        d = _obj(doc, "restore")
        plan = d.get("plan") if isinstance(d.get("plan"), Mapping) else {}
        rows = d.get("rows") if isinstance(d.get("rows"), list) else plan.get("rows")
        counts = d.get("counts") if isinstance(d.get("counts"), Mapping) else plan.get("counts")
        return cls(
            restore_id=str(d.get("restore_id") or restore_id),
            snapshot_id=_str(d.get("snapshot_id") or plan.get("snapshot_id")),
            counts={str(k): _int(v) for k, v in _dict(counts).items()},
            rows=[PlanRow.parse(r) for r in _list(rows)],
            data_plane_ref=DataPlaneRef.parse(d.get("data_plane_ref") or plan.get("data_plane_ref")),
            anchor_step=_opt_int(d.get("anchor_step")),
            state=_str(d.get("state")),
            epoch=_opt_int(d.get("epoch")),
            raw=d,
        )

    def with_more_rows(self, page: Any) -> RestoreResult:
        """This result with the rows of a ``GET /restores/{id}/rows`` page appended."""
        d = _obj(page, "restore rows page")
        return replace(self, rows=self.rows + [PlanRow.parse(r) for r in _list(d.get("rows"))])


@dataclass(frozen=True)
class GymInstance:
    """A Gym deployment replica to register: ``servers`` maps server name to base URL."""

    instance_id: str
    control_token: str = field(repr=False)
    servers: Mapping[str, str] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return {"instance_id": self.instance_id, "control_token": self.control_token, "servers": dict(self.servers)}


@dataclass(frozen=True)
class GymRegistration:
    """What discovery found: per instance its participants; ``restart_only_servers`` that
    cannot capture episodes; ``gym_settings`` the ``checkpoint:`` settings Gym must run with."""

    instances: list[dict[str, Any]]
    warnings: list[str]
    restart_only_servers: list[str] = field(default_factory=list)
    gym_settings: dict[str, Any] = field(default_factory=dict)
    raw: Json = field(default_factory=dict, repr=False, compare=False)

    @classmethod
    def parse(cls, doc: Any) -> GymRegistration:
        d = _obj(doc, "gym registration") if doc is not None else {}
        return cls(
            [_dict(i) for i in _list(d.get("instances"))],
            _strs(d.get("warnings")),
            _strs(d.get("restart_only_servers")),
            _dict(d.get("gym_settings")),
            d,
        )
