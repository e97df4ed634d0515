"""Shard plan and batch packing: plain functions of the dataset's lengths, computed once per run."""

from __future__ import annotations

import dataclasses
from typing import Sequence

import numpy as np


@dataclasses.dataclass(frozen=True)
class Shard:
    index: int
    start: int
    """First kept row of the dataset (inclusive)."""
    stop: int
    """Last kept row (exclusive)."""
    tokens: int
    batches: tuple[tuple[int, int], ...]
    """[start, stop) of each packed batch, relative to the shard's first row."""


def plan_shards(
    lengths: np.ndarray, shard_size: int, max_tokens_per_batch: int, max_samples_per_batch: int
) -> list[Shard]:
    """Consecutive row ranges of ``shard_size`` rows (shard i is always the same rows), each packed
    into batches; O(rows) in NumPy plus O(batches) in Python."""
    if shard_size < 1:
        raise ValueError(f"data.shard_size={shard_size}: must be >= 1")
    ends = np.concatenate([[0], np.cumsum(lengths, dtype=np.int64)])
    shards = []
    for index, start in enumerate(range(0, len(lengths), shard_size)):
        stop = min(start + shard_size, len(lengths))
        batches = _pack(ends[start : stop + 1] - ends[start], max_tokens_per_batch, max_samples_per_batch)
        shards.append(Shard(index, start, stop, int(ends[stop] - ends[start]), tuple(batches)))
    return shards


def shard_ranges(plan: Sequence[Shard]) -> list[tuple[int, int, int]]:
    """(index, start, stop) of every shard: what the manifest records of the plan."""
    return [(shard.index, shard.start, shard.stop) for shard in plan]


def pack_batches(lengths: np.ndarray, max_tokens: int, max_samples: int) -> list[tuple[int, int]]:
    """Greedy, order-keeping packing of consecutive samples into ``[start, stop)`` batches.

    A batch holds at most ``max_tokens`` tokens and ``max_samples`` samples; a
    sample longer than ``max_tokens`` forms a batch of its own (the runner is
    sized for the longest sample). No sample is split and nothing is padded.
    """
    return _pack(np.concatenate([[0], np.cumsum(lengths, dtype=np.int64)]), max_tokens, max_samples)


def _pack(ends: np.ndarray, max_tokens: int, max_samples: int) -> list[tuple[int, int]]:
    """``ends[i]`` = tokens of samples [0, i): a batch from ``start`` takes every next sample whose
    running total stays within ``max_tokens`` (a binary search: lengths are positive), at least one."""
    if max_tokens < 1 or max_samples < 1:
        raise ValueError(f"max_tokens={max_tokens}, max_samples={max_samples}: both must be >= 1")
    rows = len(ends) - 1
    batches: list[tuple[int, int]] = []
    start = 0
    while start < rows:
        fits = int(np.searchsorted(ends, ends[start] + max_tokens, side="right")) - 1
        stop = min(max(fits, start + 1), start + max_samples, rows)
        batches.append((start, stop))
        start = stop
    return batches
