"""The coordinator's NeMo Gym control client (spec: gym-control-protocol.md, Gen B).

A library for the snapshot and restore choreographies: httpx, pydantic and the domain's
identifier rules, with its own control connection pool and an injectable clock. One module per
operation (discovery, prepare, renew, commit, resume, restore, retire) behind the
:class:`GymControlClient` facade. Failures leave it as
:class:`GymControlError`, whose ``to_dict()`` is the plain data of spec section 9.
"""

from .client import GymControlClient, RestoreCleanup, Topology, callers_first
from .clock import Clock, ManualClock, SystemClock
from .errors import FailureClass, GymControlError, classify, normalize_code
from .lease import LeaseRenewer
from .manifest import build_gym_manifest, write_gym_manifest
from .models import (
    Episode,
    InstanceSpec,
    InstanceTopology,
    Participant,
    format_capture_key,
    instance_checkpoint_dir,
    parse_capture_key,
)
from .policy import compute_scope
from .results import (
    BatchResult,
    CommitResult,
    ForgetSettlement,
    InstanceCommit,
    PrepareResult,
    RenewResult,
    RestoreResult,
    ResumeReport,
    SaveResult,
)
from .save import GymSave, GymSaveAborted

__all__ = [
    "BatchResult",
    "Clock",
    "CommitResult",
    "Episode",
    "FailureClass",
    "ForgetSettlement",
    "GymControlClient",
    "GymControlError",
    "GymSave",
    "GymSaveAborted",
    "InstanceCommit",
    "InstanceSpec",
    "InstanceTopology",
    "LeaseRenewer",
    "ManualClock",
    "Participant",
    "PrepareResult",
    "RenewResult",
    "RestoreCleanup",
    "RestoreResult",
    "ResumeReport",
    "SaveResult",
    "SystemClock",
    "Topology",
    "build_gym_manifest",
    "callers_first",
    "classify",
    "compute_scope",
    "format_capture_key",
    "instance_checkpoint_dir",
    "normalize_code",
    "parse_capture_key",
    "write_gym_manifest",
]
