"""Differential test: the restore plan the ledger computes in SQL (``ledger.restore_plan_sql.plan_in_sql``,
what ``load_and_plan`` uses) equals the pure oracle's plan (``tests/oracles/restore_plan.py``) on
random ledger cuts and Gym manifests, against real PostgreSQL: same dispositions, rows (reused ones
included), new rollout ids, counts, rerunning cohorts, skipped groups and retires, and on a broken
cut or a disagreeing manifest the same refusal."""

from __future__ import annotations

import asyncio
import itertools
import json
from typing import Any

from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from sqlalchemy import text

from checkpoint_coordinator.domain.config import load_recovery_config
from checkpoint_coordinator.domain.cut import Cut, CutAttempt, CutGroup, PromptRef
from checkpoint_coordinator.domain.restore_plan import Disposition
from checkpoint_coordinator.errors import CoordinatorError
from checkpoint_coordinator.restore.store import imports as imported
from checkpoint_coordinator.ledger.db import make_async_engine
from checkpoint_coordinator.restore.planning import row_json
from checkpoint_coordinator.domain.errors import CutError, ManifestLedgerMismatch, PlanError
from checkpoint_coordinator.domain.gym_manifest import load_gym_manifest
from checkpoint_coordinator.restore.store import reads
from checkpoint_coordinator.domain.restore_plan import Placement, oldest_continuable_version, too_stale
from checkpoint_coordinator.domain.vocabulary import RowReason
from checkpoint_coordinator.restore.planning import live_retire_items, rollout_minter
from checkpoint_coordinator.restore.service import load_and_plan, refusal_of
from tests.oracles.restore_plan import plan_restore, restore_without_gym_state

from .test_restore_support import manifest_doc

INSTANCES = ("math/replica-0", "math/replica-1")
LIVE = ("next/replica-a", "next/replica-b", "next/replica-c")


def maps() -> Any:
    """No map, or a one-to-one map of some saved instances onto live ones."""
    return st.one_of(
        st.none(),
        st.permutations(LIVE).flatmap(
            lambda live: st.sets(st.sampled_from(INSTANCES)).map(lambda saved: {s: live[k] for k, s in enumerate(sorted(saved))})
        ),
    )
LEVELS = ("turn", "sibling", "prompt_group")
GROUP_STATUSES = ("generating", "generating", "ready", "finalized", "abandoned")
ROW_STATUSES = ("reserved", "dispatched", "returned", "sealed", "failed", "abandoned")


