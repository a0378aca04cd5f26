"""Conservation after a crash (docs/accounting.md#prompt-conservation): every prompt group a run
admitted is trained, abandoned, live or rewound, and every restore recorded what it kept. The
e2e and fault suites run :func:`assert_conserved` after each test that used a ledger database
(their ``conftest.py``), so every crash they stage is followed by this check."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator
from typing import Any

import pytest

from checkpoint_coordinator.accounting.store import run_accounting
from checkpoint_coordinator.ledger.db import make_async_engine


async def _accountings(database_url: str) -> list[dict[str, Any]]:
    engine = make_async_engine(database_url, pool_size=1)
    try:
        async with engine.connect() as conn:
            from sqlalchemy import text

            exists = (await conn.execute(text("SELECT to_regclass('group_admissions') IS NOT NULL"))).scalar()
            run_ids = list((await conn.execute(text("SELECT run_id FROM runs ORDER BY run_id"))).scalars()) if exists else []
        return [await run_accounting(engine, r) for r in run_ids]
    finally:
        await engine.dispose()


def accountings(database_url: str) -> list[dict[str, Any]]:
    """Every run's accounting, read in a thread of its own (the caller may be inside an event
    loop, or a sync fixture's teardown outside any)."""
    out: list[Any] = []

    def work() -> None:
        try:
            out.append(asyncio.run(_accountings(database_url)))
        except BaseException as e:  # handed to the caller
            out.append(e)

    t = threading.Thread(target=work, name="accounting-check")
    t.start()
    t.join(120)
    if not out:
        raise TimeoutError("reading the accounting took over 120 s")
    if isinstance(out[0], BaseException):
        raise out[0]
    return out[0]


def problems(accounting: dict[str, Any]) -> list[str]:
    """What is wrong with one run's accounting (empty: conserved and every restore recorded)."""
    p = accounting["prompts"]
    found = []
    if not p["conserved"] or p["missing"]:
        found.append(f"run {accounting['run_id']}: {p['admitted']} groups admitted, {p['accounted']} accounted for: {p['buckets']}")
    for r in accounting["restores"]:
        if not r["recorded"]:
            found.append(f"run {accounting['run_id']}: restore {r['restore_id']} recorded no accounting")
        if r["carried_seconds"] > r["found_seconds"] + 1e-6:
            found.append(f"run {accounting['run_id']}: restore {r['restore_id']} carried more than it found")
    return found


def assert_conserved(database_url: str) -> int:
    """Assert conservation for every run of the database; returns how many runs were checked."""
    runs = accountings(database_url)
    bad = [x for a in runs for x in problems(a)]
    assert not bad, "\n".join(bad)
    return len(runs)


@pytest.fixture(autouse=True)
def conservation_after_the_test(request: pytest.FixtureRequest) -> Iterator[None]:
    """Autouse in the e2e and fault suites (their conftest imports it): a test that used a ledger
    database ends with the conservation check."""
    url = request.getfixturevalue("database_url") if "database_url" in request.fixturenames else None
    yield
    if url is not None:
        assert_conserved(url)
