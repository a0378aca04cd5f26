"""The retire/forget outbox against gymsim: delivery order, refusals, backoff, two replicas."""

from __future__ import annotations

import asyncio
from collections import Counter
from typing import Any

import pytest
from sqlalchemy import text

from checkpoint_coordinator.ledger import leases
from checkpoint_coordinator.outbox.worker import OutboxDeliverer
from gymsim.testing import GymsimInstance, default_instance_config

from ..integration.ledger_helpers import group_body, new_run
from .harness import register_by_discovery

pytestmark = pytest.mark.timeout(120)
PARTICIPANTS = ("policy_model", "workplace_agent", "calendar_resources")


@pytest.fixture
def gym():
    g = GymsimInstance.start(default_instance_config("math/replica-0", token="tok-a"))
    yield g
    g.stop()


async def _abandoned(client, admin, app, gym, n_groups: int = 2, n: int = 2, **recovery):  # type: ignore[no-untyped-def]
    api = await new_run(client, admin, **recovery)
    await register_by_discovery(app.state.engine, "run-1", [gym])
    groups = [group_body(f"g{k}", n) for k in range(n_groups)]
    rows = [r for g in (await api.admit(*groups))["groups"] for r in g["rows"]]
    await api.dispatch([r["rollout_id"] for r in rows], instance_id="math/replica-0")
    await api.post("/groups/abandon", {"group_ids": [g["group_id"] for g in groups]})
    return api, rows


def _retired_keys(gym: GymsimInstance) -> dict[str, Counter[str]]:
    st = gym.state()["servers"]
    return {s: Counter(k for call in st[s]["retire_calls"] for k in call) for s in PARTICIPANTS}


async def _wait_empty(api: Any, timeout: float = 20) -> None:
    async with asyncio.timeout(timeout):
        while (await api.get("/outbox"))["items"]:
            await asyncio.sleep(0.05)


async def test_worker_retires_then_forgets_every_abandoned_attempt(client, admin, app, gym) -> None:  # type: ignore[no-untyped-def]
    api, rows = await _abandoned(client, admin, app, gym)
    await _wait_empty(api)
    keys = {r["capture_key"] for r in rows}
    for server, counts in _retired_keys(gym).items():
        assert set(counts) == keys and all(v == 1 for v in counts.values()), server
    st = gym.state()["servers"]
    for s in PARTICIPANTS:
        assert sorted(r for call in st[s]["forget_calls"] for r in call) == sorted(r["rollout_id"] for r in rows)
        assert st[s]["marks"] == {}
    g = await api.group("g0")
    assert {a["retirement"] for s in g["siblings"] for a in s["attempts"]} == {"forgotten"}


async def test_callers_are_retired_before_callees(client, admin, app, gym) -> None:  # type: ignore[no-untyped-def]
    gym.admin("POST", "/admin/faults", {"server_name": "workplace_agent", "op": "retire", "type": "error", "status": 500, "times": 1})
    api, rows = await _abandoned(client, admin, app, gym, n_groups=1, n=1, )
    async with asyncio.timeout(10):
        while True:
            items = (await api.get("/outbox"))["items"]
            if items and items[0]["tries"] >= 1:
                break
            await asyncio.sleep(0.05)
    # the agent (caller) failed, so the model and resources (callees) were not sent the retire yet
    counts = _retired_keys(gym)
    assert not counts["policy_model"] and not counts["calendar_resources"]
    assert items[0]["last_error"]
    await _wait_empty(api)
    counts = _retired_keys(gym)
    assert all(sum(c.values()) == 1 for c in counts.values())


async def test_refused_forget_gets_retire_again_then_forget(client, admin, app, gym) -> None:  # type: ignore[no-untyped-def]
    gym.admin("POST", "/admin/faults", {"server_name": "calendar_resources", "op": "forget", "type": "refuse", "code": "checkpoint_error", "times": 1})
    api, rows = await _abandoned(client, admin, app, gym, n_groups=1, n=1)
    await _wait_empty(api)
    counts = _retired_keys(gym)
    key = rows[0]["capture_key"]
    assert all(c[key] == 2 for c in counts.values())  # retire, refused forget, retire again, forget
    assert gym.state()["servers"]["calendar_resources"]["marks"] == {}


async def test_forget_refused_twice_stays_queued(client, admin, app, gym) -> None:  # type: ignore[no-untyped-def]
    gym.admin("POST", "/admin/faults", {"server_name": "calendar_resources", "op": "forget", "type": "refuse", "code": "checkpoint_error", "times": 2})
    api, rows = await _abandoned(client, admin, app, gym, n_groups=1, n=1)
    async with asyncio.timeout(10):
        while True:
            items = (await api.get("/outbox"))["items"]
            if items and items[0]["op"] == "forget" and items[0]["tries"] >= 1:
                break
            await asyncio.sleep(0.05)
    assert items[0]["rollout_id"] == rows[0]["rollout_id"] and "calendar_resources: forget" in items[0]["last_error"]
    await _wait_empty(api, timeout=30)  # backoff, then delivered once the refusals stop


async def test_two_replicas_never_deliver_the_same_item(client, admin, app, gym) -> None:  # type: ignore[no-untyped-def]
    app.state.settings.background_workers = False
    for t in app.state.background:
        t.cancel()
    api, rows = await _abandoned(client, admin, app, gym, n_groups=300, n=8)
    # Two deliverers under the lease holder's name (a restarted process beside the old one) race
    # on the claims; a replica without the lease is refused at its first claim.
    epoch = await leases.acquire(app.state.engine, "run-1", "replica-a", 60)
    assert epoch is not None
    a = OutboxDeliverer(app.state.engine, app.state.gym, "replica-a")
    a2 = OutboxDeliverer(app.state.engine, app.state.gym, "replica-a")
    b = OutboxDeliverer(app.state.engine, app.state.gym, "replica-b")
    with pytest.raises(leases.Fenced):
        await b.deliver_run("run-1", epoch)
    await asyncio.gather(a.deliver_run("run-1", epoch), a2.deliver_run("run-1", epoch), a.deliver_run("run-1", epoch), a2.deliver_run("run-1", epoch))
    await asyncio.gather(a.deliver_run("run-1", epoch), a2.deliver_run("run-1", epoch))
    assert (await api.get("/outbox"))["items"] == []
    for server, counts in _retired_keys(gym).items():
        assert len(counts) == 2400 and max(counts.values()) == 1, server
    async with app.state.engine.connect() as conn:
        per_state = dict((await conn.execute(text("SELECT state, count(*) FROM outbox_items GROUP BY state"))).all())
    assert per_state == {"delivered": 4800}
