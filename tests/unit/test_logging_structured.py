"""Structured logging: JSON lines, bound ids, and secrets that never reach the output."""

from __future__ import annotations

import asyncio
import io
import json
import logging
from collections.abc import Iterator

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from checkpoint_coordinator.observability.logging import (
    _BEARER_RE,
    _KV_RE,
    _URL_PASSWORD_RE,
    REDACTED,
    bind,
    bound,
    configure_logging,
    redact_text,
    redact_value,
)


@pytest.fixture()
def json_log() -> Iterator[io.StringIO]:
    stream = io.StringIO()
    handler = configure_logging("json", level="DEBUG", stream=stream)
    yield stream
    logging.getLogger().removeHandler(handler)


@pytest.fixture()
def text_log() -> Iterator[io.StringIO]:
    stream = io.StringIO()
    handler = configure_logging("text", level="DEBUG", stream=stream)
    yield stream
    logging.getLogger().removeHandler(handler)


def lines(stream: io.StringIO) -> list[dict]:
    """This test's JSON lines (other loggers, e.g. asyncio at DEBUG, are left out)."""
    entries = [json.loads(line) for line in stream.getvalue().splitlines() if line.strip()]
    return [e for e in entries if e["logger"].startswith("ckptc.test") or e["logger"].startswith("uvicorn")]


log = logging.getLogger("ckptc.test")


def test_json_lines_have_the_schema(json_log: io.StringIO) -> None:
    log.info("snapshot %s published", "s1", extra={"episodes": 4})
    (entry,) = lines(json_log)
    assert entry["msg"] == "snapshot s1 published"
    assert entry["level"] == "info"
    assert entry["logger"] == "ckptc.test"
    assert entry["episodes"] == 4
    assert entry["ts"].endswith("Z")
    # Ids are present on every line, null when unbound, so queries have one schema.
    assert entry["run_id"] is None and entry["snapshot_id"] is None and entry["instance_id"] is None


def test_bind_puts_ids_on_every_line_and_nests(json_log: io.StringIO) -> None:
    with bind(run_id="run-7"):
        log.info("a")
        with bind(snapshot_id="snap-1", instance_id="math/replica-0"):
            log.info("b")
            with bind(instance_id=None):
                log.info("c")
        log.info("d")
    log.info("e")
    got = [(e["msg"], e["run_id"], e["snapshot_id"], e["instance_id"]) for e in lines(json_log)]
    assert got == [
        ("a", "run-7", None, None),
        ("b", "run-7", "snap-1", "math/replica-0"),
        ("c", "run-7", "snap-1", None),
        ("d", "run-7", None, None),
        ("e", None, None, None),
    ]
    assert bound() == {}


def test_bind_rejects_other_keys() -> None:
    with pytest.raises(TypeError, match="rollout_id"):
        with bind(rollout_id="r_g0_a" + "0" * 32):
            pass


async def test_bindings_follow_asyncio_tasks(json_log: io.StringIO) -> None:
    async def work(instance: str) -> None:
        with bind(instance_id=instance):
            await asyncio.sleep(0)
            log.info("prepared")

    with bind(run_id="run-1"):
        await asyncio.gather(work("a/replica-0"), work("b/replica-0"))
    entries = lines(json_log)
    assert sorted((e["run_id"], e["instance_id"]) for e in entries) == [
        ("run-1", "a/replica-0"),
        ("run-1", "b/replica-0"),
    ]


def test_explicit_extra_id_wins_over_binding(json_log: io.StringIO) -> None:
    with bind(run_id="outer"):
        log.info("x", extra={"run_id": "explicit"})
    assert lines(json_log)[0]["run_id"] == "explicit"


SECRETS = ["tok-ABC123xyz", "hunter2pw", "s3cr3t-value", "dbpass99"]


def assert_no_secret(output: str) -> None:
    for secret in SECRETS:
        assert secret not in output, f"{secret!r} leaked into: {output}"
    assert REDACTED in output


@pytest.mark.parametrize(
    ("message", "args"),
    [
        ("calling gym with Authorization: Bearer tok-ABC123xyz", ()),
        ("headers=%s", ({"Authorization": "Bearer tok-ABC123xyz"},)),
        ("connecting to %s", ("postgresql+psycopg://ckptc:hunter2pw@db.svc:5432/ckptc",)),
        ("config admin_token=tok-ABC123xyz control_timeout_s=60", ()),
        ('body {"control_auth_token": "tok-ABC123xyz", "x": 1}', ()),
        ("libpq dsn host=db password=dbpass99 dbname=x", ()),
        ("client_secret: s3cr3t-value", ()),
    ],
)
def test_messages_are_redacted(json_log: io.StringIO, message: str, args: tuple) -> None:
    log.warning(message, *args)
    assert_no_secret(json_log.getvalue())
    # Unrelated text survives redaction.
    if "control_timeout_s" in message:
        assert "control_timeout_s=60" in lines(json_log)[0]["msg"]


