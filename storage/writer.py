"""Writes one shard file: temp name, checksum, fsync, atomic rename.

A shard file is either complete under its final name or absent: rows go to
``.<name>.tmp`` (a hidden name in the same directory, which Parquet dataset
readers skip); ``finalize()`` closes, fsyncs and renames it; leaving the
``with`` block on an exception deletes the temp file instead.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import queue
import threading
from pathlib import Path
from typing import Sequence

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from storage import schema
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
# Token columns are small and compress well; state columns are high-entropy floats
# where compression costs far more time than the ~20% it saves.
_COMPRESSION = {
    schema.SAMPLE_ID: "zstd",
    schema.INPUT_IDS: "zstd",
    schema.LOSS_MASK: "zstd",
    schema.AUX_HIDDEN_STATES: "none",
    schema.LAST_HIDDEN_STATE: "none",
}


@dataclasses.dataclass(frozen=True)
class ShardFileInfo:
    """What ``ShardWriter.finalize`` committed."""

    path: str
    rows: int
    tokens: int
    bytes: int
    sha256: str


def shard_file_name(shard: int) -> str:
    """File name of shard ``shard`` inside the output directory."""
    return f"shard-{shard:05d}.parquet"


def temp_file_name(name: str) -> str:
    """Name a shard file has while it is written."""
    return f"{TEMP_PREFIX}{name}{TEMP_SUFFIX}"


def column_compression(arrow_schema: pa.Schema) -> dict[str, str]:
    """Codec per Parquet leaf column: a list column's values live at ``<name>.list.element``,
    and a codec keyed by the list's own name would not reach them."""
    codecs: dict[str, str] = {}
    for field in arrow_schema:
        leaf = f"{field.name}.list.element" if pa.types.is_list(field.type) else field.name
        codecs[leaf] = _COMPRESSION[field.name]
    return codecs


def state_bytes_per_token(metadata: ShardMetadata) -> int:
    """Bytes of hidden states one token adds to a shard file."""
    layers = len(metadata.layer_ids) + (1 if metadata.has_last_hidden_state else 0)
    return layers * metadata.hidden_size * metadata.itemsize


def choose_rows_per_group(bytes_per_row: int, target_bytes: int = ROW_GROUP_TARGET_BYTES) -> int:
    """Rows per Parquet row group so that a group holds about ``target_bytes``."""
    return max(1, target_bytes // max(1, bytes_per_row))


class _TrailingHasher:
    """sha256 of a file being appended to, by a thread that follows the writer.

    The writer stays on pyarrow's native file (no Python call per page). The
    thread reads each batch's new bytes back from the page cache, hashes them,
    and flushes them to disk (fdatasync) while the next batch is encoded: the
    disk writes all along instead of when the shard commits, and the commit's
    fsync finds little left to do.
    """

    CHUNK_BYTES = 8 * 1024 * 1024

    def __init__(self, path: Path) -> None:
        self._file = open(path, "rb", buffering=0)
        self._hash = hashlib.sha256()
        self._hashed = 0
        self._targets: queue.SimpleQueue[int | None] = queue.SimpleQueue()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name=f"sha256 {path.name}", daemon=True)
        self._thread.start()

    def advance(self, size: int) -> None:
        """The file now holds at least ``size`` bytes; hash them in the background."""
        self._targets.put(size)

    def finish(self, size: int) -> str:
        """Hex sha256 of the first ``size`` bytes (the whole, closed file)."""
        self.advance(size)
        self.stop()
        if self._error is not None:
            raise self._error
        return self._hash.hexdigest()

    def stop(self) -> None:
        """Ends the thread once it has done what it was asked so far."""
        self._targets.put(None)
        self._thread.join()
        self._file.close()

    def _run(self) -> None:
        view = memoryview(bytearray(self.CHUNK_BYTES))
        try:
            while (target := self._targets.get()) is not None:
                while self._hashed < target:
                    count = self._file.readinto(view[: min(len(view), target - self._hashed)])
                    if not count:
                        raise OSError(f"{self._file.name}: ended at byte {self._hashed}, expected {target}")
                    self._hash.update(view[:count])
                    self._hashed += count
                os.fdatasync(self._file.fileno())
        except BaseException as error:  # reported by finish()
            self._error = error
            while self._targets.get() is not None:
                pass


def _binary_column(states: np.ndarray, row_offsets: np.ndarray, row_width_bytes: int) -> pa.Array:
    """One large_binary value per sample, sharing ``states``' memory (no per-sample copy)."""
    data = np.ascontiguousarray(states).view(np.uint8).reshape(-1)
    offsets = (row_offsets * row_width_bytes).astype(np.int64)
    return pa.LargeBinaryArray.from_buffers(
        pa.large_binary(), len(row_offsets) - 1, [None, pa.py_buffer(offsets), pa.py_buffer(data)]
    )


