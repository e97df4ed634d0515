"""A states source without a model: what the pipeline after the extractor can carry.

``SyntheticEngine`` stands in for ``TensorParallelEngine`` in the extractor
actor (``model.engine=synthetic``). It reads only the checkpoint's config.json,
keeps one batch of random states of the real layout (tokens x layers x hidden,
in the model dtype) in device memory, and for each batch sends a slice of it
through the same ``HostCopier`` as the real engine: pinned buffers and a side
stream on CUDA (fp8 quantization included), a plain copy on CPU. The object
store, writers, Parquet, hashing and fsync after it are the job's own, so the
job's rate with this source is the pipeline's capacity. Imports no SGLang.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from typing import Iterator

import numpy as np
import torch

from extractor.checkpoint import read_checkpoint_info
from extractor.host_copy import HostCopier
from extractor.layers import check_layer_ids, llama_convention, resolve_drafter_layer_ids
from extractor.quantize import fp8_relative_errors
from extractor.tensor_parallel import ActivityClock
from extractor.timing import StageTimes
from extractor.types import CaptureActivity, CapturedBatch, EngineInfo, EngineSpec

logger = logging.getLogger(__name__)

SYNTHETIC_VERSION = "none (synthetic states)"


class SyntheticEngine:
    """Random states of the checkpoint's shape at ``spec.synthetic_tokens_per_s`` (0: unpaced)."""

    def __init__(self, spec: EngineSpec) -> None:
        checkpoint = read_checkpoint_info(spec.model_path)
        layer_ids = check_layer_ids(spec.layer_ids, checkpoint.num_layers)
        drafter_ids, captured = resolve_drafter_layer_ids(llama_convention, layer_ids)
        hidden = checkpoint.hidden_size
        self.spec = spec
        self.info = EngineInfo(
            sglang_version=SYNTHETIC_VERSION,
            model_architecture="synthetic",
            language_model_architecture="synthetic",
            num_layers=checkpoint.num_layers,
            hidden_size=hidden,
            dtype=spec.dtype,
            tp_size=spec.tp_size,
            layer_ids=layer_ids,
            layers_to_capture=captured,
            drafter_layer_ids=drafter_ids,
        )
        dtype = getattr(torch, spec.dtype)
        device = torch.device("cuda" if spec.device == "cuda" else "cpu")
        generator = torch.Generator(device).manual_seed(0)
        tokens = spec.max_tokens_per_batch
        self._aux = torch.randn((tokens, len(layer_ids) * hidden), generator=generator, device=device).to(dtype)
        self._last = (
            torch.randn((tokens, hidden), generator=generator, device=device).to(dtype)
            if spec.has_last_hidden_state else None
        )
        self._times = StageTimes()
        self._copier = HostCopier(
            spec.device, dtype, tokens, layers=len(layer_ids), hidden_size=hidden,
            last_hidden_state=spec.has_last_hidden_state, fp8=spec.fp8, count=spec.host_buffers, times=self._times,
            piece_bytes=spec.copy_piece_bytes,
        )
        self._forward_lock = threading.Lock()
        self._activity = ActivityClock()
        self._next_free = 0.0
        logger.info("synthetic states: %s at %s tok/s", self.info, spec.synthetic_tokens_per_s or "unpaced")

    @property
    def max_batch_bytes(self) -> int:
        return self._copier.batch_bytes

    def _pace(self, tokens: int) -> float:
        """Seconds a forward of ``tokens`` would take at the set rate (0 when unpaced)."""
        rate = self.spec.synthetic_tokens_per_s
        return tokens / rate if rate > 0 else 0.0

    @contextlib.contextmanager
    def capture(self, input_ids: list[np.ndarray]) -> Iterator[CapturedBatch]:
        """Like ``TensorParallelEngine.capture``: the forward lock is held for the forward's time."""
        lengths = np.fromiter((len(ids) for ids in input_ids), dtype=np.int64, count=len(input_ids))
        tokens = int(lengths.sum())
        with self._copier.forward_turn(), self._forward_lock:
            started = time.perf_counter()
            self._next_free = max(self._next_free, started) + self._pace(tokens)
            time.sleep(max(0.0, self._next_free - started))
            last = self._last[:tokens] if self._last is not None else None
            pending = self._copier.start(lengths, self._aux[:tokens], last)
        with pending as batch:
            self._activity.record(started, time.perf_counter(), tokens)
            yield batch

    def activity(self) -> CaptureActivity:
        return self._activity.snapshot(self._times.snapshot())

    def bare_prefill(self, input_ids: list[np.ndarray]) -> float:
        return self._pace(sum(len(ids) for ids in input_ids))

    def fp8_relative_errors(self, input_ids: list[np.ndarray]) -> list[float]:
        tokens = sum(len(ids) for ids in input_ids)
        errors = fp8_relative_errors(self._aux[:tokens], len(self.info.layer_ids))
        return errors + (fp8_relative_errors(self._last[:tokens], 1) if self._last is not None else [])

    def close(self) -> None:
        pass
