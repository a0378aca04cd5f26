"""The Gym manifest of a snapshot, schema version 2 (docs/ledger.md#the-gym-manifest,
docs/gym-protocol.md#the-gym-manifest).

Document shape::

    {
      "schema_version": 2,
      "checkpoint_id": "<checkpoint id>",
      "instances": {
        "<instance id>": {
          "episodes":     [{"rollout_id": "<rollout id>", "attempt": <int >= 0>}, ...],
          "restarts":     [{"rollout_id": "<rollout id>", "attempt": <int >= 0>}, ...],
          "staging_keys": ["<non-empty string>", ...],
          "participants": ["<server name>", ...]
        }
      }
    }

``episodes`` are the episodes Gym exported, at their checkpointed attempt N; ``restarts`` the
candidates left out of the commit scope because a participant reported them as restarts;
``staging_keys`` the token-store keys of the exported episodes only; ``participants`` the server
names that committed the instance.

:func:`load_gym_manifest` applies these rules in order and refuses on the first
failure with a :class:`~.errors.ManifestError` naming the field (``ManifestVersionError`` for
rule 1, checked before any other field is even looked at):

1. the document is an object; ``schema_version`` is the integer 2 (not 1, not ``"2"``, not 2.0,
   not ``true``);
2. top-level keys are exactly ``schema_version``, ``checkpoint_id``, ``instances``;
   ``checkpoint_id`` is a valid checkpoint id;
3. ``instances`` is a non-empty object keyed by valid instance ids, each value an object with
   exactly ``episodes``, ``restarts``, ``staging_keys``, ``participants``;
4. ``episodes``/``restarts`` are lists of objects with exactly ``rollout_id`` (valid rollout id)
   and ``attempt`` (int >= 0; a boolean is not an int);
5. a rollout id appears at most once across all episodes and restarts of the document;
6. ``staging_keys`` are non-empty strings, unique within the instance; ``participants`` is a
   non-empty list of unique valid server names.

A loaded manifest is normalised: every list sorted (episodes by ``(rollout_id, attempt)``,
strings lexicographically), which is also the order :func:`dump_gym_manifest` writes.
:func:`manifest_to_json_bytes` writes compact UTF-8 JSON with sorted keys.
:func:`manifest_from_json_bytes` also refuses duplicate object keys and NaN/Infinity.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, Iterable, Iterator, Mapping, NamedTuple

from .errors import FieldIssue, ManifestError, ManifestVersionError
from .identity import CHECKPOINT_ID, INSTANCE_ID, SERVER_NAME, is_valid_rollout_id, ROLLOUT_ID
from .json_kinds import json_kind

__all__ = [
    "MANIFEST_SCHEMA_VERSION",
    "ManifestEpisode",
    "ManifestInstance",
    "GymManifest",
    "EpisodeOwnership",
    "load_gym_manifest",
    "dump_gym_manifest",
    "manifest_to_json_bytes",
    "manifest_from_json_bytes",
    "build_gym_manifest",
]

MANIFEST_SCHEMA_VERSION = 2

_TOP_KEYS = frozenset({"schema_version", "checkpoint_id", "instances"})
_INSTANCE_KEYS = frozenset({"episodes", "restarts", "staging_keys", "participants"})
_EPISODE_KEYS = frozenset({"rollout_id", "attempt"})


class ManifestEpisode(NamedTuple):
    """One attempt of one rollout inside Gym."""

    rollout_id: str
    attempt: int

    def to_json(self) -> dict[str, Any]:
        return {"attempt": self.attempt, "rollout_id": self.rollout_id}


@dataclass(frozen=True, slots=True)
class ManifestInstance:
    episodes: tuple[ManifestEpisode, ...]
    restarts: tuple[ManifestEpisode, ...]
    staging_keys: tuple[str, ...]
    participants: tuple[str, ...]


class EpisodeOwnership(NamedTuple):
    """Where a rollout sits in a manifest."""

    instance_id: str
    attempt: int
    saved: bool  # True: in ``episodes`` (exported); False: in ``restarts``


@dataclass(frozen=True, slots=True)
class GymManifest:
    """A validated, normalised Gym manifest. Build it with :func:`load_gym_manifest` or
    :func:`build_gym_manifest`; both run the same checks."""

    checkpoint_id: str
    instances: Mapping[str, ManifestInstance]

    @property
    def schema_version(self) -> int:
        return MANIFEST_SCHEMA_VERSION

    @property
    def instance_ids(self) -> tuple[str, ...]:
        return tuple(self.instances)

    def iter_rollouts(self) -> Iterator[tuple[str, EpisodeOwnership]]:
        """Every rollout of the document with where it sits, saved episodes first per instance."""
        for iid, inst in self.instances.items():
            for e in inst.episodes:
                yield e.rollout_id, EpisodeOwnership(iid, e.attempt, True)
            for e in inst.restarts:
                yield e.rollout_id, EpisodeOwnership(iid, e.attempt, False)

    def rollout_index(self) -> dict[str, EpisodeOwnership]:
        """``rollout_id -> EpisodeOwnership`` (rollout ids are unique across the document)."""
        return dict(self.iter_rollouts())

    @property
    def episode_count(self) -> int:
        return sum(len(i.episodes) for i in self.instances.values())

    @property
    def restart_count(self) -> int:
        return sum(len(i.restarts) for i in self.instances.values())

    def __reduce__(self):  # picklable: through its JSON form, re-validated on load
        return (load_gym_manifest, (dump_gym_manifest(self),))


def _fail(loc: Iterable[str | int], message: str) -> ManifestError:
    return ManifestError([FieldIssue(tuple(loc), message)])


def _check_version(obj: Any) -> None:
    if not isinstance(obj, Mapping):
        raise ManifestVersionError.at((), f"a Gym manifest must be a JSON object, got {json_kind(obj)}")
    loc = ("schema_version",)
    if "schema_version" not in obj:
        raise ManifestVersionError.at(loc, "missing; a Gym manifest must declare schema_version 2")
    version = obj["schema_version"]
    if type(version) is not int:
        raise ManifestVersionError.at(
            loc, f"must be the integer {MANIFEST_SCHEMA_VERSION}, got the {json_kind(version)} {version!r}"
        )
    if version == 1:
        raise ManifestVersionError.at(
            loc,
            "schema version 1 predates recorded participants and cannot be restored safely; only schema "
            "version 2 is accepted",
        )
    if version != MANIFEST_SCHEMA_VERSION:
        raise ManifestVersionError.at(
            loc, f"unknown schema version {version}; only schema version {MANIFEST_SCHEMA_VERSION} is accepted"
        )


def _exact_keys(value: Mapping[str, Any], expected: frozenset[str], loc: tuple, what: str) -> None:
    keys = set(value)
    missing = sorted(expected - keys)
    if missing:
        raise _fail(loc + (missing[0],), f"{what} is missing required key {missing[0]!r}")
    extra = sorted((k for k in keys - expected), key=str)
    if extra:
        raise _fail(
            loc + (str(extra[0]),),
            f"unknown key {extra[0]!r} in {what}; expected exactly {sorted(expected)}",
        )


def _episodes(raw: Any, loc: tuple) -> list[ManifestEpisode]:
    if not isinstance(raw, (list, tuple)):
        raise _fail(loc, f"must be an array of episode objects, got {json_kind(raw)}")
    out: list[ManifestEpisode] = []
    append = out.append
    for i, entry in enumerate(raw):
        if type(entry) is not dict and not isinstance(entry, Mapping):
            raise _fail(loc + (i,), f"an episode must be an object, got {json_kind(entry)}")
        if len(entry) != 2 or "rollout_id" not in entry or "attempt" not in entry:
            _exact_keys(entry, _EPISODE_KEYS, loc + (i,), "an episode")
        rid = entry["rollout_id"]
        if not is_valid_rollout_id(rid):
            raise _fail(loc + (i, "rollout_id"), ROLLOUT_ID.problem(rid) or "invalid rollout id")
        attempt = entry["attempt"]
        if type(attempt) is not int or attempt < 0:
            raise _fail(
                loc + (i, "attempt"),
                f"must be an integer >= 0, got the {json_kind(attempt)} {attempt!r}",
            )
        append(ManifestEpisode(rid, attempt))
    return out


def load_gym_manifest(obj: Any) -> GymManifest:
    """Validate a decoded Gym manifest document (see the module docstring for the rules)."""
    # Rule 1: the version, before any other field.
    _check_version(obj)

    # Rule 2: top-level keys and checkpoint id.
    _exact_keys(obj, _TOP_KEYS, (), "the manifest")
    cid = obj["checkpoint_id"]
    reason = CHECKPOINT_ID.problem(cid)
    if reason is not None:
        raise _fail(("checkpoint_id",), reason)

    # Rule 3: instances and their topology.
    instances = obj["instances"]
    _check_instances(instances)

    # Rule 4: episode entries.
    parsed: dict[str, tuple[list[ManifestEpisode], list[ManifestEpisode]]] = {}
    for iid, inst in instances.items():
        parsed[iid] = (
            _episodes(inst["episodes"], ("instances", iid, "episodes")),
            _episodes(inst["restarts"], ("instances", iid, "restarts")),
        )

    # Rule 5: a rollout id at most once across the whole document.
    _check_unique_rollouts(parsed)

    # Rule 6: staging keys and participants.
    out = {iid: _instance(iid, inst, *parsed[iid]) for iid, inst in instances.items()}
    ordered = {iid: out[iid] for iid in sorted(out)}
    return GymManifest(checkpoint_id=cid, instances=MappingProxyType(ordered))


def _check_instances(instances: Any) -> None:
    if not isinstance(instances, Mapping):
        raise _fail(("instances",), f"must be an object, got {json_kind(instances)}")
    if not instances:
        raise _fail(("instances",), "must name at least one instance")
    for iid, inst in instances.items():
        reason = INSTANCE_ID.problem(iid)
        if reason is not None:
            raise _fail(("instances", str(iid)), reason)
        if not isinstance(inst, Mapping):
            raise _fail(("instances", iid), f"must be an object, got {json_kind(inst)}")
        _exact_keys(inst, _INSTANCE_KEYS, ("instances", iid), f"instance {iid!r}")


def _check_unique_rollouts(parsed: Mapping[str, tuple[list[ManifestEpisode], list[ManifestEpisode]]]) -> None:
    seen: dict[str, tuple[str, str, int]] = {}
    for iid, (episodes, restarts) in parsed.items():
        for field_name, entries in (("episodes", episodes), ("restarts", restarts)):
            for i, e in enumerate(entries):
                prior = seen.get(e.rollout_id)
                if prior is None:
                    seen[e.rollout_id] = (iid, field_name, i)
                    continue
                p_iid, p_field, p_i = prior
                if p_iid != iid:
                    why = f"also in instance {p_iid!r}; a rollout belongs to one instance"
                elif p_field != field_name:
                    why = "both saved (episodes) and restarting (restarts)"
                else:
                    why = f"duplicate of {field_name}[{p_i}]"
                raise _fail(
                    ("instances", iid, field_name, i, "rollout_id"),
                    f"rollout id {e.rollout_id!r} appears twice: {why}",
                )


def _instance(iid: str, inst: Mapping[str, Any], episodes: list[ManifestEpisode], restarts: list[ManifestEpisode]) -> ManifestInstance:
    keys = inst["staging_keys"]
    loc = ("instances", iid, "staging_keys")
    if not isinstance(keys, (list, tuple)):
        raise _fail(loc, f"must be an array of strings, got {json_kind(keys)}")
    key_set: set[str] = set()
    for i, k in enumerate(keys):
        if type(k) is not str or not k:
            raise _fail(loc + (i,), f"a staging key must be a non-empty string, got {k!r}")
        if k in key_set:
            raise _fail(loc + (i,), f"duplicate staging key {k!r}")
        key_set.add(k)
    parts = inst["participants"]
    loc = ("instances", iid, "participants")
    if not isinstance(parts, (list, tuple)):
        raise _fail(loc, f"must be an array of server names, got {json_kind(parts)}")
    if not parts:
        raise _fail(loc, "must name at least one participant that committed the instance")
    part_set: set[str] = set()
    for i, p in enumerate(parts):
        reason = SERVER_NAME.problem(p)
        if reason is not None:
            raise _fail(loc + (i,), reason)
        if p in part_set:
            raise _fail(loc + (i,), f"duplicate participant {p!r}")
        part_set.add(p)
    episodes.sort()
    restarts.sort()
    return ManifestInstance(
        episodes=tuple(episodes),
        restarts=tuple(restarts),
        staging_keys=tuple(sorted(key_set)),
        participants=tuple(sorted(part_set)),
    )


def build_gym_manifest(
    checkpoint_id: str,
    instances: Mapping[str, Mapping[str, Iterable[Any]]],
) -> GymManifest:
    """Assemble a manifest from a commit's results (``episodes``/``restarts`` as
    :class:`ManifestEpisode` or ``(rollout_id, attempt)`` pairs or episode objects) and validate it
    exactly as loading would."""
    doc: dict[str, Any] = {
        "schema_version": MANIFEST_SCHEMA_VERSION,
        "checkpoint_id": checkpoint_id,
        "instances": {},
    }
    for iid, inst in instances.items():
        entry: dict[str, Any] = {}
        for key, value in inst.items():
            if key in ("episodes", "restarts"):
                entry[key] = [_episode_obj(e) for e in value]
            else:
                entry[key] = list(value)
        doc["instances"][iid] = entry
    return load_gym_manifest(doc)


def _episode_obj(e: Any) -> Any:
    if isinstance(e, tuple) and len(e) == 2:
        return {"rollout_id": e[0], "attempt": e[1]}
    return e


def dump_gym_manifest(manifest: GymManifest) -> dict[str, Any]:
    """The JSON-ready document, every list sorted (docs/gym-protocol.md#the-gym-manifest)."""
    return {
        "schema_version": MANIFEST_SCHEMA_VERSION,
        "checkpoint_id": manifest.checkpoint_id,
        "instances": {
            iid: {
                "episodes": [e.to_json() for e in sorted(inst.episodes)],
                "participants": sorted(inst.participants),
                "restarts": [e.to_json() for e in sorted(inst.restarts)],
                "staging_keys": sorted(inst.staging_keys),
            }
            for iid, inst in sorted(manifest.instances.items())
        },
    }


def manifest_to_json_bytes(manifest: GymManifest) -> bytes:
    """Compact UTF-8 JSON with sorted keys (the bytes of ``gym_checkpoint.json``)."""
    return json.dumps(
        dump_gym_manifest(manifest),
        sort_keys=True,
        separators=(",", ":"),
        ensure_ascii=False,
        allow_nan=False,
    ).encode("utf-8")


def _no_duplicate_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in pairs:
        if k in out:
            raise _fail((), f"duplicate JSON object key {k!r}")
        out[k] = v
    return out


def _no_constant(name: str) -> Any:
    raise _fail((), f"{name} is not valid JSON")


def manifest_from_json_bytes(data: bytes | str) -> GymManifest:
    """Decode and load ``gym_checkpoint.json`` bytes."""
    try:
        obj = json.loads(
            data, object_pairs_hook=_no_duplicate_keys, parse_constant=_no_constant
        )
    except ManifestError:
        raise
    except (ValueError, UnicodeDecodeError) as exc:
        raise _fail((), f"not valid JSON: {exc}") from None
    return load_gym_manifest(obj)
