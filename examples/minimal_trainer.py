"""A minimal trainer on the checkpoint coordinator, against one gymsim instance.

Each step admits prompt groups, dispatches their rows, sends them to Gym's /run and seals what
comes back; it takes a snapshot while the rows are still in flight, trains on the step's groups,
checkpoints and announces the train step. Kill it at any point, even during its own recovery,
and start it again with the same --work-dir: it restores the newest snapshot and finishes, each
group trained once. docs/trainer.md walks through it.
"""

import argparse, hashlib, json, os, threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
from ckpt_client import (BatchRefused, Conflict, CoordinatorClient, FailedRow, GroupSpec, GymInstance, SealedRow,
                         SnapshotFailed)

p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
p.add_argument("--coordinator", default=os.environ.get("CKPTC_URL", "http://127.0.0.1:8080"))
p.add_argument("--admin-token", default=os.environ.get("CKPTC_ADMIN_TOKEN"), help="to create the run (first start)")
p.add_argument("--gym", default="http://127.0.0.1:8100", help="the gymsim instance's base URL")
p.add_argument("--gym-token", default="tok-gymsim", help="its checkpoint control token")
p.add_argument("--work-dir", type=Path, default=Path("trainer-work"), help="the trainer's files; it keeps the run's token")
p.add_argument("--run", default="example-run", help="the run id (a new run needs a new id and work dir)")
p.add_argument("--steps", type=int, default=3)
p.add_argument("--groups", type=int, default=4, help="prompt groups per step, 2 rollouts each")
p.add_argument("--turns", type=int, default=20, help="turns of each rollout")
a = p.parse_args()
INSTANCE, RUN, work = "math/replica-0", a.run, a.work_dir.resolve()
work.mkdir(parents=True, exist_ok=True)
meta_file = work / "run.json"  # the run's token (shown once) and a restore under way
meta = json.loads(meta_file.read_text()) if meta_file.exists() else {}
save_meta = lambda: meta_file.write_text(json.dumps(meta))  # noqa: E731
buffer: dict[str, float] = {}  # the data plane: rewards of sealed rows, by rollout id
lock = threading.Lock()  # held while the buffer changes; a snapshot's barrier takes it
pool, gym = ThreadPoolExecutor(64), httpx.Client(timeout=600)
groups_of = lambda step: [f"s{step}-g{k}" for k in range(a.groups)]  # noqa: E731


def checkpoint(step: int, trained: dict | None = None) -> dict:
    """The trainer checkpoint of a step (what it trained so far): written, or read back."""
    f = work / f"ckpt-{step}.json"
    if trained is not None:
        f.write_text(json.dumps(trained))
    return json.loads(f.read_text()) if f.exists() else {}


def capture(keys: list[str]) -> tuple[str, str]:
    """Save the data plane for a snapshot; the coordinator keeps (path, sha256)."""
    f = work / f"buffer-{len(list(work.glob('buffer-*')))}.json"
    f.write_text(json.dumps(buffer))
    return str(f), hashlib.sha256(f.read_bytes()).hexdigest()


def send(rows) -> None:
    """Dispatch rows (a continuation to the instance holding its state), then run each in Gym."""
    for inst in {r.instance_id or INSTANCE for r in rows}:
        ids = [r.rollout_id for r in rows if (r.instance_id or INSTANCE) == inst]
        for row in c.dispatch_when_open(ids, instance_id=inst).rows:
            pool.submit(run_in_gym, row)


def run_in_gym(row) -> None:
    """One row's /run, and the report of how it ended."""
    body = {"_ng_rollout_id": row.rollout_id, "_ng_attempt_index": row.gym_attempt, "task": {"group": row.group_id}, "turns": a.turns}
    try:
        r = gym.post(f"{a.gym}/s/workplace_agent/run", json=body)
    except httpx.TransportError:  # no reply: it may still run in Gym; it is retired and replaced
        return send(c.report_failed([FailedRow(row.rollout_id, "transport")]).rows_to_send)
    if r.status_code == 200:
        with lock:
            c.report_sealed([SealedRow.from_gym_reply(row, r.json())])
            buffer[row.rollout_id] = r.json()["reward"]
    elif r.status_code == 409 and r.json()["error"]["code"] in ("checkpoint_parked", "admission_closed"):
        c.report_refused([row.rollout_id])  # Gym is parked: the same row again once it resumes
        send([row])
    elif r.status_code != 409:  # (409 stale_attempt: a restore replaced it; nothing to report)
        send(c.report_failed([FailedRow(row.rollout_id, "data", r.text[:200])]).rows_to_send)


