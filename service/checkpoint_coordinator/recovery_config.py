"""Bridge between the API and the pure config rules of ``domain.config``."""

from __future__ import annotations

from typing import Any

from .errors import InvalidConfig


def validate_recovery_config(raw: dict[str, Any]) -> tuple[dict[str, Any], list[str]]:
    """Validate a run's recovery config; return the normalised config and warnings."""
    from .domain import config as dc

    try:
        cfg = dc.RecoveryConfig.parse(raw)  # type: ignore[attr-defined]
    except dc.ConfigError as e:  # type: ignore[attr-defined]
        errors = [{"field": f"recovery.{p.field}" if p.field else "recovery", "message": p.message} for p in e.problems]
        raise InvalidConfig("; ".join(f"{x['field']}: {x['message']}" for x in errors), errors=errors) from e
    return cfg.model_dump(mode="json"), []
