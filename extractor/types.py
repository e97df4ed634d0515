"""Plain data that crosses process boundaries: no SGLang object leaves ``extractor``."""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Mapping, Optional, Sequence

import numpy as np

LoadStage = Callable[[str], None]
"""Told what an engine's load does now (``importing SGLang``, ...): the driver shows it while the model loads."""


def unreported(stage: str) -> None:
    """A ``LoadStage`` nobody listens to."""


@dataclasses.dataclass(frozen=True)
class EngineSpec:
    """Everything one TP rank needs to build its SGLang ModelRunner (picklable)."""

    model_path: str
    dtype: str
    device: str  # cpu | cuda (resolved, never auto)
    tp_size: int
    attention_backend: str
    layer_ids: tuple[int, ...]
    last_hidden_state: str
    """post_norm | pre_norm | none (``storage.schema.FINAL_STATES``)."""
    max_tokens_per_batch: int
    """KV-pool size: the largest packed batch (or single sample) a forward sees."""
    max_samples_per_batch: int
    context_length: Optional[int] = None
    mem_fraction_static: float = 0.8
    load_format: str = "auto"
    trust_remote_code: bool = False
    """Let SGLang and transformers run code that ships with the checkpoint."""
    host_buffers: int = 2
    """Batches whose states may sit in host buffers at once: one being copied while the one
    before is handed on. The extractor actor runs this many calls concurrently."""
    copy_piece_bytes: int = 0
    """extract.copy_piece_mb in bytes: the states' copy to the host in pieces (``extractor.host_copy``); 0 whole."""
    copy_by: str = "copy_engine"
    """extract.copy_by: copy_engine | kernel (``extractor.kernel_copy``)."""
    state_dtype: str = "model"
    """model | float8_e4m3fn: quantized on the device, before the host copy."""
    engine: str = "sglang"
    """sglang | synthetic (no model: states of the checkpoint's shape from device memory)."""
    synthetic_tokens_per_s: float = 0.0
    server_args: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    """The serving command's applied settings (``extractor.serving``): ServerArgs fields -> values."""
    download: bool = False
    """model.download: a node without the driver's hub snapshot at ``model_path`` downloads that commit itself."""

    @property
    def has_last_hidden_state(self) -> bool:
        return self.last_hidden_state != "none"

    @property
    def fp8(self) -> bool:
        return self.state_dtype == "float8_e4m3fn"


@dataclasses.dataclass(frozen=True)
class EngineInfo:
    """What the live model reported after loading; recorded in every shard's metadata."""

    sglang_version: str
    model_architecture: str
    """The class SGLang serves, e.g. KimiK25ForConditionalGeneration."""
    language_model_architecture: str
    """The language model inside it, e.g. DeepseekV3ForCausalLM (the same class for a bare LM)."""
    num_layers: int
    hidden_size: int
    dtype: str
    tp_size: int
    layer_ids: list[int]
    layers_to_capture: list[int]
    drafter_layer_ids: list[int]


@dataclasses.dataclass(frozen=True)
class TokenBatch:
    """One batch's token ids, flat: sample i is ``ids[offsets[i]:offsets[i + 1]]``.

    Ray pickles the two arrays in one go however many samples the batch holds; a
    list of arrays costs the sender one pickle per sample (the driver's largest
    cost per batch at a million samples).
    """

    ids: np.ndarray
    """int32, every sample's ids one after the other."""
    offsets: np.ndarray
    """int64, len(samples) + 1."""

    @classmethod
    def of(cls, samples: Sequence[np.ndarray]) -> "TokenBatch":
        lengths = np.fromiter((len(sample) for sample in samples), dtype=np.int64, count=len(samples))
        ids = np.concatenate(samples).astype(np.int32, copy=False) if len(samples) else np.zeros(0, np.int32)
        return cls(ids, np.concatenate([[0], np.cumsum(lengths)]))

    def __len__(self) -> int:
        return len(self.offsets) - 1

    def samples(self) -> list[np.ndarray]:
        """Each sample's ids (views)."""
        return split_flat(self.ids, self.offsets)


def split_flat(values: np.ndarray, offsets: np.ndarray) -> list[np.ndarray]:
    """Views ``values[offsets[i]:offsets[i + 1]]``."""
    return [values[start:stop] for start, stop in zip(offsets[:-1].tolist(), offsets[1:].tolist())]


@dataclasses.dataclass
class CapturedBatch:
    """States of one packed batch, stacked token-wise in request order.

    ``aux_hidden_states`` is [sum(lengths), L*H], ``last_hidden_state`` is
    [sum(lengths), H]; both hold the raw bits of the stored dtype (bfloat16 as
    int16, float8_e4m3fn as uint8) so that Ray moves them as zero-copy numpy
    buffers. With fp8, ``aux_scales`` [T, L] and ``last_scales`` [T, 1] hold the
    float32 scale of each token and layer: state = fp8 value * scale. ``finite``
    [samples, L (+1)] bool is False where a sample's states of a captured layer
    (then of the final state) hold a NaN or Inf, found on the device before the copy.
    """

    lengths: np.ndarray
    aux_hidden_states: np.ndarray
    last_hidden_state: Optional[np.ndarray]
    aux_scales: Optional[np.ndarray] = None
    last_scales: Optional[np.ndarray] = None
    finite: Optional[np.ndarray] = None


@dataclasses.dataclass(frozen=True)
class CaptureActivity:
    """How busy the extractor was: a job's wall time minus ``busy_seconds`` is time it waited for work."""

    batches: int
    tokens: int
    busy_seconds: float
    """Wall time during which some batch was between the start of its forward and its states on the host."""
    hand_on_seconds: float = 0.0
    """Time spent handing states on (the job: ``ray.put`` into the object store), summed over batches."""
    stage_seconds: dict = dataclasses.field(default_factory=dict)
    """``{"wall": {stage: s}, "cpu": {...}, "device": {...}}`` summed over batches (``extractor.timing``; the
    hand-on's ``hand_on`` too)."""
    process_cpu_seconds: float = 0.0
    """CPU time of the extractor's process (every thread: Ray's and its copy threads too) from its first batch
    to its last."""
