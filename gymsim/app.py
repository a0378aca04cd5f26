"""HTTP surface of one instance: control routes and data plane under `/s/<server>`, admin under `/admin`."""

from __future__ import annotations

import hmac
import json
import re
from contextlib import asynccontextmanager
from typing import Any, Callable

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, ValidationError

from .config import PUBLISHED_PROFILES, FaultSpec, ServerName
from .faults import Connection, FaultMiddleware
from .instance import Instance
from .kinds import AgentParticipant, ModelParticipant, MutateBody, ResourcesParticipant, completion
from .participant import DropConnection, Participant
from .wire import BODY_MODELS, ProtocolError, RolloutId, is_valid_capture_key

_SERVER_PATH = re.compile(r"^/s/([^/]+)/")

# Commit and restore scopes can name hundreds of thousands of episodes (at least 64 MiB must be
# taken; docs/gym-protocol.md#transport).
MAX_BODY_BYTES = 256 * 1024 * 1024


class BodyInvalid(Exception):
    """A request body the framework would refuse: rendered in FastAPI's own 422 shape."""

    def __init__(self, errors: list[dict[str, Any]]) -> None:
        super().__init__("invalid body")
        self.errors = errors


class NotFound(Exception):
    pass


def _framework_errors(exc: ValidationError) -> list[dict[str, Any]]:
    return [
        {"type": e["type"], "loc": ["body", *e["loc"]], "msg": e["msg"]}
        for e in exc.errors(include_url=False, include_context=False, include_input=False)
    ]


async def read_body(request: Request) -> bytes:
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > MAX_BODY_BYTES:
        raise ProtocolError("request_too_large", f"bodies are limited to {MAX_BODY_BYTES} bytes", status=413)
    chunks: list[bytes] = []
    size = 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > MAX_BODY_BYTES:
            raise ProtocolError("request_too_large", f"bodies are limited to {MAX_BODY_BYTES} bytes", status=413)
        chunks.append(chunk)
    return b"".join(chunks)


def parse_body(model: type[BaseModel], raw: bytes) -> Any:
    try:
        return model.model_validate_json(raw)
    except ValidationError as exc:
        raise BodyInvalid(_framework_errors(exc)) from exc


async def read_json(request: Request) -> Any:
    raw = await read_body(request)
    try:
        return json.loads(raw) if raw else None
    except ValueError as exc:
        raise BodyInvalid([{"type": "json_invalid", "loc": ["body"], "msg": f"JSON decode error: {exc}"}]) from exc


class _AdminBody(BaseModel):
    model_config = ConfigDict(extra="forbid")


class KillBody(_AdminBody):
    server_name: ServerName


class ClockBody(_AdminBody):
    advance: float = Field(allow_inf_nan=False)


class ReleaseBody(_AdminBody):
    stream_seconds: float = Field(0.0, ge=0, allow_inf_nan=False)


class NativeSessionBody(_AdminBody):
    rollout_id: RolloutId
    attempt: int = Field(ge=0)


_FAULTS = TypeAdapter(FaultSpec | list[FaultSpec])


