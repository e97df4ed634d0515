"""Tokenizing shards: each shard's conversations into its part file, in this process or in worker processes.

Rendering (Jinja, Python) and the prefix tokenizations the exact mask needs cost about a
millisecond of CPU per short conversation, so shards go to ``workers`` spawned processes, each
writing its shards' parts under their temp names. A worker gets the driver's tokenizer pickled (no
checkpoint to load, and none of the torch import AutoTokenizer brings). The driver takes the
outcomes back in shard order (so skipped rows are listed, and the first bad row fails the run, in
input order) with at most two shards per worker in flight: memory stays bounded whatever the
input's size.
"""

from __future__ import annotations

import collections
import dataclasses
import math
import multiprocessing
import os
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, Optional, Sequence

import numpy as np

from conversations import output as out_dir
from conversations.reader import ConversationRow, RowSource
from conversations.template import ChatTemplate, Encoded

ENCODE_BATCH = 512
"""Conversations rendered and tokenized at once (bounds the renderings held in memory)."""
INVALID, TOO_LONG = "invalid", "too_long"
MAX_AUTO_WORKERS = 16
ROWS_PER_AUTO_WORKER = 20_000
"""About 20 s of one core's work, against the few seconds a worker takes to start (imports, tokenizer)."""
IN_FLIGHT_PER_WORKER = 2


@dataclasses.dataclass
class Totals:
    """Counts, and a histogram of kept lengths (bounded by max_length, not by the row count)."""

    conversations: int = 0
    kept: int = 0
    truncated: int = 0
    assistant_turns: int = 0
    tokens: int = 0
    masked_tokens: int = 0
    lengths: np.ndarray = dataclasses.field(default_factory=lambda: np.zeros(1, dtype=np.int64))

    def add(self, rows: Sequence[Encoded]) -> None:
        lengths = np.fromiter((len(row.input_ids) for row in rows), dtype=np.int64, count=len(rows))
        if len(lengths):
            self._add_histogram(np.bincount(lengths))
        self.kept += len(rows)
        self.tokens += int(lengths.sum())
        self.masked_tokens += sum(row.loss_mask.count(1) for row in rows)
        self.assistant_turns += sum(row.assistant_turns for row in rows)

    def merge(self, other: "Totals") -> None:
        for name in ("conversations", "kept", "truncated", "assistant_turns", "tokens", "masked_tokens"):
            setattr(self, name, getattr(self, name) + getattr(other, name))
        self._add_histogram(other.lengths)

    def _add_histogram(self, counts: np.ndarray) -> None:
        if len(counts) > len(self.lengths):
            self.lengths = np.pad(self.lengths, (0, len(counts) - len(self.lengths)))
        self.lengths[: len(counts)] += counts

    def length_stats(self) -> dict[str, Any]:
        if not self.kept:
            return {}
        cumulative = np.cumsum(self.lengths)
        quantile = {f"p{q}": int(np.searchsorted(cumulative, math.ceil(self.kept * q / 100))) for q in (50, 90, 99)}
        present = np.flatnonzero(self.lengths)
        return {"min": int(present[0]), "max": int(present[-1]), "mean": round(self.tokens / self.kept, 2), **quantile}


@dataclasses.dataclass
class ShardOutcome:
    """What one shard became; its part (if any row was kept) is under its temp name."""

    shard: int
    totals: Totals
    skipped: list[tuple[int, RowSource, str, str]]
    """(conversation_id, where, kind, reason) of each row left out, in order."""
    part: Optional[dict[str, Any]]


@dataclasses.dataclass(frozen=True)
class TokenizeSpec:
    """How every worker tokenizes (picklable)."""

    max_length: int
    on_too_long: str
    fail: bool
    """data.on_invalid=fail: the first bad row raises (its message names file, row and reason)."""
    out: str
    content_sha256: str


def refuse(row: ConversationRow, reason: str, out: Path) -> ValueError:
    """The message of a bad row under data.on_invalid=fail (exit 2)."""
    return ValueError(
        f"{row.source.describe()} (conversation_id {row.conversation_id}): {reason} -- data.on_invalid=skip leaves "
        f"such rows out and lists them in {out / out_dir.SKIPPED_FILE}"
    )


