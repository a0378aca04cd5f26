"""NeMo RL ledger import/export, schemas 2, 3 and 4 (docs/ledger.md#importing-a-nemo-rl-ledger)."""

from __future__ import annotations

import copy
import itertools
import json
from typing import Any

import pytest
from hypothesis import given, settings

from checkpoint_coordinator.domain.cut import Cut
from checkpoint_coordinator.domain.errors import LegacyLedgerError, LegacyLedgerVersionError
from checkpoint_coordinator.domain.gym_manifest import GymManifest
from checkpoint_coordinator.domain.legacy_ledger import (
    export_legacy_ledger,
    legacy_ledger_from_json_bytes,
    legacy_ledger_to_json_bytes,
    load_legacy_ledger,
)
from checkpoint_coordinator.domain.levels import RestoreLevel
from tests.oracles.restore_plan import plan_restore, restore_without_gym_state

# The restore-plan strategies double as a source of valid cuts.
from tests.unit.test_domain_restore_plan import cuts_with_manifest  # noqa: E402

RID0 = "g41_g0_a5d1e9c0f2b3a4d5e6f708192a3b4c5d"
RID1 = "g41_g1_a0c9d8e7f6a5b4c3d2e1f00112233445"


def v4() -> dict[str, Any]:
    return {
        "schema_version": 4,
        "groups": [
            {
                "group_id": "g41",
                "prompt_ref": {"sample_id": 41, "task_name": "math"},
                "task_digest": "sha256:abc",
                "task_source": "math/gsm8k",
                "agent_name": "workplace_agent",
                "restore_level": "turn",
                "expected_generations": 2,
                "group_attempt": 0,
                "data_attempts_used": 1,
                "status": "generating",
                "target_step": 12,
                "weight_version": "w12",
                "attempts": [
                    {
                        "generation_index": 0,
                        "rollout_id": RID0,
                        "status": "dispatched",
                        "gym_instance_id": "math/replica-0",
                        "gym_attempt": 1,
                    },
                    {
                        "generation_index": 1,
                        "rollout_id": RID1,
                        "status": "sealed",
                        "row_attempts_used": 1,
                        "reward": 0.5,
                        "mask_sample": False,
                        "staging_keys": ["tq/k1"],
                        "gym_instance_id": "math/replica-0",
                        "gym_attempt": 0,
                    },
                ],
            }
        ],
        "batch_shortfall": 3,
        "sampler_stamps_target_steps": [12, 12, 13],
    }


def old(version: int) -> dict[str, Any]:
    doc = v4()
    doc["schema_version"] = version
    g = doc["groups"][0]
    g["recovery_granularity"] = "sibling"
    del g["restore_level"]
    for a in g["attempts"]:
        del a["gym_instance_id"], a["gym_attempt"]
    return doc


def refused(doc: Any) -> LegacyLedgerError:
    with pytest.raises(LegacyLedgerError) as info:
        load_legacy_ledger(doc)
    return info.value


def test_schema_4_loads() -> None:
    ledger = load_legacy_ledger(v4())
    assert ledger.source_version == 4 and ledger.notes == ()
    assert ledger.batch_shortfall == 3
    assert ledger.sampler_stamps_target_steps == [12, 12, 13]
    assert dict(ledger.data_attempts_used) == {"g41": 1}
    (g,) = ledger.cut.groups
    assert g.restore_level is RestoreLevel.turn and g.weight_version == "w12"
    a0, a1 = ledger.cut.attempts
    assert (a0.gym_instance_id, a0.gym_attempt, a0.status) == ("math/replica-0", 1, "dispatched")
    assert a1.staging_keys == ("tq/k1",) and a1.reward == 0.5 and a1.row_attempts_used == 1


@pytest.mark.parametrize("version", [2, 3])
def test_old_schemas_are_rewritten_in_the_schema_4_shape(version: int) -> None:
    ledger = load_legacy_ledger(old(version))
    assert ledger.source_version == version
    assert ledger.notes and "restore_level" in ledger.notes[0]
    (g,) = ledger.cut.groups
    assert g.restore_level is RestoreLevel.sibling
    assert all(a.gym_instance_id is None and a.gym_attempt == 0 for a in ledger.cut.attempts)
    exported = export_legacy_ledger(ledger.cut)
    assert exported["schema_version"] == 4
    assert exported["groups"][0]["restore_level"] == "sibling"
    assert "recovery_granularity" not in exported["groups"][0]


