"""The ``model`` and ``extract`` sections of the job config."""

from __future__ import annotations

import dataclasses
from typing import Optional

DEVICES = ("auto", "cpu", "cuda")
DTYPES = ("bfloat16", "float16", "float32")


@dataclasses.dataclass
class ModelConfig:
    path: str = ""
    """Local HF checkpoint directory. Empty: run the embedded demo (a tiny random model)."""
    tp_size: int = 1
    """Tensor-parallel ranks, one process each; on GPU the extractor actor asks Ray for this many GPUs."""
    dtype: str = "bfloat16"
    """Compute and storage dtype: bfloat16 | float16 | float32."""
    device: str = "auto"
    """auto | cpu | cuda. auto picks cuda when the Ray cluster has tp_size GPUs."""
    attention_backend: str = ""
    """SGLang attention backend; empty picks torch_native on CPU and flashinfer on CUDA."""
    context_length: Optional[int] = None
    """Longest sample the runner accepts; default: the model's max_position_embeddings."""
    mem_fraction_static: float = 0.8
    """Fraction of GPU memory SGLang may hold for weights + KV cache (GPU only)."""
    load_format: str = "auto"
    """SGLang load format; `dummy` builds random weights from config.json alone (benchmarks)."""


@dataclasses.dataclass
class ExtractConfig:
    layers: Optional[list[int]] = None
    """Canonical ids (output of decoder layer k, 0-based). Default [2, N//2, N-3]."""
    last_hidden_state: bool = True
    """Also store the final hidden state (post final norm) of every token."""
    max_tokens_per_batch: int = 16384
    """Token budget of one packed EXTEND batch; a longer sample runs alone."""
    max_samples_per_batch: int = 256
    """Cap on requests in one batch (sizes SGLang's request pool)."""


def validate_model_config(config: ModelConfig) -> None:
    if config.device not in DEVICES:
        raise ValueError(f"model.device={config.device!r}: use one of {', '.join(DEVICES)}")
    if config.dtype not in DTYPES:
        raise ValueError(f"model.dtype={config.dtype!r}: use one of {', '.join(DTYPES)}")
    if config.tp_size < 1:
        raise ValueError(f"model.tp_size={config.tp_size}: must be >= 1")


def validate_extract_config(config: ExtractConfig) -> None:
    if config.max_tokens_per_batch < 1:
        raise ValueError(f"extract.max_tokens_per_batch={config.max_tokens_per_batch}: must be >= 1")
    if config.max_samples_per_batch < 1:
        raise ValueError(f"extract.max_samples_per_batch={config.max_samples_per_batch}: must be >= 1")
