"""Shared API pieces: id patterns, a strict request model base, limits."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict

NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._-]*$"
RUN_ID_PATTERN = NAME_PATTERN
GROUP_ID_PATTERN = NAME_PATTERN
SNAPSHOT_ID_PATTERN = NAME_PATTERN
INSTANCE_ID_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._-]*(/[A-Za-z0-9][A-Za-z0-9._-]*)*$"
ROLLOUT_ID_PATTERN = NAME_PATTERN


class Strict(BaseModel):
    """Request bodies refuse unknown fields: a misspelled key must not be silently ignored."""

    model_config = ConfigDict(extra="forbid", strict=False)
