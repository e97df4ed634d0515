"""Reads and checks the tokenized input dataset (Parquet or JSONL).

Each row has ``input_ids`` (list of ints) and optionally ``loss_mask`` (list
of 0/1, same length). Every row is checked before any extraction starts, and
errors name the row and the file, so a bad dataset never produces a half
output.
"""

from __future__ import annotations

import dataclasses
import hashlib
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.json as pa_json
import pyarrow.parquet as pq

INPUT_IDS = "input_ids"
LOSS_MASK = "loss_mask"


@dataclasses.dataclass(frozen=True)
class TokenizedDataset:
    path: str
    input_ids: list[np.ndarray]
    """int32 token ids per row."""
    loss_masks: list[np.ndarray]
    """uint8 per row; all ones where the input had no loss_mask."""

    def __len__(self) -> int:
        return len(self.input_ids)

    def fingerprint(self) -> str:
        """sha256 of every row's tokens and loss mask: the same data gives the same shards."""
        digest = hashlib.sha256()
        for ids, mask in zip(self.input_ids, self.loss_masks):
            digest.update(len(ids).to_bytes(8, "little"))
            digest.update(ids.tobytes())
            digest.update(mask.tobytes())
        return digest.hexdigest()

    @property
    def lengths(self) -> np.ndarray:
        return np.fromiter((len(ids) for ids in self.input_ids), dtype=np.int64, count=len(self.input_ids))


def _read_table(path: Path) -> pa.Table:
    suffix = path.suffix.lower()
    if suffix == ".parquet":
        return pq.read_table(path)
    if suffix in (".jsonl", ".json"):
        return pa_json.read_json(path)
    raise ValueError(f"data.path={path}: unsupported file type {suffix!r}; use .parquet or .jsonl")


def load_tokenized_dataset(path: str, vocab_size: int, max_length: int) -> TokenizedDataset:
    """Read every row and check it against the model; raises ValueError naming the first bad row."""
    file = Path(path)
    if not file.is_file():
        raise ValueError(f"data.path={path}: no such file")
    table = _read_table(file)
    if INPUT_IDS not in table.column_names:
        raise ValueError(f"{path}: no {INPUT_IDS!r} column (found {table.column_names})")
    ids_column = table.column(INPUT_IDS).to_pylist()
    mask_column = table.column(LOSS_MASK).to_pylist() if LOSS_MASK in table.column_names else None
    input_ids: list[np.ndarray] = []
    loss_masks: list[np.ndarray] = []
    for row, ids in enumerate(ids_column):
        tokens = _check_tokens(path, row, ids, vocab_size, max_length)
        mask = None if mask_column is None else mask_column[row]
        input_ids.append(tokens)
        loss_masks.append(_check_mask(path, row, mask, len(tokens)))
    if not input_ids:
        raise ValueError(f"{path}: the dataset has no rows")
    return TokenizedDataset(path=str(path), input_ids=input_ids, loss_masks=loss_masks)


def _check_tokens(path: str, row: int, ids: object, vocab_size: int, max_length: int) -> np.ndarray:
    if not isinstance(ids, list) or not ids:
        raise ValueError(f"{path} row {row}: input_ids must be a non-empty list of token ids, got {ids!r:.80}")
    try:
        tokens = np.asarray(ids, dtype=np.int64)
    except (TypeError, ValueError):
        raise ValueError(f"{path} row {row}: input_ids holds non-integer values: {ids!r:.80}") from None
    if tokens.ndim != 1:
        raise ValueError(f"{path} row {row}: input_ids must be a flat list, got shape {tokens.shape}")
    if tokens.min() < 0 or tokens.max() >= vocab_size:
        bad = int(tokens[(tokens < 0) | (tokens >= vocab_size)][0])
        raise ValueError(
            f"{path} row {row}: token id {bad} is outside the model's vocabulary [0, {vocab_size}); "
            "was the dataset tokenized for another model?"
        )
    if len(tokens) > max_length:
        raise ValueError(
            f"{path} row {row}: {len(tokens)} tokens exceed the context length {max_length}; "
            "truncate or drop the row, or raise model.context_length if the model supports it"
        )
    return tokens.astype(np.int32)


def _check_mask(path: str, row: int, mask: object, length: int) -> np.ndarray:
    if mask is None:
        return np.ones(length, dtype=np.uint8)
    if not isinstance(mask, list) or len(mask) != length:
        size = len(mask) if isinstance(mask, list) else type(mask).__name__
        raise ValueError(f"{path} row {row}: loss_mask has {size} entries, input_ids has {length}")
    values = np.asarray(mask)
    if not np.isin(values, (0, 1)).all():
        raise ValueError(f"{path} row {row}: loss_mask must hold only 0 and 1")
    return values.astype(np.uint8)