@st.composite
def ledgers(draw: Any) -> tuple[Cut, dict[str, Any] | None, str | None]:
    """A cut (mostly valid, sometimes broken on purpose) and a manifest that mostly agrees."""
    groups: list[CutGroup] = []
    attempts: list[CutAttempt] = []
    for k in range(draw(st.integers(0, 6))):
        gid = f"g{k}"
        level = draw(st.sampled_from(LEVELS))
        n = draw(st.sampled_from((1, 2, 3, 4, 5, 63, 64)))
        ga = draw(st.integers(0, 2))
        status = draw(st.sampled_from(GROUP_STATUSES))
        groups.append(CutGroup(gid, level, n, ga, status, f"sha256:{k}", PromptRef(k, "math")))  # type: ignore[arg-type]
        # A cohort is often uniform (all sealed, all never sent): both resolve without a rerun.
        uniform = draw(st.sampled_from((None, None, "sealed", "reserved"))) if level == "prompt_group" else None
        for i in range(n):
            if uniform is not None and n > 5:
                status_i = uniform
            elif uniform is not None:
                status_i = draw(st.sampled_from((uniform, uniform, uniform, "dispatched")))
            elif level == "prompt_group":
                status_i = draw(st.sampled_from(ROW_STATUSES))
            else:
                status_i = draw(st.sampled_from(tuple(s for s in ROW_STATUSES if s != "returned")))
            inst = draw(st.sampled_from((None,) + INSTANCES)) if status_i != "reserved" else None
            gym_attempt = 0
            if level == "turn" and status_i in ("dispatched", "reserved", "sealed") and draw(st.booleans()):
                inst = draw(st.sampled_from(INSTANCES))
                gym_attempt = draw(st.integers(0, 2))
            attempts.append(CutAttempt(gid, i, 0, f"{gid}_g{i}_a{k:02d}{i:030x}", inst, gym_attempt, ga, status_i))  # type: ignore[arg-type]
    breakage = draw(st.sampled_from((None,) * 8 + ("duplicate", "missing", "group_attempt", "returned", "gym_attempt", "far_index")))
    if breakage is not None and attempts:
        j = draw(st.integers(0, len(attempts) - 1))
        a = attempts[j]
        if breakage == "duplicate":
            attempts.append(a._replace(rollout_id=a.rollout_id + "x"))
        elif breakage == "missing":
            del attempts[j]
        elif breakage == "group_attempt":
            attempts[j] = a._replace(group_attempt=a.group_attempt + 1)
        elif breakage == "far_index":
            attempts[j] = a._replace(generation_index=45)
        elif breakage == "returned":
            attempts[j] = a._replace(status="returned")  # type: ignore[arg-type]
        else:
            attempts[j] = a._replace(gym_attempt=1, gym_instance_id=INSTANCES[0])
    manifest = None
    if draw(st.booleans()):
        instances: dict[str, dict[str, list[tuple[str, int]]]] = {i: {"episodes": [], "restarts": []} for i in INSTANCES}
        level_of = {g.group_id: g.restore_level for g in groups}
        for a in attempts:
            if level_of[a.group_id] != "turn" or a.gym_instance_id is None:
                continue
            pick = draw(st.sampled_from(("none", "saved", "restart")))
            running = a.status == "dispatched" or (a.status == "reserved" and a.gym_attempt > 0)
            if pick == "restart" or (pick == "saved" and running):
                instances[a.gym_instance_id]["episodes" if pick == "saved" else "restarts"].append((a.rollout_id, a.gym_attempt))
        if attempts and draw(st.integers(0, 4)) == 0:
            # One entry that disagrees: a saved row that is not running, another instance, another
            # Gym attempt, or a row that is not turn-level.
            a = draw(st.sampled_from(attempts))
            other = INSTANCES[1] if a.gym_instance_id == INSTANCES[0] else INSTANCES[0]
            where, n = draw(st.sampled_from(((other, a.gym_attempt), (a.gym_instance_id or other, a.gym_attempt + 1))))
            listed = {r for body in instances.values() for part in body.values() for r, _ in part}
            if a.rollout_id not in listed:
                instances[where][draw(st.sampled_from(("episodes", "restarts")))].append((a.rollout_id, n))
        manifest = manifest_doc(instances)
    return Cut(groups=groups, attempts=attempts), manifest, breakage


def _every_disposition() -> tuple[Cut, dict[str, Any] | None, str | None]:
    """A turn-level group with a continued, a gym_restarted, a restarted, a reused and a
    never-sent row, a sibling-level group that reruns a row and a cohort that reruns."""
    t = [
        CutAttempt("t", i, 0, f"t_g{i}_a{i:032x}", INSTANCES[0] if st_ != "reserved" else None, 0, 0, st_)  # type: ignore[arg-type]
        for i, st_ in enumerate(("dispatched", "dispatched", "dispatched", "sealed", "reserved"))
    ]
    s_ = [CutAttempt("s", i, 0, f"s_g{i}_a{i:032x}", INSTANCES[1], 0, 1, st_) for i, st_ in enumerate(("failed", "sealed"))]  # type: ignore[arg-type]
    p_ = [CutAttempt("p", i, 0, f"p_g{i}_a{i:032x}", INSTANCES[1], 0, 0, st_) for i, st_ in enumerate(("returned", "dispatched"))]  # type: ignore[arg-type]
    groups = [
        CutGroup("t", "turn", 5, 0, "generating", "sha256:t", PromptRef(1, "math")),  # type: ignore[arg-type]
        CutGroup("s", "sibling", 2, 1, "generating", "sha256:s", PromptRef(2, "math")),  # type: ignore[arg-type]
        CutGroup("p", "prompt_group", 2, 0, "ready", "sha256:p", PromptRef(3, "math")),  # type: ignore[arg-type]
    ]
    manifest = manifest_doc({INSTANCES[0]: {"episodes": [(t[0].rollout_id, 0)], "restarts": [(t[1].rollout_id, 0)]}, INSTANCES[1]: {}})
    return Cut(groups=groups, attempts=t + s_ + p_), manifest, None


