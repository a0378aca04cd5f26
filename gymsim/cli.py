"""`python -m gymsim serve --config FILE.json [--port N] [--host 127.0.0.1]`: one instance per process."""

from __future__ import annotations

import argparse
import json
import sys

from pydantic import ValidationError

from .config import InstanceConfig
from .server import bind_socket, build_server, ready_line


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="gymsim", description="Reference NeMo Gym checkpoint participant deployment")
    sub = parser.add_subparsers(dest="command", required=True)
    serve = sub.add_parser("serve", help="serve one instance until killed")
    serve.add_argument("--config", required=True, help="instance config JSON file")
    serve.add_argument("--port", type=int, default=0, help="0 picks a free port (printed on stdout)")
    serve.add_argument("--host", default="127.0.0.1")
    default = sub.add_parser("default-config", help="print a default instance config")
    default.add_argument("--instance-id", default="math/replica-0")
    default.add_argument("--token", default="tok-gymsim")
    default.add_argument("--resources-mode", default="exported")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.command == "default-config":
        from .testing import default_instance_config

        config = default_instance_config(args.instance_id, token=args.token, resources_mode=args.resources_mode)
        print(json.dumps(config, indent=2))
        return 0
    try:
        config = InstanceConfig.load(args.config)
    except (OSError, ValueError, ValidationError) as exc:
        print(f"gymsim: cannot load {args.config}: {exc}", file=sys.stderr)
        return 2
    try:
        sock = bind_socket(args.host, args.port)
    except OSError as exc:
        print(f"gymsim: cannot listen on {args.host}:{args.port}: {exc}", file=sys.stderr)
        return 2

    def announce(instance) -> None:
        # One JSON line on stdout, so a parent process can learn the URLs (needed with --port 0).
        print(json.dumps(ready_line(instance)), flush=True)

    server, _ = build_server(config, sock, on_ready=announce)
    server.run(sockets=[sock])
    return 0
