"""The operator commands' outputs the README shows, produced as a user produces them: the crash
demo with its database kept, a coordinator served on that database, and the two commands.

``python -m tests.docs.readme_outputs`` prints them (to paste into the README after a change of
the commands); ``test_readme_outputs.py`` checks that the README's blocks have their shape.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = str(Path(sys.executable).with_name("ckpt-coordinator"))
TOKEN = "readme-admin-token-0123456789abcdef0123456"
# The README's commands, after `ckpt-coordinator` and before `--url`/`--run` (given here).
COMMANDS = {"restore-plan": ["--rows", "8"], "snapshots": ["--limit", "3"]}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextmanager
def demo_coordinator() -> Iterator[tuple[str, str]]:
    """(URL, run id) of a finished crash demo, served by a coordinator on its kept database."""
    data = Path(tempfile.mkdtemp(prefix="ckptc-readme-"))
    serve = None
    try:
        summary = data / "summary.json"
        env = {**os.environ, "CKPTC_DATA_DIR": str(data)}
        demo = subprocess.run([SCRIPT, "demo", "--data-dir", str(data), "--quiet", "--json-summary", str(summary)],
                              capture_output=True, text=True, timeout=600, env=env)
        assert demo.returncode == 0, demo.stdout[-3000:] + demo.stderr[-3000:]
        run_id = json.loads(summary.read_text())["run_id"]
        port = _free_port()
        serve = subprocess.Popen([SCRIPT, "serve", "--port", str(port)], env={**env, "CKPTC_ADMIN_TOKEN": TOKEN},
                                 stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 120
        while True:
            try:
                if httpx.get(f"{url}/readyz", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert serve.poll() is None and time.monotonic() < deadline, "the coordinator did not come up"
            time.sleep(0.2)
        yield url, run_id
    finally:
        if serve is not None:
            serve.terminate()
            serve.wait(60)
        shutil.rmtree(data, ignore_errors=True)


def outputs(url: str, run_id: str) -> dict[str, str]:
    """Each command's output, as the README shows it: its command line, then what it printed."""
    out = {}
    env = {**os.environ, "CKPTC_RUN_TOKEN": TOKEN}
    for command, extra in COMMANDS.items():
        args = [command, "--url", url, "--run", run_id, *extra]
        p = subprocess.run([SCRIPT, *args], capture_output=True, text=True, timeout=120, env=env)
        assert p.returncode == 0, p.stderr
        out[command] = f"$ CKPTC_RUN_TOKEN=... ckpt-coordinator {' '.join(args)}\n{p.stdout.rstrip()}"
    return out


if __name__ == "__main__":
    with demo_coordinator() as (url, run_id):
        for text in outputs(url, run_id).values():
            print(f"```\n{text}\n```\n")
