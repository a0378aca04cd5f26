"""The embedded PostgreSQL starts with the coordinator's tuning, never with durability weakened,
and a setting it cannot start with is reported in one clear line (no traceback, nothing left running);
a coordinator killed outright does not keep the server alive after the next one exits."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
from sqlalchemy import create_engine, text

from checkpoint_coordinator.cli import main
from checkpoint_coordinator.config import parse_pg_settings
from checkpoint_coordinator.ledger.db import (
    EMBEDDED_PG_TUNING,
    HANDLE_PIDS_FILE,
    EmbeddedStartError,
    TUNING_FILE,
    sqlalchemy_url,
    start_embedded,
)


@pytest.fixture()
def data_dir() -> Iterator[Path]:
    d = Path(tempfile.mkdtemp(prefix="ckptc-tuning-"))
    yield d
    shutil.rmtree(d, ignore_errors=True)


def _show(url: str, *names: str) -> dict[str, str]:
    eng = create_engine(sqlalchemy_url(url))
    try:
        with eng.connect() as c:
            return {n: c.execute(text(f"SHOW {n}")).scalar_one() for n in names}
    finally:
        eng.dispose()


def test_server_starts_with_the_tuning_and_overrides_keep_durability(data_dir: Path) -> None:
    emb = start_embedded(data_dir, settings={"work_mem": "48MB"})
    try:
        got = _show(emb.url, "shared_buffers", "work_mem", "max_wal_size", "wal_writer_delay", "fsync", "synchronous_commit", "full_page_writes")
    finally:
        emb.stop()
    assert got["shared_buffers"] == EMBEDDED_PG_TUNING["shared_buffers"]
    assert got["max_wal_size"] == EMBEDDED_PG_TUNING["max_wal_size"]
    assert got["wal_writer_delay"] == "10ms"  # unflushed snapshot moves reach the disk soon
    assert got["work_mem"] == "48MB"  # the override wins over the built-in value
    assert (got["fsync"], got["synchronous_commit"], got["full_page_writes"]) == ("on", "on", "on")
    conf = (data_dir / "pgdata" / "postgresql.conf").read_text()
    assert conf.count(f"include_if_exists = '{TUNING_FILE}'") == 1


def test_restart_rewrites_the_tuning_without_duplicating_the_include(data_dir: Path) -> None:
    start_embedded(data_dir, settings={"work_mem": "40MB"}).stop()
    emb = start_embedded(data_dir, settings={"work_mem": "24MB"})
    try:
        assert _show(emb.url, "work_mem") == {"work_mem": "24MB"}
    finally:
        emb.stop()
    assert (data_dir / "pgdata" / "postgresql.conf").read_text().count(TUNING_FILE) == 1


def test_a_value_the_server_refuses_is_one_clear_error_and_a_good_one_starts_again(data_dir: Path) -> None:
    with pytest.raises(EmbeddedStartError) as e:
        start_embedded(data_dir, settings={"shared_buffers": "lots"})
    assert "shared_buffers" in str(e.value) and "lots" in str(e.value)
    emb = start_embedded(data_dir)  # the file is rewritten at every start: nothing sticks
    try:
        assert _show(emb.url, "shared_buffers")["shared_buffers"] == EMBEDDED_PG_TUNING["shared_buffers"]
    finally:
        emb.stop()


@pytest.mark.parametrize(
    "value, message",
    [
        ("fsync=off", "cannot be changed"),
        ("synchronous_commit=off", "cannot be changed"),
        ("work_mem", "name=value"),
        ("work_mem=1MB;fsync=off", "name=value"),
        ("work mem=1MB", "name=value"),
        ("work_mem='1MB'", "name=value"),
    ],
)
def test_refused_settings_name_the_item(value: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        parse_pg_settings(value)


def test_parse_accepts_spaces_case_and_empty_items() -> None:
    assert parse_pg_settings(" Work_Mem = 64MB ,, shared_buffers=1GB ") == {"work_mem": "64MB", "shared_buffers": "1GB"}
    assert parse_pg_settings("") == {}


@pytest.mark.parametrize(
    "value, code, says",
    [
        # Refused by the configuration, before any server is started.
        ("fsync=off", 2, ("CKPTC_EMBEDDED_PG_SETTINGS", "durable")),
        # Lexically fine, refused by the server: one line with the server's own complaint.
        ("max_wal_size=huge", 1, ("did not start", "max_wal_size")),
    ],
)
def test_cli_reports_a_bad_setting_in_one_line(
    value: str, code: int, says: tuple[str, ...], monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], data_dir: Path
) -> None:
    monkeypatch.setenv("CKPTC_DATA_DIR", str(data_dir))
    monkeypatch.setenv("CKPTC_EMBEDDED_PG_SETTINGS", value)
    assert main(["migrate"]) == code
    err = capsys.readouterr().err
    assert all(s in err for s in says) and "Traceback" not in err
    if code == 2:
        assert not (data_dir / "pgdata").exists()


def test_a_coordinator_killed_outright_does_not_keep_the_server_alive_after_the_next_one_exits(data_dir: Path) -> None:
    """A SIGKILLed coordinator leaves its pid in the wheel's handle list; the next coordinator on
    the same data directory must still stop the server when it exits."""
    import psutil

    victim = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    victim.kill()
    victim.wait()
    assert not psutil.pid_exists(victim.pid)
    start_embedded(data_dir).stop()  # an initialised data directory, its server stopped
    pgdata = data_dir / "pgdata"
    (pgdata / HANDLE_PIDS_FILE).write_text(json.dumps([victim.pid]))  # as the killed process left it
    emb = start_embedded(data_dir)
    postmaster = psutil.Process(int((pgdata / "postmaster.pid").read_text().split()[0]))
    try:
        assert postmaster.is_running()
        assert json.loads((pgdata / HANDLE_PIDS_FILE).read_text()) == [os.getpid()]
        emb.stop()
        with contextlib.suppress(psutil.TimeoutExpired):
            postmaster.wait(timeout=30)
        assert not postmaster.is_running()
    finally:
        if postmaster.is_running():  # the failure this test is about: leave nothing behind
            postmaster.terminate()
