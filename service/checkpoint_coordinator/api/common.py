"""Shared API pieces: id patterns, a strict request model base, limits."""

from __future__ import annotations

from typing import Any

from fastapi import Response
from pydantic import BaseModel, ConfigDict
from pydantic_core import to_json

NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._-]*$"
RUN_ID_PATTERN = NAME_PATTERN
GROUP_ID_PATTERN = NAME_PATTERN
SNAPSHOT_ID_PATTERN = NAME_PATTERN
INSTANCE_ID_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._-]*(/[A-Za-z0-9][A-Za-z0-9._-]*)*$"
ROLLOUT_ID_PATTERN = NAME_PATTERN


class Strict(BaseModel):
    """Request bodies refuse unknown fields: a misspelled key must not be silently ignored."""

    model_config = ConfigDict(extra="forbid", strict=False)


class FastJSON(Response):
    """Compact UTF-8 JSON from pydantic-core's native serializer: batch answers of thousands of
    rows skip FastAPI's recursive encoder and the stdlib encoder, which cost more than the
    database work for them. Non-finite floats (never valid JSON) leave as null."""

    media_type = "application/json"

    def render(self, content: Any) -> bytes:
        return to_json(content, inf_nan_mode="null")
