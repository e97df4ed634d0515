"""Opens and checks the tokenized input dataset, and hands out rows by range.

Each row has ``input_ids`` (list of integers) and optionally ``loss_mask``
(0/1 integers, same length). One streaming pass over the files
(``inputs.files``) checks every row with vectorised Arrow/NumPy
operations, block by block, and keeps only what planning needs: each kept
row's length and sample id (its global row index across the files), a
fingerprint of every token and mask, and an index of segments (row group,
record batch or byte range) to read the rows again from. Token ids stay in
the files until a shard's batches are sent: ``rows(start, stop)`` reads only
the segments that hold them.

A bad row stops everything before any extraction starts (``on_invalid=fail``,
naming the file, the row within that file, the sample id and the reason), or
is left out and recorded (``on_invalid=skip``); kept rows keep their sample ids.
"""

from __future__ import annotations

import collections
import dataclasses
import hashlib
import logging
import time
from typing import Any, Callable, Optional

import fsspec
import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from common.checks import choices
from extractor.types import TokenBatch, split_flat
from inputs.config import OnInvalid
from inputs.files import (
    INPUT_IDS,
    LARGE_ROW_GROUP_ROWS,
    LOSS_MASK,
    Block,
    InputFile,
    column_names,
    largest_row_group,
    read_segment,
    resolve_files,
    scan,
)

logger = logging.getLogger(__name__)

EXCEEDS_CONTEXT = "tokens exceed the context length"
"""In the reason of a row longer than the context length (the dry run counts them)."""
FINGERPRINT_VERSION = b"eagle3-tokenized-dataset-v2"
CACHE_SEGMENTS = 4
"""Decoded segments kept for the next rows() calls: the open shards read neighbouring rows."""
CACHE_BYTES = 1 << 30
"""Past this many decoded bytes the cache keeps only the two most recent segments."""


@dataclasses.dataclass(frozen=True)
class InvalidRow:
    sample_id: int
    """Global row index across the input files."""
    file: str
    file_row: int
    """0-based row within that file."""
    reason: str


@dataclasses.dataclass
class _Tokens:
    """Kept rows of one segment, decoded: row i is ids[offsets[i]:offsets[i+1]]."""

    offsets: np.ndarray
    ids: np.ndarray
    masks: np.ndarray

    @property
    def nbytes(self) -> int:
        return self.offsets.nbytes + self.ids.nbytes + self.masks.nbytes


