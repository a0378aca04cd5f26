"""The served OpenAPI document, and a check of real answers against it.

``served_openapi()`` is the document a coordinator serves at ``/openapi.json`` (fetched from the
app; building the app opens no database connection). ``Conformance`` wraps an ASGI app and
checks every answer it sends against the response schema the document declares for its
operation and status: a JSON answer of a declared schema must validate (JSON Schema 2020-12, as
OpenAPI 3.1 says), an error must be ``application/problem+json``. What does not is recorded,
and the test that drove the app asserts there is nothing recorded.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import re
from dataclasses import dataclass, field
from functools import cache
from typing import Any

import httpx
from jsonschema import Draft202012Validator
from referencing import Registry, Resource
from referencing.jsonschema import DRAFT202012
from starlette.types import ASGIApp, Message, Receive, Scope, Send


@cache
def served_openapi() -> dict[str, Any]:
    from checkpoint_coordinator.app import create_app
    from checkpoint_coordinator.config import Settings

    app = create_app(Settings(_env_file=None), database_url="postgresql://unused/unused")

    async def fetch() -> httpx.Response:
        # The app's lifespan does not run: no database is needed to serve the document.
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://coordinator") as c:
            return await c.get("/openapi.json")

    # From a thread of its own: a caller may be inside a running event loop.
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        r = pool.submit(asyncio.run, fetch()).result()
    assert r.status_code == 200, r.text
    return r.json()


def operations(doc: dict[str, Any]) -> dict[str, tuple[str, str, dict[str, Any]]]:
    """operationId -> (method, path template, operation)."""
    return {op["operationId"]: (m.upper(), path, op) for path, ops in doc["paths"].items() for m, op in ops.items()}


def resolve(doc: dict[str, Any], schema: dict[str, Any]) -> dict[str, Any]:
    """``schema`` with its ``$ref`` (and a nullable ``anyOf`` of one schema and null) followed."""
    while True:
        if "$ref" in schema:
            schema = doc["components"]["schemas"][schema["$ref"].rsplit("/", 1)[1]]
            continue
        variants = [s for s in schema.get("anyOf", ()) if s.get("type") != "null"]
        if len(variants) == 1 and len(schema["anyOf"]) == 2:
            schema = variants[0]
            continue
        return schema


def response_schema(doc: dict[str, Any], operation_id: str, status: int | str) -> dict[str, Any]:
    _, _, op = operations(doc)[operation_id]
    return resolve(doc, op["responses"][str(status)]["content"]["application/json"]["schema"])


@cache
def _declared(method: str, path: str, status: str) -> tuple[str, Draft202012Validator] | None:
    """The media type and the schema's validator of the answer the document declares (None: no
    such status)."""
    doc = served_openapi()
    response = doc["paths"][path][method.lower()]["responses"].get(status)
    if response is None:
        return None
    if not response.get("content"):
        return "", Draft202012Validator(False)  # no body
    ((media, content),) = response["content"].items()
    components = Resource.from_contents({"components": doc["components"]}, default_specification=DRAFT202012)
    schema = json.loads(json.dumps(content["schema"]).replace('"#/components/', '"urn:openapi#/components/'))
    return media, Draft202012Validator(schema, registry=Registry().with_resource("urn:openapi", components))


@cache
def _templates() -> tuple[tuple[re.Pattern[str], str, str, str], ...]:
    """(pattern, method, operationId, path template) of every operation, the most specific first."""
    out = []
    for path, ops in served_openapi()["paths"].items():
        # ``{instance_id}`` of the Gym instance route may hold slashes (``{instance_id:path}``).
        pattern = re.sub(r"\{instance_id\}", r"(?P<instance_id>.+)", path)
        pattern = re.sub(r"\{(\w+)\}", r"(?P<\1>[^/]+)", pattern)
        for method, op in ops.items():
            out.append((re.compile(f"^{pattern}$"), method.upper(), op["operationId"], path))
    # A literal segment beats a parameter.
    out.sort(key=lambda t: t[0].pattern.count("(?P<"))
    return tuple(out)


@dataclass
class Conformance:
    """ASGI middleware: every answer checked against the served document (see the module)."""

    app: ASGIApp
    violations: list[str] = field(default_factory=list)
    # (operationId, status) of every answer checked.
    seen: set[tuple[str, int]] = field(default_factory=set)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        start: dict[str, Any] = {}
        chunks: list[bytes] = []

        async def keep(message: Message) -> None:
            if message["type"] == "http.response.start":
                start.update(message)
            elif message["type"] == "http.response.body":
                chunks.append(message.get("body", b""))
                if not message.get("more_body"):
                    self.check(scope["method"], scope["path"], start, b"".join(chunks))
            await send(message)

        await self.app(scope, receive, keep)

    def check(self, method: str, path: str, start: dict[str, Any], body: bytes) -> None:
        found = next(((o, t) for p, m, o, t in _templates() if m == method and p.match(path)), None)
        if found is None:
            return  # /metrics and unknown paths are not in the document
        op_id, template = found
        status = int(start["status"])
        self.seen.add((op_id, status))
        media = next((v.decode() for k, v in start.get("headers", []) if k.lower() == b"content-type"), "")
        where = f"{method} {path} -> {status}"
        if status == 500:
            return  # a server error is the driving test's failure to report, not the document's
        declared = _declared(method, template, str(status))
        if declared is None:
            self.violations.append(f"{where}: status {status} not declared for {op_id}")
            return
        want, validator = declared
        if not body:
            if want:
                self.violations.append(f"{where}: no body, {want} declared")
            return
        if media.split(";")[0].strip() != want:
            self.violations.append(f"{where}: answered as {media!r}, {want!r} declared")
            return
        errors = sorted(validator.iter_errors(json.loads(body)), key=lambda e: list(e.absolute_path))
        for e in errors[:5]:
            self.violations.append(f"{where} ({op_id}): at {'/'.join(map(str, e.absolute_path)) or '<root>'}: {e.message[:300]}")