@pytest.mark.parametrize("version", [2, 3])
def test_prompt_group_granularity_maps_to_the_same_level(version: int) -> None:
    doc = old(version)
    doc["groups"][0]["recovery_granularity"] = "prompt_group"
    doc["groups"][0]["attempts"][0]["status"] = "sealed"
    assert load_legacy_ledger(doc).cut.groups[0].restore_level is RestoreLevel.prompt_group


@pytest.mark.parametrize("version", [1, 5, 0, "4", 4.0, True, None])
def test_other_versions_are_refused_by_version(version: Any) -> None:
    doc = v4()
    doc["schema_version"] = version
    doc["groups"] = "broken too"
    with pytest.raises(LegacyLedgerVersionError) as info:
        load_legacy_ledger(doc)
    assert info.value.paths == ("schema_version",)


def test_missing_version_and_non_objects() -> None:
    doc = v4()
    del doc["schema_version"]
    with pytest.raises(LegacyLedgerVersionError):
        load_legacy_ledger(doc)
    with pytest.raises(LegacyLedgerVersionError):
        load_legacy_ledger([v4()])


@pytest.mark.parametrize("version", [2, 3])
def test_old_file_with_a_restore_level_is_refused(version: int) -> None:
    doc = old(version)
    doc["groups"][0]["restore_level"] = "sibling"
    err = refused(doc)
    assert "groups[0].restore_level" in err.paths
    assert "refused rather than guessed" in str(err)


@pytest.mark.parametrize("version", [2, 3])
@pytest.mark.parametrize("key, value", [("gym_instance_id", "math/replica-0"), ("gym_attempt", 0)])
def test_old_file_with_gym_attempt_state_is_refused(version: int, key: str, value: Any) -> None:
    doc = old(version)
    doc["groups"][0]["attempts"][1][key] = value
    err = refused(doc)
    assert err.paths == (f"groups[0].attempts[1].{key}",)


@pytest.mark.parametrize("version", [2, 3])
def test_old_file_with_the_turn_level_is_refused(version: int) -> None:
    doc = old(version)
    doc["groups"][0]["recovery_granularity"] = "turn"
    err = refused(doc)
    assert err.paths == ("groups[0].recovery_granularity",)
    assert "turn level did not exist" in err.message


@pytest.mark.parametrize("doc_of", [v4, lambda: old(3)])
def test_prefix_is_refused_with_its_reason(doc_of) -> None:  # type: ignore[no-untyped-def]
    doc = doc_of()
    key = "restore_level" if doc["schema_version"] == 4 else "recovery_granularity"
    doc["groups"][0][key] = "prefix"
    err = refused(doc)
    assert err.paths == (f"groups[0].{key}",)
    assert "generation cuts" in err.message


def test_schema_4_requires_the_restore_level_and_gym_fields() -> None:
    doc = v4()
    del doc["groups"][0]["restore_level"]
    assert refused(doc).paths == ("groups[0].restore_level",)
    for key in ("gym_instance_id", "gym_attempt"):
        doc = v4()
        del doc["groups"][0]["attempts"][0][key]
        err = refused(doc)
        assert err.paths == (f"groups[0].attempts[0].{key}",)
        assert "schema 4" in err.message


def test_schema_4_refuses_recovery_granularity() -> None:
    doc = v4()
    doc["groups"][0]["recovery_granularity"] = "sibling"
    assert refused(doc).paths == ("groups[0].recovery_granularity",)


@pytest.mark.parametrize(
    "where",
    [
        (),
        ("groups", 0),
        ("groups", 0, "prompt_ref"),
        ("groups", 0, "attempts", 1),
    ],
)
def test_unknown_fields_are_refused_at_every_level(where: tuple[Any, ...]) -> None:
    doc = v4()
    target: Any = doc
    for step in where:
        target = target[step]
    target["surprise"] = 1
    err = refused(doc)
    expected = ".".join([*(f"[{s}]" if isinstance(s, int) else s for s in where), "surprise"])
    assert err.paths == (expected.replace(".[", "["),)
    assert "unknown field" in err.message


