"""The Gym manifest of a snapshot, schema version 2 (spec 8.3), as the save writes it.

Loading and validating a manifest belongs to the domain layer; this module only produces one.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from typing import Any

from .results import CommitResult

__all__ = ["GYM_MANIFEST_FILENAME", "GYM_MANIFEST_VERSION", "build_gym_manifest", "write_gym_manifest"]

GYM_MANIFEST_VERSION = 2
GYM_MANIFEST_FILENAME = "gym_checkpoint.json"


def build_gym_manifest(checkpoint_id: str, commit: CommitResult) -> dict[str, Any]:
    """Plain-dict manifest with every list sorted and keys in sorted order.

    ``participants`` are the servers that committed the instance, which a restore requires
    to be live again; ``staging_keys`` are those of the exported episodes only.
    """
    instances: dict[str, Any] = {}
    for iid in sorted(commit.instances):
        ic = commit.instances[iid]
        instances[iid] = {
            "episodes": [ep.to_wire() for ep in sorted(ic.episodes)],
            "participants": sorted(ic.participants),
            "restarts": [ep.to_wire() for ep in sorted(ic.restarts)],
            "staging_keys": sorted(ic.staging_keys),
        }
    return {
        "checkpoint_id": checkpoint_id,
        "instances": instances,
        "schema_version": GYM_MANIFEST_VERSION,
    }


def write_gym_manifest(snapshot_dir: str, manifest: Mapping[str, Any]) -> str:
    """Write ``<snapshot_dir>/gym_checkpoint.json`` atomically; returns the path.

    Temporary file, fsync, rename, then fsync of the directory, so a crash leaves either the
    old file or the complete new one.
    """
    os.makedirs(snapshot_dir, exist_ok=True)
    path = os.path.join(snapshot_dir, GYM_MANIFEST_FILENAME)
    tmp = path + ".tmp"
    data = json.dumps(manifest, sort_keys=True, separators=(",", ":"), allow_nan=False).encode()
    with open(tmp, "wb") as fh:
        fh.write(data)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)
    dir_fd = os.open(snapshot_dir, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)
    return path
