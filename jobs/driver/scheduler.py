"""The scheduler: opens shards, sends their batches, and settles each attempt; it alone changes lanes and attempts.

One shard is one file written by one writer, in order. Each lane (an extractor, its writers, its
node's disk budget) holds up to one open shard per writer; the scheduler sends the batches of a lane's
open shards interleaved, always for the one with the fewest in flight, and hands the next shard to
whichever lane has a free writer and room in its budget, so a fast node takes more. A shard opens only
once its whole predicted size fits, so open shards can always be finished; when nothing is open and
the next shard does not fit, ``open_what_fits`` says so and the driver waits for disk
(``jobs.driver.disk_wait``). Work per batch does not depend on the dataset's size: the plan is
computed once, and only the batch's own rows are read. The shard's life in the manifest follows the
scheduler: pending when opened, done when published, failed when its writer reports an error or
faults cut it short ``extract.max_attempts`` times; pending again when its file is lost
(``jobs.driver.rescan``).
"""

from __future__ import annotations

import collections
import logging
from pathlib import Path
from typing import Any, Optional

from inputs.dataset import TokenizedDataset
from jobs.actors.writer import BatchRows
from jobs.driver.lanes import Lane, Lanes, ShardAttempt
from jobs.driver.progress import RunProgress
from jobs.driver.work import Append, Discard, Finish, PendingWork
from jobs.planning.shards import Shard
from runtime.errors import RERUN, JobFault
from storage import ShardFileInfo
from storage.manifest import DONE, FAILED, LOCAL, PENDING, Manifest, ShardRecord

logger = logging.getLogger(__name__)


class ShardQueue:
    """Shards waiting to be opened, in plan order (a shard a fault cut short goes first), and the tries
    each has had in this run."""

    def __init__(self, shards: list[ShardRecord], max_attempts: int) -> None:
        self._waiting = collections.deque(shards)
        self._tries: dict[int, int] = {}
        self.max_attempts = max_attempts

    def __bool__(self) -> bool:
        return bool(self._waiting)

    def peek(self) -> ShardRecord:
        """The shard ``take`` would give, left waiting."""
        return self._waiting[0]

    def take(self) -> ShardRecord:
        """The next shard, now being tried."""
        record = self._waiting.popleft()
        self._tries[record.index] = self.tries(record.index) + 1
        return record

    def tries(self, shard: int) -> int:
        return self._tries.get(shard, 0)

    def tries_left(self, shard: int) -> bool:
        return self.tries(shard) < self.max_attempts

    def push_front(self, record: ShardRecord) -> None:
        """A shard to extract again before the shards not started yet."""
        self._waiting.appendleft(record)


