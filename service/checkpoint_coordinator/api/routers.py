"""Feature routers beyond runs and health, in the order they appear in the OpenAPI document."""

from __future__ import annotations

from typing import Any

from . import accounting, effects, gym, restore, rollouts, snapshots

ROUTERS: list[Any] = [effects.hot, effects.router, rollouts.router, snapshots.router, gym.router, restore.router, accounting.router]
