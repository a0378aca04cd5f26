"""Kind-specific participants: the policy model, the agent and the resources server.

Each one is a data plane good enough for real multi-turn rollouts plus the hooks the phase machine
needs (readiness, restarts, export, install, stopping retired work).
"""

from __future__ import annotations

import asyncio
import hashlib
import json
from dataclasses import dataclass, field
from typing import Annotated, Any

import httpx
from pydantic import BaseModel, ConfigDict, Field, StrictInt

from .mail import Mailer
from .participant import DropConnection, Pair, Participant, Predicate
from .wire import ProtocolError, RolloutId, capture_key, is_valid_capture_key, normalize_code, parse_capture_key


def digest_of(value: Any) -> str:
    return hashlib.sha256(json.dumps(value, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def _check_key(key: str) -> Pair:
    if not is_valid_capture_key(key):
        raise ProtocolError("invalid_capture_key", f"{key!r} is not a capture key", status=400)
    return parse_capture_key(key)


# ============================================================================ model


@dataclass
class Call:
    key: str
    rollout_id: str
    attempt: int
    turn: int | None
    state: str = "computing"  # computing -> held -> streaming
    released: bool = False
    release_stream_seconds: float = 0.0
    cancelled: bool = False
    finished: bool = False


def completion(server_name: str, key: str, turn: int, staging_key: str, messages: Any) -> dict[str, Any]:
    digest = digest_of({"key": key, "turn": turn, "messages": messages})
    return {
        "id": f"chatcmpl-{digest[:16]}",
        "object": "chat.completion",
        "model": server_name,
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": f"[{key} turn {turn}] {digest[:12]}"},
                "finish_reason": "stop",
            }
        ],
        "usage": {"prompt_tokens": 8, "completion_tokens": 8, "total_tokens": 16},
        "staging_key": staging_key,
        "turn": turn,
    }


