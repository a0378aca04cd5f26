"""The Dockerfile, read as instructions (no Docker engine is needed).

Checks the properties the deployment relies on: a base image given as a build
argument (python:3.11-slim by default), a final stage without compilers or pip,
a non-root user matching the pods' runAsUser, the entrypoint and default
command, a stdlib HEALTHCHECK on /healthz, and a build context that holds
everything the builder copies. tests/image builds and runs it.
"""

from __future__ import annotations

import fnmatch
import json
import re
import shlex
from dataclasses import dataclass

import pytest
import yaml
from _deploy_helpers import DEPLOY, ROOT

DOCKERFILE = ROOT / "Dockerfile"
BUILD_TOOLS = re.compile(r"\b(gcc|g\+\+|cc|clang|make|build-essential|libpq-dev|python3-dev|cmake|curl|wget)\b")


@dataclass
class Instruction:
    keyword: str
    args: str
    line: int


@dataclass
class Stage:
    base: str
    name: str | None
    instructions: list[Instruction]

    def all(self, keyword: str) -> list[Instruction]:
        return [i for i in self.instructions if i.keyword == keyword]


def instructions_of(text: str) -> list[Instruction]:
    instructions: list[Instruction] = []
    buffer, start = "", 0
    for number, raw in enumerate(text.splitlines(), 1):
        line = raw.strip()
        if not buffer and (not line or line.startswith("#")):
            continue
        if buffer and line.startswith("#"):
            continue  # comment lines inside a continuation are dropped by Docker
        if not buffer:
            start = number
        if line.endswith("\\"):
            buffer += line[:-1] + " "
            continue
        buffer += line
        keyword, _, args = buffer.partition(" ")
        instructions.append(Instruction(keyword.upper(), args.strip(), start))
        buffer = ""
    assert not buffer, "dangling line continuation"
    return instructions


def global_args(text: str) -> dict[str, str | None]:
    """The ARGs declared before the first FROM (the only ones FROM can use), with their defaults."""
    args: dict[str, str | None] = {}
    for instruction in instructions_of(text):
        if instruction.keyword == "FROM":
            break
        if instruction.keyword == "ARG":
            name, eq, default = instruction.args.partition("=")
            args[name.strip()] = default.strip() if eq else None
    return args


def parse(text: str) -> list[Stage]:
    stages: list[Stage] = []
    for instruction in instructions_of(text):
        if instruction.keyword == "FROM":
            parts = instruction.args.split()
            name = parts[2] if len(parts) == 3 and parts[1].upper() == "AS" else None
            stages.append(Stage(parts[0], name, []))
        else:
            assert stages or instruction.keyword == "ARG", f"{instruction.keyword} before FROM"
            if stages:
                stages[-1].instructions.append(instruction)
    return stages


def exec_form(instruction: Instruction) -> list[str]:
    args = instruction.args
    if instruction.keyword == "HEALTHCHECK":
        args = args[args.index("CMD") + 3 :].strip()
    value = json.loads(args)
    assert isinstance(value, list) and all(isinstance(v, str) for v in value), f"{instruction.keyword} must be exec form"
    return value


@pytest.fixture(scope="module")
def stages() -> list[Stage]:
    return parse(DOCKERFILE.read_text())


def test_multi_stage_with_slim_final(stages: list[Stage]) -> None:
    assert len(stages) >= 2
    builder, final = stages[0], stages[-1]
    assert global_args(DOCKERFILE.read_text())["BASE_IMAGE"] == "python:3.11-slim", "the default base"
    assert final.base == "${BASE_IMAGE}"
    runs = " ".join(r.args for r in builder.all("RUN"))
    assert "pip wheel" in runs, "the builder builds wheels"
    assert re.search(r"pip install --no-index --find-links /wheels checkpoint-coordinator", runs), \
        "the builder installs only the wheels it built"
    copies = [c.args for c in final.all("COPY")]
    assert any(c.startswith(f"--from={builder.name}") for c in copies), "the final stage takes the builder's install"


def test_base_image_is_a_build_argument_of_every_stage(stages: list[Stage]) -> None:
    # The builder's venv is copied as is into the final stage: both must have the same Python.
    assert "BASE_IMAGE" in global_args(DOCKERFILE.read_text()), "ARG BASE_IMAGE before the first FROM"
    assert {s.base for s in stages} == {"${BASE_IMAGE}"}


def test_global_args_reader() -> None:
    text = "ARG A=x:1\nARG B\nFROM ${A} AS s\nARG C=2\n"
    assert global_args(text) == {"A": "x:1", "B": None}
    assert parse(text)[0].base == "${A}"


