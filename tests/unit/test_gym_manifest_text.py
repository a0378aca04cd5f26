"""The Gym manifest's text joined from per-instance entries equals the whole-dict encoding."""

from __future__ import annotations

import json
from dataclasses import replace

from checkpoint_coordinator.gym.manifest import (
    build_gym_manifest,
    encode_gym_manifest,
    encode_gym_manifest_of,
    encode_instance_entry,
)
from checkpoint_coordinator.gym.models import Episode
from checkpoint_coordinator.gym.results import CommitResult, InstanceCommit


def _instance(iid: str, n: int, keys: list[str]) -> InstanceCommit:
    eps = tuple(Episode(f"r{i:03d}", i % 3) for i in range(n))
    return InstanceCommit(
        instance_id=iid, checkpoint_dir=f"/tmp/x/{iid}", scope=eps, episodes=eps[::-1], restarts=(Episode("zz", 1),),
        staging_keys=tuple(keys), participants=("model", "agent"), pending=(),
    )


def test_joined_text_is_the_whole_dicts_text_with_and_without_encoded_entries() -> None:
    # Instance ids and keys that JSON must escape, out of order, one instance with nothing.
    a = _instance('b/replica-"1"', 5, ["tq/\u00e9", "tq/a\\b", "tq/\n"])
    b = _instance("a/replica-0", 0, [])
    c = _instance("c/\u2603", 3, ["k"])
    commit = CommitResult("cid-\u00fc", {x.instance_id: x for x in (a, b, c)})
    whole = encode_gym_manifest(build_gym_manifest("cid-\u00fc", commit))
    assert encode_gym_manifest_of("cid-\u00fc", commit) == whole
    # Some entries encoded ahead (as the commit does), others not.
    early = CommitResult("cid-\u00fc", {a.instance_id: replace(a, manifest_entry=encode_instance_entry(a)), b.instance_id: b, c.instance_id: c})
    assert encode_gym_manifest_of("cid-\u00fc", early) == whole
    assert list(json.loads(whole)["instances"]) == ["a/replica-0", 'b/replica-"1"', "c/\u2603"]
