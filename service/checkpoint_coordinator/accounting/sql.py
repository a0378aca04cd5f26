"""The SQL a run's accounting and a restore's work record share (docs/accounting.md#rollout-seconds):
one attempt row's work and, while it is in the ledger, its fate."""

from __future__ import annotations

from ..domain.vocabulary import AttemptFailureClass as F
from ..domain.vocabulary import AttemptStatus as A
from ..domain.vocabulary import WorkFate, WorkReason

# An attempt's rollout-seconds: dispatch to its end, or to now while it runs. A reserved row
# (never sent, refused by Gym, or a continuation not yet sent again) holds no work.
WORK_SECONDS = (
    f"CASE WHEN a.dispatched_at IS NULL OR a.status = '{A.reserved}' THEN 0::float8 "
    "ELSE GREATEST(0, EXTRACT(EPOCH FROM COALESCE(a.ended_at, now()) - a.dispatched_at))::float8 END"
)
# The sum of WORK_SECONDS over rows that are not reserved, for an aggregate over many of them:
# the intervals are summed exactly and turned into seconds once per group, not through a numeric
# EXTRACT per row (a large share of the CPU of a pass over a run's attempts). A row never dispatched adds
# nothing (GREATEST skips the NULL).
WORK_SECONDS_SUM = (
    "COALESCE(EXTRACT(EPOCH FROM sum(GREATEST(interval '0', COALESCE(a.ended_at, now()) - a.dispatched_at))), 0)::float8"
)

# The fate of an attempt's work while its row is in the ledger. A sealed row of an abandoned
# group is trained here; the accounting read moves those few to redone/abandoned on its own.
LIVE_FATE = (
    f"CASE WHEN a.end_reason IS NOT NULL THEN '{WorkFate.redone}' "
    f"WHEN a.status IN ('{A.failed}', '{A.abandoned}') THEN '{WorkFate.redone}' "
    f"WHEN a.status = '{A.sealed}' AND a.is_current THEN '{WorkFate.trained}' "
    f"WHEN a.status = '{A.sealed}' THEN '{WorkFate.redone}' "
    f"WHEN a.status IN ('{A.dispatched}', '{A.returned}') THEN '{WorkFate.in_flight}' END"
)
LIVE_REASON = (
    "CASE WHEN a.end_reason IS NOT NULL THEN a.end_reason "
    f"WHEN a.status = '{A.failed}' OR (a.status = '{A.abandoned}' AND a.failure_class = '{F.transport}') THEN '{WorkReason.failed}' "
    f"WHEN a.status = '{A.abandoned}' THEN '{WorkReason.abandoned}' "
    f"WHEN a.status = '{A.sealed}' AND NOT a.is_current THEN '{WorkReason.rerun}' END"
)
