"""Conformance item 54: the Gym manifest loader (docs/gym-protocol.md#the-gym-manifest,
docs/ledger.md#the-gym-manifest).

The loader refuses version 1, unknown versions and a string "2" before looking at any other
field. It also refuses unknown keys, empty instances, empty ids, duplicate rollouts, a rollout
that is both saved and restarting, a missing per-instance key, duplicate staging keys and an
empty participant list. Every refusal names the offending field.
"""

from __future__ import annotations

import copy
import json
import pickle
import re
from typing import Any

import pytest
from checkpoint_coordinator.domain.errors import ManifestError, ManifestVersionError
from checkpoint_coordinator.domain.gym_manifest import (
    GymManifest,
    ManifestEpisode,
    build_gym_manifest,
    dump_gym_manifest,
    load_gym_manifest,
    manifest_from_json_bytes,
    manifest_to_json_bytes,
)
from hypothesis import given, settings
from hypothesis import strategies as st

RID_A = "g41_g0_a5d1e9c0f2b3a4d5e6f708192a3b4c5d"
RID_B = "g41_g1_a0c9d8e7f6a5b4c3d2e1f00112233445"
RID_C = "g42_g0_affffffffffffffffffffffffffffffff"


def valid_doc() -> dict[str, Any]:
    return {
        "schema_version": 2,
        "checkpoint_id": "snap-000123-7f3a9c01",
        "instances": {
            "math/replica-0": {
                "episodes": [{"rollout_id": RID_A, "attempt": 0}],
                "restarts": [{"rollout_id": RID_B, "attempt": 1}],
                "staging_keys": [f"tq/run7/{RID_A}/0"],
                "participants": ["calendar_resources", "policy_model", "workplace_agent"],
            },
            "math/replica-1": {
                "episodes": [{"rollout_id": RID_C, "attempt": 2}],
                "restarts": [],
                "staging_keys": ["k1", "k2"],
                "participants": ["policy_model", "workplace_agent"],
            },
        },
    }


