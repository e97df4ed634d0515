"""The scheduler: opens shards and sends their batches, nothing else.

One shard is one file written by one writer, in order, then ``finish``. Each
data-parallel group (a ``Lane``: an extractor, its writers and its node's disk
budget) holds up to one open shard per writer, and the scheduler sends the
batches of a lane's open shards interleaved, always for the one with the
fewest batches in flight. Shards are handed out dynamically: the next shard
goes to whichever lane has a free writer and room in its budget, so a fast
node takes more. A shard is opened only once its whole predicted size fits
its lane's budget, so open shards can always be finished. Work per batch does
not depend on the dataset's size: the plan is computed once, and only the
batch's own rows are read.
"""

from __future__ import annotations

import collections
import dataclasses
from typing import Callable, Optional

from jobs.actors.handles import RERUN, ExtractorHost, WriterPool
from jobs.actors.writer import BatchRows
from jobs.cluster.nodes import NodeGroup
from jobs.driver.budget import DiskBudget
from jobs.driver.work import Append, Finish, PendingWork, ShardAttempt
from jobs.errors import JobFault
from jobs.inputs.dataset import TokenizedDataset
from jobs.planning.shards import Shard
from storage.manifest import FAILED, PENDING, Manifest, ShardRecord


@dataclasses.dataclass(eq=False)
class Lane:
    """One data-parallel group as the driver runs it: its node, actors, the node's budget, what it has open."""

    group: NodeGroup
    extractor: ExtractorHost
    writers: WriterPool
    budget: DiskBudget
    """Shared by the lanes of one node."""
    max_inflight: int
    """Batches between this lane's extractor and a finished write (bounds the states in its node's memory)."""
    inflight: int = 0
    open: dict[int, ShardAttempt] = dataclasses.field(default_factory=dict)
    """Attempts receiving batches: at most one per writer."""
    refused_at: int = -1
    """``budget.changes`` when the next shard last did not fit: no need to ask again before it moves."""


class Scheduler:
    def __init__(
        self, dataset: TokenizedDataset, plan: list[Shard], shards: list[ShardRecord], manifest: Manifest,
        lanes: list[Lane], work: PendingWork, bytes_per_token: int, max_attempts: int,
    ) -> None:
        self._dataset = dataset
        self._plan = plan
        self._manifest = manifest
        self.lanes = lanes
        self._work = work
        self._bytes_per_token = bytes_per_token
        self._max_attempts = max_attempts
        self._waiting = collections.deque(shards)
        self.active: dict[int, ShardAttempt] = {}
        """Attempts not settled yet: open, finishing, or being discarded after a fault."""
        self._tries: dict[int, int] = {}
        self.peak_open_shards = 0

    @property
    def has_work(self) -> bool:
        """Shards wait to be opened, or are not settled yet."""
        return bool(self._waiting or self.active)

    @property
    def any_open(self) -> bool:
        return any(lane.open for lane in self.lanes)

    def predicted_bytes(self, record: ShardRecord, budget: DiskBudget) -> int:
        shard = self._plan[record.index]
        return budget.predict(shard.tokens, self._bytes_per_token, len(shard.batches))

    def open_shards(self, wait_for_disk: Callable[[Lane, int], None]) -> None:
        """Open the next shards on every lane with a free writer whose budget fits them whole.

        With nothing open on any lane, ``wait_for_disk(lane, nbytes)`` holds the next shard until
        it fits; otherwise the open shards keep the extractors busy and it is tried again later.
        """
        for lane in self.lanes:
            while self._waiting and len(lane.open) < len(lane.writers):
                record = self._waiting[0]
                nbytes = self.predicted_bytes(record, lane.budget)
                if lane.refused_at == lane.budget.changes or lane.budget.blocking_policy(nbytes) is not None:
                    if self.any_open:
                        lane.refused_at = lane.budget.changes
                        break
                    wait_for_disk(lane, nbytes)
                self._waiting.popleft()
                self._open_shard(lane, record, nbytes)

    def _open_shard(self, lane: Lane, record: ShardRecord, nbytes: int) -> None:
        busy = {id(attempt.writer) for attempt in lane.open.values()}
        writer = next(w for w in lane.writers.writers if id(w) not in busy)
        lane.budget.reserve(record.index, nbytes)
        record = self._manifest.update(record.index, state=PENDING, attempts=record.attempts + 1, error="")
        attempt = ShardAttempt(record, lane, writer, self._plan[record.index].batches, nbytes)
        lane.open[record.index] = self.active[record.index] = attempt
        self._tries[record.index] = self._tries.get(record.index, 0) + 1
        self.peak_open_shards = max(self.peak_open_shards, sum(len(lane.open) for lane in self.lanes))

    def ready_lane(self) -> Optional[Lane]:
        """The lane with open shards and the fewest batches in flight, if it may take one more."""
        lanes = [lane for lane in self.lanes if lane.open and lane.inflight < lane.max_inflight]
        return min(lanes, key=lambda lane: lane.inflight) if lanes else None

    def send_batch(self, lane: Lane) -> None:
        """The next batch of the lane's open shard with the fewest batches in flight."""
        attempt = min(lane.open.values(), key=lambda a: (a.inflight, a.index))
        start, stop = attempt.batches[attempt.sent]
        attempt.sent += 1
        first, last = attempt.record.start + start, attempt.record.start + stop
        tokens, loss_masks = self._dataset.flat_rows(first, last)
        rows = BatchRows(
            shard=attempt.index, sample_ids=self._dataset.sample_ids[first:last], tokens=tokens, loss_masks=loss_masks
        )
        extracted = lane.extractor.extract(tokens)
        self._work.add(attempt.writer.append.remote(rows, [extracted]), Append(attempt, lane.extractor.generation))
        attempt.inflight += 1
        lane.inflight += 1
        if attempt.all_sent:
            self.close(attempt)

    def close(self, attempt: ShardAttempt) -> None:
        """No more batches for this attempt: its writer publishes (or reports) the shard and is free again."""
        lane = attempt.lane
        if lane.open.get(attempt.index) is attempt:
            del lane.open[attempt.index]
            self._work.add(attempt.writer.finish.remote(attempt.index), Finish(attempt))

    def drop(self, attempt: ShardAttempt) -> None:
        """A fault ended the attempt: send nothing more for it (its writer slot is free again)."""
        lane = attempt.lane
        if lane.open.get(attempt.index) is attempt:
            del lane.open[attempt.index]

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
