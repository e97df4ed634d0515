"""Reads samples of a shard file back as torch tensors.

The file is memory-mapped; a sample's state tensors are views on the Arrow
buffer of the row group that holds it (states are stored uncompressed), so
reading one sample decodes only its row group and copies no state bytes
beyond that. The tensors are views sharing that row group's buffers (torch
has no read-only tensor): ``.clone()`` before modifying one in place. fp8
shards are dequantized to the model dtype (a new tensor per sample) unless
the reader is asked for the raw fp8 values and their scales.
"""

from __future__ import annotations

import bisect
import dataclasses
import os
import warnings
from typing import Iterator

import numpy as np
import pyarrow as pa
import torch

import storage.schema as schema
from storage.run_index import open_parquet
from storage.schema import ShardMetadata, metadata_from_schema


@dataclasses.dataclass(frozen=True)
class Sample:
    sample_id: int
    input_ids: torch.Tensor
    """[T] int64"""
    loss_mask: torch.Tensor
    """[T] uint8"""
    aux_hidden_states: torch.Tensor
    """[T, L*H] in the model dtype (float8_e4m3fn when read raw); layer j is columns [j*H, (j+1)*H)."""
    last_hidden_state: torch.Tensor | None
    """[T, H] like ``aux_hidden_states``, post or pre final norm (``metadata.last_hidden_state``); None when not extracted."""
    aux_hidden_states_scales: torch.Tensor | None = None
    """[T, L] float32 when an fp8 shard is read raw: layer j of token t is ``fp8 values * scales[t, j]``."""
    last_hidden_state_scales: torch.Tensor | None = None
    """[T, 1] float32 when an fp8 shard is read raw."""


def read_metadata(path: str | os.PathLike) -> ShardMetadata:
    """The ``ShardMetadata`` of a shard file, from its footer alone."""
    parquet = open_parquet(str(path))
    try:
        return metadata_from_schema(parquet.schema_arrow, source=str(path))
    finally:
        parquet.close()


def _states_tensor(column: pa.Array, row: int, dtype: torch.dtype, width: int) -> torch.Tensor:
    """View of one large_binary value as a [T, width] tensor, sharing Arrow's memory."""
    offsets = np.frombuffer(column.buffers()[1], dtype=np.int64, count=len(column) + 1, offset=column.offset * 8)
    start, end = int(offsets[row]), int(offsets[row + 1])
    data = column.buffers()[2]
    with warnings.catch_warnings():
        # Arrow exports its buffers read-only, which torch cannot carry over and warns about; the
        # module docstring tells callers not to write into the view.
        warnings.simplefilter("ignore", UserWarning)
        flat = torch.frombuffer(data, dtype=dtype, count=(end - start) // dtype.itemsize, offset=start)
    return flat.view(-1, width)


def dequantize(values: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """fp8 [T, G*H] and float32 scales [T, G] -> [T, G*H] in ``dtype`` (computed in float32)."""
    tokens, groups = scales.shape
    return (values.view(tokens, groups, -1).float() * scales.unsqueeze(-1)).view(tokens, -1).to(dtype)


class ShardReader:
    """Random and sequential access to the samples of one shard file.

    States come back in the model dtype (``metadata.dtype``). For fp8 shards
    ``raw_fp8=True`` returns the stored float8_e4m3fn values and their float32
    scales instead of dequantizing them.
    """

    def __init__(self, path: str | os.PathLike, raw_fp8: bool = False) -> None:
        self.path = str(path)
        self.raw_fp8 = raw_fp8
        self._file = open_parquet(self.path)  # a damaged file raises DamagedShardError, naming it
        self.metadata = metadata_from_schema(self._file.schema_arrow, source=self.path)
        rows = [self._file.metadata.row_group(i).num_rows for i in range(self._file.num_row_groups)]
        self._group_starts = np.concatenate([[0], np.cumsum(rows)]).tolist()

    def __len__(self) -> int:
        return self._group_starts[-1]

    def sample_ids(self) -> list[int]:
        return self._file.read(columns=[schema.SAMPLE_ID]).column(0).to_pylist()

    def __getitem__(self, index: int) -> Sample:
        if not 0 <= index < len(self):
            raise IndexError(f"{self.path}: sample index {index} out of range (0..{len(self) - 1})")
        group = bisect.bisect_right(self._group_starts, index) - 1
        table = self._file.read_row_group(group)
        return sample_from_table(table, index - self._group_starts[group], self.metadata, self.raw_fp8)

    def __iter__(self) -> Iterator[Sample]:
        for group in range(self._file.num_row_groups):
            table = self._file.read_row_group(group)
            for row in range(table.num_rows):
                yield sample_from_table(table, row, self.metadata, self.raw_fp8)


def sample_from_table(table: pa.Table, row: int, meta: ShardMetadata, raw_fp8: bool = False) -> Sample:
    """Row ``row`` of a table read from a shard file (a row group, or any slice of one) as a ``Sample``.

    State tensors are views on the table's buffers; fp8 states are dequantized to the model dtype
    unless ``raw_fp8``.
    """
    stored = getattr(torch, meta.state_dtype)

    def column(name: str, dtype: torch.dtype, width: int) -> torch.Tensor:
        chunk, local = _locate(table.column(name), row)
        return _states_tensor(chunk, local, dtype, width)

    def states(name: str, layers: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        values = column(name, stored, layers * meta.hidden_size)
        if not meta.fp8:
            return values, None
        scales = column(name + schema.SCALES_SUFFIX, torch.float32, layers)
        if raw_fp8:
            return values, scales
        return dequantize(values, scales, getattr(torch, meta.dtype)), None

    aux, aux_scales = states(schema.AUX_HIDDEN_STATES, len(meta.layer_ids))
    last, last_scales = states(schema.LAST_HIDDEN_STATE, 1) if meta.has_last_hidden_state else (None, None)
    input_ids = table.column(schema.INPUT_IDS)[row].values.to_numpy()
    loss_mask = table.column(schema.LOSS_MASK)[row].values.to_numpy()
    return Sample(
        sample_id=table.column(schema.SAMPLE_ID)[row].as_py(),
        input_ids=torch.from_numpy(input_ids.astype(np.int64)),
        loss_mask=torch.from_numpy(loss_mask.copy()),
        aux_hidden_states=aux,
        last_hidden_state=last,
        aux_hidden_states_scales=aux_scales,
        last_hidden_state_scales=last_scales,
    )


def _locate(column: pa.ChunkedArray, row: int) -> tuple[pa.Array, int]:
    for chunk in column.chunks:
        if row < len(chunk):
            return chunk, row
        row -= len(chunk)
    raise IndexError(row)
