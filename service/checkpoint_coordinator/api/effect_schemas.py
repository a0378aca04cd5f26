"""Bodies and answers of the effect journal (docs/effects.md)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field

from ..domain.vocabulary import EffectAnswer, EffectState, OrphanReason
from .common import ROLLOUT_ID_PATTERN, Strict
from .schemas import Answer, Timestamp, sometimes

#: The largest result a ``complete`` records, as JSON (docs/effects.md#limits).
MAX_RESULT_BYTES = 64 * 1024
EFFECT_NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._:/-]*$"
DIGEST_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._:+/=-]*$"


class BeginIn(Strict):
    rollout_id: str = Field(pattern=ROLLOUT_ID_PATTERN, max_length=256, description="The episode's rollout id (kept by a continuation).")
    gym_attempt: int = Field(ge=0, le=1_000_000, description="The Gym attempt the episode runs at (`_ng_attempt_index`).")
    seq: int = Field(ge=0, le=2**31 - 1, description="The call's place among the episode's effectful calls, counted in its checkpointed state.")
    effect: str = Field(min_length=1, max_length=128, pattern=EFFECT_NAME_PATTERN, description="The effect's name (e.g. `send_mail`).")
    digest: str = Field(min_length=1, max_length=128, pattern=DIGEST_PATTERN, description="A digest of the call's arguments.")
    call_id: str | None = Field(
        default=None, min_length=1, max_length=64, pattern=r"^[A-Za-z0-9._-]+$",
        description="Unique per begin call: the same begin sent again (a lost reply) may act again.",
    )


class CompleteIn(Strict):
    result: Any = Field(description="What the effect did, as JSON (at most 64 KiB).")


class EffectOut(Answer):
    effect_id: int
    rollout_id: str
    seq: int
    effect: str
    digest: str
    state: Literal[tuple(s.value for s in EffectState)]  # type: ignore[valid-type]
    result: Any = Field(description="The recorded result (null until completed).")
    gym_attempt: int = Field(description="The Gym attempt that began it.")
    begun_at: Timestamp
    completed_at: Timestamp | None
    pending_restore: str | None = Field(description="The restore whose continuation must make it again before it seals.")
    orphaned_at: Timestamp | None
    orphan_reason: Literal[tuple(r.value for r in OrphanReason)] | None  # type: ignore[valid-type]
    orphaned_by: str | None = Field(description="The restore that discarded its timeline, when one did.")


class BeginOut(Answer):
    answer: Literal[tuple(a.value for a in EffectAnswer)] = Field(  # type: ignore[valid-type]
        description="proceed: act, then complete; done: return `result`, do not act; unknown: reconcile; diverged: act anew."
    )
    effect_id: int = Field(description="The record to complete (or abandon).")
    begun_at: Timestamp = sometimes("proceed and diverged: when this record began.")
    result: Any = sometimes("done: the recorded result.")
    record: EffectOut = sometimes("done and unknown: the record found.")
    orphaned: EffectOut = sometimes("diverged: the earlier record, now an orphan.")


class EffectPage(Answer):
    effects: list[EffectOut]
    orphans_total: int = Field(description="The run's orphans in all.")
    next_cursor: int | None = Field(description="The `cursor` of the next page; null on the last.")
