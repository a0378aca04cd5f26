"""Progress on stderr: a redrawn status line with a bar on a terminal, plain event lines
otherwise (logs and CI), nothing with ``--quiet``."""

from __future__ import annotations

import shutil
import sys
import time
from typing import TextIO

__all__ = ["Progress", "bar"]


def bar(done: int, total: int, width: int = 20) -> str:
    total = max(total, 1)
    filled = min(width, round(width * done / total))
    return "█" * filled + "░" * (width - filled)


class Progress:
    def __init__(self, stream: TextIO | None = None, *, quiet: bool = False, tty: bool | None = None) -> None:
        self.stream = stream if stream is not None else sys.stderr
        self.quiet = quiet
        self.tty = (self.stream.isatty() if tty is None else tty) and not quiet
        self._status = ""
        self._started = time.monotonic()

    def _clock(self) -> str:
        return f"{time.monotonic() - self._started:6.1f}s"

    def _clear(self) -> None:
        if self.tty and self._status:
            self.stream.write("\r\x1b[2K")
            self._status = ""

    def event(self, phase: str, text: str) -> None:
        """One line that stays (the status line is redrawn below it)."""
        if self.quiet:
            return
        status = self._status
        self._clear()
        self.stream.write(f"{self._clock()} [{phase}] {text}\n")
        if status:
            self.status(status)
        self.stream.flush()

    def status(self, text: str | list[str]) -> None:
        """The line that is redrawn in place; on a non-terminal it is not shown at all. Given
        parts, the trailing ones are dropped until the line fits the terminal."""
        if not self.tty:
            return
        width = max(20, shutil.get_terminal_size((100, 20)).columns - 1)
        if isinstance(text, list):
            parts = list(text)
            while len(parts) > 1 and len(" │ ".join(parts)) > width:
                parts.pop()
            text = " │ ".join(parts)
        line = text[:width]
        self.stream.write("\r\x1b[2K" + line)
        self.stream.flush()
        self._status = line

    def clear(self) -> None:
        """Drop the status line (its subject is gone, e.g. a killed trainer)."""
        self._clear()
        self.stream.flush()

    def done(self) -> None:
        self._clear()
        if not self.quiet:
            self.stream.flush()
