"""The image, built once per session from the Dockerfile on a debootstrap base, and its report.

Skip it locally with ``CKPTC_SKIP_IMAGE=1`` (or ``-m "not image"``); under ``CKPTC_CI`` it cannot
be skipped: a missing tool, a non-root user or the opt-out fails it. The debootstrap rootfs is
cached in ``CKPTC_IMAGE_BASE_CACHE`` (default ``~/.cache/ckpt-coordinator/image-base``; empty: no
cache) between local runs; CI always builds the base afresh.
"""

from __future__ import annotations

import json
import os
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from ..ci_policy import in_ci
from ..conftest import summary_line
from .buildah import Buildah, Container, ImageConfig, debootstrap_tarball, host_pip_cert, missing_tools

ROOT = Path(__file__).resolve().parents[2]
BASE = "localhost/ckptc-test-base:bookworm"
IMAGE = "localhost/ckpt-coordinator:test"

# Lines for the terminal summary: CI output shows what was built, also without -s. They reach
# it as each test's summary lines (tests/conftest.py), also from an xdist worker.
REPORT: list[str] = []
_passed_on = 0


@pytest.fixture(autouse=True)
def _report_to_summary(request: pytest.FixtureRequest) -> Iterator[None]:
    global _passed_on
    yield
    for line in REPORT[_passed_on:]:
        summary_line(request.node, "container image (tests/image)", line)
    _passed_on = len(REPORT)


def _skip_or_fail(reason: str) -> None:
    if in_ci():
        pytest.fail(f"CKPTC_CI is set, so the image test must run: {reason}", pytrace=False)
    pytest.skip(reason)


def _mb(size: int) -> str:
    return f"{size / 1e6:.1f} MB"


@pytest.fixture(scope="session")
def buildah_store() -> Iterator[Buildah]:
    if os.environ.get("CKPTC_SKIP_IMAGE"):
        _skip_or_fail("CKPTC_SKIP_IMAGE is set")
    missing = missing_tools()
    if missing:
        _skip_or_fail(f"{', '.join(missing)} is not installed (apt-get install buildah debootstrap)")
    if os.geteuid() != 0:
        _skip_or_fail("the image test needs root (buildah's vfs store, mount namespaces)")
    store = Buildah(Path(tempfile.mkdtemp(prefix="ckptc-buildah-", dir="/var/tmp")))
    try:
        yield store
    finally:
        store.cleanup()


@pytest.fixture(scope="session")
def image(buildah_store: Buildah) -> ImageConfig:
    """The Dockerfile built on the debootstrap base; its config as a runtime reads it."""
    cache_env = os.environ.get("CKPTC_IMAGE_BASE_CACHE", str(Path.home() / ".cache/ckpt-coordinator/image-base"))
    cache = None if in_ci() or not cache_env else Path(cache_env)
    tarball, debootstrap_s = debootstrap_tarball(buildah_store.root, cache)
    buildah_store.import_base(tarball, BASE, host_pip_cert())
    REPORT.append(f"base: debootstrap {tarball.name}" + (f" in {debootstrap_s:.0f}s" if debootstrap_s else " (cached)"))

    started = time.monotonic()
    # docker format: OCI image configs have no HEALTHCHECK. No --layers: each stage commits one
    # layer over its base. On buildah's vfs store (no copy-on-write) every intermediate layer is
    # a whole copy of the root filesystem, which made the build and its cleanup most of CI's time.
    buildah_store("bud", "--isolation", "chroot", "--format", "docker", "--pull=never", "--layers=false",
                  "--build-arg", f"BASE_IMAGE={BASE}", "-t", IMAGE, "-f", str(ROOT / "Dockerfile"), str(ROOT),
                  timeout=1500)
    build_s = time.monotonic() - started
    config = ImageConfig.from_inspect(json.loads(buildah_store("inspect", "--type", "image", IMAGE)))
    base_layers = len(ImageConfig.from_inspect(json.loads(buildah_store("inspect", "--type", "image", BASE))).layers)
    total = sum(size for size, _ in config.layers)
    own = sum(size for size, _ in config.layers[base_layers:])
    REPORT.append(f"build (buildah bud, vfs, one layer per stage): {build_s:.0f}s")
    REPORT.append(f"image {IMAGE}: {_mb(total)} uncompressed, {len(config.layers)} layers "
                  f"({_mb(own)} in the {len(config.layers) - base_layers} the Dockerfile adds)")
    for i, (size, created_by) in enumerate(config.layers):
        origin = "base" if i < base_layers else "Dockerfile"
        REPORT.append(f"  layer {i}: {_mb(size):>10}  {origin:10}  {created_by.removeprefix('/bin/sh -c ')[:110]}")
    return config


@pytest.fixture(scope="session")
def image_root(buildah_store: Buildah, image: ImageConfig) -> Iterator[Path]:
    """The image's filesystem, mounted from a working container of it (never written to)."""
    ctr = buildah_store("from", "-q", IMAGE)
    try:
        yield Path(buildah_store("mount", ctr))
    finally:
        buildah_store("umount", ctr)
        buildah_store("rm", ctr)


@pytest.fixture
def container(image_root: Path, image: ImageConfig) -> Container:
    return Container(image_root, image)
