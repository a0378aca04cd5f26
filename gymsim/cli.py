"""`python -m gymsim serve --config FILE.json [--port N] [--host 127.0.0.1] [--gym-profile P]`: one
instance per process."""

from __future__ import annotations

import argparse
import json
import sys
from typing import get_args

from pydantic import ValidationError

from .config import GymProfile, InstanceConfig
from .server import bind_socket, build_server, ready_line

PROFILES = get_args(GymProfile)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="gymsim", description="Reference NeMo Gym checkpoint participant deployment")
    sub = parser.add_subparsers(dest="command", required=True)
    serve = sub.add_parser("serve", help="serve one instance until killed")
    serve.add_argument("--config", required=True, help="instance config JSON file")
    serve.add_argument("--port", type=int, default=0, help="0 picks a free port (printed on stdout)")
    serve.add_argument("--host", default="127.0.0.1")
    serve.add_argument("--gym-profile", choices=PROFILES, help="overrides the config file's instance profile")
    default = sub.add_parser("default-config", help="print a default instance config")
    default.add_argument("--instance-id", default="math/replica-0")
    default.add_argument("--token", default="tok-gymsim")
    default.add_argument("--resources-mode", default="exported")
    default.add_argument("--gym-profile", choices=PROFILES, default=None, help="default: published")
    default.add_argument(
        "--lease-grace-seconds", type=float, default=60.0,
        help="Gym's checkpoint.lease_grace_seconds; default 60, what the coordinator asks of Gym with its default "
        "control_timeout_s of 60 (lease_grace_seconds = control_timeout_s). Gym's own default is 600",
    )
    return parser


def load_config(path: str, gym_profile: str | None = None) -> InstanceConfig:
    """The config file, with `--gym-profile` (when given) in place of its instance profile."""
    config = InstanceConfig.load(path)
    if gym_profile is not None:
        config = InstanceConfig.model_validate({**config.model_dump(), "gym_profile": gym_profile})
    return config


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.command == "default-config":
        from .testing import default_instance_config

        config = default_instance_config(
            args.instance_id, token=args.token, resources_mode=args.resources_mode, gym_profile=args.gym_profile,
            lease_grace_seconds=args.lease_grace_seconds,
        )
        print(json.dumps(config, indent=2))
        return 0
    try:
        config = load_config(args.config, args.gym_profile)
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
