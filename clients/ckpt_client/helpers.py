"""Small helpers with no I/O."""

from __future__ import annotations

import uuid
from collections.abc import Callable, Iterable, Iterator
from itertools import islice
from typing import TypeVar

T = TypeVar("T")

__all__ = ["batched", "batched_by_weight", "new_id"]


def batched(iterable: Iterable[T], size: int) -> Iterator[list[T]]:
    """Consecutive lists of at most ``size`` items (the last one may be shorter)."""
    if size < 1:
        raise ValueError("batch size must be >= 1")
    it = iter(iterable)
    while chunk := list(islice(it, size)):
        yield chunk


def batched_by_weight(items: Iterable[T], size: int, weight: Callable[[T], int], max_weight: int) -> Iterator[list[T]]:
    """Consecutive lists of at most ``size`` items whose weights add up to at most
    ``max_weight`` (an item heavier than that alone goes in a list of its own)."""
    if size < 1:
        raise ValueError("batch size must be >= 1")
    chunk: list[T] = []
    total = 0
    for item in items:
        w = weight(item)
        if chunk and (len(chunk) >= size or total + w > max_weight):
            yield chunk
            chunk, total = [], 0
        chunk.append(item)
        total += w
    if chunk:
        yield chunk


def new_id(prefix: str) -> str:
    """A fresh id matching the server's name pattern. Ids are minted client-side, once per
    call, so every retry of that call repeats the same id and the server can recognise it."""
    return f"{prefix}-{uuid.uuid4().hex}"
