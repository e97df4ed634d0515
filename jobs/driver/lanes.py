"""What the scheduler runs: one lane per data-parallel group, and the attempt at each shard it writes.

A ``Lane`` is an extractor, its writers and its node's disk budget; it counts its
batches in flight and holds its open attempts (at most one per writer). Its writers
exist once its actors started (``jobs.driver.startup.start_actors``); a run with
only uploads to do never starts them. A
``ShardAttempt`` is one try at one shard: which writer takes its batches, how many
went out, how many are in flight, and why a fault ended it. Both change only
through their own methods, which only the scheduler calls.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any, Iterator, Optional

from jobs.actors.extractor import ExtractorHost
from jobs.actors.writer import WriterPool
from jobs.cluster.nodes import NodeGroup
from jobs.outdir.budget import DiskBudget
from storage.manifest import ShardRecord


@dataclasses.dataclass(eq=False)
class ShardAttempt:
    """One try at writing a shard: from its first batch to its file published (or given up)."""

    record: ShardRecord
    lane: "Lane"
    writer: Any
    """The writer actor handle this attempt's batches go to."""
    batches: tuple[tuple[int, int], ...]
    """[start, stop) of each batch, relative to the shard's first row."""
    nbytes: int
    """Bytes reserved for the shard's file in the disk budget."""
    sent: int = 0
    inflight: int = 0
    """Batches sent whose write has not finished."""
    lost_reason: str = ""
    """Why a fault ended this attempt (an actor died); empty while it is healthy."""

    @property
    def index(self) -> int:
        return self.record.index

    @property
    def lost(self) -> bool:
        """A fault ended this attempt."""
        return bool(self.lost_reason)

    @property
    def all_sent(self) -> bool:
        return self.sent == len(self.batches)

    def next_batch(self) -> tuple[int, int]:
        """The next batch's [start, stop) rows, now in flight."""
        batch = self.batches[self.sent]
        self.sent += 1
        self.inflight += 1
        return batch

    def batch_done(self) -> None:
        self.inflight -= 1

    def mark_lost(self, reason: str) -> bool:
        """A fault ended the attempt; False if one already had."""
        if self.lost:
            return False
        self.lost_reason = reason
        return True

    def discard_with(self, writer: Any) -> None:
        """Its writer died: another writer of the same node removes what the dead one left."""
        self.writer = writer


class Lane:
    """One data-parallel group as the driver runs it: its node, actors, the node's budget, what it has open."""

    def __init__(self, group: NodeGroup, extractor: ExtractorHost, budget: DiskBudget, max_inflight: int) -> None:
        self.group = group
        self.extractor = extractor
        self.writers: Optional[WriterPool] = None
        """Set once the lane's actors start (``start_writers``)."""
        self.budget = budget
        """Shared by the lanes of one node directory."""
        self.max_inflight = max_inflight
        """Batches between this lane's extractor and a finished write (bounds the states in its node's memory)."""
        self._inflight = 0
        self._open: dict[int, ShardAttempt] = {}
        self._refused_at = -1

    @property
    def inflight(self) -> int:
        return self._inflight

    def start_writers(self, writers: WriterPool) -> None:
        self.writers = writers

    @property
    def open(self) -> dict[int, ShardAttempt]:
        """Attempts receiving batches (read only: ``add`` and ``close`` change it)."""
        return dict(self._open)

    @property
    def has_open(self) -> bool:
        return bool(self._open)

    @property
    def may_send(self) -> bool:
        return bool(self._open) and self._inflight < self.max_inflight

    def free_writer(self) -> Optional[Any]:
        """A writer with no open attempt, if any."""
        if self.writers is None:
            return None
        busy = {id(attempt.writer) for attempt in self._open.values()}
        return next((writer for writer in self.writers.writers if id(writer) not in busy), None)

    def refused_since_last_change(self) -> bool:
        """The next shard did not fit, and the budget has not moved since: no need to ask again."""
        return self._refused_at == self.budget.changes

    def refused(self) -> None:
        self._refused_at = self.budget.changes

    def add(self, attempt: ShardAttempt) -> None:
        self._open[attempt.index] = attempt

    def close(self, attempt: ShardAttempt) -> bool:
        """No more batches for this attempt; False if it was not open (already closed or dropped)."""
        if self._open.get(attempt.index) is not attempt:
            return False
        del self._open[attempt.index]
        return True

    def least_busy(self) -> ShardAttempt:
        """The open attempt with the fewest batches in flight (the shard order breaks ties)."""
        return min(self._open.values(), key=lambda a: (a.inflight, a.index))

    def batch_sent(self) -> None:
        self._inflight += 1

    def batch_done(self) -> None:
        self._inflight -= 1


class Lanes:
    """Every lane of the run, and which one holds a done shard's file."""

    def __init__(self, lanes: list[Lane], output_dir: Path) -> None:
        self._lanes = lanes
        self._output_dir = output_dir

    def __iter__(self) -> Iterator[Lane]:
        return iter(self._lanes)

    def __len__(self) -> int:
        return len(self._lanes)

    @property
    def started(self) -> bool:
        """Every lane's extractor and writers were started (``jobs.driver.startup.start_actors``)."""
        return all(lane.writers is not None for lane in self._lanes)

    @property
    def any_open(self) -> bool:
        return any(lane.has_open for lane in self._lanes)

    def open_count(self) -> int:
        return sum(len(lane.open) for lane in self._lanes)

    def ready(self) -> Optional[Lane]:
        """The lane with open shards and the fewest batches in flight, if it may take one more."""
        lanes = [lane for lane in self._lanes if lane.may_send]
        return min(lanes, key=lambda lane: lane.inflight) if lanes else None

    def home(self, record: ShardRecord) -> Optional[Lane]:
        """The lane on the node holding a done shard's file (records of single-node runs name no node:
        output.dir's); None if that node is not in this run's cluster."""
        for lane in self._lanes:
            if record.node == lane.group.name or (not record.node and lane.group.directory == self._output_dir):
                return lane
        return None

    def where(self, lane: Lane) -> str:
        """The setting that named the lane's directory, for messages: output.dir or output.node_dir."""
        if lane.group.directory == self._output_dir:
            return f"output.dir={lane.group.directory}"
        return f"output.node_dir={lane.group.directory} (node {lane.group.name})"

    def budgets(self) -> list[DiskBudget]:
        """Each directory's budget once (lanes of one node may share a directory)."""
        return list({id(lane.budget): lane.budget for lane in self._lanes}.values())

    def by_budget(self) -> list[Lane]:
        """One lane per distinct budget (its directory's representative)."""
        return list({id(lane.budget): lane for lane in self._lanes}.values())