def create_app(instance: Instance, *, on_ready: Callable[[Instance], None] | None = None):
    config = instance.config
    expected_auth = f"Bearer {config.token}".encode("latin-1", "replace")

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        await instance.start()
        if on_ready is not None:
            on_ready(instance)
        try:
            yield
        finally:
            await instance.stop()

    app = FastAPI(title=f"gymsim {config.instance_id}", lifespan=lifespan, docs_url=None, redoc_url=None)

    def authorize(request: Request) -> None:
        header = request.headers.get("authorization")
        # Constant-time comparison of the whole header (docs/gym-protocol.md#transport).
        if header is None or not hmac.compare_digest(header.encode("latin-1", "replace"), expected_auth):
            raise ProtocolError("unauthorized", "missing or wrong bearer token")

    def participant(server: str) -> Participant:
        found = instance.participants.get(server)
        if found is None:
            # Unknown servers and non-participants (checkpointing off) have no control routes.
            raise NotFound()
        return found

    def of_kind(server: str, cls: type) -> Any:
        found = instance.participants.get(server)
        if not isinstance(found, cls):
            raise NotFound()
        return found

    # ------------------------------------------------------------------ errors

    def server_of(request: Request) -> str | None:
        """The server a request was for (None for admin routes): its profile shapes the reply."""
        match = _SERVER_PATH.match(request.url.path)
        return match.group(1) if match else None

    @app.exception_handler(ProtocolError)
    async def _protocol_error(request: Request, exc: ProtocolError):
        spelling = instance.config.spelling_for(server_of(request))
        return JSONResponse(exc.envelope(spelling), status_code=exc.status)

    @app.exception_handler(BodyInvalid)
    async def _body_invalid(request: Request, exc: BodyInvalid):
        return JSONResponse({"detail": exc.errors}, status_code=422)

    @app.exception_handler(ValidationError)
    async def _validation(request: Request, exc: ValidationError):
        return JSONResponse({"detail": _framework_errors(exc)}, status_code=422)

    @app.exception_handler(NotFound)
    async def _not_found(request: Request, exc: NotFound):
        return JSONResponse({"detail": "Not Found"}, status_code=404)

    @app.exception_handler(DropConnection)
    async def _drop(request: Request, exc: DropConnection):
        connection: Connection = request.scope["gymsim.connection"]
        await connection.drop()
        return Response(status_code=500)  # never sent: the connection is gone

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception):
        server = server_of(request)
        if instance.config.profile_of(server) in PUBLISHED_PROFILES:
            # Published Gym has no handler for these: the framework's own plain 500, no envelope.
            return PlainTextResponse("Internal Server Error", status_code=500)
        error = ProtocolError("checkpoint_error", f"unexpected participant fault: {exc!r}", status=500)
        return JSONResponse(error.envelope(instance.config.spelling_for(server)), status_code=500)

    # ------------------------------------------------------------------ control protocol

    @app.get("/s/{server}/ng-control/v1/checkpoint/status")
    async def status(server: str, request: Request):
        target = participant(server)
        authorize(request)
        return target.status()

    @app.post("/s/{server}/ng-control/v1/checkpoint/{op}")
    async def control(server: str, op: str, request: Request):
        target = participant(server)
        if op not in BODY_MODELS:
            raise NotFound()
        authorize(request)  # before the body is even read: a bad token changes nothing
        body = parse_body(target.body_model(op), await read_body(request))
        return await getattr(target, op)(body)

    # ------------------------------------------------------------------ data plane

    @app.post("/s/{server}/run")
    async def run(server: str, request: Request):
        agent: AgentParticipant = of_kind(server, AgentParticipant)
        return await agent.run(await read_json(request))

    @app.post("/s/{server}/ng-rollout/{key}/v1/chat/completions")
    async def policy_call(server: str, key: str, request: Request):
        body = await read_json(request)
        if server in instance.non_participants:
            return _judge(server, key, body)
        model: ModelParticipant = of_kind(server, ModelParticipant)
        return await model.chat(key, body if isinstance(body, dict) else {})

    @app.post("/s/{server}/v1/chat/completions")
    async def plain_call(server: str, request: Request):
        body = await read_json(request)
        if server in instance.non_participants:
            return _judge(server, "judge", body)
        of_kind(server, ModelParticipant)
        raise ProtocolError("rollout_id_required", "a policy call must carry /ng-rollout/<capture key>")

    def _judge(server: str, key: str, body: Any) -> dict[str, Any]:
        # A judge is no participant: it never parks and records nothing.
        messages = body.get("messages") if isinstance(body, dict) else None
        if not is_valid_capture_key(key):
            raise ProtocolError("invalid_capture_key", f"{key!r} is not a capture key", status=400)
        return completion(server, key, 0, "", messages)

    @app.post("/s/{server}/sessions/{sid}/mutate")
    async def mutate(server: str, sid: str, request: Request):
        resources: ResourcesParticipant = of_kind(server, ResourcesParticipant)
        body = parse_body(MutateBody, (await read_body(request)) or b"{}")
        return await resources.mutate(sid, body)

    @app.get("/s/{server}/sessions/{sid}")
    async def read_session(server: str, sid: str):
        resources: ResourcesParticipant = of_kind(server, ResourcesParticipant)
        return await resources.read(sid)

    # ------------------------------------------------------------------ admin (bearer token, no /s/ prefix)

    @app.get("/admin/state")
    async def admin_state(request: Request):
        authorize(request)
        return instance.admin_state()

    @app.get("/admin/resources/{server}/sessions")
    async def admin_sessions(server: str, request: Request):
        authorize(request)
        resources: ResourcesParticipant = of_kind(server, ResourcesParticipant)
        return {"server_name": server, "sessions": resources.session_dump()}

    @app.get("/admin/faults")
    async def admin_faults(request: Request):
        authorize(request)
        return {"faults": instance.faults.describe()}

    @app.post("/admin/faults")
    async def admin_add_faults(request: Request):
        authorize(request)
        payload = await read_json(request)
        if isinstance(payload, dict) and set(payload) == {"faults"}:
            payload = payload["faults"]
        parsed = _FAULTS.validate_python(payload)
        specs = parsed if isinstance(parsed, list) else [parsed]
        unknown = sorted({s.server_name for s in specs} - {s.server_name for s in instance.config.servers})
        if unknown:
            raise ProtocolError("unknown_server", f"faults name unknown servers {unknown}", status=404)
        instance.faults.add(specs)
        return {"faults": instance.faults.describe()}

    @app.delete("/admin/faults")
    async def admin_clear_faults(request: Request):
        authorize(request)
        instance.faults.clear()
        return {"faults": []}

    @app.post("/admin/kill")
    async def admin_kill(request: Request):
        authorize(request)
        body = parse_body(KillBody, await read_body(request))
        participant(body.server_name)
        instance.kill_server(body.server_name)
        return {"killed": body.server_name}

    @app.post("/admin/reset")
    async def admin_reset(request: Request):
        authorize(request)
        instance.reset()
        return {"reset": instance.config.instance_id}

    @app.post("/admin/clock")
    async def admin_clock(request: Request):
        authorize(request)
        body = parse_body(ClockBody, await read_body(request))
        instance.advance_clock(body.advance)
        return {"offset": instance.clock.offset, "now": instance.clock.now()}

    @app.post("/admin/servers/{server}/knobs")
    async def admin_knobs(server: str, request: Request):
        authorize(request)
        if server not in instance.participants and server not in instance.non_participants:
            raise NotFound()
        changes = await read_json(request)
        if not isinstance(changes, dict):
            raise BodyInvalid([{"type": "dict_type", "loc": ["body"], "msg": "Input should be an object"}])
        updated = instance.set_knobs(server, changes)
        return updated.model_dump()

    @app.post("/admin/model/{server}/release_held")
    async def admin_release(server: str, request: Request):
        authorize(request)
        model: ModelParticipant = of_kind(server, ModelParticipant)
        body = parse_body(ReleaseBody, (await read_body(request)) or b"{}")
        return {"released": model.release_held(body.stream_seconds)}

    @app.post("/admin/agent/{server}/native_sessions")
    async def admin_native(server: str, request: Request):
        authorize(request)
        agent: AgentParticipant = of_kind(server, AgentParticipant)
        body = parse_body(NativeSessionBody, await read_body(request))
        agent.add_native_session((body.rollout_id, body.attempt))
        return {"native": sorted(agent.admin_extras()["native"])}

    return FaultMiddleware(app, instance)
