"""The Gym manifest of a snapshot, schema version 2 (docs/gym-protocol.md#the-gym-manifest), as the save
writes it.

Loading and validating a manifest belongs to the domain layer; this module only produces one.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from typing import Any

from pydantic_core import to_json

from .files import write_file_atomically
from .models import Episode
from .results import CommitResult, InstanceCommit

__all__ = [
    "GYM_MANIFEST_FILENAME",
    "GYM_MANIFEST_VERSION",
    "build_gym_manifest",
    "encode_gym_manifest",
    "encode_gym_manifest_of",
    "encode_instance_entry",
    "write_gym_manifest",
]

GYM_MANIFEST_VERSION = 2
GYM_MANIFEST_FILENAME = "gym_checkpoint.json"


def instance_entry(ic: InstanceCommit) -> dict[str, Any]:
    """One instance's entry of the manifest.

    ``participants`` are the servers that committed the instance, which a restore requires
    to be live again; ``staging_keys`` are those of the exported episodes only.
    """
    return {
        "episodes": _sorted_wire(ic.episodes),
        "participants": sorted(ic.participants),
        "restarts": _sorted_wire(ic.restarts),
        "staging_keys": sorted(ic.staging_keys),
    }


def _sorted_wire(episodes: Iterable[Episode]) -> list[dict[str, Any]]:
    """``Episode.to_wire`` of each, sorted, with the keys in the order ``sort_keys`` writes them
    (``encode_instance_entry`` relies on it)."""
    return [{"attempt": ep.attempt, "rollout_id": ep.rollout_id} for ep in sorted(episodes)]


def build_gym_manifest(checkpoint_id: str, commit: CommitResult) -> dict[str, Any]:
    """Plain-dict manifest with every list sorted and keys in sorted order."""
    return {
        "checkpoint_id": checkpoint_id,
        "instances": {iid: instance_entry(commit.instances[iid]) for iid in sorted(commit.instances)},
        "schema_version": GYM_MANIFEST_VERSION,
    }


def encode_gym_manifest(manifest: Mapping[str, Any]) -> str:
    """The manifest's one text form: compact, sorted keys (the file's content, and what the
    ledger stores, so a big manifest is encoded once per snapshot)."""
    return json.dumps(manifest, sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False)


def encode_instance_entry(ic: InstanceCommit) -> str:
    """``instance_entry`` in the manifest's text form: what the commit encodes for an instance
    as soon as it is validated, while other instances still commit.

    The same text as ``encode_gym_manifest(instance_entry(ic))``, by pydantic-core's encoder
    (a third of the time, on the event loop while Gym is parked): it keeps a dict's key order,
    and ``instance_entry`` builds every dict in sorted key order. No floats, only Gym's strings."""
    return to_json(instance_entry(ic)).decode()


def encode_gym_manifest_of(checkpoint_id: str, commit: CommitResult) -> str:
    """``encode_gym_manifest(build_gym_manifest(...))``, the same text, joined from the
    instances' encoded entries (``InstanceCommit.manifest_entry``, encoded here when empty)."""
    entries = ",".join(
        encode_gym_manifest(iid) + ":" + (commit.instances[iid].manifest_entry or encode_instance_entry(commit.instances[iid]))
        for iid in sorted(commit.instances)
    )
    return (
        '{"checkpoint_id":' + encode_gym_manifest(checkpoint_id) + ',"instances":{' + entries + '},"schema_version":'
        + encode_gym_manifest(GYM_MANIFEST_VERSION) + "}"
    )


def write_gym_manifest(snapshot_dir: str, manifest: Mapping[str, Any] | None = None, *, encoded: str | None = None) -> str:
    """Write ``<snapshot_dir>/gym_checkpoint.json`` with sorted keys, atomically; returns the path.
    ``encoded``: the manifest's ``encode_gym_manifest`` text, when the caller has it already
    (then ``manifest`` is not needed).

    This is the one writer of the file; callers that must refuse an invalid manifest validate
    it first (``restore.gym_manifest_file``).
    """
    if encoded is None:
        if manifest is None:
            raise ValueError("write_gym_manifest needs the manifest or its encoded text")
        encoded = encode_gym_manifest(manifest)
    data = encoded.encode()
    return write_file_atomically(snapshot_dir, GYM_MANIFEST_FILENAME, data)