async def _store(engine: Any, run_id: str, snapshot_id: str, cut: Cut, manifest: dict[str, Any] | None) -> None:
    await imported.create_imported_snapshot(
        engine, run_id, snapshot_id, cut, anchor_step=1, detail={"document_sha256": snapshot_id}, data_attempts_used={}
    )
    if manifest is not None:
        async with engine.begin() as conn:
            await conn.execute(
                text("UPDATE snapshots SET gym_manifest = CAST(:m AS jsonb), gym_checkpoint_id = :c WHERE run_id = :r AND snapshot_id = :s"),
                {"r": run_id, "s": snapshot_id, "m": json.dumps(manifest), "c": manifest["checkpoint_id"]},
            )


async def _policy_versions(engine: Any, run_id: str, snapshot_id: str, versions: list[int | None], staleness: int | None) -> frozenset[int]:
    """The run's ``max_continue_staleness`` set to ``staleness``, and each cut attempt given a live
    attempt row (the planner reads policy versions from the live ledger by attempt id,
    docs/ledger.md#stale-continuations) with a version from ``versions`` in turn. Answers the
    attempt ids too stale to continue from the snapshot (anchored at step 1)."""
    async with engine.begin() as conn:
        await conn.execute(
            text("UPDATE runs SET config = jsonb_set(config, '{max_continue_staleness}', CAST(:k AS jsonb)) WHERE run_id = :r"),
            {"r": run_id, "k": json.dumps(staleness)},
        )
        ids = (
            await conn.execute(
                text("SELECT attempt_id FROM snapshot_attempts WHERE run_id = :r AND snapshot_id = :s ORDER BY attempt_id"),
                {"r": run_id, "s": snapshot_id},
            )
        ).scalars().all()
        pv = [versions[k % len(versions)] if versions else None for k in range(len(ids))]
        await conn.execute(
            text(
                "INSERT INTO attempts (attempt_id, run_id, group_id, generation_index, rollout_id, is_current, policy_version) "
                "SELECT id, :r, 'versions', 0, :s || '/' || id, false, v FROM unnest(CAST(:ids AS bigint[]), CAST(:pv AS bigint[])) AS t(id, v)"
            ),
            {"r": run_id, "s": snapshot_id, "ids": list(ids), "pv": pv},
        )
    oldest = oldest_continuable_version(1, staleness)
    return frozenset(aid for aid, v in zip(ids, pv) if too_stale(v, oldest))


def _oracle(
    cut: Cut, manifest: Any, snapshot_id: str, with_gym_state: bool, mapped: frozenset[str] | None, stale: frozenset[int] = frozenset()
) -> tuple[Any, list[Any]]:
    minter = rollout_minter("diff", snapshot_id, 1)
    if not with_gym_state:
        plan = restore_without_gym_state(cut, minter)
        return plan, list(plan.retire)
    return plan_restore(cut, manifest, minter, mapped=mapped, too_stale=stale), []


def _summary(plan: Any, retire: Any, candidates: Any, gym: Any) -> tuple[Any, ...]:
    return (
        "planned",
        plan.total,
        dict(plan.counts),
        plan.reasons(),
        sorted(plan.cohort_reruns),
        sorted(plan.skipped_groups),
        [row_json(r, include_staging_keys=True) for r in plan.rows],
        sorted(plan.continued_by_instance().items()),
        sorted(retire, key=repr),
        sorted(candidates, key=repr),
        gym,
    )


