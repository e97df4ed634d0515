"""The training data: ``jobs.prepare`` regenerates the target's own answers to the training prompts."""

from __future__ import annotations

import glob
import sys
from pathlib import Path
from typing import Any

import numpy as np


def prepare_command(model: Path, conversations: Path, out: Path, max_new_tokens: int,
                    cuda_graph: bool = False) -> list[str]:
    """The one call of ``jobs.prepare`` with regeneration: the target answers every user turn itself,
    greedy, and the chat template and the assistant-only loss mask are applied to its answers. No decode
    CUDA graphs unless ``cuda_graph``: as for the serving step, their capture is one more thing that can fail
    on the H200's stack (and has not run there), though a 135M model's decode is bound by kernel launches, which
    graphs remove. ``data.on_invalid=skip``: an answer that cannot be trained
    on (on the H200 a greedy answer held the literal text ``<|im_end|>``; 2 of 3,000 rows were left out) is
    left out and listed in ``_skipped_rows.jsonl`` instead of stopping the run."""
    return [sys.executable, "-m", "jobs.prepare", f"model.path={model}", f"data.path={conversations}",
            f"output.dir={out}", "regenerate=true", "generation.temperature=0",
            f"generation.max_new_tokens={max_new_tokens}", f"model.cuda_graph={str(cuda_graph).lower()}",
            "data.on_invalid=skip"]


def prepared_data(out: Path) -> str:
    """What ``jobs.extract`` reads (its ``data.path``) from ``prepare_command``'s output: the Parquet files
    at its top (``part-NNNNN.parquet``; its side record ``_prepare.json`` and the ``_regenerated/`` answers
    are not data)."""
    return str(out / "*.parquet") if out.is_dir() else str(out)


def data_stats(data: Path, max_length: int) -> dict[str, Any]:
    """Samples and tokens of the prepared data, and the tokens one epoch trains on (SpecForge cuts each
    sample to max_length and zeroes its last loss-mask entry)."""
    import pyarrow.dataset

    files = sorted(glob.glob(prepared_data(data)))
    table = pyarrow.dataset.dataset(files, format="parquet").to_table(columns=["input_ids", "loss_mask"])
    masks = [np.asarray(mask[:max_length]) for mask in table.column("loss_mask").to_pylist()]
    lengths = [len(ids) for ids in table.column("input_ids").to_pylist()]
    return {"samples": len(lengths), "tokens": int(sum(lengths)),
            "loss_tokens_per_epoch": int(sum(int(mask.sum()) - int(mask[-1]) for mask in masks))}
