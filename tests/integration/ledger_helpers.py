"""Small helpers to drive the trainer-report API in tests."""

from __future__ import annotations

import itertools
import shutil
import tempfile
from typing import Any

from ..gym_placeholders import register_placeholders

_dispatch_ids = itertools.count(1)
_checkpoint_roots: list[str] = []


def checkpoint_root() -> str:
    """A fresh checkpoint root, removed when the test that made it ends (tests/conftest.py)."""
    root = tempfile.mkdtemp(prefix="ckptc-root-")
    _checkpoint_roots.append(root)
    return root


def remove_checkpoint_roots() -> None:
    while _checkpoint_roots:
        shutil.rmtree(_checkpoint_roots.pop(), ignore_errors=True)


class RunApi:
    def __init__(self, client: Any, run_id: str, token: str) -> None:
        self.c = client
        self.run_id = run_id
        self.h = {"Authorization": f"Bearer {token}"}
        self._placed: set[str] = set()

    async def post(self, path: str, body: dict[str, Any], expect: int = 200) -> dict[str, Any]:
        r = await self.c.post(f"/v1/runs/{self.run_id}{path}", json=body, headers=self.h)
        assert r.status_code == expect, (path, r.status_code, r.text)
        return r.json()

    async def get(self, path: str, expect: int = 200) -> dict[str, Any]:
        r = await self.c.get(f"/v1/runs/{self.run_id}{path}", headers=self.h)
        assert r.status_code == expect, r.text
        return r.json()

    async def admit(self, *groups: dict[str, Any], expect: int = 200) -> dict[str, Any]:
        return await self.post("/groups/admit", {"groups": list(groups)}, expect)

    async def register_placeholders(self, *instance_ids: str) -> None:
        """Register Gym instances as placeholders (``tests/gym_placeholders.py``); only for a
        client of the app in this process (its ASGI transport holds the app)."""
        await register_placeholders(self.c._transport.app.state.engine, self.run_id, *instance_ids)
        self._placed.update(instance_ids)

    async def dispatch(
        self, rollout_ids: list[str], instance_id: str | None = "math/replica-0", dispatch_id: str | None = None, expect: int = 200,
        *, placeholder: bool = True,
    ) -> dict[str, Any]:
        """``placeholder``: register ``instance_id`` as a placeholder first when the run has not
        (tests of the ledger alone dispatch without a Gym deployment; ``tests/gym_placeholders.py``)."""
        body: dict[str, Any] = {"dispatch_id": dispatch_id or f"d{next(_dispatch_ids)}", "rollout_ids": rollout_ids}
        if instance_id is not None:
            body["instance_id"] = instance_id
            if placeholder and instance_id not in self._placed:
                r = await self.c.post(f"/v1/runs/{self.run_id}/attempts/dispatch", json=body, headers=self.h)
                if r.status_code != 404 or r.json().get("code") != "unknown_instance":
                    assert r.status_code == expect, ("/attempts/dispatch", r.status_code, r.text)
                    return r.json()
                await self.register_placeholders(instance_id)  # then the same dispatch again
        return await self.post("/attempts/dispatch", body, expect)

    async def seal(self, rows: list[dict[str, Any]], expect: int = 200, reward: float = 1.0) -> dict[str, Any]:
        body = [
            {"rollout_id": r["rollout_id"], "receipt": {"rollout_id": r["capture_key"]}, "staging_keys": [f"tq/{r['capture_key']}/0"], "reward": reward}
            for r in rows
        ]
        return await self.post("/attempts/sealed", {"rows": body}, expect)

    async def fail(self, rows: list[dict[str, Any]], cls: str, expect: int = 200) -> dict[str, Any]:
        return await self.post("/attempts/failed", {"rows": [{"rollout_id": r["rollout_id"], "failure_class": cls} for r in rows]}, expect)

    async def group(self, gid: str) -> dict[str, Any]:
        return await self.get(f"/groups/{gid}")


def group_body(gid: str, n: int = 4, **kw: Any) -> dict[str, Any]:
    return {
        "group_id": gid,
        "prompt_ref": {"sample_id": gid, "task_name": "math"},
        "task_digest": f"sha256:{gid}",
        "expected_generations": n,
        **kw,
    }


async def new_run(client: Any, admin: dict[str, str], run_id: str = "run-1", **recovery: Any) -> RunApi:
    # A fresh checkpoint root per run: snapshot directories never change once written
    # (docs/gym-protocol.md#the-gym-manifest).
    root = checkpoint_root()
    body = {"run_id": run_id, "checkpoint_root": root, "recovery": {"target_level": "sibling", **recovery}}
    r = await client.post("/v1/runs", json=body, headers=admin)
    assert r.status_code == 201, r.text
    return RunApi(client, run_id, r.json()["run_token"])