class TokenizedDataset:
    """The kept rows of the input: lengths and sample ids in memory, tokens read on demand."""

    def __init__(
        self, source: str, fs: fsspec.AbstractFileSystem, files: list[InputFile], segments: dict[str, np.ndarray],
        segment_digests: list[bytes], sample_ids: np.ndarray, lengths: np.ndarray, invalid: list[InvalidRow], fingerprint: str, vocab_size: int,
    ) -> None:
        self.source = source
        self.sample_ids = sample_ids
        self.lengths = lengths
        self.invalid = invalid
        self.fingerprint = fingerprint
        self._fs = fs
        self._files = files
        # Per segment: its file, global row index of its first row, rows, where it is in the file
        # (see input_files.Block), and the kept rows it holds as positions [kept, kept_end).
        self._segment_file = segments["file"]
        self._segment_first = segments["first"]
        self._segment_rows = segments["rows"]
        self._segment_key = segments["key"]
        self._segment_bytes = segments["bytes"]
        self._segment_digests = segment_digests
        """What each segment's kept ids and masks hashed to when checked: a file changed in place is noticed."""
        self._segment_kept = np.searchsorted(sample_ids, self._segment_first)
        self._segment_kept_end = np.append(self._segment_kept[1:], len(sample_ids))
        self._vocab_size = vocab_size
        self._cache: collections.OrderedDict[int, _Tokens] = collections.OrderedDict()

    def __len__(self) -> int:
        return len(self.sample_ids)

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_cache": collections.OrderedDict()}

    def rows(self, start: int, stop: int) -> tuple[list[np.ndarray], list[np.ndarray]]:
        """input_ids (int32) and loss masks (uint8, all ones when absent) of kept rows [start, stop), one array a row."""
        tokens, masks = self.flat_rows(start, stop)
        return tokens.samples(), split_flat(masks, tokens.offsets)

    def flat_rows(self, start: int, stop: int) -> tuple[TokenBatch, np.ndarray]:
        """Kept rows [start, stop) as one flat batch of ids and its flat loss masks: what the driver sends
        (a row range within one segment is one slice of its arrays, no copy)."""
        if not 0 <= start <= stop <= len(self):
            raise IndexError(f"rows [{start}, {stop}) outside the dataset's {len(self)} rows")
        ids: list[np.ndarray] = []
        masks: list[np.ndarray] = []
        lengths: list[np.ndarray] = []
        # The last segment whose kept rows start at or before `start` holds it (empty ones are skipped).
        segment = int(np.searchsorted(self._segment_kept, start, side="right")) - 1
        position = start
        while position < stop:
            base, end = int(self._segment_kept[segment]), min(stop, int(self._segment_kept_end[segment]))
            if end > position:
                tokens = self._tokens(segment)
                first, last = position - base, end - base
                begin, finish = tokens.offsets[first], tokens.offsets[last]
                ids.append(tokens.ids[begin:finish])
                masks.append(tokens.masks[begin:finish])
                lengths.append(np.diff(tokens.offsets[first : last + 1]))
                position = end
            segment += 1
        offsets = np.concatenate([[0], np.cumsum(np.concatenate(lengths))]) if lengths else np.zeros(1, np.int64)
        if len(ids) == 1:  # the usual case
            return TokenBatch(ids[0], offsets), masks[0]
        return TokenBatch(_concat(ids, np.int32), offsets), _concat(masks, np.uint8)

    def _tokens(self, segment: int) -> _Tokens:
        """A segment's kept rows, decoded once and checked against the first pass."""
        if segment in self._cache:
            self._cache.move_to_end(segment)
            return self._cache[segment]
        file = self._files[self._segment_file[segment]]
        table = read_segment(self._fs, file, int(self._segment_key[segment]), int(self._segment_bytes[segment]))
        if table.num_rows != self._segment_rows[segment]:
            raise _changed(file, f"a segment that had {self._segment_rows[segment]} rows has {table.num_rows}")
        kept = slice(int(self._segment_kept[segment]), int(self._segment_kept_end[segment]))
        if kept.stop - kept.start < table.num_rows:
            table = table.take(self.sample_ids[kept] - self._segment_first[segment])
        tokens = decode_rows(table)
        if not np.array_equal(np.diff(tokens.offsets), self.lengths[kept]) or (
            len(tokens.ids) and (tokens.ids.min() < 0 or tokens.ids.max() >= self._vocab_size)
        ):
            raise _changed(file, f"rows from sample id {self.sample_ids[kept.start]} on differ from what was checked")
        ids, masks = _segment_digest(), _segment_digest()
        ids.update(memoryview(np.ascontiguousarray(tokens.ids)))
        masks.update(memoryview(np.ascontiguousarray(tokens.masks)))
        if ids.digest() + masks.digest() != self._segment_digests[segment]:
            raise _changed(file, f"the tokens of the rows from sample id {self.sample_ids[kept.start]} on are not the "
                                 "ones checked (same size, other content)")
        for array in (tokens.offsets, tokens.ids, tokens.masks):
            array.flags.writeable = False
        self._cache[segment] = tokens
        while len(self._cache) > CACHE_SEGMENTS or (
            len(self._cache) > 2 and sum(t.nbytes for t in self._cache.values()) > CACHE_BYTES
        ):
            self._cache.popitem(last=False)
        return tokens


def _segment_digest() -> Any:
    return hashlib.blake2b(digest_size=16)


def _changed(file: InputFile, what: str) -> ValueError:
    return ValueError(
        f"{file.name} changed while the job ran ({what}); restore it, or start again with a new output.dir"
    )


