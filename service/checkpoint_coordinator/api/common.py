"""Shared API pieces: id patterns, a strict request model base, limits."""

from __future__ import annotations

import inspect
import json
import typing
from collections.abc import Callable, Coroutine
from typing import TYPE_CHECKING, Any

from fastapi import HTTPException, Request, Response
from fastapi.encoders import jsonable_encoder
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from fastapi.routing import APIRoute
from pydantic import BaseModel, ConfigDict
from pydantic_core import from_json, to_json

if TYPE_CHECKING:
    from .auth import Caller

NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._-]*$"
RUN_ID_PATTERN = NAME_PATTERN
GROUP_ID_PATTERN = NAME_PATTERN
SNAPSHOT_ID_PATTERN = NAME_PATTERN
INSTANCE_ID_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._-]*(/[A-Za-z0-9][A-Za-z0-9._-]*)*$"
ROLLOUT_ID_PATTERN = NAME_PATTERN

# The ledger's integer columns: a step, a cursor or a count beyond them is refused as input,
# not by PostgreSQL halfway through a write.
BIGINT_MAX = 2**63 - 1
INT4_MAX = 2**31 - 1


class Strict(BaseModel):
    """Request bodies refuse unknown fields: a misspelled key must not be silently ignored."""

    model_config = ConfigDict(extra="forbid", strict=False)


class FastJSON(Response):
    """Compact UTF-8 JSON from pydantic-core's native serializer: batch answers of thousands of
    rows skip FastAPI's recursive encoder and the stdlib encoder, which cost more than the
    database work for them. Non-finite floats (never valid JSON) leave as null."""

    media_type = "application/json"

    def render(self, content: Any) -> bytes:
        return to_json(content, inf_nan_mode="null")


def json_with_raw(content: BaseModel | dict[str, Any], name: str, raw: str) -> Response:
    """The answer ``content`` (of a model: its members that are set) with its member ``name``
    given by ``raw``: JSON text written by the database (a key list of megabytes), spliced in
    rather than parsed and encoded again here."""
    if isinstance(content, BaseModel):
        head = content.__pydantic_serializer__.to_json(content, exclude_unset=True, exclude={name})[:-1]
    else:
        head = to_json({k: v for k, v in content.items() if k != name}, inf_nan_mode="null")[:-1]
    body = head + (b"," if len(head) > 1 else b"") + to_json(name) + b":" + raw.encode() + b"}"
    return Response(body, media_type="application/json")


def as_built(content: Any, status_code: int = 200) -> Response:
    """An answer the stores and services build as plain JSON (a ledger view, a restore's stored
    answer, an exported document), encoded with ``jsonable_encoder`` and sent as ``JSONResponse``
    (these values hold only JSON types and pre-formatted timestamps, so the bytes are those the
    routes answered before they declared a model). The route's ``response_model``
    documents it and is not run on it: a stored answer of an older release is answered as it
    was stored, and a page of 100 000 rows is not validated once more. tests/api checks these
    answers against their schemas."""
    return JSONResponse(jsonable_encoder(content), status_code=status_code)


class FastJSONRequest(Request):
    """A request whose JSON body is parsed by pydantic-core (faster than the stdlib's on a big
    batch). What it refuses is FastAPI's usual 422 (``json_invalid``): malformed
    JSON with the stdlib's message, and the valid JSON pydantic-core cannot hold (a lone UTF-16
    surrogate escape, which no PostgreSQL text can store either and which used to end in a 500
    when the batch was written; nesting deeper than 200 levels) with pydantic-core's."""

    async def json(self) -> Any:
        if not hasattr(self, "_json"):
            body = await self.body()
            try:
                self._json = from_json(body)
            except ValueError as e:
                try:
                    json.loads(body)  # malformed: the stdlib's JSONDecodeError, with its position
                except UnicodeDecodeError:
                    raise json.JSONDecodeError("the body is not UTF-8", "", 0) from None
                raise json.JSONDecodeError(str(e), body.decode("utf-8", "replace"), 0) from None
        return self._json

    async def refuse_nul(self) -> None:
        """PostgreSQL text and jsonb cannot hold U+0000: refuse it as a 422 naming the field,
        before anything is written. JSON carries it only escaped, so a byte search of the body
        tells that there is none (the common case) without walking the document."""
        body = await self.body()
        if b"\\u0000" not in body:
            return
        try:
            document = await self.json()
        except ValueError:
            return  # not JSON: the route's own parsing answers it
        where = _nul_path(document, ("body",))
        if where is not None:
            raise RequestValidationError(
                [{"type": "string_nul", "loc": where, "msg": "must not contain the NUL character (U+0000)", "input": None}]
            )


