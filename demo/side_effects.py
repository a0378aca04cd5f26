"""``--scenario side-effects``: a tool that acts outside Gym, across a crash and a restore, without
and with the coordinator's effect journal (the coordinator's docs/effects.md).

gymsim's resources servers have a mail tool: each turn of an episode appends a mail to a file that
no Gym checkpoint saves or restores (gymsim/README.md, "Mail tool"). Two agents share the Gym
instance: the calendar agent's mails are the same whatever the attempt, the drafting agent's name
the attempt that wrote them. The same crash is staged twice, in two runs: episodes run, a snapshot
saves them mid-way, they run (and mail) on past the cut, the Gym process is SIGKILLed, a fresh one
comes up, the restore continues every episode from its saved turn and the continuations run to the
end. Without the journal the turns after the cut mail again. With it (gymsim asks the journal
before each mail, with the run's token) a calendar mail goes out once; a drafting continuation
asks for another mail at the same place, which goes out, and the one it replaces is listed as an
orphan to compensate.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import secrets
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import httpx
from ckpt_client import AsyncCoordinatorClient, FailedRow, GroupSpec, SealedRow
from gymsim.mail import read_outbox
from gymsim.testing import default_instance_config, parse_capture_key, server_config

from .checks import Check, check_conserved, check_mails_once, check_mails_twice, check_orphans_replaced
from .processes import GymProcess

if TYPE_CHECKING:
    from .runner import Demo

__all__ = ["MAIL_INSTANCE", "run_side_effects"]

MAIL_INSTANCE = "mail/replica-0"
# Per group: its agent, that agent's resources server, and how its mails behave (gymsim's MailConfig
# variant): group 0 asks for the same mails again, group 1's name their attempt.
TOOLS = (
    ("workplace_agent", "calendar_resources", "same"),
    ("drafting_agent", "drafting_resources", "names_attempt"),
)
GROUPS, GENERATIONS, TURNS = len(TOOLS), 2, 10
SAVED_AFTER = 3  # turns every episode has done before the snapshot is requested
LOST_AFTER = 3  # turns every episode does after the snapshot before its Gym dies
CONTROL_TIMEOUT_S = 10.0


@dataclass
class _Pass:
    """One crash and restore, in a run of its own."""

    journal: bool
    run_id: str = ""
    token: str = ""
    rows: dict[str, Any] = field(default_factory=dict)  # rollout id -> the row sent last
    replies: dict[str, dict[str, Any]] = field(default_factory=dict)  # rollout id -> its final reply
    failures: list[str] = field(default_factory=list)
    tasks: set[asyncio.Task[None]] = field(default_factory=set)
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)  # the data-plane barrier

    @property
    def label(self) -> str:
        return "with the journal" if self.journal else "without the journal"

    @property
    def slug(self) -> str:
        return "journal" if self.journal else "no-journal"


async def run_side_effects(demo: Demo) -> dict[str, Any]:
    """The whole scenario: the coordinator up, the crash without the journal, then with it; the
    summary the report prints and the checks that decide the exit status."""
    await demo._setup(())
    passes = []
    for journal in (False, True):
        p = _Pass(journal)
        passes.append(await _crash_and_restore(demo, p))
    demo.phase = "verify"
    without, with_ = passes
    checks: list[Check] = [
        check_mails_twice(without["mails"]),
        check_mails_once(with_["mails"], with_["effects"], expected=TURNS),
        check_orphans_replaced(with_["mails"], with_["effects"]),
        *(_labelled(check_conserved(p["accounting"]["prompts"]), p["label"]) for p in passes),
    ]
    return {
        "ok": all(c.ok for c in checks),
        "wall_seconds": round(time.monotonic() - demo.started_at, 2),
        "run_id": with_["run_id"],
        "scenario": demo.opts.scenario,
        "options": {"gym_profile": demo.opts.gym_profile, "groups": GROUPS, "generations": GENERATIONS, "turns": TURNS,
                    "saved_after": SAVED_AFTER, "lost_after": LOST_AFTER, "tools": {f"g{g}": list(t) for g, t in enumerate(TOOLS)}},
        "side_effects": {"without_journal": without, "with_journal": with_},
        "checks": [c.to_json() for c in checks],
        "processes": demo.pids(),
        "workdir": str(demo.workdir) if demo.workdir else None,
    }


def _labelled(check: Check, label: str) -> Check:
    return Check(f"{check.name}, {label}", check.ok, check.detail)


async def _crash_and_restore(demo: Demo, p: _Pass) -> dict[str, Any]:
    assert demo.coordinator is not None and demo.workdir is not None
    demo.phase = f"run {p.slug}"
    p.run_id, p.token = await _create_run(demo, p)
    outbox = demo.workdir / f"mails-{p.slug}.jsonl"
    how = "asking the effect journal before each mail" if p.journal else "mailing unguarded"
    gym = await _start_gym(demo, _gym_config(demo, p, outbox), why=f"two agents, their resources servers {how}")
    async with AsyncCoordinatorClient(demo.coordinator.url, p.token, run_id=p.run_id) as c, httpx.AsyncClient(timeout=120, trust_env=False) as http:
        await demo._register(p.token, p.run_id, [gym])
        admitted = await c.admit_groups([_spec(p, g) for g in range(GROUPS)])
        await _send(c, http, p, gym, admitted.rows)
        saved = await _until_turns(gym, list(p.rows), SAVED_AFTER)
        snap = await c.snapshot(0, capture=lambda keys: _capture(demo, p, keys), barrier=p.lock, timeout=120)
        demo.progress.event(demo.phase, f"snapshot {snap.snapshot_id} published with every episode at turn {min(saved.values())} or later")
        done = await _turns(gym)
        await _until_turns(gym, list(p.rows), max(done.values()) + LOST_AFTER)

        demo.phase = f"crash {p.slug}"
        await asyncio.to_thread(gym.kill)
        demo.gyms.pop(MAIL_INSTANCE, None)
        demo.stopped_gyms.append(gym)
        await _wait(p)
        demo.progress.event(demo.phase, f"gymsim {MAIL_INSTANCE} (pid {gym.pid}) SIGKILLed mid-turn; {len(p.failures)} rollouts reported failed")

        demo.phase = f"restore {p.slug}"
        fresh = await _start_gym(demo, gym.config, why=f"fresh, the same {outbox.name} outside it")
        await demo._register(p.token, p.run_id, [fresh])
        res = await c.restore(snapshot_id=snap.snapshot_id, step=0)
        effects_at_restore = dict(res.raw.get("effects") or {})
        demo.progress.event(demo.phase, f"restore {res.restore_id}: " + ", ".join(f"{k} {v}" for k, v in sorted(res.counts.items()) if v))
        await _send(c, http, p, fresh, res.rows_to_send)
        await _wait(p)
        await c.finalize_groups([_group_id(p, g) for g in range(GROUPS)])
        servers = (await asyncio.to_thread(fresh.admin, "GET", "/state"))["servers"]
        mail_stats = {res: servers[res].get("mail", {}) for _, res, _ in TOOLS}
        accounting = await c.accounting()
        effects = await c.effects()
        orphans = await c.effects(orphaned=True)
    await asyncio.to_thread(fresh.stop)
    demo.gyms.pop(MAIL_INSTANCE, None)
    demo.stopped_gyms.append(fresh)
    mails = read_outbox(outbox)
    demo.progress.event(f"run {p.slug}", f"{len(mails)} mails in {outbox.name}; the journal holds {len(effects)} effects, {len(orphans)} orphaned")
    return _result(p, res, mails, effects, orphans, effects_at_restore, mail_stats, accounting.raw, outbox)


def _result(p: _Pass, res: Any, mails: list[dict[str, Any]], effects: list[Any], orphans: list[Any], at_restore: dict[str, Any],
            mail_stats: dict[str, Any], accounting: dict[str, Any], outbox: Any) -> dict[str, Any]:
    episodes = {rid: _episode_name(row) for rid, row in p.rows.items()}
    return {
        "label": p.label,
        "run_id": p.run_id,
        "outbox": str(outbox),
        "restore": {"restore_id": res.restore_id, "snapshot_id": res.snapshot_id, "counts": dict(res.counts), "effects": at_restore},
        "episodes": {
            episodes[rid]: _episode(rid, mails, p.replies.get(rid), orphans) for rid in sorted(p.rows, key=lambda r: episodes[r])
        },
        "mails": mails,
        "effects": [e.raw for e in effects],
        "orphans": sorted(({**o.raw, "episode": episodes.get(o.rollout_id, o.rollout_id)} for o in orphans), key=lambda x: (x["episode"], x["seq"])),
        "continuation_mail_tool": mail_stats,
        "failures": list(p.failures),
        "accounting": accounting,
    }


def _episode_name(row: Any) -> str:
    g = int(row.group_id.rsplit("-g", 1)[-1])
    return f"g{g}/{row.generation_index} {TOOLS[g][1].split('_')[0]}"


def _episode(rollout_id: str, mails: list[dict[str, Any]], reply: dict[str, Any] | None, orphans: list[Any]) -> dict[str, Any]:
    """What one episode mailed: places (seqs) mailed more than once, the same mail twice, and the
    places whose earlier mail the journal lists as an orphan."""
    own = [m for m in mails if m.get("rollout_id") == rollout_id]
    places = Counter(m["seq"] for m in own)
    same = Counter((m["seq"], m.get("body")) for m in own)
    return {
        "rollout_id": rollout_id,
        "saved_turn": (reply or {}).get("resumed_from_turn"),
        "turns_completed": (reply or {}).get("turns_completed"),
        "mails": len(own),
        "places": len(places),
        "sent_twice": sorted(s for (s, _), n in same.items() if n > 1),
        "mailed_twice": sorted(s for s, n in places.items() if n > 1),
        "orphaned": sorted(o.seq for o in orphans if o.rollout_id == rollout_id),
    }


# ------------------------------------------------------------------ the run and its Gym


def _group_id(p: _Pass, g: int) -> str:
    return f"{p.slug}-g{g}"


def _spec(p: _Pass, g: int) -> GroupSpec:
    digest = "sha256:" + hashlib.sha256(f"mail-task-{g}".encode()).hexdigest()
    return GroupSpec(_group_id(p, g), g, "calendar_planning", digest, GENERATIONS, task_source="calendar", agent_name=TOOLS[g][0])


async def _create_run(demo: Demo, p: _Pass) -> tuple[str, str]:
    assert demo.coordinator is not None and demo.workdir is not None
    run_id = f"demo-{time.strftime('%Y%m%d-%H%M%S')}-{secrets.token_hex(3)}-{p.slug}"
    recovery = {"target_level": "turn", "control_timeout_s": CONTROL_TIMEOUT_S, "prepare_timeout_s": 30, "drain_timeout_s": 30,
                "data_plane_timeout_s": 30}
    async with AsyncCoordinatorClient(demo.coordinator.url, demo.admin_token) as admin:
        run = await admin.create_run(run_id, str(demo.workdir / f"checkpoints-{p.slug}"), recovery)
    if not run.run_token:
        raise RuntimeError("the coordinator created the run but answered no run token")
    demo.run_id = run_id
    demo.progress.event(demo.phase, f"run {run_id} created ({p.label}): {GROUPS} groups x {GENERATIONS} episodes of {TURNS} turns")
    return run_id, run.run_token


def _gym_config(demo: Demo, p: _Pass, outbox: Any) -> dict[str, Any]:
    assert demo.coordinator is not None
    config = default_instance_config(
        MAIL_INSTANCE, token="gym-" + secrets.token_urlsafe(16), turn_seconds=demo.opts.turn_seconds,
        lease_grace_seconds=CONTROL_TIMEOUT_S, gym_profile=demo.opts.gym_profile,
    )
    # The run's token is the participant's credential for the journal (docs/effects.md#for-participants).
    journal = {"url": demo.coordinator.url, "run_id": p.run_id, "token": p.token} if p.journal else None
    agent, resources, _ = TOOLS[1]
    config["servers"] += [
        {"server_name": agent, "kind": "agent", "mode": "exported", "resources_server": resources},
        {"server_name": resources, "kind": "resources", "mode": "exported"},
    ]
    for _, res, variant in TOOLS:
        config = server_config(config, res, mail={"outbox": str(outbox), "to": "ops@example.com", "variant": variant, "journal": journal})
    return config


async def _start_gym(demo: Demo, config: dict[str, Any], *, why: str) -> GymProcess:
    assert demo.workdir is not None
    gym = GymProcess(config, demo.workdir, generation=demo._next_generation(MAIL_INSTANCE))
    demo.gyms[MAIL_INSTANCE] = gym  # kept even if it fails to start: cleanup stops it
    await asyncio.to_thread(gym.start)
    demo.progress.event(demo.phase, f"gymsim {MAIL_INSTANCE} on {gym.base_url} (pid {gym.pid}): {why}")
    return gym


async def _turns(gym: GymProcess) -> dict[str, int]:
    """Turns done per episode of the live Gym, by rollout id (its sessions are keyed by capture key)."""
    out: dict[str, int] = {}
    for _, res, _ in TOOLS:
        sessions = (await asyncio.to_thread(gym.admin, "GET", f"/resources/{res}/sessions"))["sessions"]
        for key, s in sessions.items():
            rid = parse_capture_key(key)[0]
            out[rid] = max(out.get(rid, 0), len(s.get("history", [])))
    return out


async def _until_turns(gym: GymProcess, rollout_ids: list[str], turns: int, timeout: float = 120.0) -> dict[str, int]:
    async with asyncio.timeout(timeout):
        while True:
            done = await _turns(gym)
            if all(done.get(r, 0) >= turns for r in rollout_ids):
                return done
            await asyncio.sleep(0.02)


def _capture(demo: Demo, p: _Pass, keys: list[str]) -> tuple[str, str]:
    """The data plane at the cut: the replies sealed so far (none: every episode is mid-way)."""
    assert demo.workdir is not None
    path = demo.workdir / f"dataplane-{p.slug}.json"
    data = json.dumps({"staging_keys": sorted(keys), "replies": p.replies}, sort_keys=True).encode()
    path.write_bytes(data)
    return str(path), "sha256:" + hashlib.sha256(data).hexdigest()


# ------------------------------------------------------------------ rows


async def _send(c: AsyncCoordinatorClient, http: httpx.AsyncClient, p: _Pass, gym: GymProcess, rows: list[Any]) -> None:
    sent = await c.dispatch_when_open([r.rollout_id for r in rows], instance_id=MAIL_INSTANCE)
    for row in sent.rows:
        p.rows[row.rollout_id] = row
        task = asyncio.create_task(_run_row(c, http, p, gym, row), name=f"row {row.rollout_id}")
        p.tasks.add(task)
        task.add_done_callback(p.tasks.discard)


async def _run_row(c: AsyncCoordinatorClient, http: httpx.AsyncClient, p: _Pass, gym: GymProcess, row: Any) -> None:
    task = {"group": row.group_id, "generation": row.generation_index}
    body = {"_ng_rollout_id": row.rollout_id, "_ng_attempt_index": row.gym_attempt, "task": task, "turns": TURNS}
    try:
        agent = TOOLS[int(row.group_id.rsplit("-g", 1)[-1])][0]
        resp = await http.post(f"{gym.servers[agent]}/run", json=body)
    except httpx.TransportError as e:
        # The Gym died under the call: reported, and the restore decides what happens to the row.
        p.failures.append(f"{row.rollout_id}: {type(e).__name__}")
        await c.report_failed([FailedRow(row.rollout_id, "transport", type(e).__name__)])
        return
    if resp.status_code != 200:
        p.failures.append(f"{row.rollout_id}: HTTP {resp.status_code} {resp.text[:200]}")
        await c.report_failed([FailedRow(row.rollout_id, "data", resp.text[:2000])])
        return
    reply = resp.json()
    async with p.lock:
        await c.report_sealed([SealedRow.from_gym_reply(row, reply)])
        p.replies[row.rollout_id] = reply


async def _wait(p: _Pass, timeout: float = 180.0) -> None:
    async with asyncio.timeout(timeout):
        while p.tasks:
            await asyncio.gather(*list(p.tasks))
