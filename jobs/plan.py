"""Shard plan and batch packing: plain functions of the dataset's lengths."""

from __future__ import annotations

import dataclasses

import numpy as np


@dataclasses.dataclass(frozen=True)
class Shard:
    index: int
    start: int
    """First dataset row (inclusive)."""
    stop: int
    """Last dataset row (exclusive)."""


def plan_shards(num_rows: int, shard_size: int) -> list[Shard]:
    """Consecutive row ranges of ``shard_size`` rows; shard i is always the same rows."""
    if shard_size < 1:
        raise ValueError(f"data.shard_size={shard_size}: must be >= 1")
    return [
        Shard(index=i, start=start, stop=min(start + shard_size, num_rows))
        for i, start in enumerate(range(0, num_rows, shard_size))
    ]


def pack_batches(lengths: np.ndarray, max_tokens: int, max_samples: int) -> list[tuple[int, int]]:
    """Greedy, order-keeping packing of consecutive samples into ``[start, stop)`` batches.

    A batch holds at most ``max_tokens`` tokens and ``max_samples`` samples; a
    sample longer than ``max_tokens`` forms a batch of its own (the runner is
    sized for the longest sample). No sample is split and nothing is padded.
    """
    batches: list[tuple[int, int]] = []
    start, tokens = 0, 0
    for i, length in enumerate(lengths.tolist()):
        if i > start and (tokens + length > max_tokens or i - start >= max_samples):
            batches.append((start, i))
            start, tokens = i, 0
        tokens += length
    if len(lengths):
        batches.append((start, len(lengths)))
    return batches
