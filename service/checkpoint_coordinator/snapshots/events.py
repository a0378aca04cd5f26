"""Trainer handshakes as events: one LISTEN connection per replica on the snapshot channel.

The transaction that records a handshake (``ledger.snapshots``) notifies in the same commit, so
an owner on any replica learns of it at once; the pending snapshot's own timer reads its row as
the fallback when a notification is lost (the listener reconnecting, say).
"""

from __future__ import annotations

import asyncio
import logging

from sqlalchemy.ext.asyncio import AsyncEngine

from ..ledger.db import client_options
from .runner import SnapshotRunner
from .store import NOTIFY_CHANNEL, parse_notify_payload

log = logging.getLogger(__name__)

RECONNECT_S = 1.0


def _libpq_url(engine: AsyncEngine) -> str:
    return engine.url.set(drivername="postgresql").render_as_string(hide_password=False)


async def listen(engine: AsyncEngine, runner: SnapshotRunner, *, connected: asyncio.Event | None = None) -> None:
    """Forward every notification to ``runner.wake`` until cancelled; reconnects when the
    connection drops, and then wakes everyone (notifications sent meanwhile are lost)."""
    import psycopg

    url = _libpq_url(engine)
    # Keepalives and tcp_user_timeout as on every connection of the service: a LISTEN connection
    # to a primary that died silently would otherwise wait for ever, and events then arrive only
    # through the snapshots' polling.
    options = client_options(url)
    while True:
        try:
            async with await psycopg.AsyncConnection.connect(url, autocommit=True, **options) as conn:
                await conn.execute(f"LISTEN {NOTIFY_CHANNEL}")
                runner.wake_all()
                if connected is not None:
                    connected.set()
                async for note in conn.notifies():
                    run_id, snapshot_id, kind = parse_notify_payload(note.payload)
                    runner.wake(run_id, snapshot_id, created=kind == "created", progress=kind == "progress")
        except asyncio.CancelledError:
            raise
        except Exception as e:
            if connected is not None:
                connected.clear()
            log.warning("snapshot event listener: %s: %s; reconnecting", type(e).__name__, str(e)[:500])
            await asyncio.sleep(RECONNECT_S)
