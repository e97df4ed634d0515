"""Waiting for disk: a state of the driver's loop, not a loop of its own.

When nothing is open and the next shard fits no lane's budget, the run waits:
the loop goes on settling the work in flight (writes, uploads: they free space)
and re-scanning for files a consumer deleted, and ``DiskWait`` only keeps the
wait's clocks. With nothing in flight and nothing freed for ``output.budget_wait_s``
seconds, nothing the run does can free space and no consumer is taking files:
``idle`` raises ``BudgetExhausted`` (exit 3). Space freed that is still too little
for the next shard (a consumer took a smaller shard) restarts that clock: a
trainer slower than the job keeps it waiting as long as it keeps consuming.
Because the wait never runs completions from inside the scheduler, a shard a
fault sends back while the run waits is simply the next one to open.
"""

from __future__ import annotations

import logging
import time
from typing import Callable, Optional

from common.checks import format_bytes
from jobs.driver.lanes import Lane
from jobs.driver.progress import RunProgress
from runtime.errors import BudgetExhausted

logger = logging.getLogger(__name__)

LOG_PERIOD_S = 30.0


class DiskWait:
    def __init__(
        self, wait_s: float, rescan_s: float, progress: RunProgress, exhausted: Callable[[Lane, str], str],
    ) -> None:
        """``exhausted(lane, budget state)``: the message of the stop, naming what to change."""
        self._wait_s = wait_s
        self._rescan_s = rescan_s
        self._progress = progress
        self._exhausted = exhausted
        self._blocked: Optional[tuple[Lane, int]] = None
        self._started = 0.0
        self._last_log = 0.0
        self._counted = 0.0
        """Until when the wait is counted in the metrics."""
        self._idle_since: Optional[float] = None
        self._used = 0
        """Every budget's use at the last look: less now means something freed space, on any node."""
        self.blocked_seconds = 0.0
        """Time the run held its next shard back for disk, over every wait."""

    @property
    def waiting(self) -> bool:
        return self._blocked is not None

    def update(self, blocked: Optional[tuple[Lane, int]], used: int) -> None:
        """What ``Scheduler.open_what_fits`` said: the lane and bytes of a shard that fits nowhere, or None;
        ``used``: every lane's budget use now (a consumer on any node frees space a shard may open in)."""
        now = time.monotonic()
        if blocked is not None and self._blocked is None:
            self._started = self._last_log = self._counted = now
            self._idle_since = None
            lane, nbytes = blocked
            logger.warning("waiting for disk budget: %s (next shard needs %s)", lane.budget.describe_block(nbytes),
                           format_bytes(nbytes))
            self._progress.disk_wait_started()
        elif blocked is None and self._blocked is not None:
            waited = now - self._started
            self.blocked_seconds += waited
            lane = self._blocked[0]
            logger.info("disk budget free again after %.1f s: %s", waited, lane.budget.describe_use())
            self._progress.disk_wait_ended(now - self._counted)
        elif blocked is not None and used < self._used:
            self._idle_since = None
            lane, nbytes = blocked
            logger.info("%s freed, still waiting for disk budget: %s", format_bytes(self._used - used),
                        lane.budget.describe_block(nbytes))
        elif blocked is not None and now - self._last_log >= LOG_PERIOD_S:
            self._last_log = now
            self._progress.disk_waited(now - self._counted)
            self._counted = now
            lane, nbytes = blocked
            logger.warning("waiting for disk budget: %s", lane.budget.describe_block(nbytes))
        self._blocked = blocked
        self._used = used

    def busy(self) -> None:
        """Work is in flight: it may free space, so the wait is not idle."""
        self._idle_since = None

    def idle(self) -> None:
        """Nothing is in flight: sleep until the next rescan, or stop once nothing was freed for ``budget_wait_s``."""
        assert self._blocked is not None, "idle() outside a wait for disk"
        now = time.monotonic()
        self._idle_since = self._idle_since if self._idle_since is not None else now
        idle_for = now - self._idle_since
        if idle_for >= self._wait_s:
            lane, nbytes = self._blocked
            self.update(None, self._used)
            raise BudgetExhausted(self._exhausted(lane, lane.budget.describe_block(nbytes)))
        # Also every refresh: the metrics are set only by the loop's turns, and Ray drops a gauge left unset.
        time.sleep(min(self._rescan_s, self._progress.refresh_s, self._wait_s - idle_for))

    def close(self) -> None:
        """The run ends: a wait still open counts to its end."""
        if self._blocked is not None:
            now = time.monotonic()
            self.blocked_seconds += now - self._started
            self._progress.disk_waited(now - self._counted)
            self._blocked = None
