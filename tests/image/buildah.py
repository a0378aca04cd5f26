"""Build the image with buildah from a debootstrap base, and run it the way the pods do.

No Docker engine and no registry is needed: the base is Debian bookworm made by debootstrap
(the smallest set that has Python 3.11 with venv and pip) and imported into a private buildah
store (vfs driver, chroot isolation), which the tests remove afterwards.

A container here is the mounted image root run under ``unshare --mount --pid --fork``: the root
is bind-mounted read-only, ``/tmp``, ``/var/lib/ckpt-coordinator`` and ``/dev/shm`` are tmpfs,
``/proc`` is the new pid namespace's, and the command runs through ``setpriv --no-new-privs`` and
``chroot --userspec`` as the image's user, with no capabilities left, on the host's network: what
``readOnlyRootFilesystem``, ``runAsUser`` and ``allowPrivilegeEscalation: false`` ask of the pods.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import signal
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil

SUITE = "bookworm"
MIRROR = "http://deb.debian.org/debian"
# minbase has dpkg, coreutils, passwd (useradd) and util-linux; python3-venv brings the venv
# module with the pip and setuptools wheels that ensurepip installs into a venv.
INCLUDE = ("python3", "python3-venv")
# Removed from the rootfs after debootstrap, as Debian's slim images leave them out.
PRUNE = ("var/cache/apt/archives/*.deb", "var/lib/apt/lists/*", "usr/share/doc", "usr/share/man",
         "usr/share/info", "usr/share/locale")
BASE_KEY = hashlib.sha256(repr((SUITE, MIRROR, INCLUDE, PRUNE, 1)).encode()).hexdigest()[:12]

TOOLS = ("buildah", "debootstrap", "unshare", "nsenter", "setpriv", "chroot", "tar")


def missing_tools() -> list[str]:
    return [t for t in TOOLS if shutil.which(t) is None]


def run(cmd: list[str], *, timeout: float, log: Path | None = None, **kwargs: Any) -> subprocess.CompletedProcess[str]:
    """Run a build step; on failure raise with the tail of its output (or of ``log``)."""
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, **kwargs)
    if proc.returncode != 0:
        tail = log.read_text(errors="replace")[-4000:] if log and log.exists() else ""
        raise AssertionError(f"{' '.join(cmd[:4])}... exited {proc.returncode}\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}\n{tail}")
    return proc


def debootstrap_tarball(work: Path, cache: Path | None) -> tuple[Path, float | None]:
    """The pruned debootstrap rootfs as a tarball, and the seconds debootstrap took (None: cached)."""
    cached = cache / f"{SUITE}-{BASE_KEY}.tar" if cache else None
    if cached and cached.exists():
        return cached, None
    rootfs = work / "rootfs"
    started = time.monotonic()
    run(["debootstrap", "--variant=minbase", f"--include={','.join(INCLUDE)}", SUITE, str(rootfs), MIRROR],
        timeout=900, log=rootfs / "debootstrap" / "debootstrap.log")
    seconds = time.monotonic() - started
    for pattern in PRUNE:
        for path in rootfs.glob(pattern):
            shutil.rmtree(path) if path.is_dir() and not path.is_symlink() else path.unlink()
    tarball = work / "rootfs.tar"
    run(["tar", "--numeric-owner", "-C", str(rootfs), "-cf", str(tarball), "."], timeout=300)
    shutil.rmtree(rootfs)
    if cached:
        cached.parent.mkdir(parents=True, exist_ok=True)
        tmp = cached.with_suffix(".tmp")
        shutil.copyfile(tarball, tmp)
        tmp.replace(cached)
    return tarball, seconds


def host_pip_cert() -> Path | None:
    """The CA bundle the host's pip is told to trust (a TLS-inspecting proxy's, say), if any."""
    cert = os.environ.get("PIP_CERT")
    if not cert:
        proc = subprocess.run(["python3", "-m", "pip", "config", "get", "global.cert"], capture_output=True, text=True)
        cert = proc.stdout.strip() if proc.returncode == 0 else ""
    return Path(cert) if cert and Path(cert).is_file() else None


@dataclass
class Buildah:
    """buildah on a private store under ``root``."""

    root: Path

    def __call__(self, *args: str, timeout: float = 600, log: Path | None = None) -> str:
        cmd = ["buildah", "--root", str(self.root / "storage"), "--runroot", str(self.root / "run"),
               "--storage-driver", "vfs", *args]
        return run(cmd, timeout=timeout, log=log).stdout.strip()

    def import_base(self, tarball: Path, name: str, ca_bundle: Path | None) -> None:
        """A base image from a rootfs tarball: Python's env as the python images set it.

        With ``ca_bundle``, the base trusts it for pip (a corporate base image carries its proxy's
        CA the same way); the Dockerfile needs nothing for it."""
        ctr = self("from", "scratch")
        try:
            mnt = Path(self("mount", ctr))
            run(["tar", "--numeric-owner", "-C", str(mnt), "-xpf", str(tarball)], timeout=300)
            if ca_bundle:
                shutil.copyfile(ca_bundle, mnt / "etc/ssl/certs/ca-certificates.crt")
                (mnt / "etc/pip.conf").write_text("[global]\ncert = /etc/ssl/certs/ca-certificates.crt\n")
            self("umount", ctr)
            self("config", "--env", "PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
                 "--env", "LANG=C.UTF-8", "--cmd", '["python3"]',
                 "--created-by", f"debootstrap --variant=minbase --include={','.join(INCLUDE)} {SUITE}", ctr)
            self("commit", "-q", ctr, name)
        finally:
            self("rm", ctr)

    def cleanup(self) -> None:
        """Remove every container and image of the store, then the store itself."""
        for args in (("umount", "--all"), ("rm", "--all"), ("rmi", "--all", "--force")):
            subprocess.run(["buildah", "--root", str(self.root / "storage"), "--runroot", str(self.root / "run"),
                            "--storage-driver", "vfs", *args], capture_output=True, timeout=600)
        shutil.rmtree(self.root, ignore_errors=True)


@dataclass
class ImageConfig:
    """What a runtime takes from the image config (Docker format: it keeps the HEALTHCHECK)."""

    user: str
    env: dict[str, str]
    workdir: str
    entrypoint: list[str]
    cmd: list[str]
    healthcheck: list[str]
    healthcheck_timeout_s: float
    layers: list[tuple[int, str]] = field(default_factory=list)  # (bytes, created_by)

    @classmethod
    def from_inspect(cls, inspect: dict[str, Any]) -> ImageConfig:
        config = inspect["Docker"]["config"]
        sizes = [layer["size"] for layer in json.loads(inspect["Manifest"])["layers"]]
        created = [h.get("created_by", "") for h in inspect["History"] if not h.get("empty_layer")]
        assert len(sizes) == len(created), (sizes, created)
        test = (config.get("Healthcheck") or {}).get("Test") or []
        if test[:1] == ["CMD-SHELL"]:
            test = ["CMD", "/bin/sh", "-c", test[1]]
        return cls(
            user=config.get("User") or "0:0",
            env=dict(e.split("=", 1) for e in config.get("Env") or []),
            workdir=config.get("WorkingDir") or "/",
            entrypoint=config.get("Entrypoint") or [],
            cmd=config.get("Cmd") or [],
            healthcheck=test[1:] if test[:1] == ["CMD"] else [],
            healthcheck_timeout_s=(config.get("Healthcheck") or {}).get("Timeout", 30_000_000_000) / 1e9,
            layers=list(zip(sizes, created)),
        )


# Run inside the new mount and pid namespaces, as root, before giving the command up to the user.
_CONTAINER_SH = r"""
set -e
R=$1 uid=$2 gid=$3; shift 3
mount --make-rprivate /
mount --bind "$R" "$R"
mount -o remount,bind,ro "$R"
mount -t proc proc "$R/proc"
mount -t tmpfs -o mode=755,size=1m dev "$R/dev"
for d in null zero full random urandom tty; do touch "$R/dev/$d"; mount --bind "/dev/$d" "$R/dev/$d"; done
ln -s /proc/self/fd "$R/dev/fd"
mkdir "$R/dev/shm"; mount -t tmpfs -o mode=1777,size=256m shm "$R/dev/shm"
mount -t tmpfs -o mode=1777,size=256m tmp "$R/tmp"
mount -t tmpfs -o mode=700,uid=$uid,gid=$gid,size=512m data "$R/var/lib/ckpt-coordinator"
for f in hosts resolv.conf; do [ ! -f "$R/etc/$f" ] || mount --bind -o ro "/etc/$f" "$R/etc/$f"; done
exec setpriv --no-new-privs chroot --userspec="$uid:$gid" --groups="$gid" "$R" "$@"
"""


def _ids(root: Path, user: str) -> tuple[int, int]:
    name, _, group = user.partition(":")
    passwd = {f[0]: f for f in (ln.split(":") for ln in (root / "etc/passwd").read_text().splitlines())}
    uid = int(name) if name.isdigit() else int(passwd[name][2])
    if group:
        groups = {f[0]: f for f in (ln.split(":") for ln in (root / "etc/group").read_text().splitlines())}
        gid = int(group) if group.isdigit() else int(groups[group][2])
    else:
        gid = int(next(f[3] for f in passwd.values() if int(f[2]) == uid))
    return uid, gid


@dataclass
class Container:
    """The image root ``root`` run as its config says, with a read-only root filesystem."""

    root: Path
    config: ImageConfig
    uid: int = 0
    gid: int = 0
    home: str = "/"

    def __post_init__(self) -> None:
        self.uid, self.gid = _ids(self.root, self.config.user)
        home = [f[5] for f in (ln.split(":") for ln in (self.root / "etc/passwd").read_text().splitlines()) if f[2] == str(self.uid)]
        self.home = home[0] if home else "/"

    def env(self, **overrides: str) -> list[str]:
        # What a runtime gives the process: the image's Env, and HOME from the image's passwd.
        env = {"HOME": self.home, **self.config.env, **overrides}
        return [f"{k}={v}" for k, v in env.items()]

    def start(self, argv: list[str], log: Path, **env: str) -> subprocess.Popen[bytes]:
        """Start ``argv`` in a new container; its output goes to ``log``."""
        command = ["/usr/bin/env", "-i", "-C", self.config.workdir, *self.env(**env), *argv]
        with log.open("wb") as out:
            return subprocess.Popen(
                ["unshare", "--mount", "--pid", "--fork", "sh", "-c", _CONTAINER_SH, "sh", str(self.root),
                 str(self.uid), str(self.gid), *command],
                stdout=out, stderr=subprocess.STDOUT,
            )

    def run(self, argv: list[str], log: Path, timeout: float, **env: str) -> int:
        proc = self.start(argv, log, **env)
        try:
            return proc.wait(timeout=timeout)
        finally:
            self.stop(proc)

    @staticmethod
    def init_pid(proc: subprocess.Popen[bytes], timeout: float = 30) -> int:
        """The host pid of the container's first process (pid 1 in its namespace)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                children = psutil.Process(proc.pid).children()
            except psutil.NoSuchProcess:
                children = []
            if children:
                return children[0].pid
            if proc.poll() is not None:
                raise AssertionError(f"the container exited {proc.returncode} at start")
            time.sleep(0.05)
        raise AssertionError("the container's first process did not appear")

    def exec(self, proc: subprocess.Popen[bytes], argv: list[str], timeout: float, **env: str) -> subprocess.CompletedProcess[str]:
        """Run ``argv`` inside the running container (its mounts, pid namespace, root, working
        directory), as the image's user with the image's environment: what a runtime does for a
        HEALTHCHECK."""
        target = self.init_pid(proc)
        return subprocess.run(
            ["nsenter", "-t", str(target), "-m", "-p", "-r", "-w", "-S", str(self.uid), "-G", str(self.gid),
             "/usr/bin/env", "-i", *self.env(**env), *argv],
            capture_output=True, text=True, timeout=timeout,
        )

    @classmethod
    def stop(cls, proc: subprocess.Popen[bytes], grace_s: float = 60) -> int:
        """SIGTERM to the container's first process, as a runtime stops a container; SIGKILL (the
        whole pid namespace goes with it) after ``grace_s``. Returns its exit status."""
        if proc.poll() is None:
            try:
                pid: int | None = cls.init_pid(proc, timeout=5)
            except AssertionError:
                pid = None
            if pid:
                os.kill(pid, signal.SIGTERM)
            try:
                proc.wait(timeout=grace_s)
            except subprocess.TimeoutExpired:
                if pid:
                    os.kill(pid, signal.SIGKILL)
                proc.kill()
                proc.wait(timeout=30)
        return proc.returncode
