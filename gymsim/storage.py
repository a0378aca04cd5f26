"""Participant state on the shared filesystem (docs/gym-protocol.md#the-gym-manifest): a records
file, then the manifest.

The records file is streamed to a temporary name while hashing, fsynced and renamed to its
content-addressed name; the manifest is published last through a hard link, which fails when a
manifest exists, so exactly one of two racing writers wins and a published directory never changes.
"""

from __future__ import annotations

import hashlib
import json
import os
import secrets
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable

from .wire import RECORDS_FILE_RE, ProtocolError

SCHEMA_VERSION = 1
MANIFEST = "manifest.json"


def participant_dir(checkpoint_dir: str | os.PathLike, kind: str, name: str) -> Path:
    return Path(checkpoint_dir) / "gym" / kind / name


def _invalid(detail: str) -> ProtocolError:
    return ProtocolError("invalid_checkpoint_state", detail)


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def check_checkpoint_dir(checkpoint_dir: str) -> Path:
    path = Path(checkpoint_dir)
    if not path.is_absolute():
        raise _invalid(f"checkpoint_dir must be an absolute path: {checkpoint_dir!r}")
    if not path.is_dir():
        raise _invalid(f"checkpoint_dir does not exist or is not a directory: {checkpoint_dir}")
    return path


def read_manifest(directory: Path) -> dict[str, Any] | None:
    """The published manifest of a participant directory, or None when there is none."""
    path = directory / MANIFEST
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise _invalid(f"cannot read {path}: {exc}") from exc
    try:
        manifest = json.loads(raw)
    except ValueError as exc:
        raise _invalid(f"{path} is not JSON: {exc}") from exc
    if not isinstance(manifest, dict):
        raise _invalid(f"{path} is not a JSON object")
    return manifest


def ensure_no_foreign_manifest(directory: Path, checkpoint_id: str) -> None:
    """Refuse early, before exporting, when the directory already belongs to another checkpoint."""
    existing = read_manifest(directory)
    if existing is not None and existing.get("checkpoint_id") != checkpoint_id:
        raise _invalid(
            f"{directory / MANIFEST} belongs to checkpoint {existing.get('checkpoint_id')!r}, not {checkpoint_id!r}"
        )


def record_line(record: dict[str, Any]) -> bytes:
    return (json.dumps(record, sort_keys=True, separators=(",", ":")) + "\n").encode("utf-8")


@dataclass(frozen=True)
class Written:
    manifest: dict[str, Any]
    directory: Path


def write_participant_state(
    checkpoint_dir: str,
    *,
    kind: str,
    name: str,
    checkpoint_id: str,
    records: Iterable[dict[str, Any]],
    extras: dict[str, Any] | None = None,
) -> Written:
    base = check_checkpoint_dir(checkpoint_dir)
    directory = participant_dir(base, kind, name)
    try:
        directory.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise _invalid(f"cannot create {directory}: {exc}") from exc

    token = secrets.token_hex(8)
    tmp_records = directory / f".records-{token}.tmp"
    tmp_manifest = directory / f".manifest-{token}.tmp"
    created_records: Path | None = None
    try:
        digest = hashlib.sha256()
        count = 0
        with open(tmp_records, "wb") as handle:
            for record in records:
                line = record_line(record)
                digest.update(line)
                handle.write(line)
                count += 1
            handle.flush()
            os.fsync(handle.fileno())
        sha = digest.hexdigest()
        records_file = f"records-{sha}.jsonl"
        manifest = {
            **(extras or {}),
            "schema_version": SCHEMA_VERSION,
            "kind": kind,
            "instance": name,
            "checkpoint_id": checkpoint_id,
            "records_file": records_file,
            "records_sha256": sha,
            "record_count": count,
        }
        existing = read_manifest(directory)
        if existing is not None:
            # Published already (a retried write): return it if it is this commit, else touch nothing.
            return Written(manifest=_same_commit(existing, manifest, directory), directory=directory)

        try:
            # Linking (not renaming) tells whether this writer created the file, so a loser of the
            # manifest race below can take back exactly what it added.
            os.link(tmp_records, directory / records_file)
            created_records = directory / records_file
        except FileExistsError:
            pass  # content-addressed: an existing file with this name has these bytes
        _fsync_dir(directory)

        with open(tmp_manifest, "wb") as handle:
            handle.write(json.dumps(manifest, sort_keys=True, indent=1).encode("utf-8"))
            handle.flush()
            os.fsync(handle.fileno())
        try:
            os.link(tmp_manifest, directory / MANIFEST)
        except FileExistsError:
            existing = read_manifest(directory) or {}
            if created_records is not None and existing.get("records_file") != records_file:
                created_records.unlink()
                created_records = None
            manifest = _same_commit(existing, manifest, directory)
        _fsync_dir(directory)
        return Written(manifest=manifest, directory=directory)
    except OSError as exc:
        raise _invalid(f"cannot write participant state in {directory}: {exc}") from exc
    finally:
        for leftover in (tmp_records, tmp_manifest):
            try:
                leftover.unlink()
            except OSError:
                pass


