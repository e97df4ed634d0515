"""Where a command's wall time went: its phases one after another, each from its start to the next one's.

A command's wall time is more than its steady state: starting Ray, loading the model, the engine's shutdown. The
phases are the stages a command shows (``runtime.display.stages``) and those after them that a bar shows instead
(regenerating, tokenizing); a phase entered twice adds up. The table goes into the command's record and its last
lines, so that a slow command says which part was slow.
"""

from __future__ import annotations

import threading
import time
from typing import Any


class Timeline:
    """Consecutive phases of one command, timed by the monotonic clock from the Timeline's creation."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._started = time.monotonic()
        self._seconds: dict[str, float] = {}
        self._phase = ""
        self._since = self._started

    def enter(self, phase: str, seconds_ago: float = 0.0) -> None:
        """From now on the command is in ``phase``; the phase before it ends here. With ``seconds_ago``, ``phase``
        began that long ago (a boundary known only afterwards, such as the last batch written), though not before
        the phase before it began."""
        with self._lock:
            now = max(self._since, time.monotonic() - max(0.0, seconds_ago))
            if self._phase:
                self._seconds[self._phase] = self._seconds.get(self._phase, 0.0) + now - self._since
            self._phase, self._since = phase, now

    def seconds(self) -> dict[str, Any]:
        """``{"phases": [[phase, seconds], ...], "total": seconds}``: the phases in the order first entered, the
        current one up to now, the total since creation (a list of pairs: it keeps its order through JSON written
        with sorted keys)."""
        with self._lock:
            now = time.monotonic()
            seconds = dict(self._seconds)
            if self._phase:
                seconds[self._phase] = seconds.get(self._phase, 0.0) + now - self._since
            return {"phases": [[phase, round(value, 2)] for phase, value in seconds.items()],
                    "total": round(now - self._started, 2)}

    def line(self) -> str:
        """``wall time 211.0 s: reading the inputs 1.2 s, starting Ray 2.3 s, ...``."""
        return wall_time_line(self.seconds())


def wall_time_line(seconds: dict[str, Any]) -> str:
    """The one-line table of a ``Timeline.seconds()`` (also as read back from a command's record)."""
    phases = ", ".join(f"{phase} {value:.1f} s" for phase, value in seconds["phases"])
    return f"wall time {seconds['total']:.1f} s: {phases}"