def open_tokenized_dataset(
    path: str, vocab_size: int, max_length: int, on_invalid: str = "fail",
    storage_options: Optional[dict[str, Any]] = None,
) -> TokenizedDataset:
    """Find, check and index every row of ``data.path``; raises ValueError naming the first bad row
    (``on_invalid=fail``) or records bad rows and leaves them out (``skip``)."""
    if on_invalid not in choices(OnInvalid):
        raise ValueError(f"data.on_invalid={on_invalid!r}: use {' or '.join(choices(OnInvalid))}")
    started = time.perf_counter()
    fs, files = resolve_files(path, storage_options)
    scanner = _Scanner(vocab_size, max_length, on_invalid)
    for number, file in enumerate(files):
        try:
            scanner.scan_file(fs, number, file)
            rows = largest_row_group(fs, file)
        except (pa.ArrowException, OSError) as error:  # a broken or unreadable file among good ones: name it
            raise ValueError(
                f"{file.name}: cannot be read as {file.format} ({type(error).__name__}: {' '.join(str(error).split())}); "
                "fix or remove it from data.path, then rerun"
            ) from None
        if rows > LARGE_ROW_GROUP_ROWS:
            logger.warning(
                "%s has row groups of up to %d rows; each is decoded whole to send any of its rows, so the "
                "driver may hold one such group in memory. Rewrite it with smaller row groups "
                "(pyarrow.parquet.write_table(..., row_group_size=10000)) to bound that", file.name, rows,
            )
    dataset = scanner.finish(path, fs, files)
    logger.info(
        "%s: %d files, %d rows kept (%d tokens), %d invalid rows skipped, read and checked in %.1f s",
        path, len(files), len(dataset), int(dataset.lengths.sum()), len(dataset.invalid),
        time.perf_counter() - started,
    )
    return dataset


class _Scanner:
    """One pass over the files: checks, lengths, sample ids, segments and the fingerprint."""

    def __init__(self, vocab_size: int, max_length: int, on_invalid: str) -> None:
        self.vocab_size = vocab_size
        self.max_length = max_length
        self.skip = on_invalid == "skip"
        self.next_sample = 0
        self.sample_ids: list[np.ndarray] = []
        self.lengths: list[np.ndarray] = []
        self.invalid: list[InvalidRow] = []
        self.segments: dict[str, list[int]] = {"file": [], "first": [], "rows": [], "key": [], "bytes": []}
        self.segment_digests: list[tuple[Any, Any]] = []
        """Per segment: digests of its kept rows' token ids and loss masks (a block may be part of one)."""
        self.hashes = [hashlib.sha256() for _ in range(3)]  # lengths, token ids, loss masks

    def scan_file(self, fs: fsspec.AbstractFileSystem, number: int, file: InputFile) -> None:
        file_row = 0
        masked = False
        for block in scan(fs, file):
            masked = masked or _has_masks(block.table)
            if not self.segments["file"] or (self.segments["file"][-1], self.segments["key"][-1]) != (number, block.segment):
                for name, value in zip(self.segments, (number, self.next_sample, 0, block.segment, block.segment_bytes)):
                    self.segments[name].append(value)
                self.segment_digests.append((_segment_digest(), _segment_digest()))
            self.segments["rows"][-1] += block.table.num_rows
            self._block(file, file_row, block)
            file_row += block.table.num_rows
            self.next_sample += block.table.num_rows
        if file_row and not masked:  # all ones, as documented; a mask misnamed would be so too, silently
            logger.warning("%s: no row has a %s (its columns: %s), so every token of its rows is trained on; a mask "
                           "under another name is not read: name that column %s (docs/format.md)", file.name,
                           LOSS_MASK, ", ".join(column_names(fs, file)), LOSS_MASK)

    def _block(self, file: InputFile, file_row: int, block: Block) -> None:
        reasons = check_rows(block.table, self.vocab_size, self.max_length, block.reasons)
        table = block.table
        if reasons:
            bad = sorted(reasons)
            if not self.skip:
                raise ValueError(
                    _describe(file, file_row, self.next_sample, bad[0], reasons[bad[0]], block.line_of)
                    + " -- data.on_invalid=skip would leave such rows out and list them in the run summary"
                )
            for row in bad:
                self.invalid.append(InvalidRow(self.next_sample + row, file.name, file_row + row, reasons[row]))
            keep = np.ones(table.num_rows, dtype=bool)
            keep[bad] = False
            table = table.filter(pa.array(keep))
            local = np.flatnonzero(keep)
        else:
            local = np.arange(table.num_rows)
        tokens = decode_rows(table)
        lengths = np.diff(tokens.offsets)
        self.sample_ids.append(local + self.next_sample)
        self.lengths.append(lengths)
        for digest, array in zip(self.hashes, (lengths.astype("<i8"), tokens.ids.astype("<i4", copy=False), tokens.masks)):
            digest.update(memoryview(np.ascontiguousarray(array)))  # little-endian, no copy on x86/ARM
        for digest, array in zip(self.segment_digests[-1], (tokens.ids, tokens.masks)):
            digest.update(memoryview(np.ascontiguousarray(array)))

    def finish(self, path: str, fs: fsspec.AbstractFileSystem, files: list[InputFile]) -> TokenizedDataset:
        sample_ids = np.concatenate(self.sample_ids) if self.sample_ids else np.zeros(0, np.int64)
        lengths = np.concatenate(self.lengths) if self.lengths else np.zeros(0, np.int64)
        if not len(sample_ids):
            if self.invalid:
                first = self.invalid[0]
                raise ValueError(
                    f"data.path={path}: all {len(self.invalid)} rows are invalid, e.g. {first.file} row "
                    f"{first.file_row}: {first.reason}"
                )
            raise ValueError(f"data.path={path}: the dataset has no rows")
        # Same kept rows, same sample ids, same tokens and masks: same shard contents.
        fingerprint = hashlib.sha256(FINGERPRINT_VERSION)
        for digest in self.hashes:
            fingerprint.update(digest.digest())
        if self.invalid:
            fingerprint.update(hashlib.sha256(sample_ids.astype("<i8").tobytes()).digest())
        segments = {name: np.asarray(values, dtype=np.int64) for name, values in self.segments.items()}
        digests = [ids.digest() + masks.digest() for ids, masks in self.segment_digests]
        return TokenizedDataset(
            path, fs, files, segments, digests, sample_ids.astype(np.int64), lengths.astype(np.int64), self.invalid,
            fingerprint.hexdigest(), self.vocab_size,
        )