class ModelParticipant(Participant):
    """The policy model: one staging key `tq/<capture key>/<turn>` per delivered completion."""

    PUBLISHED_REPORTS_MODE = False

    def __init__(self, instance, config) -> None:
        super().__init__(instance, config)
        self.ledgers: dict[str, list[str]] = {}
        self.calls: dict[int, Call] = {}
        self._next_call = 0
        self.waiting = 0

    @property
    def worker_label(self) -> str:
        return "policy" if self.published else "model"

    async def chat(self, key: str, body: Any) -> dict[str, Any]:
        rollout_id, attempt = _check_key(key)
        if self.published:
            await self._wait_for_admission(rollout_id, attempt)
        self.admit(rollout_id, attempt)
        self.served = True
        restored = self.claim((rollout_id, attempt))
        if restored is not None:
            # Keys carried over from attempt N belong to N+1 as well (docs/gym-protocol.md#commit).
            self.ledgers[key] = list(restored.get("staging_keys", []))
        turn = body.get("turn") if isinstance(body, dict) else None
        call = Call(key, rollout_id, attempt, turn if type(turn) is int and turn >= 0 else None)
        call_id = self._next_call
        self._next_call += 1
        self.calls[call_id] = call
        self.notifier.notify()
        try:
            await self._pause(call, self.knobs.model_latency_seconds)
            if self.knobs.hold_responses and not self.admission_open and not call.released:
                # Ready while parked: held until resume; a held response does not block readiness.
                call.state = "held"
                self.notifier.notify()
                await self.clock.wait_for(
                    lambda: self.admission_open or call.released or call.cancelled or self.killed
                )
            self._raise_if_cancelled(call)
            ledger = self.ledgers.setdefault(key, [])
            own = f"tq/{key}/"
            number = call.turn if call.turn is not None else sum(1 for k in ledger if k.startswith(own))
            staging_key = f"{own}{number}"
            if staging_key not in ledger:
                ledger.append(staging_key)
            call.state = "streaming"
            self.notifier.notify()
            await self._pause(call, call.release_stream_seconds if call.released else self.knobs.stream_seconds)
            messages = body.get("messages") if isinstance(body, dict) else None
            return completion(self.server_name, key, number, staging_key, messages)
        finally:
            call.finished = True
            self.calls.pop(call_id, None)
            self.notifier.notify()

    async def _wait_for_admission(self, rollout_id: str, attempt: int) -> None:
        """Published Gym (model.py b58bb4f): a new call waits for resume instead of being refused.

        A waiting call is not admitted, so it blocks no readiness; a retire of its attempt wakes it,
        and admission then refuses it as stale."""
        self.check_lease()
        if self.admission_open:
            return
        self.waiting += 1
        try:
            await self.clock.wait_for(lambda: self.admission_open or self.killed or self.is_marked(rollout_id, attempt))
        finally:
            self.waiting -= 1
        self.ensure_alive()

    async def _pause(self, call: Call, seconds: float) -> None:
        if seconds:
            await self.clock.wait_for(lambda: call.cancelled or self.killed, self.clock.now() + seconds)
        self._raise_if_cancelled(call)

    def _raise_if_cancelled(self, call: Call) -> None:
        self.ensure_alive()
        if call.cancelled:
            raise ProtocolError("stale_attempt", f"{call.key} was retired while its call ran")

    def release_held(self, stream_seconds: float) -> int:
        """Deliver held responses now, as a faulty Gym would: readiness regresses while they stream."""
        held = [c for c in self.calls.values() if c.state == "held"]
        for call in held:
            call.released = True
            call.release_stream_seconds = stream_seconds
        self.notifier.notify()
        return len(held)

    def blockers(self) -> list[str]:
        return [c.key for c in self.calls.values() if c.state == "streaming"]

    def counts(self) -> dict[str, int]:
        states = [c.state for c in self.calls.values()]
        return {
            "episodes": len(self.ledgers),
            "computing": states.count("computing"),
            "held": states.count("held"),
            "streaming": states.count("streaming"),
            "unclaimed": len(self.unclaimed),
        }

    def live_keys(self) -> list[str]:
        return [*self.ledgers, *(c.key for c in self.calls.values()), *super().live_keys()]

    def has_live_state(self) -> bool:
        return self.served or bool(self.ledgers) or bool(self.calls)

    def capture_state(self) -> dict[Pair, dict[str, Any]]:
        state = {parse_capture_key(k): {"staging_keys": list(v)} for k, v in self.ledgers.items()}
        state.update(super().capture_state())
        return state

    def commit_extras(self, exported: dict[Pair, dict[str, Any]]) -> dict[str, Any]:
        by_episode = {capture_key(*p): sorted(s.get("staging_keys", [])) for p, s in exported.items()}
        extras: dict[str, Any] = {"staging_keys": sorted({k for keys in by_episode.values() for k in keys})}
        if self.knobs.staging_map:  # the older published model (1a003fe) sends the union only
            extras["staging_keys_by_episode"] = dict(sorted(by_episode.items()))
        return extras

    def validate_record(self, record: dict[str, Any]) -> None:
        keys = record["state"].get("staging_keys", [])
        if not isinstance(keys, list) or not all(isinstance(k, str) for k in keys):
            raise ValueError("staging_keys must be a list of strings")

    def install_state(self, state: dict[str, Any]) -> dict[str, Any]:
        return {"staging_keys": list(state.get("staging_keys", []))}

    def stop_work(self, pairs: list[Pair]) -> Predicate:
        stopping = [c for c in self.calls.values() if any(c.rollout_id == r and c.attempt <= n for r, n in pairs)]
        for call in stopping:
            call.cancelled = True
        return lambda: all(c.finished for c in stopping)

    def free_state(self, pairs: list[Pair]) -> None:
        super().free_state(pairs)
        for key in list(self.ledgers):
            rollout_id, attempt = parse_capture_key(key)
            if any(rollout_id == r and attempt <= n for r, n in pairs):
                del self.ledgers[key]

    def tracked_attempts(self, rollout_id: str) -> list[int]:
        return [c.attempt for c in self.calls.values() if c.rollout_id == rollout_id]

    def admin_extras(self) -> dict[str, Any]:
        return {
            "served": self.served,
            "waiting": self.waiting,
            "staging_keys_by_episode": {k: list(v) for k, v in sorted(self.ledgers.items())},
            "calls": [{"key": c.key, "state": c.state} for c in self.calls.values()],
        }


# ============================================================================ resources


