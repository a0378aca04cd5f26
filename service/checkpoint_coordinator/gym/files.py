"""The coordinator's own filesystem work on the shared checkpoint root: the directories
participants commit into, and files that must appear whole or not at all."""

from __future__ import annotations

import os
from collections.abc import Iterable

__all__ = ["make_dirs", "write_file_atomically"]


def make_dirs(paths: Iterable[str]) -> None:
    for path in paths:
        os.makedirs(path, exist_ok=True)


def write_file_atomically(directory: str, name: str, data: bytes) -> str:
    """Write ``<directory>/<name>`` so that a crash leaves the old file or the complete new one.

    A temporary file beside it is fsynced, renamed over the target, and the directory fsynced so
    the rename itself survives. Returns the path written.
    """
    if not os.path.isabs(directory):
        raise ValueError(f"directory must be an absolute path, got {directory!r}")
    os.makedirs(directory, exist_ok=True)
    path = os.path.join(directory, name)
    tmp = path + ".tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view) :]
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(tmp, path)
    dir_fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)
    return path
