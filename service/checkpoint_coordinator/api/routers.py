"""Feature routers beyond runs and health, in the order they appear in the OpenAPI document."""

from __future__ import annotations

from typing import Any

from . import rollouts, snapshots

ROUTERS: list[Any] = [rollouts.router, snapshots.router]
ROUTERS.append(__import__(f"{__package__}.gym", fromlist=["router"]).router)  # Gym registration (issue 6)
ROUTERS.append(__import__(f"{__package__}.restore", fromlist=["router"]).router)  # restore, manifest, ledger import (issue 6)
