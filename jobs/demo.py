"""The embedded demo: a tiny random-weight checkpoint and a synthetic tokenized dataset.

Both are made locally (transformers ``save_pretrained``, fixed seed,
safetensors), so the job runs end to end on a machine with no model hub.
The tests build their models with the same functions.
"""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

logger = logging.getLogger(__name__)

DEMO_VOCAB_SIZE = 512
DEMO_ARCHS = ("llama", "qwen3", "deepseek_v3")


def _tiny_config(arch: str, num_layers: int, hidden_size: int, dtype: str):
    import transformers

    common = dict(
        vocab_size=DEMO_VOCAB_SIZE,
        hidden_size=hidden_size,
        intermediate_size=2 * hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=4096,
        tie_word_embeddings=False,
        dtype=dtype,
    )
    if arch == "llama":
        return transformers.LlamaConfig(**common)
    if arch == "qwen3":
        return transformers.Qwen3Config(head_dim=hidden_size // 4, **common)
    raise ValueError(f"demo.arch={arch!r}: use one of {', '.join(DEMO_ARCHS)}")


def build_tiny_model(
    directory: str | Path, arch: str = "llama", num_layers: int = 8, hidden_size: int = 64,
    dtype: str = "float32", seed: int = 0,
) -> Path:
    """Save a random-weight checkpoint of ``arch`` (fixed seed) and return its directory."""
    import torch
    import transformers

    directory = Path(directory)
    config = _tiny_config(arch, num_layers, hidden_size, dtype)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=getattr(torch, dtype))
    model.save_pretrained(directory, safe_serialization=True)
    return directory


def build_synthetic_dataset(
    path: str | Path, num_samples: int, vocab_size: int = DEMO_VOCAB_SIZE, min_len: int = 16,
    max_len: int = 256, seed: int = 0,
) -> Path:
    """Write a Parquet dataset of random token ids with a chat-like loss mask (prompt 0, answer 1)."""
    rng = np.random.default_rng(seed)
    input_ids, loss_masks = [], []
    for _ in range(num_samples):
        length = int(rng.integers(min_len, max_len + 1))
        prompt = int(rng.integers(1, length))
        input_ids.append(rng.integers(0, vocab_size, length, dtype=np.int32).tolist())
        loss_masks.append([0] * prompt + [1] * (length - prompt))
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.table({"input_ids": input_ids, "loss_mask": loss_masks}), path)
    return path


def prepare_demo(directory: str | Path, arch: str, num_samples: int, seed: int) -> tuple[Path, Path]:
    """Model and dataset for the demo run, built once and reused by later runs."""
    directory = Path(directory)
    model_dir = directory / f"model-{arch}-seed{seed}"
    data_path = directory / f"data-{num_samples}-seed{seed}.parquet"
    if not (model_dir / "config.json").exists():
        logger.info("demo: building a tiny random %s model in %s", arch, model_dir)
        build_tiny_model(model_dir, arch=arch, seed=seed)
    if not data_path.exists():
        build_synthetic_dataset(data_path, num_samples=num_samples, seed=seed)
    return model_dir, data_path
