"""The scheduler: opens shards and sends their batches, nothing else.

One shard is one file written by one writer, in order, then ``finish``. To
keep every writer busy the scheduler holds up to one open shard per writer and
sends the extractor their batches interleaved, always for the open shard with
the fewest batches in flight. A shard is opened only once its whole predicted
size fits the disk budget, so open shards can always be finished. Its work per
batch does not depend on the dataset's size: the plan is computed once, and
only the batch's own rows are read.
"""

from __future__ import annotations

import collections
from typing import Callable

from jobs.actors import RERUN, ExtractorHost, WriterPool
from jobs.budget import DiskBudget
from jobs.errors import JobFault
from jobs.dataset import TokenizedDataset
from jobs.plan import Shard
from jobs.work import Append, Finish, PendingWork, ShardAttempt
from jobs.writer import BatchRows
from storage.manifest import FAILED, PENDING, Manifest, ShardRecord


class Scheduler:
    def __init__(
        self, dataset: TokenizedDataset, plan: list[Shard], shards: list[ShardRecord], manifest: Manifest,
        budget: DiskBudget, extractor: ExtractorHost, writers: WriterPool, work: PendingWork, bytes_per_token: int,
        max_attempts: int,
    ) -> None:
        self._dataset = dataset
        self._plan = plan
        self._manifest = manifest
        self._budget = budget
        self._extractor = extractor
        self._writers = writers
        self._work = work
        self._bytes_per_token = bytes_per_token
        self._waiting = collections.deque(shards)
        self._max_attempts = max_attempts
        self._open: dict[int, ShardAttempt] = {}
        """Attempts receiving batches: at most one per writer."""
        self.active: dict[int, ShardAttempt] = {}
        """Attempts not settled yet: open, finishing, or being discarded after a fault."""
        self._tries: dict[int, int] = {}
        self._refused_at = -1
        """``budget.changes`` when the next shard last did not fit: no need to ask again before it moves."""
        self.peak_open_shards = 0

    @property
    def has_work(self) -> bool:
        """Shards wait to be opened, or are not settled yet."""
        return bool(self._waiting or self.active)

    @property
    def open_attempts(self) -> list[ShardAttempt]:
        return list(self._open.values())

    def predicted_bytes(self, record: ShardRecord) -> int:
        shard = self._plan[record.index]
        return self._budget.predict(shard.tokens, self._bytes_per_token, len(shard.batches))

    def open_shards(self, wait_for_disk: Callable[[int], None]) -> None:
        """Open the next shards while a writer is free and their whole size fits the budget.

        With nothing open, ``wait_for_disk(nbytes)`` holds the next shard until it fits; with
        shards open, they keep the extractor busy and the next one is tried again later.
        """
        while self._waiting and len(self._open) < len(self._writers):
            record = self._waiting[0]
            nbytes = self.predicted_bytes(record)
            if self._open:
                if self._refused_at == self._budget.changes or self._budget.blocking_policy(nbytes) is not None:
                    self._refused_at = self._budget.changes
                    return
            else:
                wait_for_disk(nbytes)
            self._waiting.popleft()
            self._open_shard(record, nbytes)

    def _open_shard(self, record: ShardRecord, nbytes: int) -> None:
        busy = {id(attempt.writer) for attempt in self._open.values()}
        writer = next(w for w in self._writers.writers if id(w) not in busy)
        self._budget.reserve(record.index, nbytes)
        record = self._manifest.update(record.index, state=PENDING, attempts=record.attempts + 1, error="")
        attempt = ShardAttempt(record, writer, self._plan[record.index].batches, nbytes)
        self._open[record.index] = self.active[record.index] = attempt
        self._tries[record.index] = self._tries.get(record.index, 0) + 1
        self.peak_open_shards = max(self.peak_open_shards, len(self._open))

    def send_batch(self) -> None:
        """The next batch of the open shard with the fewest batches in flight."""
        attempt = min(self._open.values(), key=lambda a: (a.inflight, a.index))
        start, stop = attempt.batches[attempt.sent]
        attempt.sent += 1
        first, last = attempt.record.start + start, attempt.record.start + stop
        input_ids, loss_masks = self._dataset.rows(first, last)
        rows = BatchRows(
            shard=attempt.index,
            sample_ids=self._dataset.sample_ids[first:last].tolist(),
            input_ids=input_ids,
            loss_masks=loss_masks,
        )
        extracted = self._extractor.extract(rows.input_ids)
        self._work.add(attempt.writer.append.remote(rows, [extracted]), Append(attempt, self._extractor.generation))
        attempt.inflight += 1
        if attempt.all_sent:
            self.close(attempt)

    def close(self, attempt: ShardAttempt) -> None:
        """No more batches for this attempt: its writer publishes (or reports) the shard and is free again."""
        if self._open.get(attempt.index) is attempt:
            del self._open[attempt.index]
            self._work.add(attempt.writer.finish.remote(attempt.index), Finish(attempt))

    def drop(self, attempt: ShardAttempt) -> None:
        """A fault ended the attempt: send nothing more for it (its writer slot is free again)."""
        if self._open.get(attempt.index) is attempt:
            del self._open[attempt.index]

    def settled(self, attempt: ShardAttempt) -> None:
        """The attempt's shard is published, failed, or discarded."""
        self.drop(attempt)
        if self.active.get(attempt.index) is attempt:
            del self.active[attempt.index]

    def retry(self, attempt: ShardAttempt) -> None:
        """Extract a shard a fault cut short again, before the shards not started yet; JobFault once
        it has had ``extract.max_attempts`` tries in this run."""
        self.settled(attempt)
        tries = self._tries[attempt.index]
        if tries >= self._max_attempts:
            self._manifest.update(attempt.index, state=FAILED, error=attempt.lost)
            raise JobFault(
                f"shard {attempt.index} was cut short by faults {tries} times in this run (extract.max_attempts="
                f"{self._max_attempts}); last: {attempt.lost}. {RERUN}"
            )
        self._waiting.appendleft(self._manifest.update(attempt.index, error=attempt.lost))
