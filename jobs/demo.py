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


def _tiny_config(arch: str, num_layers: int, hidden_size: int, dtype: str, q_lora_rank: int | None):
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
    if arch == "deepseek_v3":
        return transformers.DeepseekV3Config(
            **_deepseek_v3_shape(q_lora_rank), **{**common, "num_key_value_heads": 4, "max_position_embeddings": 131072}
        )
    raise ValueError(f"demo.arch={arch!r}: use one of {', '.join(DEMO_ARCHS)}")


def _deepseek_v3_shape(q_lora_rank: int | None) -> dict:
    """Kimi-K2.5's architecture at toy width: MLA, MoE with a shared expert, a first dense layer."""
    return dict(
        moe_intermediate_size=32, n_shared_experts=1, n_routed_experts=4, num_experts_per_tok=2,
        routed_scaling_factor=2.5, n_group=2, topk_group=1, norm_topk_prob=True, first_k_dense_replace=1,
        q_lora_rank=q_lora_rank, kv_lora_rank=32, qk_rope_head_dim=16, qk_nope_head_dim=16, v_head_dim=16,
        rope_interleave=True, rms_norm_eps=1e-6,
        # SGLang's DeepSeek rope is yarn-only (its CPU rope builder asserts deepseek_yarn); real
        # DeepSeek-V3 and Kimi configs carry such a section.
        rope_parameters=dict(
            rope_type="yarn", rope_theta=50000.0, factor=32.0, original_max_position_embeddings=4096,
            beta_fast=1.0, beta_slow=1.0, mscale=1.0, mscale_all_dim=1.0,
        ),
        # Read by SGLang, not by HF (which hard-codes sigmoid scoring and noaux_tc).
        scoring_func="sigmoid", topk_method="noaux_tc", moe_layer_freq=1,
    )


def _randomize_constant_inits(model, generator) -> None:
    """Norm weights init to 1 and the router bias to 0; make them random so that tests
    comparing engines notice a missing or misplaced one."""
    import torch

    with torch.no_grad():
        for name, tensor in [*model.named_parameters(), *model.named_buffers()]:
            if "norm" in name or "e_score_correction_bias" in name:
                tensor.add_(0.1 * torch.randn(tensor.shape, generator=generator, dtype=tensor.dtype))


def build_tiny_model(
    directory: str | Path, arch: str = "llama", num_layers: int = 8, hidden_size: int = 64,
    dtype: str = "float32", seed: int = 0, q_lora_rank: int | None = 32,
) -> Path:
    """Save a random-weight checkpoint of ``arch`` (fixed seed) and return its directory.

    ``q_lora_rank`` applies to deepseek_v3 only (None: full-rank query projection).
    """
    import torch
    import transformers

    directory = Path(directory)
    config = _tiny_config(arch, num_layers, hidden_size, dtype, q_lora_rank)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=getattr(torch, dtype))
    _randomize_constant_inits(model, torch.Generator().manual_seed(seed + 1))
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