class Scheduler:
    def __init__(
        self, dataset: TokenizedDataset, plan: list[Shard], shards: list[ShardRecord], manifest: Manifest,
        lanes: Lanes, work: PendingWork, progress: RunProgress, bytes_per_token: int, max_attempts: int,
    ) -> None:
        self._dataset = dataset
        self._plan = plan
        self._manifest = manifest
        self._lanes = lanes
        self._work = work
        self._progress = progress
        self._bytes_per_token = bytes_per_token
        self._waiting = ShardQueue(shards, max_attempts)
        self._active: dict[int, ShardAttempt] = {}
        """Attempts not settled yet: open, finishing, or being discarded after a fault."""
        self.extracted_again: set[int] = set()
        """Done shards whose files were lost while the run went on: this run writes them again too."""
        self.peak_open_shards = 0
        self.attempts_undone = 0
        """Attempts whose written batches came to nothing: failed, or discarded after a fault."""

    @property
    def has_work(self) -> bool:
        """Shards wait to be opened, or are not settled yet."""
        return bool(self._waiting or self._active)

    def active(self) -> list[ShardAttempt]:
        return list(self._active.values())

    # -- opening and sending ---------------------------------------------------------------------

    def open_what_fits(self) -> Optional[tuple[Lane, int]]:
        """Open the next shards on every lane with a free writer whose budget fits them whole.

        Returns the lane and bytes of the next shard when it fits nowhere and nothing is open (the
        run must wait for disk); None otherwise (open shards keep the extractors busy meanwhile).
        """
        blocked: Optional[tuple[Lane, int]] = None
        for lane in self._lanes:
            while self._waiting:
                writer = lane.free_writer()
                if writer is None:
                    break
                record = self._waiting.peek()
                shard = self._plan[record.index]
                nbytes = lane.budget.predict(shard.tokens, self._bytes_per_token, len(shard.batches))
                if lane.refused_since_last_change() or lane.budget.blocking_policy(nbytes) is not None:
                    lane.refused()
                    blocked = blocked or (lane, nbytes)
                    break
                self._open(lane, writer, self._waiting.take(), nbytes)
        return None if self._lanes.any_open else blocked

    def _open(self, lane: Lane, writer: Any, record: ShardRecord, nbytes: int) -> None:
        lane.budget.reserve(record.index, nbytes)
        record = self._manifest.update(record.index, state=PENDING, attempts=record.attempts + 1, error="")
        attempt = ShardAttempt(record, lane, writer, self._plan[record.index].batches, nbytes)
        lane.add(attempt)
        self._active[record.index] = attempt
        self.peak_open_shards = max(self.peak_open_shards, self._lanes.open_count())

    def send_batch(self, lane: Lane) -> None:
        """The next batch of the lane's open shard with the fewest batches in flight."""
        attempt = lane.least_busy()
        start, stop = attempt.next_batch()
        rows = BatchRows.of(self._dataset, attempt.index, attempt.record.start + start, attempt.record.start + stop)
        extracted = lane.extractor.extract(rows.tokens)
        self._work.add(attempt.writer.append.remote(rows, [extracted]), Append(attempt, attempt.writer, lane.extractor.generation))
        lane.batch_sent()
        if attempt.all_sent:
            self._close(attempt)

    def _close(self, attempt: ShardAttempt) -> None:
        """No more batches for this attempt: its writer publishes (or reports) the shard and is free again."""
        if attempt.lane.close(attempt):
            self._work.add(attempt.writer.finish.remote(attempt.index), Finish(attempt, attempt.writer))

    # -- what comes back -------------------------------------------------------------------------

    def batch_returned(self, attempt: ShardAttempt) -> None:
        """A batch's write ended, however it ended: it is no longer in flight."""
        attempt.batch_done()
        attempt.lane.batch_done()

    def batch_written(self, attempt: ShardAttempt, tokens: int) -> None:
        if tokens == 0 and not attempt.lost:  # the writer dropped the shard: spend no more extraction on it
            self._close(attempt)
        self._progress.tokens_written(attempt.index, tokens)

    def published(self, attempt: ShardAttempt, info: ShardFileInfo) -> ShardRecord:
        """The shard's file is whole under its final name: done, its bytes committed."""
        if attempt.lost:  # every batch was written before the fault hit: the file is whole
            logger.info("shard %d was published before the fault reached it", attempt.index)
        lane = attempt.lane
        self._settled(attempt)
        lane.budget.commit(attempt.index, info.bytes, info.tokens, self._bytes_per_token)
        record = self._manifest.update(
            attempt.index, state=DONE, error="", file=Path(info.path).name, rows=info.rows, tokens=info.tokens,
            bytes=info.bytes, checksum=info.checksum, location=LOCAL, sink_url="", node=lane.group.name,
            nonfinite=list(info.nonfinite),
        )
        self._progress.shard_settled(attempt.index)
        return record

    def failed(self, attempt: ShardAttempt, message: str) -> None:
        """The writer reported an error for the shard (its temp file is gone): failed, its reservation freed."""
        self.attempts_undone += 1
        self._settled(attempt)
        attempt.lane.budget.release(attempt.index)
        self._manifest.update(attempt.index, state=FAILED, error=message)
        logger.error("shard %d failed: %s", attempt.index, message)
        self._progress.shard_settled(attempt.index)

    # -- faults ----------------------------------------------------------------------------------

    def lose(self, attempt: ShardAttempt, reason: str) -> None:
        """A fault cut the attempt short: stop sending its batches and discard what its writer holds."""
        if not attempt.mark_lost(reason):
            return
        logger.warning("shard %d: %s; it will be written again", attempt.index, reason)
        attempt.lane.close(attempt)
        self.discard(attempt)

    def discard(self, attempt: ShardAttempt) -> None:
        """After the writer's calls for this shard (one caller's calls run in order): no write of the
        attempt can follow the discard, which also removes a temp file a dead writer left (a writer of
        the same node: the file is on its disk)."""
        writers = attempt.lane.writers
        if not writers.is_member(attempt.writer):
            attempt.discard_with(writers.writers[0])
        self._work.add(attempt.writer.discard.remote(attempt.index), Discard(attempt, attempt.writer))

    def writer_died(self, lane: Lane, writer: Any, reason: str) -> None:
        """Replace the writer; every attempt it held is lost (once: its other failures change nothing)."""
        if lane.writers.replace(writer) is None:
            return
        for attempt in self.active():
            if attempt.writer is writer:
                self.lose(attempt, f"its writer died: {reason}")

    def discarded(self, attempt: ShardAttempt) -> None:
        """What a lost attempt wrote is gone: extract the shard again, before the shards not started yet;
        JobFault once it has had ``extract.max_attempts`` tries in this run. Nothing to do for an attempt that
        ``published`` settled (its file was whole before the fault reached it): the shard is done."""
        if self._active.get(attempt.index) is not attempt:
            return
        self.attempts_undone += 1
        attempt.lane.budget.release(attempt.index)
        self._progress.shard_discarded(attempt.index)
        self._settled(attempt)
        if not self._waiting.tries_left(attempt.index):
            self._manifest.update(attempt.index, state=FAILED, error=attempt.lost_reason)
            self._progress.shard_settled(attempt.index)
            raise JobFault(
                f"shard {attempt.index} was cut short by faults {self._waiting.tries(attempt.index)} times in this "
                f"run (extract.max_attempts={self._waiting.max_attempts}); last: {attempt.lost_reason}. {RERUN}"
            )
        self._waiting.push_front(self._manifest.update(attempt.index, error=attempt.lost_reason))

    # -- files lost ------------------------------------------------------------------------------

    def extract_again(self, index: int, reason: str) -> None:
        """A done shard's file was lost (gone, and no consumer declared it consumed; its bytes are free already):
        pending again and extracted again in this run, before the shards not started yet; failed once it has had
        ``extract.max_attempts`` tries in this run."""
        self.extracted_again.add(index)
        self._progress.shard_reopened(index)
        if not self._waiting.tries_left(index):
            self._manifest.update(index, state=FAILED, error=f"{reason}; it was written {self._waiting.tries(index)} "
                                  "times in this run (extract.max_attempts): something deletes the run's files")
            self._progress.shard_settled(index)
            return
        self._waiting.push_front(self._manifest.update(index, state=PENDING, error=reason))

    def _settled(self, attempt: ShardAttempt) -> None:
        attempt.lane.close(attempt)
        if self._active.get(attempt.index) is attempt:
            del self._active[attempt.index]