class MutateBody(BaseModel):
    model_config = ConfigDict(extra="forbid")
    turn: Annotated[StrictInt, Field(ge=0)] | None = None
    entry: Any = None
    # Time the request spends in flight (it blocks readiness meanwhile).
    work_seconds: Annotated[float, Field(ge=0, le=3600, allow_inf_nan=False)] = 0.0


@dataclass
class Session:
    counter: int = 0
    history: list[dict[str, Any]] = field(default_factory=list)
    mails: int = 0  # mails this episode sent: the next one's seq, checkpointed with the session


class ResourcesParticipant(Participant):
    """Per-session tool state. Requests during a checkpoint wait for resume; they are never refused."""

    PUBLISHED_EXPORTS_LIVE_OUTSIDE_SCOPE = True
    PUBLISHED_RESTART_ONLY_STAYS_OPEN = True

    def __init__(self, instance, config) -> None:
        super().__init__(instance, config)
        self.sessions: dict[str, Session] = {}
        self.in_flight: dict[str, int] = {}
        self.waiting = 0
        self.retired_sessions: set[str] = set()
        self.stopping: set[str] = set()
        self.mailer = Mailer(config.mail) if config.mail is not None else None

    def shutdown(self) -> None:
        super().shutdown()
        if self.mailer is not None:
            self.mailer.close_soon()

    def configured_mode(self, configured: str | None) -> str | None:
        # Published Gym's resources always have a mode, and restart_only is the one it falls back to.
        if configured is None and self.published:
            return "restart_only"
        return configured

    def _refused(self, sid: str, rollout_id: str, attempt: int) -> bool:
        if self.broken("ignore_stale_attempt"):
            return False
        return sid in self.retired_sessions or self.is_marked(rollout_id, attempt)

    def _raise_if_refused(self, sid: str, rollout_id: str, attempt: int) -> None:
        if self._refused(sid, rollout_id, attempt):
            raise ProtocolError("stale_attempt", f"session {sid} was retired")

    async def _enter(self, sid: str) -> Pair:
        rollout_id, attempt = _check_key(sid)
        self.check_lease()
        self._raise_if_refused(sid, rollout_id, attempt)
        if not self.admission_open:
            self.waiting += 1
            try:
                await self.clock.wait_for(
                    lambda: self.admission_open or self.killed or self._refused(sid, rollout_id, attempt)
                )
            finally:
                self.waiting -= 1
            self.ensure_alive()
            self._raise_if_refused(sid, rollout_id, attempt)
        self.in_flight[sid] = self.in_flight.get(sid, 0) + 1
        self.served = True
        self.notifier.notify()
        return rollout_id, attempt

    def _leave(self, sid: str) -> None:
        left = self.in_flight.get(sid, 1) - 1
        if left:
            self.in_flight[sid] = left
        else:
            self.in_flight.pop(sid, None)
        self.notifier.notify()

    def _session(self, sid: str, pair: Pair) -> Session:
        session = self.sessions.get(sid)
        if session is None:
            restored = self.claim(pair)
            session = Session()
            if restored is not None:
                session = Session(restored.get("counter", 0), list(restored.get("history", [])), restored.get("mails", 0))
            self.sessions[sid] = session
        return session

    async def mutate(self, sid: str, body: MutateBody) -> dict[str, Any]:
        rollout_id, attempt = await self._enter(sid)
        try:
            if body.work_seconds:
                await self.clock.wait_for(lambda: self.killed, self.clock.now() + body.work_seconds)
            self.ensure_alive()
            self._raise_if_refused(sid, rollout_id, attempt)
            session = self._session(sid, (rollout_id, attempt))
            mail = await self._mail(session, rollout_id, attempt)
            session.counter += 1
            session.history.append({"rollout_id": rollout_id, "attempt": attempt, "turn": body.turn, "entry": body.entry})
            reply = {"session_id": sid, "counter": session.counter, "history_len": len(session.history)}
            return reply if mail is None else {**reply, "mail": mail}
        finally:
            self._leave(sid)

    async def _mail(self, session: Session, rollout_id: str, attempt: int) -> dict[str, Any] | None:
        """The mail tool (gymsim/mail.py): sent before the mutation is applied, so a refused or
        failed send leaves the session as it was."""
        if self.mailer is None or not self.mailer.wants(attempt, len(session.history)):
            return None
        mail = await self.mailer.send(rollout_id, attempt, session.mails, len(session.history))
        self.ensure_alive()
        session.mails += 1
        return mail

    async def read(self, sid: str) -> dict[str, Any]:
        rollout_id, attempt = await self._enter(sid)
        try:
            session = self._session(sid, (rollout_id, attempt))
            return {"session_id": sid, "counter": session.counter, "history": list(session.history)}
        finally:
            self._leave(sid)

    def blockers(self) -> list[str]:
        if self.mode == "restart_only":
            return []  # it captures nothing, so nothing can make it unready
        return [*self.in_flight, *self.stopping]

    def counts(self) -> dict[str, int]:
        return {
            "sessions": len(self.sessions),
            "in_flight": sum(self.in_flight.values()),
            "waiting": self.waiting,
            "unclaimed": len(self.unclaimed),
        }

    def live_keys(self) -> list[str]:
        return [*self.sessions, *self.in_flight, *super().live_keys()]

    def has_live_state(self) -> bool:
        return bool(self.sessions) or bool(self.in_flight)

    def capture_state(self) -> dict[Pair, dict[str, Any]]:
        state = {
            parse_capture_key(sid): {"counter": s.counter, "history": [dict(h) for h in s.history], "mails": s.mails}
            for sid, s in self.sessions.items()
        }
        state.update(super().capture_state())
        return state

    def validate_record(self, record: dict[str, Any]) -> None:
        state = record["state"]
        if state and (type(state.get("counter")) is not int or not isinstance(state.get("history"), list)):
            raise ValueError("a resources record needs counter and history")
        if state and type(state.get("mails", 0)) is not int:
            raise ValueError("a resources record's mails is a count")

    def stop_work(self, pairs: list[Pair]) -> Predicate:
        sids = {capture_key(r, n) for r, n in pairs}
        for sid in [*self.sessions, *self.in_flight]:
            rollout_id, attempt = parse_capture_key(sid)
            if any(rollout_id == r and attempt <= n for r, n in pairs):
                sids.add(sid)
        self.retired_sessions |= sids
        live = {sid for sid in sids if sid in self.sessions or sid in self.in_flight}
        self.stopping |= live
        return lambda: not any(sid in self.in_flight for sid in live)

    def free_state(self, pairs: list[Pair]) -> None:
        super().free_state(pairs)
        for sid in list(self.sessions) + list(self.stopping):
            rollout_id, attempt = parse_capture_key(sid)
            if any(rollout_id == r and attempt <= n for r, n in pairs) and sid not in self.in_flight:
                self.sessions.pop(sid, None)
                self.stopping.discard(sid)

    def tracked_attempts(self, rollout_id: str) -> list[int]:
        return [a for r, a in map(parse_capture_key, [*self.in_flight, *self.stopping]) if r == rollout_id]

    def on_forget(self, rollout_id: str) -> None:
        self.retired_sessions = {s for s in self.retired_sessions if parse_capture_key(s)[0] != rollout_id}

    def status_extras(self) -> dict[str, Any]:
        return {"retired_sessions": len(self.retired_sessions)}

    def admin_extras(self) -> dict[str, Any]:
        extras = {"sessions": len(self.sessions), "retired_sessions": sorted(self.retired_sessions)}
        return extras if self.mailer is None else {**extras, "mail": dict(self.mailer.stats)}

    def session_dump(self) -> dict[str, Any]:
        return {
            sid: {"counter": s.counter, "history": [dict(h) for h in s.history], "mails": s.mails}
            for sid, s in sorted(self.sessions.items())
        }


