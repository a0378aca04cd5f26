"""The coordinator's NeMo Gym control client (Gen B, docs/gym-protocol.md).

A library for the snapshot and restore choreographies: httpx, pydantic and the domain's
identifier rules, with its own control connection pool and an injectable clock. One module per
operation (discovery, prepare, renew, commit, resume, restore, retire) behind the
:class:`GymControlClient` facade. Failures leave it as
:class:`GymControlError`, whose ``to_dict()`` is the plain data of its failure
(docs/gym-protocol.md#failure-classes).
"""

from . import results
from .client import GymControlClient, Topology, callers_first
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
from .results import *  # noqa: F403 (what each operation hands back: results.__all__)
from .save import GymSave, GymSaveAborted

__all__ = [
    "Clock",
    "Episode",
    "FailureClass",
    "GymControlClient",
    "GymControlError",
    "GymSave",
    "GymSaveAborted",
    "InstanceSpec",
    "InstanceTopology",
    "LeaseRenewer",
    "ManualClock",
    "Participant",
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
__all__ += results.__all__
