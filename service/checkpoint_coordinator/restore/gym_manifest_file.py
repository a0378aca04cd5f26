"""``<snapshot_dir>/gym_checkpoint.json``: the Gym manifest (schema 2) on disk, for tools that
read NeMo RL's layout (ledger spec section 8, protocol 8.2/8.3).

Writing and reading both go through the domain loader, so a file is never written from, nor read
into, anything but a valid schema-2 manifest (the version is checked before any other field).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

from ..domain.gym_manifest import (
    GymManifest,
    dump_gym_manifest,
    load_gym_manifest,
    manifest_from_json_bytes,
    manifest_to_json_bytes,
)

GYM_MANIFEST_FILENAME = "gym_checkpoint.json"

__all__ = ["GYM_MANIFEST_FILENAME", "manifest_document", "read_gym_manifest", "write_gym_manifest"]


def manifest_document(manifest: Mapping[str, Any] | GymManifest) -> dict[str, Any]:
    """The normalised JSON document of a manifest (lists sorted), validated on the way."""
    loaded = manifest if isinstance(manifest, GymManifest) else load_gym_manifest(manifest)
    return dump_gym_manifest(loaded)


def write_gym_manifest(snapshot_dir: str, manifest_dict: Mapping[str, Any]) -> str:
    """Validate ``manifest_dict`` and write it to ``<snapshot_dir>/gym_checkpoint.json``.

    ``gym_checkpoint.json.tmp`` is written with sorted keys and fsynced, renamed over the target,
    then the directory is fsynced: a crash leaves the old file or the complete new one, never a
    torn one. Raises ``ManifestError`` (nothing written) for an invalid manifest and ``ValueError``
    for a relative ``snapshot_dir``. Returns the path written.
    """
    if not os.path.isabs(snapshot_dir):
        raise ValueError(f"snapshot_dir must be an absolute path, got {snapshot_dir!r}")
    loaded = manifest_dict if isinstance(manifest_dict, GymManifest) else load_gym_manifest(manifest_dict)
    data = manifest_to_json_bytes(loaded)
    os.makedirs(snapshot_dir, exist_ok=True)
    path = os.path.join(snapshot_dir, GYM_MANIFEST_FILENAME)
    tmp = path + ".tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        view = memoryview(data)
        while view:
            written = os.write(fd, view)
            view = view[written:]
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(tmp, path)
    dir_fd = os.open(snapshot_dir, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)
    return path


def read_gym_manifest(snapshot_dir: str) -> GymManifest:
    """Load ``<snapshot_dir>/gym_checkpoint.json`` through the domain loader (version first)."""
    with open(os.path.join(snapshot_dir, GYM_MANIFEST_FILENAME), "rb") as fh:
        return manifest_from_json_bytes(fh.read())