class RecordingDict(dict):
    """A dict that records which keys were read, to prove what the loader looked at."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.touched: list[str] = []

    def __getitem__(self, key: Any) -> Any:
        self.touched.append(key)
        return super().__getitem__(key)

    def get(self, key: Any, default: Any = None) -> Any:
        self.touched.append(key)
        return super().get(key, default)

    def __contains__(self, key: object) -> bool:
        self.touched.append(key)  # type: ignore[arg-type]
        return super().__contains__(key)

    def __iter__(self):  # type: ignore[no-untyped-def]
        self.touched.append("<iter>")
        return super().__iter__()

    def keys(self):  # type: ignore[no-untyped-def]
        self.touched.append("<keys>")
        return super().keys()

    def items(self):  # type: ignore[no-untyped-def]
        self.touched.append("<items>")
        return super().items()

    def values(self):  # type: ignore[no-untyped-def]
        self.touched.append("<values>")
        return super().values()


def refusal(doc: Any) -> ManifestError:
    with pytest.raises(ManifestError) as info:
        load_gym_manifest(doc)
    return info.value


# -- the version, before anything else ----------------------------------------------------------


@pytest.mark.parametrize(
    "version, words",
    [
        (1, "schema version 1"),
        (3, "unknown schema version 3"),
        (0, "unknown schema version 0"),
        (-2, "unknown schema version -2"),
        ("2", "string '2'"),
        (2.0, "number 2.0"),
        (True, "boolean True"),
        (None, "null"),
        ([2], "array"),
    ],
)
def test_wrong_version_is_refused_by_version_before_any_other_field(version: Any, words: str) -> None:
    # Every other field is broken too: only the version may be reported.
    doc = RecordingDict(
        schema_version=version, checkpoint_id="", instances={}, surprise=1
    )
    err = refusal(doc)
    assert isinstance(err, ManifestVersionError)
    assert err.loc == ("schema_version",)
    assert words in err.message
    assert all(k == "schema_version" for k in doc.touched), doc.touched


def test_missing_version_is_refused_by_version() -> None:
    doc = valid_doc()
    del doc["schema_version"]
    err = refusal(doc)
    assert isinstance(err, ManifestVersionError)
    assert err.path == "schema_version"


def test_version_1_file_written_before_participants_is_refused_by_version() -> None:
    old = valid_doc()
    old["schema_version"] = 1
    for inst in old["instances"].values():
        del inst["participants"]  # what a version 1 file looked like
    err = refusal(old)
    assert isinstance(err, ManifestVersionError)
    assert "participants" in err.message or "version 1" in err.message


@pytest.mark.parametrize("doc", [[], "manifest", 2, None])
def test_a_document_that_is_not_an_object_is_refused(doc: Any) -> None:
    err = refusal(doc)
    assert isinstance(err, ManifestVersionError)
    assert err.loc == ()


def test_valid_document_loads_sorted() -> None:
    m = load_gym_manifest(valid_doc())
    assert isinstance(m, GymManifest)
    assert m.checkpoint_id == "snap-000123-7f3a9c01"
    assert m.instance_ids == ("math/replica-0", "math/replica-1")
    inst = m.instances["math/replica-0"]
    assert inst.episodes == (ManifestEpisode(RID_A, 0),)
    assert inst.restarts == (ManifestEpisode(RID_B, 1),)
    assert inst.participants == ("calendar_resources", "policy_model", "workplace_agent")
    assert m.episode_count == 2 and m.restart_count == 1


# -- unknown and missing keys -------------------------------------------------------------------


def test_unknown_top_level_key_is_refused() -> None:
    doc = valid_doc()
    doc["gym_version"] = "x"
    err = refusal(doc)
    assert err.path == "gym_version"
    assert "unknown key" in err.message


@pytest.mark.parametrize("key", ["checkpoint_id", "instances"])
def test_missing_top_level_key_is_refused(key: str) -> None:
    doc = valid_doc()
    del doc[key]
    err = refusal(doc)
    assert err.path == key
    assert "missing" in err.message


def test_unknown_per_instance_key_is_refused() -> None:
    doc = valid_doc()
    doc["instances"]["math/replica-1"]["exported"] = []
    err = refusal(doc)
    assert err.loc == ("instances", "math/replica-1", "exported")
    assert "unknown key" in err.message


@pytest.mark.parametrize("key", ["episodes", "restarts", "staging_keys", "participants"])
def test_missing_per_instance_key_is_refused(key: str) -> None:
    doc = valid_doc()
    del doc["instances"]["math/replica-0"][key]
    err = refusal(doc)
    assert err.loc == ("instances", "math/replica-0", key)
    assert "missing" in err.message


@pytest.mark.parametrize("bad", [{"rollout_id": RID_C}, {"attempt": 0}, {"rollout_id": RID_C, "attempt": 0, "kind": "x"}])
def test_episode_entries_have_exactly_rollout_id_and_attempt(bad: dict[str, Any]) -> None:
    doc = valid_doc()
    doc["instances"]["math/replica-1"]["episodes"] = [bad]
    err = refusal(doc)
    assert err.loc[:4] == ("instances", "math/replica-1", "episodes", 0)
    assert len(err.loc) == 5


def test_episode_entry_must_be_an_object() -> None:
    doc = valid_doc()
    doc["instances"]["math/replica-1"]["restarts"] = [RID_C]
    err = refusal(doc)
    assert err.loc == ("instances", "math/replica-1", "restarts", 0)


@pytest.mark.parametrize("attempt", [-1, True, False, 1.0, "0", None])
def test_attempt_is_an_int_at_least_zero_and_never_a_bool(attempt: Any) -> None:
    doc = valid_doc()
    doc["instances"]["math/replica-1"]["episodes"][0]["attempt"] = attempt
    err = refusal(doc)
    assert err.path == 'instances["math/replica-1"].episodes[0].attempt'


# -- empty instances and ids ----------------------------------------------------------------------


def test_empty_instances_is_refused() -> None:
    doc = valid_doc()
    doc["instances"] = {}
    err = refusal(doc)
    assert err.path == "instances"
    assert "at least one instance" in err.message


def test_instances_must_be_an_object() -> None:
    doc = valid_doc()
    doc["instances"] = [valid_doc()["instances"]["math/replica-0"]]
    assert refusal(doc).path == "instances"


@pytest.mark.parametrize("cid", ["", "-starts-with-dash", "x" * 129, 7, None, "has space"])
def test_bad_or_empty_checkpoint_id_is_refused(cid: Any) -> None:
    doc = valid_doc()
    doc["checkpoint_id"] = cid
    assert refusal(doc).path == "checkpoint_id"


@pytest.mark.parametrize("iid", ["", "/math", "math/", "math//r0", "ma th", "x" * 257])
def test_bad_or_empty_instance_id_is_refused(iid: str) -> None:
    doc = valid_doc()
    doc["instances"][iid] = doc["instances"].pop("math/replica-1")
    err = refusal(doc)
    assert err.loc == ("instances", iid)


@pytest.mark.parametrize("rid", ["", "r-a12", "-r", "r x", "x" * 257, 12])
def test_bad_or_empty_rollout_id_is_refused(rid: Any) -> None:
    doc = valid_doc()
    doc["instances"]["math/replica-1"]["episodes"][0]["rollout_id"] = rid
    err = refusal(doc)
    assert err.path == 'instances["math/replica-1"].episodes[0].rollout_id'


# -- duplicates -----------------------------------------------------------------------------------


def test_duplicate_rollout_in_episodes_is_refused() -> None:
    doc = valid_doc()
    doc["instances"]["math/replica-1"]["episodes"].append({"rollout_id": RID_C, "attempt": 3})
    err = refusal(doc)
    assert err.loc == ("instances", "math/replica-1", "episodes", 1, "rollout_id")
    assert "appears twice" in err.message


def test_rollout_both_saved_and_restarting_is_refused() -> None:
    doc = valid_doc()
    doc["instances"]["math/replica-0"]["restarts"].append({"rollout_id": RID_A, "attempt": 0})
    err = refusal(doc)
    assert err.loc[:3] == ("instances", "math/replica-0", "restarts")
    assert "both saved" in err.message


def test_rollout_in_two_instances_is_refused() -> None:
    doc = valid_doc()
    doc["instances"]["math/replica-1"]["restarts"].append({"rollout_id": RID_A, "attempt": 5})
    err = refusal(doc)
    assert err.loc[:3] == ("instances", "math/replica-1", "restarts")
    assert "math/replica-0" in err.message


def test_duplicate_staging_keys_are_refused() -> None:
    doc = valid_doc()
    doc["instances"]["math/replica-1"]["staging_keys"] = ["k1", "k2", "k1"]
    err = refusal(doc)
    assert err.loc == ("instances", "math/replica-1", "staging_keys", 2)
    assert "duplicate" in err.message


@pytest.mark.parametrize("key", ["", 3, None])
def test_empty_or_non_string_staging_key_is_refused(key: Any) -> None:
    doc = valid_doc()
    doc["instances"]["math/replica-1"]["staging_keys"] = ["k1", key]
    assert refusal(doc).loc == ("instances", "math/replica-1", "staging_keys", 1)


def test_empty_participant_list_is_refused() -> None:
    doc = valid_doc()
    doc["instances"]["math/replica-1"]["participants"] = []
    err = refusal(doc)
    assert err.loc == ("instances", "math/replica-1", "participants")
    assert "at least one participant" in err.message


@pytest.mark.parametrize("names, index", [(["a", "a"], 1), (["a", ""], 1), (["a b"], 0), ([5], 0)])
def test_duplicate_empty_or_invalid_participant_is_refused(names: list[Any], index: int) -> None:
    doc = valid_doc()
    doc["instances"]["math/replica-1"]["participants"] = names
    assert refusal(doc).loc == ("instances", "math/replica-1", "participants", index)


def test_rules_apply_in_order_first_failure_wins() -> None:
    doc = valid_doc()
    doc["instances"]["math/replica-1"]["participants"] = []  # rule 6
    doc["instances"]["math/replica-0"]["episodes"][0]["attempt"] = -1  # rule 4
    assert refusal(doc).loc[-1] == "attempt"


def test_json_bytes_refuse_duplicate_keys_and_nan() -> None:
    raw = b'{"schema_version": 2, "schema_version": 2, "checkpoint_id": "c", "instances": {}}'
    with pytest.raises(ManifestError, match="duplicate JSON object key"):
        manifest_from_json_bytes(raw)
    with pytest.raises(ManifestError):
        manifest_from_json_bytes(b'{"schema_version": NaN}')
    with pytest.raises(ManifestError, match="not valid JSON"):
        manifest_from_json_bytes(b"{")


# -- round trip -----------------------------------------------------------------------------------

NAME = st.from_regex(r"[A-Za-z0-9][A-Za-z0-9._-]{0,15}", fullmatch=True)
ROLLOUT = NAME.filter(lambda s: re.search(r"-a[0-9]+$", s) is None)
INSTANCE = st.lists(NAME, min_size=1, max_size=3).map("/".join)


@st.composite
def manifests(draw: st.DrawFn) -> dict[str, Any]:
    instance_ids = draw(st.lists(INSTANCE, min_size=1, max_size=4, unique=True))
    rollouts = draw(st.lists(ROLLOUT, max_size=30, unique=True))
    instances: dict[str, Any] = {
        iid: {"episodes": [], "restarts": [], "staging_keys": [], "participants": []}
        for iid in instance_ids
    }
    for rid in rollouts:
        iid = draw(st.sampled_from(instance_ids))
        kind = draw(st.sampled_from(["episodes", "restarts"]))
        instances[iid][kind].append({"rollout_id": rid, "attempt": draw(st.integers(0, 50))})
    for iid in instance_ids:
        instances[iid]["staging_keys"] = draw(
            st.lists(st.text(min_size=1, max_size=12), max_size=5, unique=True)
        )
        instances[iid]["participants"] = draw(st.lists(NAME, min_size=1, max_size=4, unique=True))
        for key in ("episodes", "restarts", "staging_keys", "participants"):
            draw(st.randoms()).shuffle(instances[iid][key])
    return {"schema_version": 2, "checkpoint_id": draw(NAME), "instances": instances}


def normalised(doc: dict[str, Any]) -> dict[str, Any]:
    out = copy.deepcopy(doc)
    for inst in out["instances"].values():
        for key in ("episodes", "restarts"):
            inst[key].sort(key=lambda e: (e["rollout_id"], e["attempt"]))
        inst["staging_keys"].sort()
        inst["participants"].sort()
    return out


@settings(max_examples=200, deadline=None)
@given(manifests())
def test_round_trip(doc: dict[str, Any]) -> None:
    m = load_gym_manifest(doc)
    dumped = dump_gym_manifest(m)
    assert dumped == normalised(doc)
    assert load_gym_manifest(dumped) == m
    raw = manifest_to_json_bytes(m)
    assert manifest_from_json_bytes(raw) == m
    assert pickle.loads(pickle.dumps(m)) == m
    # sorted keys at every level, as written to gym_checkpoint.json
    assert raw == json.dumps(json.loads(raw), sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode()
    # building from commit results gives the same manifest
    rebuilt = build_gym_manifest(
        m.checkpoint_id,
        {
            iid: {
                "episodes": list(i.episodes),
                "restarts": list(i.restarts),
                "staging_keys": i.staging_keys,
                "participants": i.participants,
            }
            for iid, i in m.instances.items()
        },
    )
    assert rebuilt == m


@settings(max_examples=100, deadline=None)
@given(manifests(), st.data())
def test_duplicating_any_rollout_is_refused(doc: dict[str, Any], data: st.DataObject) -> None:
    entries = [
        (iid, kind, e)
        for iid, inst in doc["instances"].items()
        for kind in ("episodes", "restarts")
        for e in inst[kind]
    ]
    if not entries:
        return
    _iid, _kind, e = data.draw(st.sampled_from(entries))
    target_iid = data.draw(st.sampled_from(sorted(doc["instances"])))
    target_kind = data.draw(st.sampled_from(["episodes", "restarts"]))
    doc["instances"][target_iid][target_kind].append(dict(e))
    err = refusal(doc)
    assert err.loc[-1] == "rollout_id"
    assert "appears twice" in err.message
