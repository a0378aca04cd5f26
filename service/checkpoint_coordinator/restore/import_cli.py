"""``ckpt-coordinator import-ledger``: import a NeMo RL rollout-recovery ledger into a run as a
published snapshot, through a running coordinator (``--url``/``--token``) or straight into its
database (``CKPTC_DATABASE_URL`` or ``--database-url``).

Exit status: 0 imported (or already imported with the same document), 1 refused (the message
names the field), 2 usage or connection problem. Never a traceback.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
from typing import Any, TextIO

PROG = "ckpt-coordinator import-ledger"

# The problem code said when a refusal names none (an older coordinator).
_REFUSED_CODE = "import_refused"


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog=PROG,
        description="Import a NeMo RL rollout-recovery ledger (JSON, schema_version 2, 3 or 4) into a run as a "
        "published snapshot. Schemas 2 and 3 are rewritten in the schema 4 shape; a refusal names the field.",
        epilog="Without --url the ledger is written straight into the database named by --database-url or "
        "CKPTC_DATABASE_URL. Exit status: 0 imported, 1 refused, 2 usage or connection problem.",
    )
    p.add_argument("file", metavar="FILE", help="the ledger JSON file ('-' reads standard input)")
    p.add_argument("--run", required=True, metavar="RUN", help="the run to import into")
    p.add_argument(
        "--snapshot-id", metavar="ID", help="id of the snapshot to create (default: nemo-rl-<first 12 hex of the document digest>)"
    )
    p.add_argument("--anchor-step", type=int, metavar="STEP", help="the train step the snapshot is anchored on (default: newest target step in the document)")
    p.add_argument("--url", metavar="URL", help="base URL of a running coordinator, e.g. http://127.0.0.1:8080")
    p.add_argument("--token", metavar="TOKEN", help="the run's token or the admin token (default: $CKPTC_TOKEN); needs --url")
    p.add_argument("--database-url", metavar="URL", help="PostgreSQL URL (default: $CKPTC_DATABASE_URL); without --url")
    p.add_argument("--timeout", type=float, default=120.0, metavar="SECONDS", help="HTTP timeout with --url (default 120)")
    return p


class _Usage(Exception):
    pass


def _fail(out: TextIO, message: str) -> None:
    print(f"{PROG}: {message}", file=out)


def _read(path: str) -> Any:
    try:
        if path == "-":
            raw = sys.stdin.read()
        else:
            with open(path, encoding="utf-8") as fh:
                raw = fh.read()
    except OSError as e:
        raise _Usage(f"cannot read {path}: {e.strerror or e}") from None
    except UnicodeDecodeError as e:
        raise _Refused("document", f"not UTF-8 text: {e}") from None
    try:
        return json.loads(raw)
    except json.JSONDecodeError as e:
        raise _Refused("document", f"not valid JSON: {e.msg} at line {e.lineno} column {e.colno}") from None


class _Refused(Exception):
    def __init__(self, field: str, message: str, code: str = "legacy_ledger_invalid", errors: list[dict[str, Any]] | None = None) -> None:
        super().__init__(message)
        self.field = field
        self.message = message
        self.code = code
        self.errors = errors or [{"field": field, "message": message}]


def _default_snapshot_id(doc: Any) -> str:
    from .ledger_import import document_digest

    try:
        return "nemo-rl-" + document_digest(doc).split(":", 1)[1][:12]
    except (TypeError, ValueError) as e:
        raise _Refused("document", f"not a JSON document: {e}") from None


def _via_http(args: argparse.Namespace, doc: Any, snapshot_id: str) -> dict[str, Any]:
    import httpx

    token = args.token or os.environ.get("CKPTC_TOKEN")
    if not token:
        raise _Usage("--url needs --token (or CKPTC_TOKEN)")
    body: dict[str, Any] = {"snapshot_id": snapshot_id, "document": doc}
    if args.anchor_step is not None:
        body["anchor_step"] = args.anchor_step
    url = f"{args.url.rstrip('/')}/v1/runs/{args.run}/ledger-import"
    try:
        r = httpx.post(url, json=body, headers={"Authorization": f"Bearer {token}"}, timeout=args.timeout, trust_env=False)
    except httpx.HTTPError as e:
        raise _Usage(f"cannot reach the coordinator at {args.url}: {e}") from None
    try:
        payload = r.json()
    except ValueError:
        payload = {"detail": r.text[:500]}
    if r.status_code in (200, 201):
        return payload
    if r.status_code in (401, 403):
        raise _Usage(f"the coordinator refused the token ({r.status_code} {payload.get('code', '')})")
    if 400 <= r.status_code < 500:
        errors = payload.get("errors") or [{"field": "document", "message": payload.get("detail", "")}]
        raise _Refused(errors[0].get("field", "document"), str(payload.get("detail", "")), str(payload.get("code", _REFUSED_CODE)), errors)
    raise _Usage(f"the coordinator answered {r.status_code}: {payload.get('detail', '')}")


def _via_database(args: argparse.Namespace, doc: Any, snapshot_id: str) -> dict[str, Any]:
    url = args.database_url or os.environ.get("CKPTC_DATABASE_URL")
    if not url:
        raise _Usage("no database: pass --url and --token, or set CKPTC_DATABASE_URL (or --database-url)")

    async def run() -> dict[str, Any]:
        from ..ledger.db import make_async_engine
        from .ledger_import import import_document

        engine = make_async_engine(url, pool_size=1)
        try:
            return await import_document(engine, args.run, snapshot_id, doc, anchor_step=args.anchor_step)
        finally:
            await engine.dispose()

    from ..errors import CoordinatorError

    try:
        return asyncio.run(run())
    except CoordinatorError as e:
        errors = e.extra.get("errors") or [{"field": "document", "message": e.detail}]
        raise _Refused(errors[0].get("field", "document"), e.detail, e.code, errors) from None
    except ValueError as e:  # a malformed database URL
        raise _Usage(f"invalid database URL: {e}") from None
    except OSError as e:
        raise _Usage(f"cannot reach the database: {e}") from None
    except Exception as e:  # driver errors (connection refused, authentication): no traceback
        if type(e).__module__.startswith(("sqlalchemy", "psycopg")):
            raise _Usage(f"database error: {str(e).splitlines()[0] if str(e) else type(e).__name__}") from None
        raise


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(sys.argv[1:] if argv is None else argv)
    try:
        if args.token and not args.url:
            raise _Usage("--token needs --url")
        if args.url and args.database_url:
            raise _Usage("pass either --url or --database-url, not both")
        if args.anchor_step is not None and args.anchor_step < 0:
            raise _Usage("--anchor-step must be >= 0")
        doc = _read(args.file)
        snapshot_id = args.snapshot_id or _default_snapshot_id(doc)
        result = _via_http(args, doc, snapshot_id) if args.url else _via_database(args, doc, snapshot_id)
    except _Usage as e:
        _fail(sys.stderr, str(e))
        return 2
    except _Refused as e:
        _fail(sys.stderr, f"refused ({e.code}): {e.message}")
        for err in e.errors[:50]:
            print(f"  {err.get('field', 'document')}: {err.get('message', '')}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        _fail(sys.stderr, "interrupted")
        return 2
    verb = "imported" if result.get("created", True) else "already imported (same document)"
    print(
        f"{verb}: snapshot {result.get('snapshot_id')} of run {args.run}: {result.get('groups')} group(s), "
        f"{result.get('siblings')} sibling(s), anchor step {result.get('anchor_step')}, "
        f"source schema {result.get('source_schema_version')}"
    )
    for note in result.get("notes") or []:
        print(f"  note: {note}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
