"""What the job does before its first batch, shown from its first second: a live line on a terminal, log lines
otherwise.

Before the first batch the job goes through stages (reading the inputs, checking the layers, starting Ray,
loading the model and starting the writers, warming the object store), any of which may last minutes on a large
model while the driver sits in one call. A thread of the driver redraws the live line every ``LIVE_REFRESH_S``
with the stage's seconds and its detail (while the model loads: how many extractors are ready and what the others'
loads do now, how many writers are up); without a terminal the stage is logged when it begins and every
``progress.interval_s`` while it lasts. ``RunProgress`` closes the stages at the first batch and draws its own
line in the same place.
"""

from __future__ import annotations

import logging
import sys
import threading
import time
from typing import Callable, Optional, TextIO

from runtime.display.live import LIVE_REFRESH_S, LiveLine, format_duration
from runtime.display.timeline import Timeline

logger = logging.getLogger(__name__)

JOIN_TIMEOUT_S = 2.0
"""How long closing waits for the redrawing thread (a daemon): a detail read from a Ray cluster that went away
may hold it longer, and the job's end must not wait on that."""


class StageLine:
    """The job's current stage on ``stream`` (default stderr): a live line if it is a terminal, else log lines."""

    def __init__(self, interval_s: float, stream: Optional[TextIO] = None, interactive: Optional[bool] = None) -> None:
        self.interval_s = interval_s
        self.stream = stream if stream is not None else sys.stderr
        self.interactive = self.stream.isatty() if interactive is None else interactive
        self._lock = threading.Lock()
        self._stage = ""
        self._detail: Optional[Callable[[], str]] = None
        self._since = self._logged = 0.0
        self._line: Optional[LiveLine] = None
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None
        self.timeline = Timeline()
        """Every stage shown is a phase of it; the phases after the stages are entered there directly."""

    def show(self, stage: str, detail: Optional[Callable[[], str]] = None) -> None:
        """From now on the job is in ``stage`` (``starting Ray``); ``detail``, called at each redraw, says more
        (``0 of 2 extractors ready``)."""
        self.timeline.enter(stage)
        with self._lock:
            if self._stop.is_set():
                return
            self._stage, self._detail, self._since = stage, detail, time.monotonic()
            if self.interactive and self._line is None:
                self._line = LiveLine(self.stream)
            if self._thread is None:
                self._thread = threading.Thread(target=self._keep, name="eagle3-stages", daemon=True)
                self._thread.start()
        self._draw(log=True)

    def text(self) -> str:
        """``loading the model (12s): 0 of 1 extractors ready (node 10.0.0.5: importing SGLang)``: the seconds
        before the detail, so that a narrow terminal, which cuts the line's end, still shows them move."""
        detail = self._detail() if self._detail is not None else ""
        return f"{self._stage} ({format_duration(time.monotonic() - self._since)}){': ' + detail if detail else ''}"

    def close(self) -> None:
        """The stages are over (the first batch goes out, or the job ends): the live line is erased."""
        with self._lock:
            self._stop.set()
            if self._line is not None:
                self._line.close()
                self._line = None
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=JOIN_TIMEOUT_S)

    def _keep(self) -> None:
        period = LIVE_REFRESH_S if self.interactive else min(LIVE_REFRESH_S, self.interval_s)
        while not self._stop.wait(period):
            self._draw(log=time.monotonic() - self._logged >= self.interval_s)

    def _draw(self, log: bool) -> None:
        since = self._since
        try:  # outside the lock: a detail may wait on Ray's GCS
            text = self.text()
        except Exception as error:  # noqa: BLE001 - a detail that cannot be read now must not stop the job
            text = f"{self._stage} (its detail failed: {type(error).__name__}: {error})"
        with self._lock:
            if self._stop.is_set() or since != self._since:  # closed, or a new stage began meanwhile
                return
            if self._line is not None:
                self._line.show(text)
            elif log:
                self._logged = time.monotonic()
                logger.info("%s", text)
