"""The coordinator's pure domain: rules with no I/O and no project imports outside this package.

Modules: ``errors`` (typed refusals naming fields), ``levels`` (restore levels), ``config``
(the run's recovery config), ``identity`` (id patterns and formats), ``gym_manifest`` (the
Gym manifest, schema 2), ``cut`` (a snapshot's ledger copy), ``restore_plan`` (what each
sibling does after a restore), ``legacy_ledger`` (NeMo RL ledger JSON, schemas 2-4) and
``snapshot_state`` (state machines and the closed enum of snapshot reasons).
"""

from .errors import (
    ConfigError,
    CutError,
    DomainError,
    FieldIssue,
    IdentityError,
    LegacyLedgerError,
    LegacyLedgerVersionError,
    LevelError,
    ManifestError,
    ManifestLedgerMismatch,
    ManifestVersionError,
    PlanError,
    TopologyMismatch,
    TransitionError,
)
from .levels import LiveGranularity, RestoreLevel, live_granularity, parse_level, resolve_level

__all__ = [
    "ConfigError",
    "CutError",
    "DomainError",
    "FieldIssue",
    "IdentityError",
    "LegacyLedgerError",
    "LegacyLedgerVersionError",
    "LevelError",
    "ManifestError",
    "ManifestLedgerMismatch",
    "ManifestVersionError",
    "PlanError",
    "TopologyMismatch",
    "TransitionError",
    "LiveGranularity",
    "RestoreLevel",
    "live_granularity",
    "parse_level",
    "resolve_level",
]
