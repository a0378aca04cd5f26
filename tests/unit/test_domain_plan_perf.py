"""Cost of the restore plan at scale.

The test is a smoke check with a generous bound (CI machines vary); the real measurement is

    python tests/unit/test_domain_plan_perf.py 1000000

which prints CPU and wall time of ``plan_restore`` and ``restore_without_gym_state`` for a
million siblings in four mixes, next to a bare loop over the same rows for scale.
"""

from __future__ import annotations

import random
import sys
import time

from checkpoint_coordinator.domain.cut import Cut, CutAttempt, CutGroup, PromptRef
from checkpoint_coordinator.domain.gym_manifest import GymManifest, build_gym_manifest
from checkpoint_coordinator.domain.identity import rollout_id_minter
from tests.oracles.restore_plan import plan_restore, restore_without_gym_state

N_PER_GROUP = 8
INSTANCES = ("math/replica-0", "math/replica-1")


def make_cut(siblings: int, mix: str, seed: int = 1) -> tuple[Cut, GymManifest]:
    """``mix``: a level for every group, or "typical" (levels in turn). Each sibling is sealed
    (40%), dispatched (50%; at turn level 85% of those exported, 15% restarting) or reserved."""
    rnd = random.Random(seed)
    levels = ("turn", "sibling", "prompt_group")
    groups: list[CutGroup] = []
    attempts: list[CutAttempt] = []
    saved: dict[str, list[tuple[str, int]]] = {i: [] for i in INSTANCES}
    restarts: dict[str, list[tuple[str, int]]] = {i: [] for i in INSTANCES}
    for g in range(siblings // N_PER_GROUP):
        gid = f"grp{g}"
        level = levels[g % 3] if mix == "typical" else mix
        groups.append(CutGroup(gid, level, N_PER_GROUP, 0, "generating", "sha256:x", PromptRef(g, "math")))  # type: ignore[arg-type]
        inst = INSTANCES[g % 2]
        for i in range(N_PER_GROUP):
            rid = f"{gid}_g{i}_a{g:016x}{i:016x}"
            r = rnd.random()
            status = "sealed" if r < 0.4 else "dispatched" if r < 0.9 else "reserved"
            if level == "turn" and status == "dispatched":
                (saved if r < 0.85 else restarts)[inst].append((rid, 0))
            attempts.append(
                CutAttempt(gid, i, g * N_PER_GROUP + i, rid, inst if status != "reserved" else None, 0, 0, status, ("k",) if status == "sealed" else ())  # type: ignore[arg-type]
            )
    manifest = build_gym_manifest(
        "snap-1-0000abcd",
        {i: {"episodes": saved[i], "restarts": restarts[i], "staging_keys": ["k"], "participants": ["policy_model"]} for i in INSTANCES},
    )
    return Cut(groups, attempts), manifest


def _fast_hex(seed: int):  # type: ignore[no-untyped-def]
    rnd = random.Random(seed)
    return lambda n: rnd.randbytes(n).hex()


def test_a_hundred_thousand_siblings_plan_quickly() -> None:
    cut, manifest = make_cut(100_000, "typical")
    start = time.process_time()
    plan = plan_restore(cut, manifest, rollout_id_minter(_fast_hex(0)))
    spent = time.process_time() - start
    assert len(plan.rows) == 100_000
    assert sum(plan.counts.values()) == 100_000
    assert spent < 5.0, f"plan of 100k siblings took {spent:.2f}s of CPU"


def main(siblings: int) -> None:
    import secrets

    for mix in ("typical", "turn", "sibling", "prompt_group"):
        cut, manifest = make_cut(siblings, mix)
        t0, w0 = time.process_time(), time.perf_counter()
        for _ in cut.attempts:
            pass
        base = time.process_time() - t0
        for label, run in (
            ("plan_restore", lambda: plan_restore(cut, manifest, rollout_id_minter(secrets.token_hex))),
            (
                "plan_restore (ledger cut)",
                lambda: plan_restore(cut, manifest, rollout_id_minter(secrets.token_hex), verify_unique_rollout_ids=False),
            ),
            ("restore_without_gym_state", lambda: restore_without_gym_state(cut, rollout_id_minter(secrets.token_hex))),
        ):
            t0, w0 = time.process_time(), time.perf_counter()
            plan = run()
            cpu, wall = time.process_time() - t0, time.perf_counter() - w0
            counts = {d.value: n for d, n in plan.counts.items() if n}
            print(f"{mix:13s} {label:27s} {len(plan.rows):>8d} siblings  cpu {cpu:6.3f}s  wall {wall:6.3f}s  (bare loop {base:.3f}s)  {counts}")


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 1_000_000)
