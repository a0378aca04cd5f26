"""What the database's schema is to this release.

A replica runs on its own head revision, and on a newer schema when that schema says so: every
revision says whether it is ``additive`` (in the revision's module: code that ran on the schema
before it still runs on it), and each migration run writes the oldest revision whose code runs on
the schema it leaves (``runs_on_from``: the floor of the additive revisions above the last
breaking one) into ``schema_compat``. A replica of an older release then reads a revision it has
never heard of, and that floor: one of its own revisions means it may serve. That is what lets a rolling upgrade migrate first and replace the
replicas after, and a rollback run the previous release on the newer schema
(deploy/README.md#upgrades-and-rollbacks).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncConnection

from ..domain.vocabulary import SchemaState

# pg_advisory_lock key every migration run takes (any fixed 64-bit number; this one spells "ckptcmig").
MIGRATION_LOCK_KEY = 0x636B7074636D6967
# How long a migration waits for another one to finish before it gives up (well inside the
# migration Job's activeDeadlineSeconds).
DEFAULT_LOCK_WAIT_S = 300.0
# How long one DDL statement waits for a table lock (a long transaction of a replica): past it the
# migration fails, rolled back whole, instead of queueing every write of the fleet behind it.
DEFAULT_LOCK_TIMEOUT_S = 10.0


class MigrationLockBusy(Exception):
    def __init__(self, waited_s: float) -> None:
        super().__init__(f"another migration held the migration lock for {waited_s:.0f} s; nothing was changed")


@dataclass(frozen=True)
class SchemaStatus:
    state: SchemaState
    head: str
    revision: str | None = None
    runs_on_from: str | None = None

    @property
    def usable(self) -> bool:
        """This release may read and write the ledger (unknown: the database will say)."""
        return self.state in (SchemaState.at_head, SchemaState.ahead, SchemaState.unknown)

    def message(self) -> str:
        at = f"the database schema is at revision {self.revision}" if self.revision else "the database has no ledger schema"
        if self.state is SchemaState.at_head:
            return f"{at}, this release's head"
        if self.state is SchemaState.ahead:
            return f"{at}, newer than this release's {self.head}; it runs releases from revision {self.runs_on_from} on, this one among them"
        if self.state is SchemaState.behind:
            return f"{at}; this release needs {self.head}: run `ckpt-coordinator migrate` (in Kubernetes: the migration Job of this release)"
        if self.state is SchemaState.incompatible:
            return (f"{at}, newer than this release's {self.head}, and runs only releases from revision {self.runs_on_from} on: "
                    "finish the upgrade, or downgrade the schema with the newer release first (deploy/README.md, \"Rolling back\")")
        return "the database schema has not been read yet"


def runs_on_from_of(scripts: Any, revision: str) -> str:
    """The oldest revision whose code runs on ``revision``'s schema: walking down the chain of
    ``scripts`` (an alembic ScriptDirectory), past every additive revision to the last one that is
    not (a revision that does not say is not: the safe reading of those before the convention)."""
    script = scripts.get_revision(revision)
    while getattr(script.module, "additive", False) is True and script.down_revision is not None:
        script = scripts.get_revision(script.down_revision)
    return str(script.revision)


@functools.cache
def known_revisions() -> frozenset[str]:
    """Every revision this release has a migration for."""
    from alembic.script import ScriptDirectory

    from .db import alembic_config

    scripts = ScriptDirectory.from_config(alembic_config("postgresql://localhost/unused"))
    return frozenset(s.revision for s in scripts.walk_revisions())


@functools.cache
def this_head() -> str:
    from .db import head_revision

    return head_revision()


def classify(revision: str | None, runs_on_from: str | None) -> SchemaStatus:
    head = this_head()
    if revision == head:
        state = SchemaState.at_head
    elif revision is None or revision in known_revisions():
        state = SchemaState.behind
    elif runs_on_from is not None and runs_on_from in known_revisions():
        state = SchemaState.ahead
    else:
        state = SchemaState.incompatible
    return SchemaStatus(state, head, revision, runs_on_from)


_TABLES_SQL = "SELECT to_regclass('alembic_version') IS NOT NULL, to_regclass('schema_compat') IS NOT NULL"
_REVISION_SQL = "SELECT version_num FROM alembic_version LIMIT 1"
_COMPAT_SQL = "SELECT runs_on_from FROM schema_compat"


async def read_status(conn: AsyncConnection) -> SchemaStatus:
    """Without ``alembic_version`` the database has no ledger yet (behind); without
    ``schema_compat`` it is older than the revision that brought it."""
    has_version, has_compat = (await conn.execute(text(_TABLES_SQL))).one()
    revision = (await conn.execute(text(_REVISION_SQL))).scalar() if has_version else None
    runs_on_from = (await conn.execute(text(_COMPAT_SQL))).scalar() if has_compat else None
    return classify(revision, runs_on_from)


def read_status_sync(url: str) -> SchemaStatus:
    from sqlalchemy import create_engine, pool

    from .db import client_options, sqlalchemy_url

    engine = create_engine(sqlalchemy_url(url), poolclass=pool.NullPool, connect_args=client_options(url))
    try:
        with engine.connect() as conn:
            has_version, has_compat = conn.execute(text(_TABLES_SQL)).one()
            revision = conn.execute(text(_REVISION_SQL)).scalar() if has_version else None
            runs_on_from = conn.execute(text(_COMPAT_SQL)).scalar() if has_compat else None
        return classify(revision, runs_on_from)
    finally:
        engine.dispose()