def _same_commit(existing: dict[str, Any], ours: dict[str, Any], directory: Path) -> dict[str, Any]:
    if all(existing.get(k) == ours[k] for k in ("checkpoint_id", "kind", "instance", "records_sha256")):
        return existing
    raise _invalid(f"{directory / MANIFEST} was published by another checkpoint or with other records")


@dataclass(frozen=True)
class Loaded:
    manifest: dict[str, Any]
    records: list[dict[str, Any]]  # only the records whose episode is in scope


def read_participant_state(
    checkpoint_dir: str, *, kind: str, name: str, scope: set[tuple[str, int]]
) -> Loaded:
    """Read and verify a participant directory in one streaming pass."""
    base = check_checkpoint_dir(checkpoint_dir)
    directory = participant_dir(base, kind, name)
    manifest = read_manifest(directory)
    if manifest is None:
        raise _invalid(f"no {MANIFEST} in {directory}")
    version = manifest.get("schema_version")
    if type(version) is not int or version != SCHEMA_VERSION:
        raise _invalid(f"unsupported schema_version {version!r}")
    if manifest.get("kind") != kind:
        raise _invalid(f"manifest kind {manifest.get('kind')!r} is not this participant's kind {kind!r}")
    if manifest.get("instance") != name:
        raise _invalid(f"manifest instance {manifest.get('instance')!r} is not this participant {name!r}")
    if not isinstance(manifest.get("checkpoint_id"), str):
        raise _invalid("manifest checkpoint_id is not a string")
    records_file = manifest.get("records_file")
    if not isinstance(records_file, str) or not RECORDS_FILE_RE.match(records_file):
        raise _invalid(f"bad records_file {records_file!r}")
    expected_sha = manifest.get("records_sha256")
    expected_count = manifest.get("record_count")
    if not isinstance(expected_sha, str) or type(expected_count) is not int or expected_count < 0:
        raise _invalid("manifest records_sha256 or record_count is malformed")

    digest = hashlib.sha256()
    count = 0
    kept: list[dict[str, Any]] = []
    problem: str | None = None
    try:
        with open(directory / records_file, "rb") as handle:
            for line in handle:
                # The digest and the count cover the whole file, whatever the scope keeps.
                digest.update(line)
                count += 1
                if problem is not None:
                    continue
                try:
                    record = json.loads(line)
                    episode = record["episode_id"]
                    pair = (episode["rollout_id"], episode["attempt"])
                    if type(pair[1]) is not int or not isinstance(pair[0], str) or record.get("kind") != kind:
                        raise ValueError("malformed record")
                    if not isinstance(record.get("state"), dict):
                        raise ValueError("record state is not an object")
                except (ValueError, KeyError, TypeError) as exc:
                    problem = f"record {count} is malformed: {exc}"
                    continue
                if pair in scope:
                    kept.append(record)
    except OSError as exc:
        raise _invalid(f"cannot read {directory / records_file}: {exc}") from exc
    if digest.hexdigest() != expected_sha:
        raise _invalid("records_sha256 does not match the records file")
    if count != expected_count:
        raise _invalid(f"record_count {expected_count} does not match the {count} lines of the records file")
    if problem is not None:
        raise _invalid(problem)
    return Loaded(manifest=manifest, records=kept)