def test_extra_fields_are_redacted_by_name_and_content(json_log: io.StringIO) -> None:
    log.info(
        "registered instance",
        extra={
            "control_token": "tok-ABC123xyz",
            "database_url": "postgresql://u:dbpass99@h/db",
            "servers": [{"name": "model", "password": "hunter2pw", "base_url": "http://m:8000"}],
            "db_secret": {"nested": "s3cr3t-value"},
        },
    )
    entry = lines(json_log)[0]
    assert_no_secret(json_log.getvalue())
    assert entry["control_token"] == REDACTED
    assert entry["database_url"] == f"postgresql://u:{REDACTED}@h/db"
    assert entry["servers"][0]["base_url"] == "http://m:8000"


def test_exception_text_is_redacted(json_log: io.StringIO) -> None:
    try:
        raise ConnectionError("could not connect to postgresql://ckptc:hunter2pw@db:5432/x")
    except ConnectionError:
        log.exception("database down")
    entry = lines(json_log)[0]
    assert "ConnectionError" in entry["exc"]
    assert_no_secret(json_log.getvalue())


def test_text_format_is_redacted_and_shows_ids(text_log: io.StringIO) -> None:
    with bind(run_id="run-9"):
        log.info("token=%s", "tok-ABC123xyz", extra={"admin_token": "s3cr3t-value"})
    out = text_log.getvalue()
    assert "run_id=run-9" in out and "INFO" in out
    assert_no_secret(out)


def test_redaction_is_idempotent() -> None:
    once = redact_text("Authorization: Bearer abc token=x postgresql://u:p@h/d")
    assert redact_text(once) == once
    assert once.count(REDACTED) == 3 and "]]" not in once


def test_redact_value_keeps_harmless_values() -> None:
    assert redact_value({"count": 3, "ok": True, "name": "model"}) == {"count": 3, "ok": True, "name": "model"}
    assert redact_value({"Authorization": "Basic Zm9vOmJhcg=="}) == {"Authorization": REDACTED}


def test_configure_takes_back_loggers_uvicorn_configured() -> None:
    import logging.config

    from uvicorn.config import LOGGING_CONFIG

    logging.config.dictConfig(LOGGING_CONFIG)  # what uvicorn.run does with its default log_config
    access = logging.getLogger("uvicorn.access")
    access.disabled = True
    access.setLevel(logging.WARNING)
    stream = io.StringIO()
    handler = configure_logging("json", stream=stream)
    try:
        access.info('%s - "GET /v1/runs/r?token=%s HTTP/1.1" 200', "127.0.0.1:5", "tok-ABC123xyz")
        (entry,) = [json.loads(line) for line in stream.getvalue().splitlines()]
        assert entry["logger"] == "uvicorn.access" and "tok-ABC123xyz" not in entry["msg"]
        assert not access.handlers and access.propagate
    finally:
        logging.getLogger().removeHandler(handler)


def test_configure_is_idempotent_and_adopts_uvicorn() -> None:
    root = logging.getLogger()
    h1 = configure_logging("json", stream=io.StringIO())
    h2 = configure_logging("json", stream=io.StringIO())
    try:
        assert h1 not in root.handlers and h2 in root.handlers
        uvicorn_access = logging.getLogger("uvicorn.access")
        assert uvicorn_access.propagate and not uvicorn_access.handlers
    finally:
        root.removeHandler(h2)
    with pytest.raises(ValueError):
        configure_logging("xml")  # type: ignore[arg-type]


def test_uvicorn_console_colour_copy_is_dropped(json_log: io.StringIO) -> None:
    logging.getLogger("uvicorn.error").info(
        "Started server process [%d]", 42, extra={"color_message": "Started server process [\x1b[36m%d\x1b[0m]"}
    )
    (entry,) = lines(json_log)
    assert entry["msg"] == "Started server process [42]" and "color_message" not in entry


def test_uvicorn_access_lines_go_through_redaction(json_log: io.StringIO) -> None:
    logging.getLogger("uvicorn.access").info(
        '%s - "%s %s HTTP/%s" %d', "127.0.0.1:5", "GET", "/v1/runs/r?token=tok-ABC123xyz", "1.1", 200
    )
    assert_no_secret(json_log.getvalue())


def _every_pattern(text: str) -> str:
    """Redaction without the shortcut that skips a pattern: the oracle for ``redact_text``."""
    if not text:
        return text
    text = _URL_PASSWORD_RE.sub(lambda m: f"{m['prefix']}{REDACTED}{m['at']}", text)
    text = _KV_RE.sub(lambda m: f"{m['key']}{m['sep']}{m['quote']}{REDACTED}", text)
    return _BEARER_RE.sub(lambda m: f"{m[1]}{m[2]}{REDACTED}", text)


# Pieces of secrets and of harmless text, in any case, with the characters IGNORECASE matches
# to their letters (long s, Kelvin sign, dotless i, dotted capital I).
_PIECES = st.sampled_from([
    "token", "TOKEN", "Passwd", "password", "pwd", "secret", "ſecret", "Authorization", "authorızation", "api_key",
    "API-KEY", "cookie", "\u212aey", "bearer", "Basic", "basİc", "://", "https://u:", "@", "=", ": ", '"', "'", " ",
    "abc", "control_timeout_s", "x.y-z", "tok-9", ",", "}", "\n",
])


@settings(max_examples=500, deadline=None)
@given(st.lists(_PIECES, max_size=12).map("".join))
@example("bas\u0130c token")  # the dotted capital I folds to two characters
def test_redaction_skips_a_pattern_only_where_it_cannot_match(text: str) -> None:
    assert redact_text(text) == _every_pattern(text)
