"""One line on a terminal, redrawn in place: the job's stages and its bar (``jobs.driver.progress``) draw in it.

A log record of this process erases the line first, so records print whole; the line is cut to the terminal's
width, so that it can be redrawn in place.
"""

from __future__ import annotations

import logging
import math
import threading
from typing import TextIO

from common.terminal import terminal_columns

LIVE_REFRESH_S = 1.0
"""How often the live line on a terminal is redrawn."""


def format_duration(seconds: float) -> str:
    """130 -> 2m10s, 3900 -> 1h05m, 42 -> 42s, 200000 -> 2d07h; not a finite number -> ?."""
    if not math.isfinite(seconds):
        return "?"
    whole = int(round(seconds))
    hours, rest = divmod(whole, 3600)
    minutes, secs = divmod(rest, 60)
    if hours >= 48:
        return f"{hours // 24}d{hours % 24:02d}h"
    if hours:
        return f"{hours}h{minutes:02d}m"
    return f"{minutes}m{secs:02d}s" if minutes else f"{secs}s"


class LiveLine:
    """One line on a terminal, redrawn in place (``show``) and left on the screen at the end (``end``).

    After each redraw the cursor goes back to the line's start, so that whatever else writes to the
    terminal (Ray prints its workers' log lines from a thread of its own) overwrites the line rather
    than continuing it; the next redraw puts it back below. While the line is shown, a log record of
    this process first erases it (a filter on the root logger's handlers), so records print whole.
    """

    def __init__(self, stream: TextIO) -> None:
        self._stream = stream
        self._shown = False
        self._lock = threading.Lock()
        """A thread redraws the line while the main thread sits in a Ray call and may log."""
        self._filter = _EraseBefore(self)
        self._handlers = list(logging.getLogger().handlers)
        for handler in self._handlers:
            handler.addFilter(self._filter)

    def show(self, text: str) -> None:
        with self._lock:
            self._write("\r" + _fit(text, self._stream) + "\x1b[K\r")
            self._shown = True

    def erase(self) -> None:
        with self._lock:
            if self._shown:
                self._write("\r\x1b[K")
                self._shown = False

    def end(self, text: str) -> None:
        """The last redraw, kept: the cursor goes to the next line."""
        with self._lock:
            self._write("\r" + _fit(text, self._stream) + "\x1b[K\n")
            self._shown = False
        self._remove_filter()

    def close(self) -> None:
        """Erased, leaving the screen as it was before the line."""
        self.erase()
        self._remove_filter()

    def _remove_filter(self) -> None:
        for handler in self._handlers:
            handler.removeFilter(self._filter)

    def _write(self, text: str) -> None:
        try:
            self._stream.write(text)
            self._stream.flush()
        except (OSError, ValueError):  # the terminal went away: the run goes on, its summary still says it
            pass


class _EraseBefore(logging.Filter):
    def __init__(self, line: LiveLine) -> None:
        super().__init__()
        self._line = line

    def filter(self, record: logging.LogRecord) -> bool:
        self._line.erase()
        return True


def _fit(text: str, stream: TextIO) -> str:
    """``text`` cut to the terminal's width, 80 columns where it reports none (a wrapped line could not be
    redrawn in place), after its last whole ``, ``-separated part that fits; whole on a stream that is no
    terminal."""
    width = terminal_columns(stream) - 1
    if not stream.isatty() or len(text) <= width:
        return text
    cut = text.rfind(", ", 0, width + 1)
    return text[:cut] if cut > 0 else text[:width]