class ShardTokenizer:
    """One shard's rows -> kept encodings (truncated or dropped by max_length) -> its part's temp file."""

    def __init__(self, spec: TokenizeSpec, chat: ChatTemplate) -> None:
        self.spec = spec
        self.chat = chat
        self.out = Path(spec.out)

    def __call__(self, shard: int, rows: list[ConversationRow]) -> ShardOutcome:
        spec = self.spec
        valid = [row for row in rows if row.messages is not None]
        encoded: dict[int, Any] = {}
        for start in range(0, len(valid), ENCODE_BATCH):
            batch = valid[start : start + ENCODE_BATCH]
            encoded.update(zip((row.conversation_id for row in batch), self.chat.encode([row.messages for row in batch])))
        totals = Totals(conversations=len(rows))
        skipped: list[tuple[int, RowSource, str, str]] = []
        kept_ids: list[int] = []
        kept_row_ids: list[Optional[str]] = []
        kept: list[Encoded] = []
        for row in rows:
            result = encoded.get(row.conversation_id, row.reason)
            if isinstance(result, str):
                if spec.fail:
                    raise refuse(row, result, self.out)
                skipped.append((row.conversation_id, row.source, INVALID, result))
                continue
            if len(result.input_ids) > spec.max_length:
                why = f"{len(result.input_ids)} tokens, more than data.max_length={spec.max_length}"
                if spec.on_too_long == "drop":
                    skipped.append((row.conversation_id, row.source, TOO_LONG, why + " (data.on_too_long=drop)"))
                    continue
                result = Encoded(result.input_ids[: spec.max_length], result.loss_mask[: spec.max_length],
                                 result.assistant_turns)
                if 1 not in result.loss_mask:
                    skipped.append((row.conversation_id, row.source, TOO_LONG,
                                    why + ": no assistant token is left in the first max_length tokens"))
                    continue
                totals.truncated += 1
            kept_ids.append(row.conversation_id)
            kept_row_ids.append(row.row_id)
            kept.append(result)
        totals.add(kept)
        part = None
        if kept:  # no part for a shard whose every row was left out
            meta = {"content_sha256": spec.content_sha256, "shard": shard, "conversations": len(rows), "kept": len(kept)}
            out_dir.write_part(self.out, shard, kept_ids, kept_row_ids, kept, meta)
            part = {"file": out_dir.part_name(shard), "shard": shard, "rows": len(kept), "tokens": totals.tokens}
        return ShardOutcome(shard, totals, skipped, part)


def resolve_workers(requested: int, shards: int, rows: int) -> int:
    """0: one per CPU this process may use (at most MAX_AUTO_WORKERS), one per ROWS_PER_AUTO_WORKER rows at most
    (a worker's start costs seconds); never more than there are shards."""
    count = requested or min(len(os.sched_getaffinity(0)), MAX_AUTO_WORKERS, rows // ROWS_PER_AUTO_WORKER)
    return max(1, min(count, shards))


_worker: Optional[ShardTokenizer] = None


def _start_worker(spec: TokenizeSpec, chat: ChatTemplate) -> None:
    global _worker
    # One process per core already: the tokenizer's own thread pool would only oversubscribe them.
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    _worker = ShardTokenizer(spec, chat)


def _tokenize_in_worker(shard: int, rows: list[ConversationRow]) -> ShardOutcome:
    if _worker is None:
        raise RuntimeError("the tokenizer worker was not initialised")
    return _worker(shard, rows)


def tokenize_shards(spec: TokenizeSpec, chat: ChatTemplate, shards: Iterable[tuple[int, list[ConversationRow]]],
                    workers: int, handle: Callable[[ShardOutcome], None]) -> None:
    """Every shard, ``handle``d in shard order; with workers > 1 in a pool of spawned processes."""
    if workers <= 1:
        tokenizer = ShardTokenizer(spec, chat)
        for shard, rows in shards:
            handle(tokenizer(shard, rows))
        return
    # The driver's tokenizer, pickled: a worker unpickles it without importing what AutoTokenizer imports
    # (torch among it: about 100 MiB a worker instead of 850 with SmolLM2's tokenizer).
    pool = multiprocessing.get_context("spawn").Pool(workers, initializer=_start_worker, initargs=(spec, chat))
    try:
        for outcome in _in_order(pool, shards, workers * IN_FLIGHT_PER_WORKER):
            handle(outcome)
    except BaseException:
        pool.terminate()  # a failed or stopped run: the shards under way are not worth waiting for
        raise
    finally:
        pool.close()
        pool.join()


def _in_order(pool: Any, shards: Iterable[tuple[int, list[ConversationRow]]], window: int) -> Iterator[ShardOutcome]:
    pending: collections.deque[Any] = collections.deque()
    for shard, rows in shards:
        pending.append(pool.apply_async(_tokenize_in_worker, (shard, rows)))
        if len(pending) >= window:
            yield pending.popleft().get()
    while pending:
        yield pending.popleft().get()
