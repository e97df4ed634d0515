"""Writes one shard file: temp name, checksum, fsync, atomic rename.

A shard file is either complete under its final name or absent: rows go to
``.<name>.tmp`` (a hidden name in the same directory, which Parquet dataset
readers skip), created new without following a link (``storage.atomic``);
``finalize()`` closes, fsyncs and renames it; leaving the ``with`` block on an
exception deletes the temp file instead.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import queue
import re
import threading
import time
from pathlib import Path
from typing import Iterator, Optional, Sequence

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

import storage.checksum as checksum
import storage.nonfinite as nonfinite
import storage.schema as schema
from storage.atomic import create_new, fd_path, fsync_path
from storage.schema import ShardMetadata

SHARD_GLOB = "shard-*.parquet"
# A shard being written: hidden (pyarrow, Spark and HF datasets skip dot files), same
# directory, so publishing it is one atomic rename.
TEMP_PREFIX = "."
TEMP_SUFFIX = ".tmp"
TEMP_GLOB = f"{TEMP_PREFIX}{SHARD_GLOB}{TEMP_SUFFIX}"
# A row group is the unit a reader fetches. Keep it near this size so that one
# sample (88 MB for 2K tokens of Kimi-K2.5's three layers) is not read with many others.
ROW_GROUP_TARGET_BYTES = 256 * 1024 * 1024
# Where a writer's time goes, summed over its shards (``ShardWriter.clock``): building the Arrow
# table, Parquet encoding + write() into the page cache, the checksum (reading the bytes back), fdatasync
# behind the writes and at commit, and closing + renaming. The hasher thread's stages overlap the others.
STAGES = ("encode", "write", "hash", "sync", "commit")


class StageClock:
    """Wall and CPU seconds per named stage, for one thread at a time (CPU time is the thread's)."""

    def __init__(self, stages: Sequence[str] = STAGES) -> None:
        self.wall = dict.fromkeys(stages, 0.0)
        self.cpu = dict.fromkeys(stages, 0.0)

    @contextlib.contextmanager
    def stage(self, name: str) -> Iterator[None]:
        wall, cpu = time.perf_counter(), time.thread_time()
        try:
            yield
        finally:
            self.wall[name] += time.perf_counter() - wall
            self.cpu[name] += time.thread_time() - cpu

    def add(self, other: "StageClock") -> None:
        for name in other.wall:
            self.wall[name] = self.wall.get(name, 0.0) + other.wall[name]
            self.cpu[name] = self.cpu.get(name, 0.0) + other.cpu[name]


@dataclasses.dataclass(frozen=True)
class ShardFileInfo:
    """What ``ShardWriter.finalize`` committed."""

    path: str
    rows: int
    tokens: int
    bytes: int
    checksum: str
    """``storage.checksum``'s ``<algorithm>:<hex>`` of the whole file."""
    nonfinite: tuple[dict, ...] = ()
    """Samples whose states held NaN/Inf, skipped or kept (``storage.nonfinite.screen`` records)."""


def shard_file_name(shard: int) -> str:
    """File name of shard ``shard`` inside the output directory."""
    return f"shard-{shard:05d}.parquet"


def shard_of_file(name: str) -> Optional[int]:
    """The shard a file name (``shard_file_name``) is of; None for another name."""
    found = re.fullmatch(r"shard-(\d{5,})\.parquet", name)
    return int(found.group(1)) if found else None


def temp_file_name(name: str) -> str:
    """Name a shard file has while it is written."""
    return f"{TEMP_PREFIX}{name}{TEMP_SUFFIX}"


def state_bytes_per_token(metadata: ShardMetadata) -> int:
    """Bytes of hidden states one token adds to a shard file (with fp8, their scales too)."""
    layers = len(metadata.layer_ids) + (1 if metadata.has_last_hidden_state else 0)
    scales = layers * schema.SCALE_ITEMSIZE if metadata.fp8 else 0
    return layers * metadata.hidden_size * metadata.itemsize + scales


def choose_rows_per_group(bytes_per_row: int, target_bytes: int = ROW_GROUP_TARGET_BYTES) -> int:
    """Rows per Parquet row group so that a group holds about ``target_bytes``."""
    return max(1, target_bytes // max(1, bytes_per_row))


class _TrailingHasher:
    """The checksum of a file being appended to, by a thread that follows the writer.

    The writer stays on pyarrow's native file (no Python call per page). The
    thread reads each batch's new bytes back from the page cache, hashes them,
    and flushes them to disk (fdatasync) while the next batch is encoded: the
    disk writes all along instead of when the shard commits, and the commit's
    fsync finds little left to do.
    """

    CHUNK_BYTES = 8 * 1024 * 1024

    def __init__(self, path: str, name: str, algorithm: str) -> None:
        """``path`` opens the file (``storage.atomic.fd_path``); ``name`` is its file name, for the thread's."""
        self._file = open(path, "rb", buffering=0)
        self._hash = checksum.Hasher(algorithm)
        self._hashed = 0
        self.clock = StageClock(("hash", "sync"))
        """This thread's time hashing and in fdatasync; read it once ``finish`` or ``stop`` returned."""
        self._targets: queue.SimpleQueue[int | None] = queue.SimpleQueue()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name=f"checksum {name}", daemon=True)
        self._thread.start()

    def advance(self, size: int) -> None:
        """The file now holds at least ``size`` bytes; hash them in the background."""
        self._targets.put(size)

    def finish(self, size: int) -> str:
        """The checksum of the first ``size`` bytes (the whole, closed file)."""
        self.advance(size)
        self.stop()
        if self._error is not None:
            raise self._error
        return self._hash.value

    def stop(self) -> None:
        """Ends the thread once it has done what it was asked so far."""
        self._targets.put(None)
        self._thread.join()
        self._file.close()

    def _run(self) -> None:
        view = memoryview(bytearray(self.CHUNK_BYTES))
        try:
            while (target := self._targets.get()) is not None:
                with self.clock.stage("hash"):
                    while self._hashed < target:
                        count = self._file.readinto(view[: min(len(view), target - self._hashed)])
                        if not count:
                            raise OSError(f"{self._file.name}: ended at byte {self._hashed}, expected {target}")
                        self._hash.update(view[:count])
                        self._hashed += count
                with self.clock.stage("sync"):
                    os.fdatasync(self._file.fileno())
        except BaseException as error:  # reported by finish()
            self._error = error
            while self._targets.get() is not None:
                pass


# Columns are built from buffers: ``pa.array`` of numpy data imports pandas (0.5-1 s on a
# writer's first batch) and walks lists of arrays in Python.
def _flat_column(values: np.ndarray, arrow_type: pa.DataType) -> pa.Array:
    values = np.ascontiguousarray(values)
    return pa.Array.from_buffers(arrow_type, len(values), [None, pa.py_buffer(values)])


def _list_column(rows: Sequence[np.ndarray], dtype: type, arrow_type: pa.DataType, row_offsets: np.ndarray) -> pa.Array:
    """One list value per sample, from the rows' values concatenated and their offsets."""
    values = np.concatenate([np.asarray(row, dtype=dtype) for row in rows]) if len(rows) else np.empty(0, dtype)
    offsets = pa.py_buffer(row_offsets.astype(np.int32))
    return pa.Array.from_buffers(pa.list_(arrow_type), len(rows), [None, offsets], children=[_flat_column(values, arrow_type)])


def _binary_column(states: np.ndarray, row_offsets: np.ndarray, row_width_bytes: int) -> pa.Array:
    """One large_binary value per sample, sharing ``states``' memory (no per-sample copy)."""
    data = np.ascontiguousarray(states).view(np.uint8).reshape(-1)
    offsets = (row_offsets * row_width_bytes).astype(np.int64)
    return pa.LargeBinaryArray.from_buffers(
        pa.large_binary(), len(row_offsets) - 1, [None, pa.py_buffer(offsets), pa.py_buffer(data)]
    )


def encode_batch(
    meta: ShardMetadata,
    arrow_schema: pa.Schema,
    file_name: str,
    sample_ids: Sequence[int],
    input_ids: Sequence[np.ndarray],
    loss_masks: Sequence[np.ndarray],
    aux_hidden_states: np.ndarray,
    last_hidden_state: np.ndarray | None,
    aux_scales: np.ndarray | None,
    last_scales: np.ndarray | None,
) -> tuple[pa.Table, np.ndarray]:
    """A batch as an Arrow table of the file's schema, and its rows' token counts; state columns share the
    arrays' memory. ValueError (naming ``file_name`` and the samples) when a part does not fit the metadata."""
    lengths = np.fromiter((len(ids) for ids in input_ids), dtype=np.int64, count=len(input_ids))
    if not (len(sample_ids) == len(input_ids) == len(loss_masks)):
        raise ValueError(
            f"{file_name}: {len(sample_ids)} sample ids, {len(input_ids)} input_ids, "
            f"{len(loss_masks)} loss masks; they must match one to one"
        )
    _check_masks(file_name, sample_ids, lengths, loss_masks)
    row_offsets = np.concatenate([[0], np.cumsum(lengths)])
    total = int(row_offsets[-1])
    columns = {
        schema.SAMPLE_ID: _flat_column(np.asarray(sample_ids, dtype=np.int64), pa.int64()),
        schema.INPUT_IDS: _list_column(input_ids, np.int32, pa.int32(), row_offsets),
        schema.LOSS_MASK: _list_column(loss_masks, np.uint8, pa.uint8(), row_offsets),
    }
    states = [(schema.AUX_HIDDEN_STATES, aux_hidden_states, aux_scales, len(meta.layer_ids))]
    if meta.has_last_hidden_state:
        if last_hidden_state is None:
            raise ValueError(f"{file_name}: the shard stores last_hidden_state but none was given")
        states.append((schema.LAST_HIDDEN_STATE, last_hidden_state, last_scales, 1))
    for name, values, scales, layers in states:
        width = layers * meta.hidden_size
        _check_states(meta, file_name, name, values, (total, width), meta.itemsize, sample_ids)
        columns[name] = _binary_column(values, row_offsets, width * meta.itemsize)
        if meta.fp8:
            _check_states(meta, file_name, name + schema.SCALES_SUFFIX, scales, (total, layers), schema.SCALE_ITEMSIZE,
                          sample_ids)
            columns[name + schema.SCALES_SUFFIX] = _binary_column(scales, row_offsets, layers * schema.SCALE_ITEMSIZE)
    return pa.Table.from_pydict(columns, schema=arrow_schema), lengths


def _check_masks(file_name: str, sample_ids: Sequence[int], lengths: np.ndarray, loss_masks: Sequence[np.ndarray]) -> None:
    """Each loss mask as long as its input_ids: the masks are stored end to end at the tokens' offsets, so one of
    another length would shift the masks of every sample after it."""
    mask_lengths = np.fromiter((len(mask) for mask in loss_masks), dtype=np.int64, count=len(loss_masks))
    wrong = np.flatnonzero(mask_lengths != lengths)
    if len(wrong):
        row = int(wrong[0])
        more = f" (and {len(wrong) - 1} more samples of this batch)" if len(wrong) > 1 else ""
        raise ValueError(
            f"{file_name}: sample {sample_ids[row]} has {lengths[row]} input_ids but a loss mask of "
            f"{mask_lengths[row]}{more}; a loss mask has one value per token: fix the sample's loss_mask"
        )


def _check_states(
    meta: ShardMetadata, file_name: str, name: str, states: np.ndarray | None, expected: tuple[int, int],
    itemsize: int, sample_ids: Sequence[int],
) -> None:
    if states is None or states.shape != expected or states.dtype.itemsize != itemsize:
        first, last = (sample_ids[0], sample_ids[-1]) if len(sample_ids) else (None, None)
        got = "none" if states is None else f"shape {states.shape} and itemsize {states.dtype.itemsize}"
        raise ValueError(
            f"{file_name}: {name} for samples {first}..{last} has {got}; expected {expected} with itemsize "
            f"{itemsize} ({meta.state_dtype if itemsize == meta.itemsize else 'float32'})"
        )


class ShardWriter:
    """Appends captured batches to one shard file; a context manager.

    >>> with ShardWriter(path, metadata) as writer:
    ...     writer.append(sample_ids, input_ids, loss_masks, aux, last)
    ...     info = writer.finalize()

    ``on_nonfinite`` (``storage.nonfinite.ACTIONS``) is what happens to a sample the
    extractor flagged as holding NaN/Inf: fail the shard, skip the sample, or keep it.
    ``checksum_algorithm`` is the file checksum's (``storage.checksum``).
    """

    def __init__(self, path: str | os.PathLike, metadata: ShardMetadata, on_nonfinite: str = nonfinite.FAIL,
                 checksum_algorithm: str = checksum.DEFAULT_ALGORITHM) -> None:
        if on_nonfinite not in nonfinite.ACTIONS:
            raise ValueError(f"on_nonfinite={on_nonfinite!r}: use one of {', '.join(nonfinite.ACTIONS)}")
        self.checksum_algorithm = checksum.check_algorithm(checksum_algorithm)
        self.path = Path(path)
        self.temp_path = self.path.with_name(temp_file_name(self.path.name))
        self.metadata = metadata
        self.on_nonfinite = on_nonfinite
        self._nonfinite: list[dict] = []
        self._schema = schema.build_schema(metadata)
        self._fd: int | None = None
        """The temp file this writer created: everything else opens it through ``fd_path``."""
        self._file: pa.NativeFile | None = None
        self._hasher: _TrailingHasher | None = None
        self._writer: pq.ParquetWriter | None = None
        self._rows = 0
        self._tokens = 0
        self.clock = StageClock()
        """Time per stage (``STAGES``); the hasher's is added once the file is finalized or aborted."""

    def __enter__(self) -> "ShardWriter":
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._fd = create_new(self.temp_path)
        try:
            self._file = pa.OSFile(fd_path(self._fd), "wb")
            self._hasher = _TrailingHasher(fd_path(self._fd), self.temp_path.name, self.checksum_algorithm)
            columns = schema.columns(self.metadata)
            self._writer = pq.ParquetWriter(
                self._file,
                self._schema,
                compression={column.parquet_path: column.compression for column in columns},
                use_dictionary=False,
                write_statistics=[column.parquet_path for column in columns if column.statistics],
                store_schema=True,
                # A CRC per page: a reader that verifies them (ours do) raises on a corrupted page
                # instead of returning wrong states.
                write_page_checksum=True,
            )
        except BaseException:  # a full disk already: nothing of this shard stays
            self.abort()
            raise
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if self._writer is not None:  # not finalized: an error happened or finalize was skipped
            self.abort()

    def append(
        self,
        sample_ids: Sequence[int],
        input_ids: Sequence[np.ndarray],
        loss_masks: Sequence[np.ndarray],
        aux_hidden_states: np.ndarray,
        last_hidden_state: np.ndarray | None = None,
        aux_scales: np.ndarray | None = None,
        last_scales: np.ndarray | None = None,
        finite: np.ndarray | None = None,
    ) -> None:
        """Append samples whose states are stacked token-wise: aux is [sum(T_i), L*H].

        State arrays hold the raw element bits in any numpy dtype of the stored
        dtype's itemsize (bfloat16 travels as int16, fp8 as uint8), C-contiguous.
        With fp8 states, ``aux_scales`` [sum(T_i), L] and ``last_scales``
        [sum(T_i), 1] are float32. ``finite`` [samples, columns] bool says which
        samples' states are free of NaN/Inf per layer (then the final state);
        ``on_nonfinite`` decides about the others.
        """
        if self._writer is None:
            raise RuntimeError(f"{self.path}: append() outside the writer's `with` block")
        with self.clock.stage("encode"):
            table, lengths = encode_batch(
                self.metadata, self._schema, self.path.name, sample_ids, input_ids, loss_masks, aux_hidden_states,
                last_hidden_state, aux_scales, last_scales,
            )
            if finite is not None:
                keep, records = nonfinite.screen(sample_ids, finite, self.metadata, self.on_nonfinite, self.path.name)
                self._nonfinite += records
                if keep is not None:
                    table, lengths = table.filter(pa.array(keep)), lengths[keep]
        tokens = int(lengths.sum())
        with self.clock.stage("write"):
            if table.num_rows:
                bytes_per_row = table.nbytes // table.num_rows
                self._writer.write_table(table, row_group_size=choose_rows_per_group(bytes_per_row))
        assert self._hasher is not None and self._file is not None
        self._hasher.advance(self._file.tell())
        self._rows += table.num_rows
        self._tokens += tokens

    def finalize(self) -> ShardFileInfo:
        """Close, fsync and atomically publish the file under its final name."""
        if self._writer is None or self._file is None or self._hasher is None:
            raise RuntimeError(f"{self.path}: finalize() called twice or outside `with`")
        with self.clock.stage("commit"):
            self._writer.close()
            self._writer = None
            size = self._file.tell()
            self._file.close()
        hasher, self._hasher = self._hasher, None
        value = hasher.finish(size)  # waits for the hasher, whose time its own clock counts
        self.clock.add(hasher.clock)
        with self.clock.stage("sync"):
            os.fsync(self._fd)
        with self.clock.stage("commit"):
            self._close_fd()
            os.replace(self.temp_path, self.path)
            fsync_path(self.path.parent)
        return ShardFileInfo(
            path=str(self.path), rows=self._rows, tokens=self._tokens, bytes=size, checksum=value,
            nonfinite=tuple(self._nonfinite),
        )

    def abort(self) -> None:
        """Drop everything written so far; the final name is never touched."""
        writer, self._writer = self._writer, None
        try:
            # The file is being thrown away: a close that fails (the disk is full, the very reason
            # for the abort) must not keep the temp file on disk nor hide the first error.
            with contextlib.suppress(OSError):
                if writer is not None:
                    writer.close()
        finally:
            if self._file is not None and not self._file.closed:
                with contextlib.suppress(OSError):
                    self._file.close()
            if self._hasher is not None:
                self._hasher.stop()
                self.clock.add(self._hasher.clock)
            self._close_fd()
            self.temp_path.unlink(missing_ok=True)

    def _close_fd(self) -> None:
        fd, self._fd = self._fd, None
        if fd is not None:
            os.close(fd)
