"""The driver's work in flight: one map from each Ray object reference to what it stands for.

A shard is written by one ``ShardAttempt`` (``jobs.driver.lanes``): its batches go to one writer
(``Append``), then ``Finish`` publishes the file. A fault (an actor lost) ends
an attempt early; ``Discard`` then removes what the writer held of it before
the shard may start again. ``Upload`` carries a committed file to the sink;
``Restarted`` is an extractor started again after a fault, loading its model.
The driver waits on all of them at once and handles each completion by its
type, never by looking a reference up in several maps.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Protocol, Union

import ray

from jobs.driver.lanes import Lane, ShardAttempt


@dataclasses.dataclass(frozen=True)
class Append:
    attempt: ShardAttempt
    writer: Any
    """The writer the batch went to (a fault may hand the attempt's clean-up to another meanwhile)."""
    generation: int
    """Which start of the extractor ran the batch (a fault in an older one is already handled)."""


@dataclasses.dataclass(frozen=True)
class Finish:
    attempt: ShardAttempt
    writer: Any


@dataclasses.dataclass(frozen=True)
class Discard:
    attempt: ShardAttempt
    writer: Any


@dataclasses.dataclass(frozen=True)
class Upload:
    shard: int


@dataclasses.dataclass(frozen=True)
class Restarted:
    """An extractor started again after a fault: completes once its model has loaded."""

    lane: Lane
    generation: int


Work = Union[Append, Finish, Discard, Upload, Restarted]


def error_text(error: BaseException) -> str:
    """``"Type: message"`` of what a work item failed with: the task's own error, not Ray's wrapper around it."""
    cause = getattr(error, "cause", None) or error
    return f"{type(cause).__name__}: {cause}"


class Runtime(Protocol):
    """How the driver waits on and reads its work: Ray (``RayRuntime``), or a test's fake actors."""

    def wait(self, refs: list[Any], timeout: float | None, num_returns: int = 1) -> list[Any]:
        """Up to ``num_returns`` of ``refs`` that are complete, waiting at most ``timeout`` seconds for the first."""

    def get(self, ref: Any) -> Any:
        """The result of a completed reference, or the error it completed with, raised."""


class RayRuntime:
    def wait(self, refs: list[Any], timeout: float | None, num_returns: int = 1) -> list[Any]:
        return ray.wait(refs, num_returns=num_returns, timeout=timeout)[0]

    def get(self, ref: Any) -> Any:
        return ray.get(ref)


class PendingWork:
    """Work in flight, keyed by the reference Ray completes; O(1) per add and per completion."""

    def __init__(self, runtime: Runtime | None = None) -> None:
        self._runtime = runtime or RayRuntime()
        self._items: dict[Any, Work] = {}

    def add(self, ref: Any, item: Work) -> None:
        self._items[ref] = item

    def __bool__(self) -> bool:
        return bool(self._items)

    def next_done(self, timeout: float | None) -> tuple[Work, Any] | None:
        """The next completed item and its reference (``result`` gives its result or raises its error),
        or None if none completed within ``timeout`` seconds."""
        if not self._items:
            return None
        ready = self._runtime.wait(list(self._items), timeout=timeout)
        if not ready:
            return None
        return self._items.pop(ready[0]), ready[0]

    def result(self, ref: Any) -> Any:
        return self._runtime.get(ref)

    def completed(self, kind: type) -> list[tuple[Work, Any]]:
        """Every item of ``kind`` that has completed by now, taken out (the run is ending early)."""
        refs = [ref for ref, item in self._items.items() if isinstance(item, kind)]
        if not refs:
            return []
        ready = self._runtime.wait(refs, timeout=0, num_returns=len(refs))
        return [(self._items.pop(ref), ref) for ref in ready]
