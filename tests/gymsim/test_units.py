"""Pure pieces of gymsim: identifiers, code spellings, config validation and the on-disk format."""

from __future__ import annotations

import hashlib
import json
import threading

import pytest
from hypothesis import given
from hypothesis import strategies as st
from pydantic import ValidationError

from gymsim.config import InstanceConfig
from gymsim.storage import participant_dir, read_participant_state, write_participant_state
from gymsim.testing import default_instance_config
from gymsim.wire import (
    CURRENT_CODES,
    LEGACY_CODES,
    ProtocolError,
    capture_key,
    is_valid_capture_key,
    normalize_code,
    parse_capture_key,
    spell,
)

rollout_ids = st.from_regex(r"[A-Za-z0-9][A-Za-z0-9._-]{0,40}", fullmatch=True).filter(
    lambda r: not __import__("re").search(r"-a[0-9]+$", r)
)


@given(rollout_ids, st.integers(min_value=0, max_value=10**6))
def test_capture_keys_round_trip(rollout_id, attempt):
    key = capture_key(rollout_id, attempt)
    assert parse_capture_key(key) == (rollout_id, attempt)
    assert is_valid_capture_key(key)


def test_capture_key_examples():
    assert capture_key("g41_g0_ab", 0) == "g41_g0_ab"
    assert capture_key("g41_g0_ab", 12) == "g41_g0_ab-a12"
    assert parse_capture_key("x-a0") == ("x-a0", 0)  # no leading zeros: not a suffix
    assert parse_capture_key("x-a07") == ("x-a07", 0)
    assert not is_valid_capture_key("x-a0")  # its rollout part ends in -a<digits>


def test_codes_normalise_from_every_spelling():
    for legacy, current in zip(LEGACY_CODES, CURRENT_CODES):
        assert normalize_code(current) == legacy == normalize_code(legacy)
        assert spell(legacy, "current") == current and spell(current, "legacy") == legacy
    assert normalize_code("checkpoint_stale") == "stale_checkpoint"
    assert normalize_code("agent_admission_closed") == "admission_closed"
    assert normalize_code("checkpoint_invalid_state") == "invalid_checkpoint_state"
    assert normalize_code("something_else") == "something_else"
    assert ProtocolError("invalid_checkpoint_state", "x").status == 422
    assert ProtocolError("rollout_id_required", "x").status == 400


def test_instance_config_refuses_extras_duplicates_and_bad_ids():
    InstanceConfig.model_validate(default_instance_config())
    bad = [
        {**default_instance_config(), "extra": 1},
        default_instance_config(instance_id="no spaces"),
        default_instance_config(instance_id="math//replica-0"),
        default_instance_config(broken=["not_a_breakage"]),
        default_instance_config(wire_spelling="klingon"),
        default_instance_config(faults=[{"server_name": "nobody", "op": "status", "type": "reset"}]),
    ]
    duplicated = default_instance_config()
    duplicated["servers"].append({"server_name": "policy_model", "kind": "model"})
    bad.append(duplicated)
    for config in bad:
        with pytest.raises(ValidationError):
            InstanceConfig.model_validate(config)


def _records(n):
    return [{"episode_id": {"rollout_id": f"r{i}", "attempt": 0}, "kind": "agent", "state": {"turn": i}} for i in range(n)]


def test_state_round_trips_and_the_scope_filters_what_is_read(tmp_path):
    written = write_participant_state(str(tmp_path), kind="agent", name="a", checkpoint_id="c1", records=_records(5))
    data = (written.directory / written.manifest["records_file"]).read_bytes()
    assert written.manifest["records_sha256"] == hashlib.sha256(data).hexdigest()
    loaded = read_participant_state(str(tmp_path), kind="agent", name="a", scope={("r1", 0), ("r4", 0), ("r9", 0)})
    assert [r["episode_id"]["rollout_id"] for r in loaded.records] == ["r1", "r4"]
    with pytest.raises(ProtocolError) as info:
        read_participant_state(str(tmp_path), kind="model", name="a", scope=set())
    assert info.value.code == "invalid_checkpoint_state"


def test_a_published_directory_never_changes(tmp_path):
    first = write_participant_state(str(tmp_path), kind="model", name="m", checkpoint_id="c1", records=_records(2))
    # The same commit written again returns the same manifest.
    again = write_participant_state(str(tmp_path), kind="model", name="m", checkpoint_id="c1", records=_records(2))
    assert again.manifest == first.manifest
    before = sorted(p.name for p in first.directory.iterdir())
    for checkpoint_id, records in (("c2", _records(2)), ("c1", _records(3))):
        with pytest.raises(ProtocolError):
            write_participant_state(str(tmp_path), kind="model", name="m", checkpoint_id=checkpoint_id, records=records)
    assert sorted(p.name for p in first.directory.iterdir()) == before
    assert json.loads((first.directory / "manifest.json").read_text()) == first.manifest


def test_racing_writers_publish_exactly_one_manifest(tmp_path):
    outcomes: list[str] = []

    def write(n: int) -> None:
        try:
            write_participant_state(str(tmp_path), kind="agent", name="a", checkpoint_id="c1", records=_records(n))
            outcomes.append("won")
        except ProtocolError:
            outcomes.append("refused")

    threads = [threading.Thread(target=write, args=(n,)) for n in (1, 2, 3, 4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert outcomes.count("won") == 1 and outcomes.count("refused") == 3
    directory = participant_dir(tmp_path, "agent", "a")
    manifest = json.loads((directory / "manifest.json").read_text())
    assert (directory / manifest["records_file"]).exists()
    assert not [p for p in directory.iterdir() if p.name.startswith(".")]


def test_a_relative_or_missing_checkpoint_dir_is_invalid_state(tmp_path):
    for bad in ("relative/dir", str(tmp_path / "missing")):
        with pytest.raises(ProtocolError) as info:
            write_participant_state(bad, kind="agent", name="a", checkpoint_id="c1", records=[])
        assert info.value.code == "invalid_checkpoint_state"