class ShardWriter:
    """Appends captured batches to one shard file; a context manager.

    >>> with ShardWriter(path, metadata) as writer:
    ...     writer.append(sample_ids, input_ids, loss_masks, aux, last)
    ...     info = writer.finalize()
    """

    def __init__(self, path: str | os.PathLike, metadata: ShardMetadata) -> None:
        self.path = Path(path)
        self.temp_path = self.path.with_name(temp_file_name(self.path.name))
        self.metadata = metadata
        self._schema = schema.build_schema(metadata)
        self._file: pa.NativeFile | None = None
        self._hasher: _TrailingHasher | None = None
        self._writer: pq.ParquetWriter | None = None
        self._rows = 0
        self._tokens = 0

    def __enter__(self) -> "ShardWriter":
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file = pa.OSFile(str(self.temp_path), "wb")
        self._hasher = _TrailingHasher(self.temp_path)
        self._writer = pq.ParquetWriter(
            self._file,
            self._schema,
            compression=column_compression(self._schema),
            use_dictionary=False,
            write_statistics=[schema.SAMPLE_ID],
            store_schema=True,
        )
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
    ) -> None:
        """Append samples whose states are stacked token-wise: aux is [sum(T_i), L*H].

        State arrays hold the raw element bits in any numpy dtype of the model
        dtype's itemsize (bfloat16 travels as int16), C-contiguous.
        """
        if self._writer is None:
            raise RuntimeError(f"{self.path}: append() outside the writer's `with` block")
        meta = self.metadata
        lengths = np.fromiter((len(ids) for ids in input_ids), dtype=np.int64, count=len(input_ids))
        if not (len(sample_ids) == len(input_ids) == len(loss_masks)):
            raise ValueError(
                f"{self.path}: {len(sample_ids)} sample ids, {len(input_ids)} input_ids, "
                f"{len(loss_masks)} loss masks; they must match one to one"
            )
        row_offsets = np.concatenate([[0], np.cumsum(lengths)])
        total = int(row_offsets[-1])
        self._check_states("aux_hidden_states", aux_hidden_states, total, meta.aux_width, sample_ids)
        columns = {
            schema.SAMPLE_ID: pa.array(np.asarray(sample_ids, dtype=np.int64)),
            schema.INPUT_IDS: pa.array([np.asarray(ids, dtype=np.int32) for ids in input_ids], pa.list_(pa.int32())),
            schema.LOSS_MASK: pa.array([np.asarray(m, dtype=np.uint8) for m in loss_masks], pa.list_(pa.uint8())),
            schema.AUX_HIDDEN_STATES: _binary_column(aux_hidden_states, row_offsets, meta.aux_width * meta.itemsize),
        }
        if meta.has_last_hidden_state:
            if last_hidden_state is None:
                raise ValueError(f"{self.path}: the shard stores last_hidden_state but none was given")
            self._check_states("last_hidden_state", last_hidden_state, total, meta.hidden_size, sample_ids)
            columns[schema.LAST_HIDDEN_STATE] = _binary_column(
                last_hidden_state, row_offsets, meta.hidden_size * meta.itemsize
            )
        table = pa.Table.from_pydict(columns, schema=self._schema)
        bytes_per_row = table.nbytes // max(1, table.num_rows)
        self._writer.write_table(table, row_group_size=choose_rows_per_group(bytes_per_row))
        assert self._hasher is not None and self._file is not None
        self._hasher.advance(self._file.tell())
        self._rows += len(sample_ids)
        self._tokens += total

    def _check_states(
        self, name: str, states: np.ndarray, tokens: int, width: int, sample_ids: Sequence[int]
    ) -> None:
        expected = (tokens, width)
        if states.shape != expected or states.dtype.itemsize != self.metadata.itemsize:
            first, last = (sample_ids[0], sample_ids[-1]) if len(sample_ids) else (None, None)
            raise ValueError(
                f"{self.path}: {name} for samples {first}..{last} has shape {states.shape} and "
                f"itemsize {states.dtype.itemsize}; expected {expected} with itemsize "
                f"{self.metadata.itemsize} ({self.metadata.dtype})"
            )

    def finalize(self) -> ShardFileInfo:
        """Close, fsync and atomically publish the file under its final name."""
        if self._writer is None or self._file is None or self._hasher is None:
            raise RuntimeError(f"{self.path}: finalize() called twice or outside `with`")
        self._writer.close()
        self._writer = None
        size = self._file.tell()
        self._file.close()
        sha256 = self._hasher.finish(size)
        _fsync_path(self.temp_path)
        os.replace(self.temp_path, self.path)
        _fsync_path(self.path.parent)
        return ShardFileInfo(path=str(self.path), rows=self._rows, tokens=self._tokens, bytes=size, sha256=sha256)

    def abort(self) -> None:
        """Drop everything written so far; the final name is never touched."""
        writer, self._writer = self._writer, None
        try:
            if writer is not None:
                writer.close()
        finally:
            if self._file is not None and not self._file.closed:
                self._file.close()
            if self._hasher is not None:
                self._hasher.stop()
            self.temp_path.unlink(missing_ok=True)


def _fsync_path(path: Path) -> None:
    """fsync a file or directory by path (Linux flushes the inode whichever descriptor asks)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