async def _both(
    engine: Any, run_id: str, snapshot_id: str, with_gym_state: bool, instance_map: dict[str, str] | None = None,
    stale: frozenset[int] = frozenset(),
) -> tuple[Any, Any]:
    async with engine.connect() as conn:
        detailed, _ = await reads.load_cut(conn, run_id, snapshot_id, detailed=True)
        snap = await reads.get_snapshot(conn, run_id, snapshot_id)
    manifest = load_gym_manifest(snap.gym_manifest) if snap.gym_manifest is not None else None
    # In the cut's order (attempt ids), as the planner reads it, with every field.
    cut = Cut(groups=detailed.groups, attempts=sorted(detailed.attempts, key=lambda a: a[2]))
    try:
        # As the service checks a map: against the manifest before planning, else against the
        # instances the planned rows ran on.
        if instance_map is not None and manifest is not None and set(instance_map) - set(manifest.instances):
            raise _Unknown(sorted(set(instance_map) - set(manifest.instances)))
        mapped = frozenset(instance_map) if instance_map is not None else None
        plan, retire = _oracle(cut, manifest, snapshot_id, with_gym_state, mapped, stale)
        if instance_map is not None and manifest is None:
            live_groups = {g.group_id for g in cut.groups if g.status in ("generating", "ready")}
            unknown = sorted(set(instance_map) - {a[4] for a in cut.attempts if a[0] in live_groups and a[4]})
            if unknown:
                raise _Unknown(unknown)
        if instance_map is not None:
            plan = plan.placed(Placement(instance_map, LIVE))
        live = {g.group_id for g in cut.groups if g.status in ("generating", "ready")}
        candidates = live_retire_items(a for a in cut.attempts if a[0] in live)
        if not with_gym_state:
            gym: tuple[bool, str | None] = (False, "with_gym_state is false")
        elif manifest is None:
            gym = (False, "the snapshot holds no Gym state")
        elif instance_map == {}:
            gym = (False, "the instance map maps no saved instance")
        else:
            gym = (True, None)
        # Nothing installed with Gym state asked for: what the cut knows as running is retired.
        nothing_installed = with_gym_state and (manifest is None or instance_map == {})
        ref = _summary(plan, candidates if nothing_installed else retire, candidates, gym)
    except (CutError, ManifestLedgerMismatch, PlanError) as e:
        err = refusal_of(e, snapshot_id)
        ref = ("refused", type(err).__name__, err.problem())
    except _Unknown as e:
        ref = ("refused", "InstanceMapUnknown", e.saved)
    try:
        p = await load_and_plan(
            engine, run_id, snapshot_id=snapshot_id, step=None, with_gym_state=with_gym_state, include_reused=True,
            instance_map=instance_map,
        )
        got = _summary(p.plan, p.retire, p.retire_candidates(), (p.install, p.no_gym_reason))
    except CoordinatorError as e:
        got = ("refused", type(e).__name__, e.extra["unknown_saved_instances"] if e.code == "instance_map_unknown_instance" else e.problem())
    return ref, got


class _Unknown(Exception):
    def __init__(self, saved: list[str]) -> None:
        self.saved = saved


async def _create_run(engine: Any) -> None:
    async with engine.begin() as conn:
        await conn.execute(
            text("INSERT INTO runs (run_id, config, checkpoint_root, token_hash) VALUES ('diff', CAST(:c AS jsonb), '/tmp/diff', 'x')"),
            {"c": json.dumps(load_recovery_config({"target_level": "turn"}).public_dict())},
        )
        # The live instances an instance map may name (the plan only reads their ids).
        for iid in LIVE:
            await conn.execute(
                text("INSERT INTO gym_instances (run_id, instance_id, servers, control_token) VALUES ('diff', :i, '{}', 'x')"), {"i": iid}
            )


