"""The driver's work in flight: one map from each Ray object reference to what it stands for.

A shard is written by one ``ShardAttempt``: its batches go to one writer
(``Append``), then ``Finish`` publishes the file. A fault (an actor lost) ends
an attempt early; ``Discard`` then removes what the writer held of it before
the shard may start again. ``Upload`` carries a committed file to the sink;
``Restarted`` is an extractor started again after a fault, loading its model.
The driver waits on all of them at once and handles each completion by its
type, never by looking a reference up in several maps.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Union

import ray

from storage.manifest import ShardRecord


@dataclasses.dataclass(eq=False)
class ShardAttempt:
    """One try at writing a shard: from its first batch to its file published (or given up)."""

    record: ShardRecord
    lane: Any
    """The data-parallel group (``scheduler.Lane``) writing it."""
    writer: Any
    """The writer actor handle this attempt's batches go to."""
    batches: tuple[tuple[int, int], ...]
    """[start, stop) of each batch, relative to the shard's first row."""
    nbytes: int
    """Bytes reserved for the shard's file in the disk budget."""
    sent: int = 0
    inflight: int = 0
    """Batches sent whose write has not finished."""
    lost: str = ""
    """Why a fault ended this attempt (an actor died); empty while it is healthy."""

    @property
    def index(self) -> int:
        return self.record.index

    @property
    def all_sent(self) -> bool:
        return self.sent == len(self.batches)


@dataclasses.dataclass(frozen=True)
class Append:
    attempt: ShardAttempt
    generation: int
    """Which start of the extractor ran the batch (a fault in an older one is already handled)."""


@dataclasses.dataclass(frozen=True)
class Finish:
    attempt: ShardAttempt


@dataclasses.dataclass(frozen=True)
class Discard:
    attempt: ShardAttempt


@dataclasses.dataclass(frozen=True)
class Upload:
    shard: int


@dataclasses.dataclass(frozen=True)
class Restarted:
    """An extractor started again after a fault: completes once its model has loaded."""

    lane: Any
    generation: int


Work = Union[Append, Finish, Discard, Upload, Restarted]


class PendingWork:
    """Work in flight, keyed by the reference Ray completes; O(1) per add and per completion."""

    def __init__(self) -> None:
        self._items: dict[ray.ObjectRef, Work] = {}

    def add(self, ref: ray.ObjectRef, item: Work) -> None:
        self._items[ref] = item

    def __bool__(self) -> bool:
        return bool(self._items)

    def next_done(self, timeout: float | None) -> tuple[Work, ray.ObjectRef] | None:
        """The next completed item and its reference (``ray.get`` it to see its result or error),
        or None if none completed within ``timeout`` seconds."""
        if not self._items:
            return None
        ready, _ = ray.wait(list(self._items), num_returns=1, timeout=timeout)
        if not ready:
            return None
        return self._items.pop(ready[0]), ready[0]