# ============================================================================ agent


class RunBody(BaseModel):
    model_config = ConfigDict(extra="forbid", populate_by_name=False)
    rollout_id: RolloutId = Field(alias="_ng_rollout_id")
    attempt: Annotated[StrictInt, Field(ge=0)] = Field(0, alias="_ng_attempt_index")
    task: Any = None
    turns: Annotated[StrictInt, Field(ge=0, le=10_000)] | None = None


@dataclass
class Episode:
    rollout_id: str
    attempt: int
    task: Any
    task_digest: str
    turns: int
    turn: int = 0  # completed turns
    counter: int = 0  # the resources session counter after the last mutation
    staging_keys: list[str] = field(default_factory=list)
    resumed_from_turn: int | None = None
    # When this /run began, and (a continuation) what its saved state embodied: the seconds from
    # the saved attempt's start to the commit that captured it, and that commit's time. Reported
    # in the reply so tests can price a restore against gymsim's own clock.
    started_at: float = 0.0
    resumed_saved: dict[str, float] | None = None
    state: str = "boundary"  # boundary -> calling -> working -> ... -> wire
    runner: asyncio.Task | None = None
    cancel_requested: bool = False

    @property
    def key(self) -> str:
        return capture_key(self.rollout_id, self.attempt)

    @property
    def pair(self) -> Pair:
        return (self.rollout_id, self.attempt)


