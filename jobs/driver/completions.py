"""What each completed piece of work means, and who hears of it.

A completion is one of the work items of ``jobs.driver.work``. Its result (or
the error Ray raises for it) tells what happened: a batch written, a shard
published or failed, a fault (the extractor or a writer died), a lost attempt
discarded, an extractor loaded again, an upload verified or refused. Each is
passed to the one object that owns what it changes: the scheduler (lanes and
attempts), the extractor's host (its restarts), the upload queue (uploads).
"""

from __future__ import annotations

import logging
from typing import Any

import ray

from jobs.actors.writer import ExtractorLost, ShardDiskFull
from jobs.driver.lanes import Lane, Lanes, ShardAttempt
from jobs.driver.result import WriteClock
from jobs.driver.scheduler import Scheduler
from jobs.driver.uploads import UploadQueue
from jobs.driver.work import (
    Append,
    Discard,
    Finish,
    PendingWork,
    Restarted,
    Upload,
    Work,
    error_text,
)
from runtime.errors import DiskFull, is_disk_full

logger = logging.getLogger(__name__)


class Completions:
    def __init__(self, scheduler: Scheduler, uploads: UploadQueue, work: PendingWork, lanes: Lanes) -> None:
        self._scheduler = scheduler
        self._lanes = lanes
        self._uploads = uploads
        self._work = work
        self.writes = WriteClock()
        """When batches were written: the run's first batch, steady state and drain are measured from it."""

    def settle_one(self, timeout: float | None) -> bool:
        """Handle the next completion within ``timeout`` seconds; False if none came."""
        done = self._work.next_done(timeout)
        if done is None:
            return False
        self.handle(*done)
        return True

    def handle(self, item: Work, ref: Any) -> None:
        if isinstance(item, Append):
            self._on_append(item, ref)
        elif isinstance(item, Finish):
            self._on_finish(item, ref)
        elif isinstance(item, Discard):
            self._on_discard(item, ref)
        elif isinstance(item, Upload):
            self._uploads.settle(item.shard, ref)
        elif isinstance(item, Restarted):
            self._on_restarted(item, ref)

    def _on_append(self, item: Append, ref: Any) -> None:
        attempt, lane = item.attempt, item.attempt.lane
        self._scheduler.batch_returned(attempt)
        try:
            tokens = self._work.result(ref)
        except ExtractorLost as error:
            if item.generation == lane.extractor.generation:
                self._restart_extractor(lane, error_text(error))
            self._scheduler.lose(attempt, f"the extractor died: {error_text(error)}")
            return
        except ray.exceptions.RayActorError as error:
            self._scheduler.writer_died(lane, item.writer, error_text(error))
            return
        self.writes.batch_written(tokens)
        lane.extractor.batch_extracted(item.generation)
        self._scheduler.batch_written(attempt, tokens)

    def _on_finish(self, item: Finish, ref: Any) -> None:
        attempt = item.attempt
        try:
            info = self._work.result(ref)
        except ExtractorLost as error:  # the extractor's restart follows the batch that met the fault
            self._scheduler.lose(attempt, f"the extractor died: {error_text(error)}")
            return
        except ray.exceptions.RayActorError as error:
            self._scheduler.writer_died(attempt.lane, item.writer, error_text(error))
            return
        except Exception as error:
            if not attempt.lost:  # a lost attempt is settled by its Discard
                self._shard_failed(attempt, error)
            return
        record = self._scheduler.published(attempt, info)
        self._uploads.offer(record, attempt.lane)

    def _shard_failed(self, attempt: ShardAttempt, error: Exception) -> None:
        message = error_text(error)
        if not isinstance(error, ShardDiskFull):
            self._scheduler.failed(attempt, message)
            return
        try:
            self._scheduler.failed(attempt, message)
        except OSError as unrecorded:
            if not is_disk_full(unrecorded):
                raise
            # The manifest is on the full disk too: the shard stays pending there, and the rerun extracts it.
            logger.error("shard %d: its failure could not be recorded in the manifest (%s)", attempt.index, unrecorded)
        raise DiskFull(
            f"{self._lanes.where(attempt.lane)} is full: {message}. The shard's temp file was removed. Free space "
            "there (or set output.sink, or lower output.disk_budget below the space the disk has), then "
            "rerun the same command: it resumes where this run stopped"
        )

    def _on_discard(self, item: Discard, ref: Any) -> None:
        attempt = item.attempt
        try:
            self._work.result(ref)
        except ray.exceptions.RayActorError as error:  # the writer asked to clean up died too: ask another
            self._scheduler.writer_died(attempt.lane, item.writer, error_text(error))
            self._scheduler.discard(attempt)
            return
        self._scheduler.discarded(attempt)

    def _on_restarted(self, item: Restarted, ref: Any) -> None:
        extractor = item.lane.extractor
        if item.generation != extractor.generation:
            return  # a later fault already replaced it
        try:
            extractor.loaded(self._work.result(ref))
        except ray.exceptions.RayError as error:  # died while loading: its queued batches died with it
            self._restart_extractor(item.lane, error_text(error))

    def _restart_extractor(self, lane: Lane, reason: str) -> None:
        """A new extractor for the lane; the run goes on while it loads (see ``ExtractorHost.restart``)."""
        loaded = lane.extractor.restart(reason)
        self._work.add(loaded, Restarted(lane, lane.extractor.generation))

    def record_published(self) -> list[int]:
        """After the writers were told to discard every open shard (the run is ending early): record the
        shards whose ``finish`` had already published them, so that no whole file is left unrecorded."""
        recorded = []
        for item, ref in self._work.completed(Finish):
            try:
                info = self._work.result(ref)
            except Exception:  # failed, lost or not finished: its temp file is gone with the discard
                continue
            try:
                self._scheduler.published(item.attempt, info)
            except OSError as error:
                if not is_disk_full(error):
                    raise
                logger.error("shard %d: published, but the manifest could not record it (%s); the next run removes "
                             "its file and extracts it again", item.attempt.index, error)
                continue
            recorded.append(item.attempt.index)
        return recorded
