"""The ``data`` and ``demo`` sections: what the job reads, and the embedded demo that makes it locally."""

from __future__ import annotations

import dataclasses
from typing import Any, Dict, Literal

from common.checks import check_choice, check_int, choices

OnInvalid = Literal["fail", "skip"]
"""What happens to a row that fails the input checks."""
DemoArch = Literal["llama", "qwen3", "deepseek_v3", "kimi_k25"]
"""Architectures of the demo's tiny random-weight model."""


@dataclasses.dataclass
class DataConfig:
    path: str = ""
    """Tokenized dataset with input_ids (and optional loss_mask): a .parquet, .jsonl or .arrow file, a directory
    or glob of them, an HF datasets save_to_disk directory, or an fsspec URL (s3://...). Empty: demo data."""
    shard_size: int = 200
    """Samples per shard; one Parquet file per shard."""
    on_invalid: OnInvalid = "fail"
    """A row that fails the input checks: fail (stop before anything runs, naming file, row and reason) or skip
    (leave it out, listed in .summary.json and .invalid_rows.jsonl; the other rows keep their sample ids)."""
    storage_options: Dict[str, Any] = dataclasses.field(default_factory=dict)
    """Keyword arguments for data.path's fsspec filesystem (e.g. client_kwargs for an S3 endpoint)."""

    def __post_init__(self) -> None:
        check_int("data.shard_size", self.shard_size, 1, "samples per shard file")
        if self.on_invalid not in choices(OnInvalid):
            raise ValueError(f"data.on_invalid={self.on_invalid!r}: use {' or '.join(choices(OnInvalid))}")


@dataclasses.dataclass
class DemoConfig:
    dir: str = "eagle3-demo"
    """Where the demo writes its tiny model, dataset and (unless output.dir is set) output."""
    arch: DemoArch = "llama"
    """Architecture of the tiny random-weight model: llama | qwen3 | deepseek_v3 | kimi_k25 (a DeepSeek-V3 in Kimi-K2.5's wrapper)."""
    num_samples: int = 48
    """Synthetic samples the demo makes (lengths vary from 16 to 256 tokens)."""
    seed: int = 0
    """Seed of the demo's random weights and data."""

    def __post_init__(self) -> None:
        if not self.dir:
            raise ValueError("demo.dir is empty: name the directory the demo builds its model and data in")
        check_choice("demo.arch", self.arch, DemoArch)
        check_int("demo.num_samples", self.num_samples, 1)
        check_int("demo.seed", self.seed, 0)