def _nul_path(value: Any, path: tuple[Any, ...]) -> tuple[Any, ...] | None:
    """Where in a parsed JSON document a string (value or key) holds U+0000, if anywhere."""
    stack: list[tuple[Any, tuple[Any, ...]]] = [(value, path)]
    while stack:
        v, at = stack.pop()
        if isinstance(v, str):
            if "\x00" in v:
                return at
        elif isinstance(v, dict):
            for k, item in v.items():
                if "\x00" in k:
                    return (*at, k)
                stack.append((item, (*at, k)))
        elif isinstance(v, list):
            stack.extend((item, (*at, i)) for i, item in enumerate(v))
    return None


async def _admitted(request: Request) -> tuple[FastJSONRequest, Caller]:
    """The request as every /v1 route reads it, and its caller."""
    from .auth import authenticate  # auth reads this module's id patterns

    fast = FastJSONRequest(request.scope, request.receive)
    # The caller first: nothing of the body is read for a request without a valid token.
    caller = await authenticate(fast)
    # Outside the handler: FastAPI turns an error raised while it parses a body into a 400.
    await fast.refuse_nul()
    return fast, caller


class FastJSONRoute(APIRoute):
    """Route class of every /v1 endpoint: bodies are read through ``FastJSONRequest``."""

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handler = super().get_route_handler()

        async def route_handler(request: Request) -> Response:
            fast, _ = await _admitted(request)
            return await handler(fast)

        return route_handler


class DirectRoute(FastJSONRoute):
    """Route class of the few hot endpoints a participant calls around every tool call (the
    effect journal's begin and complete): their inputs are the caller (``require_run_access``),
    path ids and one JSON body, validated here by the same fields FastAPI declares and by its
    rules (a body is JSON only under a JSON content type; the same 400 and 422 answers, in the same
    order; the same OpenAPI), and the endpoint is called without FastAPI's dependency solving,
    about a tenth of an effect's time in the coordinator (docs/effects.md#cost). An endpoint it
    cannot call that way is refused when the route is built."""

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        from .auth import require_run_access

        d, call = self.dependant, self.dependant.call
        callers = [sub.name for sub in d.dependencies if sub.call is require_run_access]
        extras = (d.query_params, d.header_params, d.cookie_params, d.response_param_name, d.background_tasks_param_name,
                  d.security_scopes_param_name, d.websocket_param_name, d.http_connection_param_name)
        returns = typing.get_type_hints(call).get("return") if call is not None else None
        if (len(callers) != 1 or len(d.dependencies) != 1 or d.request_param_name is None or len(d.body_params) != 1
                or self.body_field is None or any(extras) or not inspect.iscoroutinefunction(call)
                or not (isinstance(returns, type) and issubclass(returns, Response))):
            raise TypeError(f"{self.path}: a DirectRoute endpoint is a coroutine of the request, its caller, path ids and one body, answering a Response")
        assert call is not None
        caller_name, body_name, request_name = callers[0], d.body_params[0].name, d.request_param_name
        body_field = self.body_field
        own_path = list(d.path_params)
        # FastAPI's order: the caller's dependency (the run id) first, then the route's own ids.
        path_fields = [f for sub in d.dependencies for f in sub.path_params] + own_path

        async def route_handler(request: Request) -> Response:
            fast, caller = await _admitted(request)
            values: dict[str, Any] = {}
            errors: list[Any] = []
            for f in path_fields:
                value, errs = f.validate(fast.path_params.get(f.alias), loc=("path", f.alias))
                values[f.name] = value
                errors += errs
            raw = await fast.body()
            if not raw:
                errors.append({"type": "missing", "loc": ("body",), "msg": "Field required", "input": None})
            else:
                document = await _json_body(fast, raw)
                value, errs = body_field.validate(document, loc=("body",))
                values[body_name] = value
                errors += errs
            if errors:
                raise RequestValidationError(errors)
            args = {f.name: values[f.name] for f in own_path}
            return await call(**args, **{body_name: values[body_name], request_name: fast, caller_name: caller})

        return route_handler


async def _json_body(request: FastJSONRequest, raw: bytes) -> Any:
    """The body as FastAPI reads it for a model: parsed under a JSON content type
    (``application/json``, ``application/*+json``), else the bytes themselves (which the model
    refuses); malformed JSON a 422 ``json_invalid``, a body the parser cannot take (nested too
    deep) a 400."""
    main, _, sub = request.headers.get("content-type", "").partition(";")[0].strip().lower().partition("/")
    if main != "application" or not (sub == "json" or sub.endswith("+json")):
        return raw
    try:
        return await request.json()
    except json.JSONDecodeError as e:
        raise RequestValidationError(
            [{"type": "json_invalid", "loc": ("body", e.pos), "msg": "JSON decode error", "input": {}, "ctx": {"error": e.msg}}], body=e.doc,
        ) from None
    except Exception as e:  # noqa: BLE001 - FastAPI answers any other parse failure so
        raise HTTPException(status_code=400, detail="There was an error parsing the body") from e
