"""The Gym manifest's text joined from per-instance entries equals the whole-dict encoding."""

from __future__ import annotations

import json
from dataclasses import replace

from hypothesis import given, settings
from hypothesis import strategies as st

from checkpoint_coordinator.gym.manifest import (
    build_gym_manifest,
    encode_gym_manifest,
    encode_gym_manifest_of,
    encode_instance_entry,
    instance_entry,
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


# Any text Gym may send back, lone surrogates aside (no JSON parser hands those over).
_text = st.text(st.characters(blacklist_categories=("Cs",)), max_size=12)


@settings(max_examples=200, deadline=None)
@given(
    episodes=st.lists(st.tuples(_text, st.integers(0, 2**40)), max_size=6),
    restarts=st.lists(st.tuples(_text, st.integers(0, 5)), max_size=3),
    keys=st.lists(_text, max_size=6),
    participants=st.lists(_text, max_size=3),
)
def test_an_entry_encoded_by_pydantic_core_is_the_standard_librarys_text(
    episodes: list[tuple[str, int]], restarts: list[tuple[str, int]], keys: list[str], participants: list[str]
) -> None:
    eps = tuple(Episode(r, a) for r, a in episodes)
    ic = InstanceCommit(
        instance_id="i", checkpoint_dir="/tmp/x/i", scope=eps, episodes=eps, restarts=tuple(Episode(r, a) for r, a in restarts),
        staging_keys=tuple(keys), participants=tuple(participants), pending=(),
    )
    assert encode_instance_entry(ic) == encode_gym_manifest(instance_entry(ic))
