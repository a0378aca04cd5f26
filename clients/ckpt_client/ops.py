"""Operator commands on the thin client: ``ckpt-coordinator restore-plan``, ``ckpt-coordinator
snapshots`` and ``ckpt-coordinator accounting`` (and the options, running and tables that
``ckpt-coordinator effects``, in ``ops_effects``, shares).

Each reads a running coordinator over HTTP with the client's own calls and prints tables (or the
JSON the coordinator answered). The token comes from ``CKPTC_RUN_TOKEN`` only: a token on the
command line would end up in shell histories and in every ``ps`` listing. The coordinator's URL
is ``--url``, or ``CKPTC_URL`` when that option is left out.

Exit status: 0 printed; 1 the coordinator refused (unknown run, bad token, invalid request...);
2 usage (bad arguments, no token); 3 the coordinator could not be reached or answered something
unreadable; 4 (``accounting`` only) printed, but the run's prompt groups are not conserved. Every
failure is one line on stderr, never a traceback.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, TextIO

from .errors import CoordinatorError, ProtocolError, Unavailable
from .models import PlanRow, RestorePlan, Snapshot
from .sync import CoordinatorClient

__all__ = ["TOKEN_ENV", "URL_ENV", "restore_plan_main", "snapshots_main", "accounting_main", "parse_instance_map"]

TOKEN_ENV = "CKPTC_RUN_TOKEN"
URL_ENV = "CKPTC_URL"
EXIT_OK, EXIT_REFUSED, EXIT_USAGE, EXIT_UNREACHABLE = 0, 1, 2, 3
# Not an error of the command: the answer was printed, and it says a prompt group went missing.
# A code of its own, so that a cron job or a CI step can alert on exactly that.
EXIT_NOT_CONSERVED = 4

_DISPOSITIONS = ("reused", "continued", "restarted", "gym_restarted", "rerun", "dispatch")
_PHASES = ("gate", "pre_cut", "prepare", "commit", "drain", "data_plane", "resume", "total")

_EPILOG = f"""\
The token is read from ${TOKEN_ENV} (the run's token, or the admin token), never from the
command line. Exit status: 0 printed; 1 the coordinator refused the request (unknown run, token
not valid for the run, invalid request); 2 bad arguments or no token; 3 the coordinator could not
be reached or answered something unreadable."""


class _Usage(Exception):
    pass


# --------------------------------------------------------------------------------------------
# Arguments


def parse_instance_map(text: str) -> dict[str, str]:
    """``old=new,old2=new2`` -> ``{old: new, old2: new2}``; a saved instance named twice is refused
    here (a dict would keep only the last, silently)."""
    out: dict[str, str] = {}
    for part in (p.strip() for p in text.split(",")):
        if not part:
            continue
        saved, sep, live = part.partition("=")
        saved, live = saved.strip(), live.strip()
        if not sep or not saved or not live or "=" in live:
            raise argparse.ArgumentTypeError(f"not SAVED=LIVE: {part!r}")
        if saved in out:
            raise argparse.ArgumentTypeError(f"saved instance {saved!r} mapped twice")
        out[saved] = live
    if not out:
        raise argparse.ArgumentTypeError("empty instance map")
    return out


def _at_least(minimum: float, kind: type = int, *, strictly: bool = False) -> Callable[[str], Any]:
    """An argparse type: a ``kind`` number ``>= minimum`` (``> minimum`` when ``strictly``)."""

    def parse(value: str) -> Any:
        try:
            n = kind(value)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not {'an integer' if kind is int else 'a number'}: {value!r}") from None
        if n < minimum or (strictly and n == minimum):
            raise argparse.ArgumentTypeError(f"must be {'>' if strictly else '>='} {minimum:g}, got {value}")
        return n

    return parse


_non_negative, _positive, _seconds = _at_least(0), _at_least(1), _at_least(0, float, strictly=True)


_ACCOUNTING_EPILOG = _EPILOG + f"""

Exit status {EXIT_NOT_CONSERVED}: the accounting was printed (--json too) and the run's prompt
groups are NOT CONSERVED: some admitted group is in no bucket (docs/accounting.md#prompt-conservation).
Scripts can alert on it."""


def _parser(command: str, description: str, epilog: str = _EPILOG) -> argparse.ArgumentParser:
    """A command's parser with the options every command shares."""
    p = argparse.ArgumentParser(prog=f"ckpt-coordinator {command}", description=description, epilog=epilog)
    url = os.environ.get(URL_ENV, "").strip()
    p.add_argument(
        "--url", required=not url, default=url or None, metavar="URL",
        help=f"base URL of the coordinator, e.g. http://127.0.0.1:8080 (default: ${URL_ENV})",
    )
    p.add_argument("--run", required=True, metavar="RUN", help="the run id")
    p.add_argument("--json", action="store_true", help="print the coordinator's answer as JSON instead of tables")
    p.add_argument("--timeout", type=_seconds, default=60.0, metavar="SECONDS", help="HTTP timeout per request (default 60)")
    return p


def restore_plan_parser() -> argparse.ArgumentParser:
    p = _parser(
        "restore-plan",
        "Print the restore plan of a run without applying it (docs/ledger.md#restore): the snapshot "
        "it would restore, its anchor step and data-plane reference, the rows per disposition and per reason, and "
        "what each row would do.",
    )
    p.add_argument("--step", type=_non_negative, metavar="S", help="the trainer's restored step: the newest published snapshot anchored at or before it "
                   "(without --step and --snapshot: the newest published snapshot)")
    p.add_argument("--snapshot", metavar="ID", help="plan the restore of this snapshot")
    p.add_argument(
        "--instance-map",
        type=parse_instance_map,
        metavar="OLD=NEW,...",
        help="restore into another Gym topology: saved instance -> live instance (e.g. math/replica-0=job-2/gym-0)",
    )
    p.add_argument("--no-gym-state", action="store_true", help="plan a restore without Gym state (Gym kept running): continuations restart")
    p.add_argument("--include-reused", action="store_true", help="list the reused rows too (they are always counted)")
    p.add_argument("--rows", type=_non_negative, default=50, metavar="N", help="rows shown in the row table (default 50, 0: none)")
    return p


def snapshots_parser() -> argparse.ArgumentParser:
    p = _parser(
        "snapshots",
        "Print a run's snapshot history, newest first (docs/ledger.md#snapshot-history): outcome and reason, phase "
        "timings, seconds Gym was parked, and per Gym instance its participants, exported episodes (and those outside "
        "the commit scope), restarts, staging keys and the slowest participant of each phase.",
    )
    p.add_argument("--limit", type=_positive, default=20, metavar="N", help="the N newest snapshots (default 20)")
    p.add_argument("--all", action="store_true", help="every snapshot the coordinator keeps (pages through the history)")
    return p


def accounting_parser() -> argparse.ArgumentParser:
    p = _parser(
        "accounting",
        "Print a run's accounting (docs/accounting.md): every admitted prompt group in one bucket (trained, abandoned, "
        "live, rewound) and whether they add up (CONSERVED or NOT CONSERVED), the rollout-seconds by fate (trained, "
        "in flight, carried, redone) and why work was redone, and per applied restore what it found in flight, carried "
        "and must redo.",
        _ACCOUNTING_EPILOG,
    )
    p.add_argument("--by-instance", action="store_true", help="each restore's figures per Gym instance too")
    p.add_argument("--by-level", action="store_true", help="each restore's figures per restore level (turn, sibling, prompt_group) too")
    return p


# --------------------------------------------------------------------------------------------
# Running


def _client(args: argparse.Namespace) -> CoordinatorClient:
    token = os.environ.get(TOKEN_ENV, "").strip()
    if not token:
        raise _Usage(f"no token: set {TOKEN_ENV} to the run's token (or the admin token)")
    if not args.url.startswith(("http://", "https://")):
        raise _Usage(f"--url must start with http:// or https://, got {args.url!r}")
    # One retry: an operator at a terminal wants a verdict, not a trainer's patience.
    return CoordinatorClient(args.url, token, run_id=args.run, timeout=args.timeout, retries=1, backoff=0.2, max_backoff=1.0)


Body = Callable[[argparse.Namespace, CoordinatorClient, TextIO], int | None]


def _run(prog: str, parser: argparse.ArgumentParser, argv: Sequence[str] | None, body: Body) -> int:
    """Run ``body`` with a client; its answer (None: 0) is the exit status unless a failure
    comes first."""
    args = parser.parse_args(list(sys.argv[1:] if argv is None else argv))
    out, err = sys.stdout, sys.stderr
    # The client logs each retry as a warning; without a handler Python would print it, and the
    # verdict below is the one line an operator should see.
    logging.getLogger("ckpt_client").addHandler(logging.NullHandler())
    try:
        with _client(args) as client:
            code = body(args, client, out)
    except _Usage as e:
        print(f"{prog}: {e}", file=err)
        return EXIT_USAGE
    except (Unavailable, ProtocolError) as e:
        print(f"{prog}: {args.url}: {_one_line(e)}", file=err)
        return EXIT_UNREACHABLE
    except CoordinatorError as e:
        print(f"{prog}: the coordinator refused: {_one_line(e)}", file=err)
        return EXIT_REFUSED
    except BrokenPipeError:
        # `| head`: the reader left. Point stdout at /dev/null so the flush at exit stays quiet.
        # A verdict the body reached before writing (``args.verdict``) still decides the status.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return getattr(args, "verdict", EXIT_OK)
    return code or EXIT_OK


def _one_line(e: BaseException) -> str:
    text = " ".join(str(e).split())
    if isinstance(e, CoordinatorError):
        errors = e.problem.get("errors")
        if isinstance(errors, list) and errors:
            named = [f"{x.get('field')}: {x.get('message')}" for x in errors[:3] if isinstance(x, Mapping)]
            text += " (" + "; ".join(named) + ")"
    return text[:1000]


def restore_plan_main(argv: Sequence[str] | None = None) -> int:
    """``ckpt-coordinator restore-plan``."""
    parser = restore_plan_parser()

    def body(args: argparse.Namespace, client: CoordinatorClient, out: TextIO) -> None:
        plan = client.restore_plan(
            args.step,
            args.snapshot,
            with_gym_state=not args.no_gym_state,
            include_reused=args.include_reused,
            instance_map=args.instance_map,
        )
        if args.json:
            doc = {k: v for k, v in plan.raw.items() if k != "next_cursor"}
            doc["rows"] = [r.raw for r in plan.rows]
            out.write(json.dumps(doc, indent=2, sort_keys=True) + "\n")
        else:
            out.write(render_plan(args.run, plan, rows=args.rows, instance_map=args.instance_map, include_reused=args.include_reused) + "\n")

    return _run(parser.prog, parser, argv, body)


def snapshots_main(argv: Sequence[str] | None = None) -> int:
    """``ckpt-coordinator snapshots``."""
    parser = snapshots_parser()

    def body(args: argparse.Namespace, client: CoordinatorClient, out: TextIO) -> None:
        snaps = client.snapshot_history(limit=None if args.all else args.limit)
        # The history lists every snapshot; the Gym figures are read from the snapshot itself
        # when a coordinator leaves them out of the list.
        snaps = [client.get_snapshot(s.snapshot_id) if s.published and not s.gym_figures else s for s in snaps]
        if args.json:
            out.write(json.dumps({"run_id": args.run, "snapshots": [s.raw for s in snaps]}, indent=2, sort_keys=True) + "\n")
        else:
            out.write(render_snapshots(args.run, snaps) + "\n")

    return _run(parser.prog, parser, argv, body)


def accounting_main(argv: Sequence[str] | None = None) -> int:
    """``ckpt-coordinator accounting``."""
    # Imported here: the renderer imports this module's table helpers.
    from .ops_accounting import not_conserved_line, render_accounting

    parser = accounting_parser()

    def body(args: argparse.Namespace, client: CoordinatorClient, out: TextIO) -> int:
        acc = client.accounting()
        args.verdict = EXIT_OK if acc.conserved else EXIT_NOT_CONSERVED  # kept when `| head` leaves early
        if args.json:
            out.write(json.dumps(acc.raw, indent=2, sort_keys=True) + "\n")
        else:
            out.write(render_accounting(acc, by_instance=args.by_instance, by_level=args.by_level) + "\n")
        if acc.conserved:
            return EXIT_OK
        out.flush()  # the tables first, then the verdict on stderr
        print(f"{parser.prog}: {not_conserved_line(acc)}", file=sys.stderr)
        return int(args.verdict)

    return _run(parser.prog, parser, argv, body)


# --------------------------------------------------------------------------------------------
# Rendering


def table(rows: Sequence[Sequence[str]], indent: str = "  ") -> list[str]:
    """Left-aligned columns under a header line and a rule."""
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    out = []
    for k, r in enumerate(rows):
        out.append(indent + "  ".join(c.ljust(widths[i]) for i, c in enumerate(r)).rstrip())
        if k == 0:
            out.append(indent + "  ".join("-" * w for w in widths))
    return out


def _ordered(keys: Iterable[str], order: Sequence[str]) -> list[str]:
    known = [k for k in order if k in keys]
    return known + sorted(k for k in keys if k not in order)


def render_plan(run_id: str, plan: RestorePlan, *, rows: int = 50, instance_map: Mapping[str, str] | None = None, include_reused: bool = False) -> str:
    raw = plan.raw
    ref = plan.data_plane_ref
    lines = [f"restore plan of run {run_id} (a preview: nothing is applied)"]
    head = [
        ("snapshot", plan.snapshot_id),
        ("anchor step", f"{plan.anchor_step} (load this trainer checkpoint)" if plan.anchor_step is not None else "-"),
        ("data plane", f"{ref.path} ({ref.digest})" if ref else "-"),
    ]
    if raw.get("gym_checkpoint_id"):
        head.append(("Gym checkpoint", str(raw["gym_checkpoint_id"])))
    gym_state = raw.get("gym_state") if isinstance(raw.get("gym_state"), Mapping) else {}
    if gym_state:
        installs = "yes" if gym_state.get("installs") else "no"
        head.append(("Gym state", installs + (f" ({gym_state['reason']})" if gym_state.get("reason") else "")))
    if instance_map:
        head.append(("instance map", ", ".join(f"{k} -> {v}" for k, v in sorted(instance_map.items()))))
    if isinstance(raw.get("continued_by_instance"), Mapping) and raw["continued_by_instance"]:
        head.append(("continued on", ", ".join(f"{k} {v}" for k, v in sorted(raw["continued_by_instance"].items()))))
    width = max(len(k) for k, _ in head)
    lines += [f"  {k.ljust(width)}  {v}" for k, v in head]

    total = sum(plan.counts.values())
    lines += ["", f"rows per disposition ({total} in all)"]
    lines += table([["disposition", "rows"], *[[d, str(plan.counts.get(d, 0))] for d in _ordered(plan.counts, _DISPOSITIONS)]])

    reasons = plan.reasons
    lines.append("")
    if reasons:
        lines.append("rows per reason")
        body = [[d, r, str(n)] for d in _ordered(reasons, _DISPOSITIONS) for r, n in sorted(reasons[d].items())]
        lines += table([["disposition", "reason", "rows"], *body])
    elif "reasons" in raw:
        lines.append("rows per reason: none")
    else:
        lines.append("rows per reason: not reported by this coordinator")

    listed = plan.rows
    what = "rows" if include_reused else "rows to send (reused rows: --include-reused)"
    if rows > 0 and listed:
        shown = listed[:rows]
        lines += ["", f"{what}, {len(shown)} of {len(listed)}"]
        lines += table([["rollout id", "group", "sibling", "disposition", "reason", "attempt", "instance"], *[_plan_row(r) for r in shown]])
        if len(listed) > len(shown):
            lines.append(f"  … {len(listed) - len(shown)} more (--rows N shows more, --json all)")
    elif not listed:
        lines += ["", f"{what}: none"]
    return "\n".join(lines)


def _plan_row(r: PlanRow) -> list[str]:
    return [r.rollout_id or "-", r.group_id, str(r.generation_index), r.disposition, r.reason or "-", str(r.gym_attempt), r.instance_id or "-"]


def _secs(value: Any) -> str:
    try:
        return f"{float(value):.2f}s"
    except (TypeError, ValueError):
        return "-"


def _stop_text(s: Snapshot) -> str:
    if not s.raw.get("stop"):
        return "-"
    honoured = s.stop_honoured
    deadline = f" {float(s.raw['deadline_s']):g}s" if isinstance(s.raw.get("deadline_s"), (int, float)) else ""
    return "stop" + deadline + {True: ", honoured", False: ", not honoured", None: ""}[honoured]


def _slowest(value: Any) -> str:
    """``{phase: {participant|server, seconds}}`` (or ``{phase: name}``) as ``phase name 0.12s``."""
    if not isinstance(value, Mapping):
        return ""
    parts = []
    for phase, who in value.items():
        if isinstance(who, Mapping):
            name = who.get("participant") or who.get("server") or who.get("name") or "?"
            secs = who.get("seconds", who.get("s"))
            parts.append(f"{phase} {name}" + (f" {_secs(secs)}" if secs is not None else ""))
        else:
            parts.append(f"{phase} {who}")
    return ", ".join(parts)


def _instance_line(iid: str, f: Mapping[str, Any]) -> str:
    def n(key: str) -> str:
        return str(f.get(key, "-"))

    text = (
        f"gym {iid}: {n('participants')} participants, {n('exported')} exported"
        f" ({n('exported_outside_scope')} outside the scope), {n('restarts')} restarts, {n('staging_keys')} staging keys"
    )
    if f.get("stranded"):
        text += f", stranded {f['stranded']}"
    slowest = _slowest(f.get("slowest"))
    if slowest:
        text += f"; slowest: {slowest}"
    return text


def render_snapshots(run_id: str, snaps: Sequence[Snapshot]) -> str:
    if not snaps:
        return f"snapshots of run {run_id}: none"
    lines = [f"snapshots of run {run_id}, newest first ({len(snaps)})"]
    head = ["snapshot", "anchor", "outcome", "reason", "stop", "created", "gym parked", "total"]
    body = []
    for s in snaps:
        created = str(s.raw.get("created_at") or "-")[:19]
        body.append(
            [s.snapshot_id, str(s.anchor_step), s.outcome or f"({s.phase})", s.reason or "-", _stop_text(s), created, _secs(s.gym_parked_seconds), _secs(s.phase_timings.get("total"))]
        )
    lines += table([head, *body])
    for s in snaps:
        timings = s.phase_timings
        gym = s.gym_figures
        if not timings and not gym and not s.cause and not s.warnings:
            continue
        lines += ["", f"  {s.snapshot_id}"]
        if s.cause:
            again = {True: "a new snapshot later should work", False: "waiting will not help", None: ""}[s.retryable]
            lines.append(f"    cause: {' '.join(s.cause.split())}" + (f" ({again})" if again else ""))
        if s.blockers is not None and s.blockers.count:
            more = s.blockers.count - len(s.blockers.rollout_ids)
            lines.append(f"    blocked by {s.blockers.count} episode(s): {', '.join(s.blockers.rollout_ids)}" + (f", … {more} more" if more > 0 else ""))
        phases = [f"{k} {_secs(timings[k])}" for k in _ordered(timings, _PHASES) if k not in ("total", "gym_parked")]
        if phases:
            lines.append("    phases: " + ", ".join(phases))
        for iid, f in sorted(gym.items()):
            lines.append("    " + _instance_line(iid, f))
        for w in s.warnings[:5]:
            lines.append(f"    warning: {' '.join(w.split())}")
        if len(s.warnings) > 5:
            lines.append(f"    … {len(s.warnings) - 5} more warnings (--json shows them all)")
    return "\n".join(lines)
