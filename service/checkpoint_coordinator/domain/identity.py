"""Identifiers: their patterns, limits, formats and parsers.

``NAME`` is ``^[A-Za-z0-9][A-Za-z0-9._-]*$`` (docs/gym-protocol.md#identifiers). Rules per identifier:

=================  =========================================  ==========  =========================
identifier         pattern                                    max length  note
=================  =========================================  ==========  =========================
run id             NAME                                       128
group id           NAME                                       180         leaves room for the
                                                                          ``_g<i>_a<32 hex>`` suffix
                                                                          within 256
snapshot id        NAME                                       100         ``snap-<id>-<8 hex>`` must
                                                                          fit a 128-char checkpoint id
checkpoint id      NAME                                       128
instance id        NAME segments joined by ``/``              256         e.g. ``math/replica-0``
server name        NAME                                       256         also participant and agent
                                                                          names
task source        NAME segments joined by ``/``              256
rollout id         NAME, never ending in ``-a<digits>``       256
=================  =========================================  ==========  =========================

Formats (docs/ledger.md#identifiers, docs/gym-protocol.md#identifiers):

* sibling id ``"<group_id>_g<i>"``;
* rollout id ``"<group_id>_g<i>_a<32 lowercase hex>"``, the hex drawn fresh for every attempt from
  an injected ``token_hex(nbytes) -> str`` (``secrets.token_hex`` in production), so this module
  has no randomness of its own;
* capture key: ``rollout_id`` when the Gym attempt is 0, else ``"<rollout_id>-a<attempt>"``;
  parsing maps a key matching ``^(.+)-a([1-9][0-9]*)$`` to ``(group 1, int(group 2))`` and any
  other key to ``(key, 0)``.

Each :class:`IdRule` exposes a ``pattern`` free of look-around (usable by pydantic's Rust regex
engine and in OpenAPI) and, for rollout ids, the separate ``forbidden_suffix``; ``validate``
applies both and the length limit.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Callable, Mapping

from .errors import FieldIssue, IdentityError

__all__ = [
    "NAME_PATTERN",
    "SEGMENTED_NAME_PATTERN",
    "ROLLOUT_ID_FORBIDDEN_SUFFIX",
    "IdRule",
    "RUN_ID",
    "GROUP_ID",
    "SNAPSHOT_ID",
    "CHECKPOINT_ID",
    "INSTANCE_ID",
    "SERVER_NAME",
    "TASK_SOURCE",
    "ROLLOUT_ID",
    "ID_PATTERNS",
    "MAX_GENERATIONS",
    "TokenHex",
    "sibling_id",
    "parse_sibling_id",
    "format_rollout_id",
    "mint_rollout_id",
    "rollout_id_minter",
    "parse_rollout_id",
    "capture_key",
    "parse_capture_key",
    "is_valid_rollout_id",
]

NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._-]*$"
SEGMENTED_NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._-]*(?:/[A-Za-z0-9][A-Za-z0-9._-]*)*$"
ROLLOUT_ID_FORBIDDEN_SUFFIX = r"-a[0-9]+$"

#: Upper bound on ``expected_generations`` of a group (siblings per prompt).
MAX_GENERATIONS = 65536

TokenHex = Callable[[int], str]


@dataclass(frozen=True, slots=True)
class IdRule:
    """Pattern and length limit of one kind of identifier."""

    kind: str
    pattern: str
    max_length: int
    forbidden_suffix: str | None = None
    _compiled: re.Pattern[str] = field(init=False, repr=False, compare=False)
    _suffix: re.Pattern[str] | None = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "_compiled", re.compile(self.pattern))
        object.__setattr__(
            self,
            "_suffix",
            re.compile(self.forbidden_suffix.replace("$", r"\Z")) if self.forbidden_suffix else None,
        )

    def problem(self, value: object) -> str | None:
        """Why ``value`` is not a valid identifier of this kind, or ``None`` if it is."""
        if not isinstance(value, str):
            return f"{self.kind} must be a string, got {type(value).__name__}"
        if not value:
            return f"{self.kind} must not be empty"
        if len(value) > self.max_length:
            return f"{self.kind} is {len(value)} characters long; the limit is {self.max_length}"
        if self._compiled.fullmatch(value) is None:
            return f"{self.kind} {value!r} does not match {self.pattern}"
        if self._suffix is not None and self._suffix.search(value) is not None:
            return (
                f"{self.kind} {value!r} ends in '-a<digits>', a suffix reserved for capture keys"
            )
        return None

    def is_valid(self, value: object) -> bool:
        return self.problem(value) is None

    def validate(self, value: object, loc: tuple[str | int, ...] = ()) -> str:
        """``value`` itself if valid, else :class:`IdentityError` at ``loc``."""
        reason = self.problem(value)
        if reason is not None:
            raise IdentityError([FieldIssue(tuple(loc), reason)])
        return value  # type: ignore[return-value]


RUN_ID = IdRule("run id", NAME_PATTERN, 128)
GROUP_ID = IdRule("group id", NAME_PATTERN, 180)
SNAPSHOT_ID = IdRule("snapshot id", NAME_PATTERN, 100)
CHECKPOINT_ID = IdRule("checkpoint id", NAME_PATTERN, 128)
INSTANCE_ID = IdRule("instance id", SEGMENTED_NAME_PATTERN, 256)
SERVER_NAME = IdRule("server name", NAME_PATTERN, 256)
TASK_SOURCE = IdRule("task source", SEGMENTED_NAME_PATTERN, 256)
ROLLOUT_ID = IdRule("rollout id", NAME_PATTERN, 256, ROLLOUT_ID_FORBIDDEN_SUFFIX)

#: Every rule by kind, for the API to reuse in path and body validation.
ID_PATTERNS: Mapping[str, IdRule] = {
    "run_id": RUN_ID,
    "group_id": GROUP_ID,
    "snapshot_id": SNAPSHOT_ID,
    "checkpoint_id": CHECKPOINT_ID,
    "instance_id": INSTANCE_ID,
    "server_name": SERVER_NAME,
    "task_source": TASK_SOURCE,
    "rollout_id": ROLLOUT_ID,
}

_ROLLOUT_NAME = re.compile(NAME_PATTERN)
_ROLLOUT_SUFFIX = re.compile(r"-a[0-9]+\Z")
_HEX32 = re.compile(r"[0-9a-f]{32}")
_MINTED = re.compile(r"(?P<group>.+)_g(?P<index>0|[1-9][0-9]*)_a(?P<hex>[0-9a-f]{32})")
_SIBLING = re.compile(r"(?P<group>.+)_g(?P<index>0|[1-9][0-9]*)")
_CAPTURE = re.compile(r"(.+)-a([1-9][0-9]*)")


def is_valid_rollout_id(value: object) -> bool:
    """Fast check of the rollout-id rule (used on hot paths)."""
    return (
        isinstance(value, str)
        and 0 < len(value) <= 256
        and _ROLLOUT_NAME.fullmatch(value) is not None
        and _ROLLOUT_SUFFIX.search(value) is None
    )


def _check_index(generation_index: object, loc: tuple[str | int, ...]) -> int:
    if (
        type(generation_index) is not int
        or generation_index < 0
        or generation_index >= MAX_GENERATIONS
    ):
        raise IdentityError(
            [
                FieldIssue(
                    loc,
                    f"generation index must be an int in [0, {MAX_GENERATIONS}), got "
                    f"{generation_index!r}",
                )
            ]
        )
    return generation_index


def sibling_id(group_id: str, generation_index: int) -> str:
    """Logical sibling id ``"<group_id>_g<i>"``."""
    GROUP_ID.validate(group_id, ("group_id",))
    _check_index(generation_index, ("generation_index",))
    return f"{group_id}_g{generation_index}"


def parse_sibling_id(value: str) -> tuple[str, int]:
    """``(group_id, generation_index)`` of a sibling id; :class:`IdentityError` otherwise."""
    m = _SIBLING.fullmatch(value) if isinstance(value, str) else None
    if m is None or not GROUP_ID.is_valid(m["group"]) or int(m["index"]) >= MAX_GENERATIONS:
        raise IdentityError([FieldIssue((), f"{value!r} is not a sibling id '<group_id>_g<i>'")])
    return m["group"], int(m["index"])


def format_rollout_id(group_id: str, generation_index: int, hex32: str) -> str:
    """``"<group_id>_g<i>_a<hex32>"``, validated."""
    GROUP_ID.validate(group_id, ("group_id",))
    _check_index(generation_index, ("generation_index",))
    if not isinstance(hex32, str) or _HEX32.fullmatch(hex32) is None:
        raise IdentityError(
            [FieldIssue(("token_hex",), f"expected 32 lowercase hex digits, got {hex32!r}")]
        )
    rid = f"{group_id}_g{generation_index}_a{hex32}"
    return ROLLOUT_ID.validate(rid, ("rollout_id",))


def mint_rollout_id(group_id: str, generation_index: int, token_hex: TokenHex) -> str:
    """A fresh rollout id for a new attempt of sibling ``(group_id, generation_index)``.

    ``token_hex(16)`` must return 32 lowercase hex digits (``secrets.token_hex`` does)."""
    return format_rollout_id(group_id, generation_index, token_hex(16))


def rollout_id_minter(token_hex: TokenHex, batch: int = 256) -> Callable[[str, int], str]:
    """``new_rollout_id(group_id, generation_index)`` bound to a random source, the generator
    the restore plan and the live ledger take.

    ``token_hex(nbytes)`` must return ``2 * nbytes`` lowercase hex digits of fresh randomness
    (``secrets.token_hex`` does). To keep minting cheap at a million rows, random bytes are
    drawn ``batch`` ids at a time (one ``token_hex(16 * batch)`` call) and cut into 32-digit
    pieces; each id still gets 128 bits of its own. Group ids are validated once per group."""
    if type(batch) is not int or batch < 1:
        raise ValueError("batch must be a positive int")
    checked: set[str] = set()
    hex_ok = re.compile(r"[0-9a-f]*").fullmatch
    want = 32 * batch
    limit = MAX_GENERATIONS
    buf = ""
    at = want  # forces a draw on first use

    def refill() -> None:
        nonlocal buf, at
        drawn = token_hex(16 * batch)
        if type(drawn) is not str or len(drawn) != want or hex_ok(drawn) is None:
            raise IdentityError(
                [
                    FieldIssue(
                        ("token_hex",),
                        f"token_hex({16 * batch}) must return {want} lowercase hex digits",
                    )
                ]
            )
        buf = drawn
        at = 0

    def new_rollout_id(group_id: str, generation_index: int) -> str:
        nonlocal at
        if group_id not in checked:
            GROUP_ID.validate(group_id, ("group_id",))
            checked.add(group_id)
        if generation_index.__class__ is not int or not 0 <= generation_index < limit:
            _check_index(generation_index, ("generation_index",))
        if at >= want:
            refill()
        start = at
        at = start + 32
        # group id <= 180, index < 65536, so the id is <= 223 characters and matches NAME.
        return f"{group_id}_g{generation_index}_a{buf[start:at]}"

    # Read by the restore plan: ids carry 128 bits of fresh randomness each.
    new_rollout_id.random_bits = 128  # type: ignore[attr-defined]
    return new_rollout_id


def parse_rollout_id(value: str) -> tuple[str, int, str] | None:
    """``(group_id, generation_index, hex)`` of a rollout id minted by this module, ``None`` for
    any other valid rollout id (imported ledgers may carry ids of another shape)."""
    if not isinstance(value, str):
        return None
    m = _MINTED.fullmatch(value)
    if m is None or not GROUP_ID.is_valid(m["group"]):
        return None
    return m["group"], int(m["index"]), m["hex"]


def capture_key(rollout_id: str, gym_attempt: int) -> str:
    """Gym's episode id: ``rollout_id`` at attempt 0, else ``"<rollout_id>-a<attempt>"``."""
    if type(gym_attempt) is not int or gym_attempt < 0:
        raise IdentityError(
            [FieldIssue(("gym_attempt",), f"must be an int >= 0, got {gym_attempt!r}")]
        )
    return rollout_id if gym_attempt == 0 else f"{rollout_id}-a{gym_attempt}"


def parse_capture_key(key: str) -> tuple[str, int]:
    """``(rollout_id, attempt)`` of a capture key (docs/gym-protocol.md#identifiers)."""
    if not isinstance(key, str) or not key:
        raise IdentityError([FieldIssue((), f"a capture key must be a non-empty string: {key!r}")])
    m = _CAPTURE.fullmatch(key)
    if m is None:
        return key, 0
    return m[1], int(m[2])
