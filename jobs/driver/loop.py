"""The driver's loop over its small owners; it holds no state of its own.

First the directories are scanned (a rerun's local files that the sink lacks
are offered for upload). Then each turn: report progress, re-scan the directories when due, open the shards
that fit (or learn that the run must wait for disk), then send one batch, or
settle one completion, or, with nothing in flight, wait for disk or for the
next rescan. A run that started no actor (it had only uploads to do) starts them when a shard is to be
extracted after all (a done file lost meanwhile). The loop ends when every shard is settled, nothing is in flight,
no upload waits for another try, and a last rescan finds no file lost.
"""

from __future__ import annotations

import time
from typing import Callable

from jobs.driver.completions import Completions
from jobs.driver.disk_wait import DiskWait
from jobs.driver.lanes import Lanes
from jobs.driver.progress import RunProgress
from jobs.driver.rescan import Rescanner
from jobs.driver.scheduler import Scheduler
from jobs.driver.uploads import UploadQueue
from jobs.driver.work import PendingWork
from runtime.interrupts import raise_if_stopped


class DriverLoop:
    def __init__(
        self, lanes: Lanes, scheduler: Scheduler, completions: Completions, uploads: UploadQueue, rescanner: Rescanner,
        disk_wait: DiskWait, progress: RunProgress, work: PendingWork, start_actors: Callable[[], None],
    ) -> None:
        """``start_actors``: starts every lane's extractor and writers (called once, if they have not started)."""
        self._lanes = lanes
        self._scheduler = scheduler
        self._completions = completions
        self._uploads = uploads
        self._rescanner = rescanner
        self._disk_wait = disk_wait
        self._progress = progress
        self._work = work
        self._start_actors = start_actors

    def run(self) -> None:
        try:
            # Before the first turn: a rerun may have nothing to extract, only done files the sink still lacks.
            self._rescanner.rescan()
            while self._busy():
                while self._busy():
                    self._turn()
                # Once more before the end: a file lost while the last shards were written is written again now.
                self._rescanner.rescan()
        finally:
            self._disk_wait.close()

    def _busy(self) -> bool:
        return self._scheduler.has_work or bool(self._work) or self._uploads.retries

    def _turn(self) -> None:
        raise_if_stopped()
        self._progress.tick()
        self._rescanner.rescan_if_due()
        if self._scheduler.has_work and not self._lanes.started:
            self._start_actors()
        self._disk_wait.update(self._scheduler.open_what_fits(), sum(budget.used for budget in self._lanes.budgets()))
        lane = self._lanes.ready()
        if lane is not None:
            self._scheduler.send_batch(lane)
        elif self._work:
            # Bounded, so that progress is reported while nothing completes (an extractor loading
            # its model after a fault holds every batch of its lane).
            self._disk_wait.busy()
            self._completions.settle_one(timeout=self._progress.refresh_s)
        elif self._disk_wait.waiting and not self._uploads.retries:
            self._disk_wait.idle()  # BudgetExhausted once nothing could free space for budget_wait_s
        else:  # failed uploads (they free space once through): the first rescan past their pause offers them again
            self._disk_wait.busy()
            time.sleep(min(self._rescanner.rescan_s, self._progress.refresh_s))