# 1. The run, once (keep its token), and Gym registered at every start (its URLs may change).
if "token" not in meta:
    run = CoordinatorClient(a.coordinator, a.admin_token).create_run(RUN, str(work / "checkpoints"), {"target_level": "turn"})
    meta["token"] = run.run_token
    save_meta()
c = CoordinatorClient(a.coordinator, meta["token"], run_id=RUN)
for s in c.list_snapshots():  # a snapshot the dead process left open holds the gate: end it
    if not s.terminal:
        c.abort_snapshot(s.snapshot_id)
servers = {n: f"{a.gym}/s/{n}" for n in ("policy_model", "workplace_agent", "calendar_resources", "judge_model")}
c.register_gym_instances([GymInstance(INSTANCE, a.gym_token, servers)])

# 2. First start: a snapshot before anything runs, so that any crash has one to restore.
#    Later starts: restore the newest snapshot at or before the newest trainer checkpoint.
if not meta.get("started"):
    c.snapshot(0, capture=capture, barrier=lock)
    meta["started"] = True
    save_meta()
    trained, start = {}, 1
else:
    newest = max((int(f.stem.split("-")[1]) for f in work.glob("ckpt-*.json")), default=0)
    meta.setdefault("restore_id", f"restore-{os.urandom(4).hex()}")
    save_meta()  # kept before it is applied: a recovery that crashes reads the same answer again
    try:
        res = c.restore(meta["restore_id"], step=newest)
    except Conflict as e:  # gym_not_fresh: Gym outlived the crash; its rollouts start over
        if e.code != "gym_not_fresh":
            raise
        meta["restore_id"] += "-without-gym"
        save_meta()
        res = c.restore(meta["restore_id"], step=newest, with_gym_state=False)
    buffer.update(json.loads(Path(res.data_plane_ref.path).read_text()))
    trained, start = checkpoint(res.anchor_step), res.anchor_step + 1  # the checkpoint it names
    pending = set(c.pending([r.rollout_id for r in res.rows_to_send]))  # sent by a crashed recovery
    rows = [r for r in res.rows_to_send if r.rollout_id not in pending]
    print(f"restored {res.snapshot_id}: {len(rows)} rows to send, {len(pending)} lost by a crashed recovery", flush=True)
    while rows:
        try:
            send(rows)
            rows = []
        except BatchRefused as e:  # rows that ended after a crashed recovery sent them
            rows = [r for r in rows if r.rollout_id not in e.codes()]
    if pending:  # their /run went with the process that sent them: retired and replaced
        send(c.report_failed([FailedRow(i, "transport") for i in sorted(pending)]).rows_to_send)
    del meta["restore_id"]
    save_meta()

# 3. The training loop: one snapshot per step, taken while the step's rows are in flight.
for step in range(start, a.steps + 1):
    admitted = c.admit_groups([GroupSpec(g, g, "math", f"sha256:{g}", 2) for g in groups_of(step)])
    send([r for r in admitted.rows if r.status == "reserved"])  # restored rows went out above
    try:
        print(f"step {step}: snapshot {c.snapshot(step - 1, capture=capture, barrier=lock).snapshot_id} published", flush=True)
    except SnapshotFailed as e:  # not fatal: the previous snapshot stays the one a restore uses
        print(f"step {step}: {e} (retryable: {e.retryable})", flush=True)
    while any(c.group(g).status == "generating" for g in groups_of(step)):
        threading.Event().wait(0.1)
    with lock:  # train, finalize, checkpoint, announce: a snapshot's cut never falls in between
        for g in (g for g in groups_of(step) if (d := c.group(g)).status == "ready"):
            trained[g] = [buffer[s.current.rollout_id] for s in d.siblings]
        c.finalize_groups(groups_of(step))
        checkpoint(step, trained)
        c.announce_train_step(step, checkpoint_ref=str(work / f"ckpt-{step}.json"))
    print(f"step {step}: trained {len(trained)} groups in all", flush=True)
pool.shutdown()
print(f"done: {len(trained)} groups trained over {a.steps} steps")