def _describe(file: InputFile, file_row: int, sample_id: int, row: int, reason: str,
              line_of: Optional[Callable[[int], int]]) -> str:
    where = f"line {line_of(row)}, " if line_of else ""
    return f"{file.name} row {file_row + row} ({where}sample id {sample_id + row}): {reason}"


# -- vectorised checks --------------------------------------------------------------------------


def check_rows(table: pa.Table, vocab_size: int, max_length: int, reasons: dict[int, str]) -> dict[int, str]:
    """Reason for every bad row of ``table`` (row -> why), the first failed check per row.

    ``reasons`` holds rows the reader already refused; the column types were checked per file.
    """
    reasons = dict(reasons)
    ids = _column(table, INPUT_IDS)
    lengths = _lengths(ids)

    def flag(rows: np.ndarray, why: Callable[[int], str]) -> None:
        for row in np.flatnonzero(rows).tolist():
            reasons.setdefault(row, why(row))

    null_rows = ~_valid(ids)
    flag(null_rows, lambda row: "input_ids is missing (null)")
    flag(~null_rows & (lengths == 0), lambda row: "input_ids must be a non-empty list of token ids, got []")
    values = pc.list_flatten(ids)
    offsets = np.concatenate([[0], np.cumsum(lengths)])
    bad_values = _bad_positions(values, lambda v: (v < 0) | (v >= vocab_size), 0, vocab_size - 1)
    flag(_rows_of(bad_values, offsets, len(lengths)), lambda row: _id_reason(values, offsets, row, vocab_size))
    flag(lengths > max_length, lambda row: (
        f"{lengths[row]} {EXCEEDS_CONTEXT} {max_length}; truncate or drop the row, or raise "
        "model.context_length if the model supports it"
    ))
    masks = _mask_column(table)
    if masks is not None:
        present = _valid(masks)
        mask_lengths = _lengths(masks)
        flag(present & (mask_lengths != lengths),
             lambda row: f"loss_mask has {mask_lengths[row]} entries, input_ids has {lengths[row]}")
        mask_offsets = np.concatenate([[0], np.cumsum(mask_lengths)])
        bad_masks = _bad_positions(pc.list_flatten(masks), lambda v: (v < 0) | (v > 1), 0, 1)
        flag(_rows_of(bad_masks, mask_offsets, len(lengths)), lambda row: "loss_mask must hold only 0 and 1")
    return reasons


