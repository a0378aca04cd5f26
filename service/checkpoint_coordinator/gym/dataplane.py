"""What a caller must do with a data-plane ``/run`` reply (spec section 9).

The coordinator never sends ``/run`` itself; this classification is shared with the code that
reports row outcomes, so a refusal at admission is never mistaken for a failed attempt.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

from .errors import normalize_code, truncate_detail

__all__ = ["RunDisposition", "RunOutcome", "classify_run_reply"]


class RunDisposition(StrEnum):
    COMPLETED = "completed"
    # Admission closed by a checkpoint: re-send the same row, same rollout id and attempt,
    # once the instance resumed. Spends no attempt.
    RETRY_SAME_ATTEMPT_AFTER_RESUME = "retry_same_attempt_after_resume"
    # The attempt was retired and already replaced: never retry it.
    STALE_ATTEMPT = "stale_attempt"
    # A reply that ended the episode in Gym: a data failure, no retire needed.
    DATA_FAILURE = "data_failure"
    # No reply: the row may still run in Gym. Retire it and re-send under a new rollout id.
    NO_REPLY = "no_reply"


@dataclass(frozen=True, slots=True)
class RunOutcome:
    disposition: RunDisposition
    http_status: int | None
    code: str | None
    detail: str
    spends_attempt: bool
    needs_retire: bool
    # True when the row is re-sent under a fresh rollout id (an infra failure).
    new_rollout_id: bool


def classify_run_reply(http_status: int | None, body: bytes | str | dict[str, Any] | None) -> RunOutcome:
    """Classify a ``/run`` reply; ``http_status=None`` means no reply at all."""
    if http_status is None:
        return RunOutcome(RunDisposition.NO_REPLY, None, None, "no reply", True, True, True)
    if 200 <= http_status < 300:
        return RunOutcome(RunDisposition.COMPLETED, http_status, None, "", True, False, False)
    code, detail = _envelope(body)
    norm = normalize_code(code) if code is not None else None
    if norm == "admission_closed":
        return RunOutcome(
            RunDisposition.RETRY_SAME_ATTEMPT_AFTER_RESUME, http_status, norm, detail, False, False, False
        )
    if norm == "stale_attempt":
        return RunOutcome(RunDisposition.STALE_ATTEMPT, http_status, norm, detail, False, False, False)
    # rollout_id_required and every other refusal: the episode ended (or never began) in Gym.
    return RunOutcome(RunDisposition.DATA_FAILURE, http_status, norm, detail, True, False, False)


def _envelope(body: bytes | str | dict[str, Any] | None) -> tuple[str | None, str]:
    data: Any = body
    if isinstance(body, (bytes, str)):
        try:
            data = json.loads(body) if body else None
        except ValueError:
            return None, truncate_detail(body if isinstance(body, str) else body.decode("utf-8", "replace"))
    if isinstance(data, dict) and isinstance(data.get("error"), dict):
        err = data["error"]
        code = err.get("code") if isinstance(err.get("code"), str) else None
        return code, truncate_detail(err.get("detail", ""))
    return None, truncate_detail(json.dumps(data, default=str) if data is not None else "")
