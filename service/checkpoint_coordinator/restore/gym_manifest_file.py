"""``<snapshot_dir>/gym_checkpoint.json``: the Gym manifest (schema 2) on disk, for tools that
read NeMo RL's layout (docs/ledger.md#the-gym-manifest, docs/gym-protocol.md#the-gym-manifest).

Writing and reading both go through the domain loader, so a file is never written from, nor read
into, anything but a valid schema-2 manifest (the version is checked before any other field).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

from ..domain.gym_manifest import GymManifest, dump_gym_manifest, load_gym_manifest, manifest_from_json_bytes
from ..gym.manifest import GYM_MANIFEST_FILENAME
from ..gym.manifest import write_gym_manifest as gym_write_manifest

__all__ = ["GYM_MANIFEST_FILENAME", "manifest_document", "read_gym_manifest", "write_gym_manifest"]


def manifest_document(manifest: Mapping[str, Any] | GymManifest) -> dict[str, Any]:
    """The normalised JSON document of a manifest (lists sorted), validated on the way."""
    loaded = manifest if isinstance(manifest, GymManifest) else load_gym_manifest(manifest)
    return dump_gym_manifest(loaded)


def write_gym_manifest(snapshot_dir: str, manifest_dict: Mapping[str, Any]) -> str:
    """Validate ``manifest_dict``, then write it to ``<snapshot_dir>/gym_checkpoint.json``
    through the save's own writer (atomic: the old file or the complete new one).

    Raises ``ManifestError`` (nothing written) for an invalid manifest and ``ValueError`` for a
    relative ``snapshot_dir``. Returns the path written.
    """
    if not os.path.isabs(snapshot_dir):
        raise ValueError(f"snapshot_dir must be an absolute path, got {snapshot_dir!r}")
    return gym_write_manifest(snapshot_dir, manifest_document(manifest_dict))


def read_gym_manifest(snapshot_dir: str) -> GymManifest:
    """Load ``<snapshot_dir>/gym_checkpoint.json`` through the domain loader (version first)."""
    with open(os.path.join(snapshot_dir, GYM_MANIFEST_FILENAME), "rb") as fh:
        return manifest_from_json_bytes(fh.read())
