"""Typed errors of the pure domain.

Every refusal of the domain is a :class:`DomainError` carrying a stable ``code`` and one or
more :class:`FieldIssue` objects. An issue names the offending field by its location, a tuple
of object keys (``str``) and list indexes (``int``) from the root of the input, the way pydantic
names locations. Two renderings of a location are offered:

* ``path``: a readable form, ``instances["math/replica-0"].episodes[3].attempt``; a key that is
  a plain identifier is written after a dot, any other key is quoted in brackets, so keys that
  contain ``.`` or ``/`` stay unambiguous.
* ``pointer``: an RFC 6901 JSON Pointer, ``/instances/math~1replica-0/episodes/3/attempt``, which
  a problem document can carry as-is.

The API layer maps ``code`` to an HTTP status; the domain knows nothing about HTTP.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Iterable, Sequence

Loc = tuple[str | int, ...]

_IDENT = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


def render_path(loc: Sequence[str | int]) -> str:
    """Readable rendering of a location (``""`` for the document itself)."""
    out: list[str] = []
    for seg in loc:
        if isinstance(seg, int):
            out.append(f"[{seg}]")
        elif _IDENT.fullmatch(seg):
            out.append(f".{seg}" if out else seg)
        else:
            quoted = seg.replace("\\", "\\\\").replace('"', '\\"')
            out.append(f'["{quoted}"]')
    return "".join(out)


def render_pointer(loc: Sequence[str | int]) -> str:
    """RFC 6901 JSON Pointer of a location (``""`` for the document itself)."""
    return "".join("/" + str(seg).replace("~", "~0").replace("/", "~1") for seg in loc)


@dataclass(frozen=True, slots=True)
class FieldIssue:
    """One thing wrong with one field."""

    loc: Loc
    message: str

    @property
    def path(self) -> str:
        return render_path(self.loc)

    @property
    def pointer(self) -> str:
        return render_pointer(self.loc)

    def __str__(self) -> str:
        where = self.path or "<document>"
        return f"{where}: {self.message}"


class IssueList:
    """The issues found so far: the first ``limit`` of them, then only a count of the others,
    which :meth:`done` reports as one last issue (``... and N more <what>``)."""

    __slots__ = ("items", "more", "_limit", "_what")

    def __init__(self, limit: int = 50, what: str = "issues") -> None:
        self.items: list[FieldIssue] = []
        self.more = 0
        self._limit = limit
        self._what = what

    def add(self, loc: Loc, message: str) -> None:
        if len(self.items) < self._limit:
            self.items.append(FieldIssue(loc, message))
        else:
            self.more += 1

    def done(self) -> list[FieldIssue]:
        items = list(self.items)
        if self.more:
            items.append(FieldIssue((), f"... and {self.more} more {self._what}"))
        return items


class DomainError(Exception):
    """Base of every refusal raised by ``checkpoint_coordinator.domain``.

    ``issues`` is never empty. ``str(error)`` lists every issue, one per line.
    """

    code: str = "domain_error"

    def __init__(self, issues: Iterable[FieldIssue]) -> None:
        self.issues: tuple[FieldIssue, ...] = tuple(issues)
        if not self.issues:
            raise ValueError("a DomainError needs at least one issue")
        super().__init__("\n".join(str(i) for i in self.issues))

    @classmethod
    def at(cls, loc: Sequence[str | int], message: str) -> "DomainError":
        """The error with a single issue at ``loc``."""
        return cls([FieldIssue(tuple(loc), message)])

    # Convenience accessors for the (common) single-issue case.
    @property
    def loc(self) -> Loc:
        return self.issues[0].loc

    @property
    def path(self) -> str:
        return self.issues[0].path

    @property
    def message(self) -> str:
        return self.issues[0].message

    @property
    def paths(self) -> tuple[str, ...]:
        return tuple(i.path for i in self.issues)

    def __reduce__(self):  # picklable across process boundaries
        return (self.__class__, (self.issues,))


# The domain's refusals, one a line: the class and its stable code (what it refuses above it).
#: The run's recovery configuration is refused; one issue per offending key.
class ConfigError(DomainError): code = "invalid_recovery_config"
#: A restore level that does not exist or is refused (``prefix``); also a ``ValueError`` so that
#: pydantic validators report it as a field error.
class LevelError(DomainError, ValueError): code = "invalid_restore_level"
#: An identifier breaks its pattern or length limit.
class IdentityError(DomainError, ValueError): code = "invalid_identifier"
#: A Gym manifest (schema 2) is refused; the first failing rule is reported.
class ManifestError(DomainError): code = "gym_manifest_invalid"
#: A Gym manifest of another schema version, refused before any other field is read.
class ManifestVersionError(ManifestError): code = "gym_manifest_version"
#: A NeMo RL rollout-recovery ledger document is refused.
class LegacyLedgerError(DomainError): code = "legacy_ledger_invalid"
#: ... of a schema version the importer does not read.
class LegacyLedgerVersionError(LegacyLedgerError): code = "legacy_ledger_version"
#: A ledger cut is internally inconsistent, so no restore plan can be made from it.
class CutError(DomainError): code = "ledger_cut_invalid"
#: Live Gym instances or participants differ from what the manifest needs.
class TopologyMismatch(DomainError): code = "topology_mismatch"
#: The injected rollout-id generator produced an id that is already taken.
class PlanError(DomainError): code = "restore_plan_rollout_id_collision"


class ManifestLedgerMismatch(DomainError):
    """The Gym manifest disagrees with the ledger cut; ``instance_ids`` names the instances."""

    code = "gym_manifest_disagrees_with_ledger"

    def __init__(self, issues: Iterable[FieldIssue], instance_ids: Sequence[str] = ()) -> None:
        self.instance_ids: tuple[str, ...] = tuple(instance_ids)
        super().__init__(issues)

    def __reduce__(self):
        return (self.__class__, (self.issues, self.instance_ids))


class TransitionError(DomainError):
    """A state change that the state machine does not allow."""

    code = "illegal_transition"

    def __init__(
        self,
        machine: str,
        current: str,
        target: str,
        allowed: Iterable[str],
        field: str = "status",
    ) -> None:
        self.machine = machine
        self.field = field
        self.current = current
        self.target = target
        self.allowed = tuple(sorted(allowed))
        allowed_txt = ", ".join(self.allowed) if self.allowed else "none (terminal state)"
        super().__init__(
            [
                FieldIssue(
                    (field,),
                    f"{machine}: {current} -> {target} is not allowed; from {current} the "
                    f"allowed targets are: {allowed_txt}",
                )
            ]
        )

    def __reduce__(self):
        return (
            self.__class__,
            (self.machine, self.current, self.target, self.allowed, self.field),
        )
