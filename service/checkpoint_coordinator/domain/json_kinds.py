"""How a refusal names the JSON type of a decoded value (``null``, ``boolean``, ``integer``,
``number``, ``string``, ``array``, ``object``): one rule for every document loader of the domain
(Gym manifests, NeMo RL ledgers), so their messages agree."""

from __future__ import annotations

from collections.abc import Mapping

__all__ = ["json_kind"]


def json_kind(value: object) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int):
        return "integer"
    if isinstance(value, float):
        return "number"
    if isinstance(value, str):
        return "string"
    if isinstance(value, (list, tuple)):
        return "array"
    if isinstance(value, Mapping):
        return "object"
    return type(value).__name__
