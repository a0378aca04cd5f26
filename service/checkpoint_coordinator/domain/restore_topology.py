"""Whether a live Gym deployment can take a snapshot's Gym state (docs/ledger.md#checks-before-gym):
the instances and the participants each instance committed."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import replace
from typing import NamedTuple

from .errors import FieldIssue, TopologyMismatch
from .gym_manifest import GymManifest

__all__ = [
    "InstanceSetDiff",
    "compare_instance_sets",
    "missing_participants",
    "require_restorable_topology",
    "InstanceMapIssue",
    "instance_map_pairs",
    "unknown_in_map",
    "remap_manifest",
    "only_continued",
]


class InstanceSetDiff(NamedTuple):
    missing: tuple[str, ...]  # in the manifest, not live
    unknown: tuple[str, ...]  # live, not in the manifest

    @property
    def equal(self) -> bool:
        return not self.missing and not self.unknown


def compare_instance_sets(manifest: GymManifest, live_instance_ids: Iterable[str]) -> InstanceSetDiff:
    live = set(live_instance_ids)
    have = set(manifest.instances)
    return InstanceSetDiff(tuple(sorted(have - live)), tuple(sorted(live - have)))


def missing_participants(
    manifest: GymManifest, live_participants: Mapping[str, Iterable[str]]
) -> dict[str, list[str]]:
    """Per instance, the manifest participants that are not live on it (extra live
    participants are fine: they have nothing to restore)."""
    out: dict[str, list[str]] = {}
    for iid, inst in manifest.instances.items():
        live = set(live_participants.get(iid, ()))
        missing = [p for p in inst.participants if p not in live]
        if missing:
            out[iid] = sorted(missing)
    return out


def require_restorable_topology(
    manifest: GymManifest, live_participants: Mapping[str, Iterable[str]]
) -> None:
    """Raise :class:`TopologyMismatch` naming missing/unknown instances and missing
    participants; ``live_participants`` maps every live instance to its participant names."""
    diff = compare_instance_sets(manifest, live_participants)
    issues: list[FieldIssue] = []
    if diff.missing:
        issues.append(
            FieldIssue(("instances",), f"instances in the manifest but not live: {', '.join(diff.missing)}")
        )
    if diff.unknown:
        issues.append(
            FieldIssue(("instances",), f"live instances unknown to the manifest: {', '.join(diff.unknown)}")
        )
    if not issues:
        for iid, names in sorted(missing_participants(manifest, live_participants).items()):
            issues.append(
                FieldIssue(
                    ("instances", iid, "participants"),
                    f"participants that committed the instance are not live: {', '.join(names)}",
                )
            )
    if issues:
        raise TopologyMismatch(issues)



class InstanceMapIssue(NamedTuple):
    """What is wrong with an instance map: ``kind`` is ``mapped_twice`` (one saved instance to
    two live ones), ``same_live`` (two saved instances to one live one), ``unknown_saved`` or
    ``unknown_live``; ``instances`` names the instances concerned."""

    kind: str
    instances: tuple[str, ...]
    message: str


def instance_map_pairs(entries: Iterable[tuple[str, str]]) -> tuple[dict[str, str], list[InstanceMapIssue]]:
    """The map ``{saved: live}`` of ``(saved, live)`` pairs, and what makes it no map: a saved
    instance named twice, or two saved instances sent to one live instance."""
    out: dict[str, str] = {}
    issues: list[InstanceMapIssue] = []
    for saved, live in entries:
        if saved in out and out[saved] != live:
            issues.append(
                InstanceMapIssue("mapped_twice", (saved,), f"saved instance {saved!r} is mapped twice ({out[saved]!r} and {live!r})")
            )
            continue
        out[saved] = live
    by_live: dict[str, list[str]] = {}
    for saved, live in out.items():
        by_live.setdefault(live, []).append(saved)
    for live, saved in sorted(by_live.items()):
        if len(saved) > 1:
            issues.append(
                InstanceMapIssue(
                    "same_live", tuple(sorted(saved)), f"saved instances {', '.join(sorted(saved))} are all mapped to live instance {live!r}"
                )
            )
    return out, issues


def unknown_in_map(instance_map: Mapping[str, str], saved: Iterable[str], live: Iterable[str]) -> list[InstanceMapIssue]:
    """Saved instances the snapshot does not know, live instances not registered."""
    issues = []
    unknown_saved = sorted(set(instance_map) - set(saved))
    if unknown_saved:
        issues.append(
            InstanceMapIssue("unknown_saved", tuple(unknown_saved), f"saved instance(s) not in the snapshot: {', '.join(unknown_saved)}")
        )
    unknown_live = sorted(set(instance_map.values()) - set(live))
    if unknown_live:
        issues.append(
            InstanceMapIssue("unknown_live", tuple(unknown_live), f"live instance(s) not registered for the run: {', '.join(unknown_live)}")
        )
    return issues


def remap_manifest(manifest: GymManifest, instance_map: Mapping[str, str]) -> GymManifest:
    """The manifest as the live deployment takes it: each mapped saved instance under its live
    id, the unmapped ones left out (their episodes restart)."""
    return replace(manifest, instances={instance_map[iid]: inst for iid, inst in manifest.instances.items() if iid in instance_map})


def only_continued(manifest: GymManifest, continued: Iterable[str]) -> GymManifest:
    """The manifest with only the saved episodes whose rollout ids are in ``continued``: Gym
    installs what the plan continues and nothing else, so a saved episode the plan restarts
    (``too_stale``, docs/ledger.md#stale-continuations) is never resumed under its old rollout id.
    Restarts, staging keys and participants are left as they are (the Gym restore sends each
    instance its episodes only)."""
    keep = set(continued)
    if all(e.rollout_id in keep for inst in manifest.instances.values() for e in inst.episodes):
        return manifest
    return replace(
        manifest,
        instances={
            iid: replace(inst, episodes=tuple(e for e in inst.episodes if e.rollout_id in keep)) for iid, inst in manifest.instances.items()
        },
    )
