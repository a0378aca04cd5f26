"""Bridge between the API and the pure config rules of ``domain.config``."""

from __future__ import annotations

from typing import Any

from .domain.config import load_recovery_config
from .domain.errors import DomainError
from .errors import CoordinatorError, InvalidConfig


def validate_recovery_config(raw: dict[str, Any]) -> tuple[dict[str, Any], list[str]]:
    """Validate a run's recovery config; return the normalised config (every key present)."""
    try:
        cfg = load_recovery_config(raw)
    except DomainError as e:
        raise domain_problem(e, prefix="recovery", error=InvalidConfig) from e
    return cfg.public_dict(), []


def domain_problem(e: DomainError, *, prefix: str = "", error: type[CoordinatorError] = InvalidConfig) -> CoordinatorError:
    """A problem document naming every field a domain refusal points at."""
    errors = []
    for issue in e.issues:
        path = ".".join(x for x in (prefix, issue.path) if x)
        errors.append({"field": path or "body", "message": issue.message})
    return error("; ".join(f"{x['field']}: {x['message']}" for x in errors), errors=errors)