@pytest.mark.parametrize(
    "mutate, path",
    [
        (lambda d: d.update(batch_shortfall=-1), "batch_shortfall"),
        (lambda d: d.update(sampler_stamps_target_steps=[1, "x"]), "sampler_stamps_target_steps[1]"),
        (lambda d: d.update(sampler_stamps_target_steps="x"), "sampler_stamps_target_steps"),
        (lambda d: d.update(groups={}), "groups"),
        (lambda d: d["groups"].append(7), "groups[1]"),
        (lambda d: d["groups"][0].update(group_id="bad id"), "groups[0].group_id"),
        (lambda d: d["groups"][0].update(expected_generations=0), "groups[0].expected_generations"),
        (lambda d: d["groups"][0].update(group_attempt=True), "groups[0].group_attempt"),
        (lambda d: d["groups"][0].update(status="done"), "groups[0].status"),
        (lambda d: d["groups"][0].update(task_digest=""), "groups[0].task_digest"),
        (lambda d: d["groups"][0].update(task_source="bad source"), "groups[0].task_source"),
        (lambda d: d["groups"][0].update(agent_name="a/b"), "groups[0].agent_name"),
        (lambda d: d["groups"][0].update(target_step=-1), "groups[0].target_step"),
        (lambda d: d["groups"][0].update(weight_version=1.5), "groups[0].weight_version"),
        (lambda d: d["groups"][0].update(data_attempts_used=-1), "groups[0].data_attempts_used"),
        (lambda d: d["groups"][0]["prompt_ref"].pop("task_name"), "groups[0].prompt_ref.task_name"),
        (lambda d: d["groups"][0]["prompt_ref"].update(sample_id=None), "groups[0].prompt_ref.sample_id"),
        (lambda d: d["groups"][0].update(attempts={}), "groups[0].attempts"),
        (lambda d: d["groups"][0]["attempts"][0].update(rollout_id="r-a1"), "groups[0].attempts[0].rollout_id"),
        (lambda d: d["groups"][0]["attempts"][0].update(status="running"), "groups[0].attempts[0].status"),
        (lambda d: d["groups"][0]["attempts"][0].update(gym_attempt=-1), "groups[0].attempts[0].gym_attempt"),
        (lambda d: d["groups"][0]["attempts"][0].update(gym_attempt=True), "groups[0].attempts[0].gym_attempt"),
        (lambda d: d["groups"][0]["attempts"][0].update(gym_instance_id="/x"), "groups[0].attempts[0].gym_instance_id"),
        (lambda d: d["groups"][0]["attempts"][1].update(reward=float("nan")), "groups[0].attempts[1].reward"),
        (lambda d: d["groups"][0]["attempts"][1].update(mask_sample=0), "groups[0].attempts[1].mask_sample"),
        (lambda d: d["groups"][0]["attempts"][1].update(staging_keys=["a", "a"]), "groups[0].attempts[1].staging_keys[1]"),
        (lambda d: d["groups"][0]["attempts"][1].update(row_attempts_used=-2), "groups[0].attempts[1].row_attempts_used"),
        # cut invariants, mapped back onto the document
        (lambda d: d["groups"][0]["attempts"].pop(), "groups[0].attempts"),
        (lambda d: d["groups"][0]["attempts"][1].update(generation_index=0), "groups[0].attempts[1].generation_index"),
        (lambda d: d["groups"][0]["attempts"][1].update(rollout_id=RID0), "groups[0].attempts[1].rollout_id"),
        (lambda d: d["groups"][0]["attempts"][0].update(gym_instance_id=None), "groups[0].attempts[0].gym_instance_id"),
        (lambda d: d["groups"][0].update(restore_level="sibling"), "groups[0].attempts[0].gym_attempt"),
        (lambda d: d["groups"][0]["attempts"][1].update(status="returned"), "groups[0].attempts[1].status"),
    ],
)
def test_every_refusal_names_its_field(mutate, path: str) -> None:  # type: ignore[no-untyped-def]
    doc = v4()
    mutate(doc)
    assert path in refused(doc).paths


