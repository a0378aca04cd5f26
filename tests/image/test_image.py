"""The container image, built and run: the Dockerfile on a Debian bookworm base made here, run as
its own user with a read-only root filesystem (tests/image/buildah.py).

It serves (``/readyz`` 200 seen from the host, the image's own HEALTHCHECK command exits 0 inside)
and runs the demo to exit 0. The size and layers go to the terminal summary.
"""

from __future__ import annotations

import errno
import socket
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from .buildah import Container, ImageConfig
from .conftest import REPORT

pytestmark = [pytest.mark.image, pytest.mark.slow]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _status(url: str) -> int | None:
    try:
        with urllib.request.urlopen(url, timeout=2) as answer:
            return int(answer.status)
    except urllib.error.HTTPError as e:
        return e.code
    except OSError:
        return None


def _tail(log: Path) -> str:
    return log.read_text(errors="replace")[-4000:] if log.exists() else ""


@pytest.mark.timeout(1800)
def test_image_holds_the_venv_and_not_the_wheels(image_root: Path, image: ImageConfig) -> None:
    assert image.user == "10001:10001"
    assert image.entrypoint == ["ckpt-coordinator"] and image.cmd == ["serve"]
    assert image.healthcheck, "the docker-format config keeps the HEALTHCHECK"
    venv = image_root / "opt/ckpt-coordinator"
    assert (venv / "bin/ckpt-coordinator").exists()
    assert not (image_root / "wheels").exists(), "the wheels stay in the builder"
    assert not (venv / "bin/pip").exists(), "no pip in the runtime venv"
    assert any(line.startswith("ckptc:x:10001:10001:") for line in (image_root / "etc/passwd").read_text().splitlines())


@pytest.mark.timeout(1800)
def test_serves_as_its_user_on_a_read_only_root(container: Container, image: ImageConfig, tmp_path: Path) -> None:
    port = _free_port()
    log = tmp_path / "serve.log"
    started = time.monotonic()
    proc = container.start([*image.entrypoint, *image.cmd], log, CKPTC_PORT=str(port))
    try:
        ready_s = None
        while time.monotonic() - started < 180 and proc.poll() is None:
            if _status(f"http://127.0.0.1:{port}/readyz") == 200:
                ready_s = time.monotonic() - started
                break
            time.sleep(0.1)
        assert ready_s is not None, f"/readyz never answered 200 (exit {proc.poll()}):\n{_tail(log)}"
        REPORT.append(f"serve in the image: /readyz 200 after {ready_s:.1f}s (embedded PostgreSQL, migrations)")

        # The HEALTHCHECK exactly as the image config has it, run inside the running container.
        check = container.exec(proc, image.healthcheck, timeout=image.healthcheck_timeout_s + 10, CKPTC_PORT=str(port))
        assert check.returncode == 0, check.stdout + check.stderr
        REPORT.append(f"HEALTHCHECK {image.healthcheck[:2]}...: exit 0 inside the container")

        import psutil

        server = psutil.Process(container.init_pid(proc))
        assert server.uids().real == server.uids().effective == 10001
        assert server.gids().real == 10001

        # The root filesystem is read-only even where the image's permissions allow writing;
        # /tmp and the data directory are writable, as on the pods.
        probe = container.exec(proc, ["python", "-c", (
            "import errno, sys\n"
            "def write(path):\n"
            "    try:\n"
            "        open(path, 'w').close()\n"
            "        return 0\n"
            "    except OSError as e:\n"
            "        return e.errno\n"
            "print(write('/var/tmp/probe'), write('/tmp/probe'), write('/var/lib/ckpt-coordinator/probe'))\n"
        )], timeout=30)
        assert probe.stdout.split() == [str(errno.EROFS), "0", "0"], probe.stdout + probe.stderr
    finally:
        status = Container.stop(proc)
    assert status == 0, f"serve exited {status} on SIGTERM:\n{_tail(log)}"
    assert "stopping embedded PostgreSQL" in log.read_text()


@pytest.mark.timeout(1800)
def test_demo_runs_inside_the_image(container: Container, tmp_path: Path) -> None:
    log = tmp_path / "demo.log"
    started = time.monotonic()
    status = container.run(["ckpt-coordinator", "demo", "--steps", "2", "--groups", "4", "--quiet"], log, timeout=600)
    REPORT.append(f"demo in the image: exit {status} in {time.monotonic() - started:.0f}s")
    assert status == 0, _tail(log)
    assert "OK in" in log.read_text()