def test_plan_in_sql_equals_the_pure_plan(database_url: str) -> None:
    loop = asyncio.new_event_loop()
    engine = make_async_engine(database_url, pool_size=2)
    counter = itertools.count()
    seen: set[str] = set()
    loop.run_until_complete(_create_run(engine))

    # Policy versions (given to the cut's attempts in turn) and max_continue_staleness: with the
    # snapshot anchored at step 1, a limit of 0 makes version 0 too stale and keeps 1 (the
    # boundary), a limit of 1 none (docs/ledger.md#stale-continuations).
    versions = st.lists(st.sampled_from((None, 0, 1, 2)), max_size=5)
    staleness = st.sampled_from((None, None, 0, 1))

    @settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
    @given(ledger=ledgers(), with_gym_state=st.booleans(), instance_map=maps(), versions=versions, staleness=staleness)
    @example(ledger=_every_disposition(), with_gym_state=True, instance_map=None, versions=[], staleness=None)
    @example(ledger=_every_disposition(), with_gym_state=True, instance_map={INSTANCES[1]: LIVE[0]}, versions=[], staleness=None)
    @example(ledger=_every_disposition(), with_gym_state=True, instance_map=None, versions=[0], staleness=0)
    def check(
        ledger: tuple[Cut, dict[str, Any] | None, str | None], with_gym_state: bool, instance_map: dict[str, str] | None,
        versions: list[int | None], staleness: int | None,
    ) -> None:
        cut, manifest, _breakage = ledger
        sid = f"s{next(counter)}"
        loop.run_until_complete(_store(engine, "diff", sid, cut, manifest))
        stale = loop.run_until_complete(_policy_versions(engine, "diff", sid, versions, staleness))
        ref, got = loop.run_until_complete(_both(engine, "diff", sid, with_gym_state, instance_map, stale))
        assert got == ref
        seen.add(ref[0])
        if ref[0] == "planned":
            seen.update(d for d, n in ref[2].items() if n)
            seen.update(why for per in ref[3].values() for why in per)

    try:
        check()
    finally:
        loop.run_until_complete(engine.dispose())
        loop.close()
    # The random ledgers reached every disposition and both refusals and plans.
    assert {"planned", "refused"} | {d.value for d in Disposition} <= seen, seen
    # ... and every reason the planner gives (the restore itself adds sent_after_cut and
    # gym_restore_failed, see test_restore_plan.py and test_restore_instance_map.py).
    assert {r.value for r in RowReason} - {"sent_after_cut", "gym_restore_failed"} <= seen, seen


def test_a_refusal_names_the_cut_groups_in_group_id_order(database_url: str) -> None:
    """A broken cut is refused with its issues located in the cut's group order (by group id, as
    the oracle reads it), not in the order its rows lie in the table. Here the groups rewritten last
    lie last, and the planner scans sequentially (as it does once statistics show the table
    small): ``g1``, which lacks a sibling, is ``cut.groups[1]``, not ``cut.groups[2]``."""
    groups = [CutGroup(f"g{k}", "sibling", 2, 0, "generating", f"sha256:{k}", PromptRef(k, "math")) for k in range(3)]  # type: ignore[arg-type]
    attempts = [
        CutAttempt(f"g{k}", i, 0, f"g{k}_g{i}_a{k:02d}{i:030x}", None, 0, 0, "sealed")  # type: ignore[arg-type]
        for k in range(3)
        for i in range(2)
        if (k, i) != (1, 1)
    ]
    loop = asyncio.new_event_loop()

    async def scan_sequentially() -> None:
        setup = make_async_engine(database_url, pool_size=1)
        try:
            async with setup.begin() as conn:
                name = (await conn.execute(text("SELECT current_database()"))).scalar_one()
                for knob in ("enable_indexscan", "enable_bitmapscan"):
                    await conn.execute(text(f'ALTER DATABASE "{name}" SET {knob} = off'))
        finally:
            await setup.dispose()

    loop.run_until_complete(scan_sequentially())
    engine = make_async_engine(database_url, pool_size=2)

    async def go() -> tuple[Any, Any, list[str]]:
        await _create_run(engine)
        await _store(engine, "diff", "s0", Cut(groups=groups, attempts=attempts), None)
        async with engine.begin() as conn:
            # A no-op update writes a new version of a row after the others: the table holds g2, g0, g1.
            for gid in ("g0", "g1"):
                await conn.execute(
                    text("UPDATE snapshot_cut_groups SET status = status WHERE run_id = 'diff' AND snapshot_id = 's0' AND group_id = :g"), {"g": gid}
                )
            stored = (await conn.execute(text("SELECT group_id FROM snapshot_cut_groups WHERE snapshot_id = 's0' ORDER BY ctid"))).scalars().all()
        ref, got = await _both(engine, "diff", "s0", with_gym_state=False)
        return ref, got, list(stored)

    try:
        ref, got, stored = loop.run_until_complete(go())
    finally:
        loop.run_until_complete(engine.dispose())
        loop.close()
    assert stored == ["g2", "g0", "g1"], stored
    assert got == ref
    assert got[0] == "refused" and [e["field"] for e in got[2]["errors"]] == ["cut.groups[1].expected_generations"], got