def _column(table: pa.Table, name: str) -> Optional[pa.Array]:
    if name not in table.column_names:
        return None
    column = table.column(name)
    return column.combine_chunks() if column.num_chunks != 1 else column.chunk(0)


def _mask_column(table: pa.Table) -> Optional[pa.Array]:
    """The loss_mask column, or None where the rows have none (no column, or only nulls)."""
    masks = _column(table, LOSS_MASK)
    if masks is None or pa.types.is_null(masks.type) or pa.types.is_null(masks.type.value_type):
        return None
    return masks


def _has_masks(table: pa.Table) -> bool:
    """Whether any row of ``table`` has a loss mask."""
    masks = _mask_column(table)
    return masks is not None and masks.null_count < len(masks)


def _valid(array: pa.Array) -> np.ndarray:
    if array.null_count == 0:
        return np.ones(len(array), dtype=bool)
    return array.is_valid().to_numpy(zero_copy_only=False)


def _lengths(lists: pa.Array) -> np.ndarray:
    """Entries per row; 0 for a null row (whose values list_flatten leaves out)."""
    return pc.fill_null(pc.list_value_length(lists), 0).to_numpy(zero_copy_only=False).astype(np.int64)


def _bad_positions(values: pa.Array, is_bad: Callable[[np.ndarray], np.ndarray], low: int, high: int) -> np.ndarray:
    """Positions of null values and of values outside [low, high]; one min/max pass when all are fine."""
    nulls = np.zeros(0, dtype=np.int64)
    if values.null_count:
        nulls = np.flatnonzero(~values.is_valid().to_numpy(zero_copy_only=False))
        values = pc.fill_null(values, low)
    if len(values):
        extremes = pc.min_max(values)
        if extremes["min"].as_py() < low or extremes["max"].as_py() > high:
            return np.union1d(nulls, np.flatnonzero(is_bad(values.to_numpy())))
    return nulls


def _rows_of(positions: np.ndarray, offsets: np.ndarray, rows: int) -> np.ndarray:
    flagged = np.zeros(rows, dtype=bool)
    flagged[np.searchsorted(offsets, positions, side="right") - 1] = True
    return flagged


def _id_reason(values: pa.Array, offsets: np.ndarray, row: int, vocab_size: int) -> str:
    row_values = values[offsets[row] : offsets[row + 1]].to_pylist()
    if None in row_values:
        return f"input_ids holds a null at position {row_values.index(None)}"
    bad = next(v for v in row_values if not 0 <= v < vocab_size)
    return (
        f"token id {bad} is outside the model's vocabulary [0, {vocab_size}); was the dataset tokenized "
        "for another model?"
    )


def _concat(parts: list[np.ndarray], dtype: type) -> np.ndarray:
    return np.concatenate(parts) if parts else np.zeros(0, dtype)


def decode_rows(table: pa.Table) -> _Tokens:
    """Token ids (int32) and loss masks (uint8; ones where the row has none) of rows already checked."""
    ids = _column(table, INPUT_IDS)
    lengths = _lengths(ids)
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    flat_ids = pc.list_flatten(ids).to_numpy().astype(np.int32)
    masks = np.ones(len(flat_ids), dtype=np.uint8)
    mask_column = _mask_column(table)
    if mask_column is not None and mask_column.null_count < len(mask_column):
        present = _valid(mask_column)
        values = pc.list_flatten(mask_column).to_numpy().astype(np.uint8)
        if present.all():
            masks = values
        else:
            masks[np.repeat(present, lengths)] = values
    return _Tokens(offsets=offsets, ids=flat_ids, masks=masks)
