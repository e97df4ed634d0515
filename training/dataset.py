"""A PyTorch map-style dataset over one or more runs, for training a drafter straight from the shards.

>>> dataset = HiddenStatesDataset("out")                        # or "s3://bucket/run1", or a list of runs
>>> loader = DataLoader(dataset, batch_size=8, collate_fn=collate, num_workers=4,
...                     sampler=DistributedSampler(dataset))    # shards by rank
>>> HiddenStatesDataset("out", view="specforge")   # SpecForge's items, in the order its loader reads them
>>> HiddenStatesDataset("out", view="speculators", train_ratio=0.9, split="train")  # speculators' ArrowDataset

Any sample is two bisects away (``storage.run_index``) and decodes its row group only; state tensors
are views on the last row group read, which stays cached: ``clone()`` before modifying one
(``collate`` copies). The dataset pickles as its index, so each ``DataLoader`` worker opens its own
files. What it reads, and what it costs: docs/training.md.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any, Callable, Mapping, Sequence

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import torch
from torch.utils.data import Dataset

from storage import schema
from storage.reader import Sample, sample_from_table
from storage.run_index import RunIndex, open_parquet
from storage.schema import ShardMetadata
from storage.token_freq import TokenCounter, read_token_freq
from training import peer_formats
from training.final_state import FinalNorm, FinalNormSource, final_norm_for

SAMPLE = "sample"
VIEWS = (SAMPLE, peer_formats.SPECFORGE, peer_formats.SPECULATORS)
TRAIN, VAL = "train", "val"


def sample_item(sample: Sample) -> dict[str, Any]:
    """This project's item: ``sample_id``, ``input_ids`` [T] int64, ``loss_mask`` [T] uint8,
    ``aux_hidden_states`` [T, L*H], ``last_hidden_state`` [T, H] (when the run has one), and
    with raw fp8 states their scales ``aux_hidden_states_scales`` [T, L], ``last_hidden_state_scales`` [T, 1]."""
    item: dict[str, Any] = {
        "sample_id": sample.sample_id,
        "input_ids": sample.input_ids,
        "loss_mask": sample.loss_mask,
        "aux_hidden_states": sample.aux_hidden_states,
    }
    optional = {
        "last_hidden_state": sample.last_hidden_state,
        "aux_hidden_states_scales": sample.aux_hidden_states_scales,
        "last_hidden_state_scales": sample.last_hidden_state_scales,
    }
    item.update((key, value) for key, value in optional.items() if value is not None)
    return item


class HiddenStatesDataset(Dataset):
    """Samples of one or more runs (``output.dir`` paths or URLs of shard files), in run, file and row order.

    ``view`` picks the item: ``sample`` (``sample_item``), ``specforge`` (SpecForge's offline
    item, ``normalize_offline_sample``, cut to ``max_len``; from a pre-norm run, the final state is
    the checkpoint's final norm applied to it, ``model_path`` or the run's model.path:
    ``training.final_state``) or ``speculators`` (speculators' ``ArrowDataset`` item, states cast
    to ``hidden_states_dtype``; needs a pre-norm run). ``storage_options`` go to fsspec for URLs (a
    sink's endpoint and keys).

    Order: ``sample`` and ``speculators`` keep the files' order, which in a run of the job is by
    sample id (speculators' rows, as ``jobs.export`` numbers them); ``specforge`` goes as
    SpecForge's loader does over an export of the run: it sorts the files' paths as strings
    (``rows_0-2000/data_10.ckpt`` before ``data_2.ckpt``), within each run. ``train_ratio`` and
    ``split`` cut that order as speculators' ``ArrowDataset`` does: ``train`` is the first
    ``int(len * train_ratio)`` items, ``val`` the rest, the same items on every rank and every run.
    ``approx_lengths`` (tokens per item, in order) is what speculators' batch sampler packs by.
    """

    def __init__(
        self,
        runs: str | os.PathLike | Sequence[str | os.PathLike],
        view: str = SAMPLE,
        *,
        raw_fp8: bool = False,
        max_len: int = peer_formats.SPECFORGE_MAX_LEN,
        hidden_states_dtype: torch.dtype = torch.bfloat16,
        train_ratio: float = 1.0,
        split: str = TRAIN,
        storage_options: Mapping[str, Any] | None = None,
        model_path: str = "",
    ) -> None:
        if view not in VIEWS:
            raise ValueError(f"view={view!r}: use one of {', '.join(VIEWS)}")
        if not 0.0 < train_ratio <= 1.0:
            raise ValueError(f"train_ratio={train_ratio}: the share of the items in the train split, in (0, 1]")
        if split not in (TRAIN, VAL):
            raise ValueError(f"split={split!r}: use {TRAIN} or {VAL}")
        if split == VAL and train_ratio == 1.0:
            raise ValueError("split='val' with train_ratio=1.0 leaves no validation items; pass e.g. train_ratio=0.9")
        self.runs = [os.fspath(runs)] if isinstance(runs, (str, os.PathLike)) else [os.fspath(r) for r in runs]
        self.index = RunIndex.build(runs, storage_options)
        self.view = view
        self.raw_fp8 = raw_fp8
        self.max_len = max_len
        self.hidden_states_dtype = hidden_states_dtype
        self.storage_options = dict(storage_options or {})
        self.final_norm: FinalNormSource | None = None
        """The final norm the ``specforge`` view applies to a pre-norm run's final state."""
        if view != SAMPLE:
            self.final_norm = final_norm_for(view, self.metadata, str(runs), model_path)
            if raw_fp8:
                raise ValueError(f"view={view!r} returns what that trainer reads, model-dtype states: drop raw_fp8")
        if raw_fp8 and not self.metadata.fp8:
            raise ValueError(f"raw_fp8=True but {runs} stored {self.metadata.state_dtype} states, not fp8")
        self._item: Callable[[Sample], dict[str, Any]] = self._item_function()
        self._files: dict[int, pq.ParquetFile] = {}
        self._cached: tuple[int, int, pa.Table] | None = None
        self._opened_by = os.getpid()
        order = self._specforge_order() if view == peer_formats.SPECFORGE else range(len(self.index))
        cut = int(len(order) * train_ratio)  # speculators' ArrowDataset: one expression for both splits
        self._positions: range | np.ndarray = order[:cut] if split == TRAIN else order[cut:]
        """Item i is the index's sample ``_positions[i]``."""
        if len(self._positions) == 0:
            raise ValueError(f"the {split} split is empty: {len(order)} samples, train_ratio={train_ratio}")
        self._lengths: list[int] | None = None

    @property
    def metadata(self) -> ShardMetadata:
        return self.index.metadata

    def __len__(self) -> int:
        return len(self._positions)

    def __getitem__(self, index: int) -> dict[str, Any]:
        return self._item(self.sample(index))

    def sample(self, index: int) -> Sample:
        """The ``Sample`` of item ``index`` (model dtype; raw fp8 with ``raw_fp8``)."""
        file, group, row = self.index.locate(self._position(index))
        return sample_from_table(self._row_group(file, group), row, self.metadata, self.raw_fp8)

    def run_of(self, index: int) -> int:
        """Which of the runs given (its position in the list) holds item ``index``."""
        return self.index.files[self.index.locate(self._position(index))[0]].run

    @property
    def approx_lengths(self) -> list[int]:
        """Tokens of each item, in order (read once from the files' token columns): speculators' batch sampler
        (``MultipackDistributedBatchSamplerV2``) packs batches by them."""
        if self._lengths is None:
            lengths = np.concatenate([self._file_column(file, schema.INPUT_IDS, pc.list_value_length)
                                      for file in range(len(self.index.files))])
            self._lengths = lengths[np.asarray(self._positions)].tolist()
        return self._lengths

    def token_freq(self) -> dict[int, int]:
        """{token id: count over loss-masked tokens} of the runs, as speculators' ``token_freq.pt`` holds it (save
        it with ``torch.save`` for its ``--token-freq-path``): a single run's ``.token_freq.pt`` when the run has one
        (written once it was complete: it still counts shards consumed since), else counted from the files read
        here. Over every item of the runs, whatever the split (as speculators counts its whole dataset)."""
        if len(self.runs) == 1 and os.path.isdir(self.runs[0]):
            stored = read_token_freq(self.runs[0])
            if stored is not None:
                return stored
        counter = TokenCounter()
        for file in range(len(self.index.files)):
            ids = self._file_column(file, schema.INPUT_IDS, lambda column: column)
            counter.add(ids, self._file_column(file, schema.LOSS_MASK, lambda column: column))
        return counter.counts()

    def _position(self, index: int) -> int:
        if not -len(self) <= index < len(self):
            raise IndexError(f"item {index} out of range (0..{len(self) - 1})")
        return int(self._positions[int(index)])

    def _file_column(self, file: int, name: str, transform: Callable[[pa.ChunkedArray], Any]) -> Any:
        """One column of a file, in its row order, through ``transform``."""
        parquet = open_parquet(self.index.files[file].url, self.storage_options)
        try:
            return transform(parquet.read(columns=[name]).column(0))
        finally:
            parquet.close()

    def _specforge_order(self) -> np.ndarray:
        """The index's samples in the order SpecForge's loader reads an export of them: each run's file paths
        (``rows_{g}-{g+2000}/data_{id}.ckpt``) sorted as strings (its ``list_local_files``: ``sorted`` paths)."""
        ids = [self._file_column(file, schema.SAMPLE_ID, lambda column: column.to_numpy())
               for file in range(len(self.index.files))]
        keys = [(shard.run, peer_formats.specforge_path(int(sample_id)))
                for shard, file_ids in zip(self.index.files, ids) for sample_id in file_ids]
        return np.array(sorted(range(len(keys)), key=keys.__getitem__), dtype=np.int64)

    def _row_group(self, file: int, group: int) -> pa.Table:
        if self._opened_by != os.getpid():  # a forked DataLoader worker: its own handles, not the parent's sockets
            self._files, self._cached, self._opened_by = {}, None, os.getpid()
        if self._cached is not None and self._cached[:2] == (file, group):
            return self._cached[2]
        if file not in self._files:
            self._files[file] = open_parquet(self.index.files[file].url, self.storage_options)
        table = self._files[file].read_row_group(group)
        self._cached = (file, group, table)
        return table

    def _item_function(self) -> Callable[[Sample], dict[str, Any]]:
        hidden = self.metadata.hidden_size
        if self.view == peer_formats.SPECFORGE:
            max_len = self.max_len
            if self.final_norm is None:
                return lambda sample: peer_formats.specforge_item(sample, max_len)
            norm = FinalNorm(self.final_norm, getattr(torch, self.metadata.dtype))
            return lambda sample: peer_formats.specforge_item(
                dataclasses.replace(sample, last_hidden_state=norm(sample.last_hidden_state)), max_len)
        if self.view == peer_formats.SPECULATORS:
            dtype = self.hidden_states_dtype
            return lambda sample: peer_formats.speculators_item(sample, hidden, dtype)
        return sample_item

    def __getstate__(self) -> dict[str, Any]:
        """Open files, the cached row group and the item function stay behind; a worker reopens lazily."""
        state = dict(self.__dict__)
        state.update(_files={}, _cached=None, _item=None)
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._item = self._item_function()


def collate(batch: Sequence[Mapping[str, Any]]) -> dict[str, torch.Tensor]:
    """Pads a list of ``sample`` items to the longest: [B, T] token tensors and [B, T, W] states,
    zeros after each sample's end; ``attention_mask`` [B, T] int64 is 1 on real tokens; ``lengths``
    and ``sample_ids`` are [B] int64."""
    if not batch:
        raise ValueError("collate got an empty batch")
    lengths = torch.tensor([item["input_ids"].shape[0] for item in batch], dtype=torch.long)
    longest = int(lengths.max())
    out: dict[str, torch.Tensor] = {
        "sample_ids": torch.tensor([item["sample_id"] for item in batch], dtype=torch.long),
        "lengths": lengths,
        "attention_mask": (torch.arange(longest).unsqueeze(0) < lengths.unsqueeze(1)).to(torch.long),
    }
    for key, first in batch[0].items():
        if key == "sample_id":
            continue
        padded = first.new_zeros((len(batch), longest, *first.shape[1:]))
        for row, item in enumerate(batch):
            padded[row, : item[key].shape[0]] = item[key]
        out[key] = padded
    return out