AT_BOUNDARY = ("boundary", "calling")


class AgentParticipant(Participant):
    """Legacy /run sessions: the agent's own /run drives a whole multi-turn episode."""

    PUBLISHED_REPORTS_MODE = False
    PUBLISHED_EXPORTS_LIVE_OUTSIDE_SCOPE = True
    PUBLISHED_RESTART_ONLY_STAYS_OPEN = True

    def __init__(self, instance, config) -> None:
        super().__init__(instance, config)
        self.episodes: dict[str, Episode] = {}
        self.native: set[Pair] = set()

    # ---------------------------------------------------------------- data plane

    async def run(self, payload: Any) -> dict[str, Any]:
        if isinstance(payload, dict) and payload.get("_ng_rollout_id") in (None, ""):
            raise ProtocolError("rollout_id_required", "a /run row must carry _ng_rollout_id")
        body = RunBody.model_validate(payload)
        self.admit(body.rollout_id, body.attempt)
        pair = (body.rollout_id, body.attempt)
        key = capture_key(*pair)
        if key in self.episodes:
            raise ProtocolError("episode_running", f"{key} is already running here", status=409)
        digest = digest_of(body.task)
        restored = self.unclaimed.get(pair)
        if restored is not None and restored.get("task_digest", digest) != digest:
            raise ProtocolError("task_mismatch", f"{key} continues a restored episode with a different task", status=409)
        self.claim(pair)
        episode = Episode(
            rollout_id=body.rollout_id,
            attempt=body.attempt,
            task=body.task,
            task_digest=digest,
            turns=body.turns if body.turns is not None else self.instance.config.default_turns,
            started_at=self.clock.now(),
        )
        if restored:
            if "captured_at" in restored and "attempt_started_at" in restored:
                episode.resumed_saved = {
                    "seconds": round(restored["captured_at"] - restored["attempt_started_at"], 6),
                    "at": restored["captured_at"],
                }
            episode.turns = restored["turns"]
            episode.turn = episode.resumed_from_turn = restored["turn"]
            episode.counter = restored.get("counter", 0)
            episode.staging_keys = list(restored.get("staging_keys", []))
        self.served = True
        self.episodes[key] = episode
        episode.runner = self.spawn(self._play(episode))
        await asyncio.wait({episode.runner})
        if episode.runner.cancelled():
            if self.killed:
                raise DropConnection()
            raise ProtocolError("stale_attempt", f"{key} was retired while it ran")
        error = episode.runner.exception()
        if error is not None:
            raise error
        return episode.runner.result()

    async def _play(self, episode: Episode) -> dict[str, Any]:
        config = self.instance.config
        try:
            for turn in range(episode.turn, episode.turns):
                # A boundary: the episode parks here while a checkpoint is open.
                episode.state = "boundary"
                self.notifier.notify()
                await self.clock.wait_for(lambda: self.admission_open)
                episode.state = "calling"  # waiting on the policy model still counts as the boundary
                await self._call_model(episode, turn)
                episode.state = "working"
                self.notifier.notify()
                await self.clock.sleep(config.turn_seconds)
                episode.counter = await self._mutate(episode, turn)
                episode.turn = turn + 1
            episode.state = "wire"
            self.notifier.notify()
            delay = self.instance.faults.take(self.server_name, "run_reply")
            if delay is not None and delay.type == "delay":
                await self.clock.sleep(delay.seconds or 0.0)
            return {
                "rollout_id": episode.rollout_id,
                "attempt": episode.attempt,
                "capture_key": episode.key,
                "turns_completed": episode.turn,
                "reward": round(episode.counter / episode.turns, 6) if episode.turns else 0.0,
                "staging_keys": list(episode.staging_keys),
                "resumed_from_turn": episode.resumed_from_turn,
                "started_at": episode.started_at,
                "resumed_saved": episode.resumed_saved,
            }
        except asyncio.CancelledError:
            if episode.cancel_requested and self.knobs.stop_seconds and not self.killed:
                await self.clock.sleep(self.knobs.stop_seconds)  # cleanup of a retired episode
            raise
        finally:
            if self.episodes.get(episode.key) is episode:
                del self.episodes[episode.key]
            self.notifier.notify()

    def _peer(self, kind: str, chosen: str | None) -> str | None:
        name = chosen or self.instance.first_server_of_kind(kind)
        return self.instance.server_url(name) if name else None

    async def _call_model(self, episode: Episode, turn: int) -> None:
        base = self._peer("model", self.config.model_server)
        if base is None:
            return
        url = f"{base}/ng-rollout/{episode.key}/v1/chat/completions"
        body = {
            "model": "policy",
            "messages": [{"role": "user", "content": json.dumps({"task": episode.task, "turn": turn})}],
            "turn": turn,
        }
        while True:
            response = await self._post(url, body)
            if response.status_code == 200:
                episode.staging_keys.append(response.json()["staging_key"])
                return
            code = _error_code(response)
            if response.status_code == 409 and code == "admission_closed":
                # The model closed first (stage order): wait at the boundary and send the same call again.
                await self.clock.sleep(0.05)
                continue
            raise _upstream_failure("policy model", response, code)

    async def _mutate(self, episode: Episode, turn: int) -> int:
        base = self._peer("resources", self.config.resources_server)
        if base is None:
            return episode.counter + 1
        body = {"turn": turn, "entry": {"calendar_entry": f"{episode.rollout_id}/turn-{turn}"}}
        response = await self._post(f"{base}/sessions/{episode.key}/mutate", body)
        if response.status_code == 200:
            return response.json()["counter"]
        raise _upstream_failure("resources", response, _error_code(response))

    async def _post(self, url: str, body: dict[str, Any]) -> httpx.Response:
        try:
            return await self.instance.http.post(url, json=body)
        except httpx.TransportError as exc:
            raise ProtocolError("upstream_unreachable", f"{url}: {exc!r}", status=502) from exc

    # ---------------------------------------------------------------- participant hooks

    def add_native_session(self, pair: Pair) -> None:
        """A session driven by an environment, not by /run: exported but not in run_episode_ids."""
        self.native.add(pair)
        self.notifier.notify()

    def check_binding(self, rollout_id: str, attempt: int) -> None:
        """Published Gym keys /run sessions by rollout id: while one attempt of a rollout is live or
        restored and unclaimed, any other attempt of it is stale (N10; after a restore this is what
        refuses attempt N, since no mark is raised)."""
        if not self.published:
            return
        bound = {e.attempt for e in self.episodes.values() if e.rollout_id == rollout_id}
        bound |= {a for r, a in self.unclaimed if r == rollout_id}
        if bound - {attempt}:
            raise ProtocolError(
                "stale_attempt", f"{rollout_id} is bound to attempt {min(bound - {attempt})} here, not {attempt}"
            )

    def blockers(self) -> list[str]:
        if self.stays_open:
            return []  # it never parks, so nothing it runs can hold up a checkpoint
        return [
            e.key
            for e in self.episodes.values()
            if e.state == "working" or (e.cancel_requested and not (e.runner and e.runner.done()))
        ]

    def counts(self) -> dict[str, int]:
        states = [e.state for e in self.episodes.values()]
        return {
            "at_boundary": states.count("boundary") + states.count("calling"),
            "working": states.count("working"),
            "on_wire": states.count("wire"),
            "unclaimed": len(self.unclaimed),
            "native": len(self.native),
        }

    def live_keys(self) -> list[str]:
        in_flight = [e.key for e in self.episodes.values() if e.state != "wire"]
        return [*in_flight, *(capture_key(*p) for p in self.native), *super().live_keys()]

    def has_live_state(self) -> bool:
        return bool(self.episodes) or bool(self.native)

    def capture_state(self) -> dict[Pair, dict[str, Any]]:
        state: dict[Pair, dict[str, Any]] = {}
        for e in self.episodes.values():
            # An episode whose reply is on the wire has ended: it is drained, never exported.
            if e.state in AT_BOUNDARY and not e.cancel_requested:
                state[e.pair] = {
                    "turn": e.turn,
                    "turns": e.turns,
                    "task": e.task,
                    "task_digest": e.task_digest,
                    "counter": e.counter,
                    "staging_keys": list(e.staging_keys),
                    "attempt_started_at": e.started_at,
                    "captured_at": self.clock.now(),
                }
        for pair in self.native:
            state[pair] = {"native": True}
        state.update(super().capture_state())
        return state

    def commit_extras(self, exported: dict[Pair, dict[str, Any]]) -> dict[str, Any]:
        if self.profile == "published":
            return {}  # published Gym's agent adds nothing to the commit reply (P1)
        # Strict agents export the scope only; pinned ones (P8) export every live session, so
        # their /run sessions are named whether the scope holds them or not.
        return {"run_episode_ids": sorted(capture_key(*p) for p in exported if p not in self.native)}

    def validate_record(self, record: dict[str, Any]) -> None:
        state = record["state"]
        if not state or state.get("native"):
            return
        turn, turns = state.get("turn"), state.get("turns")
        if type(turn) is not int or type(turns) is not int or not 0 <= turn <= turns:
            raise ValueError("an agent record needs 0 <= turn <= turns")
        if not isinstance(state.get("staging_keys", []), list):
            raise ValueError("staging_keys must be a list")

    def install_state(self, state: dict[str, Any]) -> dict[str, Any]:
        if not state or state.get("native"):
            # Stateless and native sessions carry nothing to continue from: the N+1 run starts over.
            return {"turn": 0, "turns": self.instance.config.default_turns}
        return dict(state)

    def stop_work(self, pairs: list[Pair]) -> Predicate:
        stopping = [e for e in self.episodes.values() if any(e.rollout_id == r and e.attempt <= n for r, n in pairs)]
        for episode in stopping:
            if not episode.cancel_requested:  # cancelled once; a repeated retire only waits
                episode.cancel_requested = True
                if episode.runner is not None:
                    episode.runner.cancel()
        self.native -= {p for p in self.native if any(p[0] == r and p[1] <= n for r, n in pairs)}
        return lambda: all(e.runner is None or e.runner.done() for e in stopping)

    def tracked_attempts(self, rollout_id: str) -> list[int]:
        return [e.attempt for e in self.episodes.values() if e.rollout_id == rollout_id]

    def status_extras(self) -> dict[str, Any]:
        return {"accepting": self.admission_open}

    def admin_extras(self) -> dict[str, Any]:
        return {
            "episodes": {
                e.key: {"state": e.state, "turn": e.turn, "turns": e.turns, "cancel_requested": e.cancel_requested}
                for e in self.episodes.values()
            },
            "native": sorted(capture_key(*p) for p in self.native),
        }


def _error_code(response: httpx.Response) -> str | None:
    try:
        code = response.json()["error"]["code"]
    except (ValueError, KeyError, TypeError):
        return None
    return normalize_code(code) if isinstance(code, str) else None


def _upstream_failure(what: str, response: httpx.Response, code: str | None) -> ProtocolError:
    if code == "stale_attempt":
        return ProtocolError("stale_attempt", f"the {what} refused this attempt as retired")
    return ProtocolError("upstream_error", f"the {what} answered {response.status_code} {code or ''}".strip(), status=502)


PARTICIPANT_CLASSES: dict[str, type[Participant]] = {
    "model": ModelParticipant,
    "agent": AgentParticipant,
    "resources": ResourcesParticipant,
}


def make_participant(instance, config) -> Participant:
    # environment and unknown kinds take part in the protocol with no data plane of their own.
    return PARTICIPANT_CLASSES.get(config.kind, Participant)(instance, config)