def test_final_stage_installs_no_build_tools(stages: list[Stage]) -> None:
    final = stages[-1]
    for run in final.all("RUN"):
        assert not BUILD_TOOLS.search(run.args), f"line {run.line}: build tool in the final stage: {run.args}"
        assert "--no-index" in run.args or "pip" not in run.args, "the final stage installs only the built wheels"


def test_runs_as_non_root_matching_the_pods(stages: list[Stage]) -> None:
    final = stages[-1]
    users = final.all("USER")
    assert users, "USER missing"
    user = users[-1].args.split(":")[0]
    assert user not in {"root", "0"}
    deployment = yaml.safe_load((DEPLOY / "k8s" / "base" / "deployment.yaml").read_text())
    run_as = deployment["spec"]["template"]["spec"]["securityContext"]["runAsUser"]
    assert user == str(run_as), "image user and pod runAsUser should agree"
    assert any(f"--uid {run_as}" in r.args for r in final.all("RUN")), "the user is created with that uid"


def test_entrypoint_cmd_port_env(stages: list[Stage]) -> None:
    final = stages[-1]
    assert exec_form(final.all("ENTRYPOINT")[-1]) == ["ckpt-coordinator"]
    assert exec_form(final.all("CMD")[-1]) == ["serve"]
    assert "8080" in final.all("EXPOSE")[-1].args.split()
    env = " ".join(e.args for e in final.all("ENV"))
    assert re.search(r"\bCKPTC_HOST=0\.0\.0\.0\b", env)


def test_healthcheck_uses_stdlib_on_healthz(stages: list[Stage]) -> None:
    final = stages[-1]
    (check,) = final.all("HEALTHCHECK")
    command = exec_form(check)
    assert command[:2] == ["python", "-c"]
    assert "/healthz" in command[2] and "urllib.request" in command[2]
    assert "/readyz" not in command[2], "a container health check must not depend on the database"
    compile(command[2], "<healthcheck>", "exec")  # the one-liner is valid Python
    assert "--timeout=" in check.args and "--interval=" in check.args


def test_build_context_has_what_the_builder_copies(stages: list[Stage]) -> None:
    ignored = [
        p.strip().rstrip("/")
        for p in (ROOT / ".dockerignore").read_text().splitlines()
        if p.strip() and not p.startswith("#")
    ]
    for copy in stages[0].all("COPY"):
        sources = shlex.split(copy.args)[:-1]
        for source in sources:
            if source.startswith("--"):
                continue
            path = source.rstrip("/")
            assert (ROOT / path).exists(), f"COPY {source}: missing from the repository"
            assert not any(fnmatch.fnmatch(path, pattern) for pattern in ignored), f"COPY {source} is dockerignored"
    # What pyproject.toml packages must be copied into the builder.
    copied = {shlex.split(c.args)[0].rstrip("/") for c in stages[0].all("COPY")}
    pyproject = (ROOT / "pyproject.toml").read_text()
    package_dirs = re.findall(r'"(?:[a-z_]*)"\s*=\s*"([a-z_]+)(?:/[^"]*)?"', pyproject)
    assert "service" in package_dirs
    for top in package_dirs:
        assert top in copied, f"{top}/ is a package directory in pyproject.toml but not copied"


def test_parser_sees_through_continuations() -> None:
    stages = parse("FROM a AS b\nRUN x \\\n  # note\n  && y\nFROM c\nUSER 1\n")
    assert [s.base for s in stages] == ["a", "c"]
    assert stages[0].all("RUN")[0].args.split() == ["x", "&&", "y"]


def test_healthcheck_command_really_probes_healthz(stages: list[Stage]) -> None:
    """Run the HEALTHCHECK one-liner against a loopback server: 0 when /healthz is 200, else not."""
    import http.server
    import os
    import subprocess
    import sys
    import threading

    (check,) = stages[-1].all("HEALTHCHECK")
    code = exec_form(check)[2]
    answers = {"/healthz": 200}

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 - http.server's naming
            self.send_response(answers.get(self.path, 404))
            self.end_headers()
            self.wfile.write(b"{}")

        def log_message(self, *args: object) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        env = {**os.environ, "CKPTC_PORT": str(server.server_address[1])}
        assert subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, timeout=30).returncode == 0
        answers["/healthz"] = 503
        assert subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, timeout=30).returncode != 0
    finally:
        server.shutdown()
        server.server_close()
    # Nothing listening: unhealthy, not a hang.
    env = {**os.environ, "CKPTC_PORT": str(server.server_address[1])}
    assert subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, timeout=30).returncode != 0