def test_many_problems_are_reported_together() -> None:
    doc = v4()
    doc["batch_shortfall"] = -1
    doc["groups"][0]["attempts"][0]["status"] = "x"
    doc["groups"][0]["attempts"][1]["reward"] = "high"
    assert set(refused(doc).paths) == {
        "batch_shortfall",
        "groups[0].attempts[0].status",
        "groups[0].attempts[1].reward",
    }


def test_json_bytes_round_trip_and_refusals() -> None:
    ledger = load_legacy_ledger(v4())
    doc = export_legacy_ledger(
        ledger.cut,
        data_attempts_used=ledger.data_attempts_used,
        batch_shortfall=ledger.batch_shortfall,
        sampler_stamps_target_steps=ledger.sampler_stamps_target_steps,
    )
    expected = v4()
    # export writes every optional key, with its default
    expected["groups"][0]["attempts"][0].update(
        row_attempts_used=0, reward=None, mask_sample=False, staging_keys=[]
    )
    assert doc == expected
    again = legacy_ledger_from_json_bytes(legacy_ledger_to_json_bytes(doc))
    assert again.cut == ledger.cut
    with pytest.raises(LegacyLedgerError, match="duplicate JSON object key"):
        legacy_ledger_from_json_bytes(b'{"schema_version": 4, "schema_version": 4}')
    with pytest.raises(LegacyLedgerError):
        legacy_ledger_from_json_bytes(b"[1,")


def test_sampler_stamps_may_be_an_object() -> None:
    doc = v4()
    doc["sampler_stamps_target_steps"] = {"math": 12}
    assert load_legacy_ledger(doc).sampler_stamps_target_steps == {"math": 12}


def sibling_ids(g: str, i: int) -> str:
    return f"{g}_g{i}_new"


def without_attempt_ids(plan) -> list[tuple[Any, ...]]:  # type: ignore[no-untyped-def]
    return sorted((tuple(r[:9]) + (r.replaces_rollout_id,) for r in plan.rows), key=repr)


@settings(max_examples=200, deadline=None)
@given(cuts_with_manifest())
def test_import_of_export_gives_the_same_restore_plan(case: tuple[Cut, GymManifest | None]) -> None:
    cut, m = case
    doc = export_legacy_ledger(cut, batch_shortfall=2, sampler_stamps_target_steps=[5])
    doc = json.loads(legacy_ledger_to_json_bytes(doc))  # through real JSON
    ledger = load_legacy_ledger(doc)
    assert ledger.source_version == 4 and ledger.batch_shortfall == 2
    # same cut, except the placeholder attempt ids
    assert [g for g in ledger.cut.groups] == [
        g for g in cut.groups
    ]
    assert len(ledger.cut.attempts) == len(cut.attempts)
    assert without_attempt_ids(plan_restore(ledger.cut, m, sibling_ids)) == without_attempt_ids(
        plan_restore(cut, m, sibling_ids)
    )
    assert without_attempt_ids(restore_without_gym_state(ledger.cut, sibling_ids)) == without_attempt_ids(
        restore_without_gym_state(cut, sibling_ids)
    )
    # and exporting the import gives the same document
    assert export_legacy_ledger(ledger.cut, batch_shortfall=2, sampler_stamps_target_steps=[5]) == doc


@settings(max_examples=50, deadline=None)
@given(cuts_with_manifest())
def test_old_schema_exports_import_as_sibling_or_prompt_group(case: tuple[Cut, GymManifest | None]) -> None:
    cut, _m = case
    doc = export_legacy_ledger(cut)
    # keep only what a schema 3 file could say
    ok = all(g["restore_level"] != "turn" for g in doc["groups"]) and all(
        a["gym_attempt"] == 0 for g in doc["groups"] for a in g["attempts"]
    )
    if not ok:
        return
    old_doc = copy.deepcopy(doc)
    old_doc["schema_version"] = 3
    for g in old_doc["groups"]:
        g["recovery_granularity"] = g.pop("restore_level")
        for a in g["attempts"]:
            del a["gym_instance_id"], a["gym_attempt"]
    ledger = load_legacy_ledger(old_doc)
    assert [str(g.restore_level) for g in ledger.cut.groups] == [g["recovery_granularity"] for g in old_doc["groups"]]
    counter = itertools.count()
    plan = plan_restore(ledger.cut, None, lambda g, i: f"{g}_g{i}_x{next(counter)}")
    assert plan.counts["continued"] == 0
