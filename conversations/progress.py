"""Progress of a pass over the conversations: a tqdm bar on a terminal, else a log line per interval."""

from __future__ import annotations

import logging
import sys
import time
from typing import Any, Optional

from common.terminal import tqdm_width

logger = logging.getLogger(__name__)


class Progress:
    """Conversations done of ``total``, their rate and the time left."""

    def __init__(self, what: str, total: int, interval_s: float, already: int = 0) -> None:
        self.what, self.total, self.interval_s = what, total, interval_s
        self.done = already
        self._already = already
        self._started = self._last = time.monotonic()
        self._bar: Optional[Any] = None
        if sys.stderr.isatty():
            from tqdm import tqdm

            self._bar = tqdm(total=total, initial=already, unit="conv", desc=what, **tqdm_width(sys.stderr))

    @property
    def rate(self) -> float:
        """Conversations a second in this run (rows an earlier run did are not counted)."""
        return (self.done - self._already) / max(time.monotonic() - self._started, 1e-9)

    def update(self, rows: int) -> None:
        self.done += rows
        if self._bar is not None:
            self._bar.update(rows)
            return
        now = time.monotonic()
        if now - self._last >= self.interval_s:
            self._last = now
            self._log()

    def _log(self) -> None:
        rate = self.rate
        left = (self.total - self.done) / rate if rate > 0 else float("inf")
        eta = f"{left:.0f} s left" if left != float("inf") else "rate not known yet"
        logger.info("%s: %d/%d conversations (%.1f%%), %.0f/s, %s", self.what, self.done, self.total,
                    100.0 * self.done / max(self.total, 1), rate, eta)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
        else:
            self._log()
