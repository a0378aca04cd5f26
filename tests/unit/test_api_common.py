"""``json_with_raw``: a member written by the database spliced into an answer."""

from __future__ import annotations

import json

from checkpoint_coordinator.api.common import json_with_raw


def test_the_raw_member_is_spliced_after_the_others() -> None:
    r = json_with_raw({"snapshot_id": "s\u00e9", "as_of": "pre_cut"}, "staging_keys", '["a", "b\\"c"]')
    assert r.media_type == "application/json"
    assert json.loads(r.body) == {"snapshot_id": "s\u00e9", "as_of": "pre_cut", "staging_keys": ["a", 'b"c']}
    assert r.headers["content-length"] == str(len(r.body))


def test_an_empty_object_gets_the_raw_member_alone() -> None:
    assert json.loads(json_with_raw({}, "keys", "[]").body) == {"keys": []}


def test_a_models_set_members_come_first_and_its_own_value_of_the_raw_member_is_left_out() -> None:
    from checkpoint_coordinator.api.schemas import CutKeysOut, SnapshotOut

    keys = CutKeysOut.model_construct(snapshot_id="s", as_of="cut", staging_keys=["stale"])
    assert json.loads(json_with_raw(keys, "staging_keys", '["a"]').body) == {"snapshot_id": "s", "as_of": "cut", "staging_keys": ["a"]}
    # A member left unset (``sometimes()``) is not sent.
    record = SnapshotOut.model_construct(snapshot_id="s", anchor_step=1)
    assert json.loads(json_with_raw(record, "staging_keys", "[]").body) == {"snapshot_id": "s", "anchor_step": 1, "staging_keys": []}

