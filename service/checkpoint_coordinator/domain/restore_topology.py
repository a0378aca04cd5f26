"""Whether a live Gym deployment can take a snapshot's Gym state (recovery-ledger.md section 6):
the instances and the participants each instance committed."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import NamedTuple

from .errors import FieldIssue, TopologyMismatch
from .gym_manifest import GymManifest

__all__ = ["InstanceSetDiff", "compare_instance_sets", "missing_participants", "require_restorable_topology"]


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

