"""One tensor-parallel rank's SGLang ModelRunner, driven batch by batch.

Together with ``extractor.sglang_compat`` (which holds every difference
between the supported SGLang releases) this is the only code that touches
SGLang internals.

One forward = one packed EXTEND batch of whole samples (no padding tokens),
run with ``CaptureHiddenMode.FULL``: SGLang returns the aux states of every
token, concatenated over the captured layers; ``FinalStateTap`` keeps the final
hidden state, after the final norm or entering it. ``extractor.host_copy``
(quantizing to fp8 first if asked) moves them to the host while the next batch
computes. The requests of a batch (``requests``) are built before its forward takes
the forward lock, while the previous forward runs; ``StageTimes`` says where the time went.
"""

from __future__ import annotations

import contextlib
import logging
import time
from array import array
from typing import Any, ContextManager, Iterator, Optional

import numpy as np
import torch

from extractor.checkpoint import architectures, read_config
from extractor.cpu_shims import install_cpu_shims, register_torch_native_mla
from extractor.host_copy import HostCopier, PendingCopy
from extractor.language_model import LanguageModel
from extractor.layers import check_layer_ids, resolve_drafter_layer_ids
from extractor.quantize import fp8_relative_errors
from extractor.serving import runner_server_args
from extractor.sglang_compat import (
    FinalStateTap,
    build_model_runner,
    import_sglang,
    register_only_models_naming,
    set_extend_length,
)
from extractor.timing import DeviceSpans, StageTimes, maybe_device_spans
from extractor.types import EngineInfo, EngineSpec, LoadStage, unreported

logger = logging.getLogger(__name__)

WARM_UP_TOKENS = 2048


class CaptureEngine:
    """SGLang ModelRunner of one TP rank, set up to capture EAGLE-3 aux states."""

    def __init__(self, spec: EngineSpec, tp_rank: int, nccl_port: int, stage: LoadStage = unreported) -> None:
        if spec.device == "cpu":
            install_cpu_shims()  # before the first sglang import
        register_only_models_naming(architectures(read_config(spec.model_path)))
        self.spec = spec
        self.tp_rank = tp_rank
        stage("importing SGLang")
        self._sgl = sgl = import_sglang()
        if spec.device == "cpu":
            register_torch_native_mla()
        server_args = runner_server_args(spec, nccl_port, capture_only=sgl.capture_only)
        stage("loading the weights")
        self._runner = build_model_runner(sgl, server_args, spec, tp_rank)
        # Multimodal wrappers (Kimi-K2.5) hold the language model; bare causal LMs are their own.
        self._model = model = LanguageModel(self._runner.model, self._runner.model_config.hf_text_config)
        # The decoder stack's final norm, looked up only when its input is wanted.
        final_norm = model.decoder.norm if spec.last_hidden_state == "pre_norm" else None
        self._final_state = FinalStateTap(sgl, spec.last_hidden_state, model.logits_processor, final_norm)
        layer_ids = check_layer_ids(spec.layer_ids, model.num_layers)
        drafter_ids, captured = resolve_drafter_layer_ids(model.set_and_read_back, layer_ids)
        self.info = EngineInfo(
            sglang_version=sgl.version,
            model_architecture=model.architecture,
            language_model_architecture=model.language_model_architecture,
            num_layers=model.num_layers,
            hidden_size=model.hidden_size,
            dtype=spec.dtype,
            tp_size=spec.tp_size,
            layer_ids=layer_ids,
            layers_to_capture=captured,
            drafter_layer_ids=drafter_ids,
        )
        self.times = StageTimes()
        """Where this rank's time went (``extractor.timing``)."""
        # Only rank 0's states leave the TP group.
        self._host_copier = HostCopier(
            spec.device, getattr(torch, spec.dtype), spec.max_tokens_per_batch, layers=len(layer_ids),
            hidden_size=self.info.hidden_size, last_hidden_state=spec.has_last_hidden_state, fp8=spec.fp8,
            count=spec.host_buffers, times=self.times, piece_bytes=spec.copy_piece_bytes,
            by_kernel=spec.copy_by == "kernel",
        ) if tp_rank == 0 else None
        if spec.device == "cuda":
            stage("warm-up forward")
            self._warm_up()
        logger.info("TP rank %d ready: %s", tp_rank, self.info)
        if spec.server_args:
            logger.info("TP rank %d runs the serving settings %s", tp_rank, dict(spec.server_args))

    @property
    def max_batch_bytes(self) -> int:
        """Bytes of the largest batch's states on the host (rank 0)."""
        if self._host_copier is None:
            raise RuntimeError(f"TP rank {self.tp_rank} keeps no states on the host")
        return self._host_copier.batch_bytes

    def _warm_up(self) -> None:
        """One forward before the first batch: kernel JIT and library setup count as startup.

        Every rank calls it at the end of its own startup; the forward's collectives pair them up.
        """
        started = time.perf_counter()
        self.capture_forward([np.zeros(min(WARM_UP_TOKENS, self.spec.max_tokens_per_batch), dtype=np.int64)])
        torch.cuda.synchronize()
        self.times.clear()  # the warm-up's JIT is start-up time
        logger.info("TP rank %d: warm-up forward took %.1f s", self.tp_rank, time.perf_counter() - started)

    def requests(self, input_ids: list[np.ndarray]) -> list[Any]:
        """SGLang's requests for one packed batch of whole samples. They touch no pool of the runner: a caller
        builds them before taking the forward lock, while the previous forward still runs."""
        sgl = self._sgl
        reqs = []
        for index, ids in enumerate(input_ids):
            req = sgl.Req(
                rid=str(index),
                origin_input_text="",
                origin_input_ids=array("q", np.asarray(ids, dtype=np.int64).tobytes()),
                sampling_params=sgl.SamplingParams(temperature=0, max_new_tokens=1),
            )
            req.full_untruncated_fill_ids = req.origin_input_ids
            req.logprob_start_len = -1
            set_extend_length(req, len(ids))
            reqs.append(req)
        return reqs

    @contextlib.contextmanager
    def _extend(self, reqs: list[Any], capture_mode: Any, spans: Optional[DeviceSpans] = None) -> Iterator[Any]:
        """One packed EXTEND forward over ``reqs``; yields SGLang's logits output. Times its ``prepare`` and
        ``forward`` stages (with ``spans``, the forward's device time too)."""
        runner = self._runner
        try:
            with self.times.stage("prepare"):
                forward_batch = self._forward_batch(reqs, capture_mode)
            with self.times.stage("forward"), torch.no_grad():
                if spans is not None:
                    spans.mark(None)
                output = runner.forward(forward_batch).logits_output
                if spans is not None:
                    spans.mark("forward")
            yield output
        finally:
            # Nothing is cached between batches: hand every KV slot back.
            runner.req_to_token_pool.clear()
            runner.token_to_kv_pool_allocator.clear()

    def _forward_batch(self, reqs: list[Any], capture_mode: Any) -> Any:
        """SGLang's ForwardBatch of ``reqs`` as one EXTEND, their KV slots allocated."""
        sgl = self._sgl
        runner = self._runner
        tree_cache = sgl.TreeCacheNamespace(
            page_size=runner.page_size,
            device=runner.device,
            token_to_kv_pool_allocator=runner.token_to_kv_pool_allocator,
        )
        batch = sgl.ScheduleBatch.init_new(
            reqs=reqs,
            req_to_token_pool=runner.req_to_token_pool,
            token_to_kv_pool_allocator=runner.token_to_kv_pool_allocator,
            tree_cache=tree_cache,
            model_config=runner.model_config,
            enable_overlap=False,
            spec_algorithm=sgl.SpeculativeAlgorithm.NONE,
        )
        batch.prepare_for_extend()
        if batch.input_ids is None and getattr(batch, "prefill_input_ids_cpu", None) is not None:
            batch.input_ids = batch.prefill_input_ids_cpu.to(batch.device, non_blocking=True)
            batch.prefill_input_ids_cpu = None
        return sgl.ForwardBatch.init_new(
            batch, runner, capture_hidden_mode=capture_mode, return_hidden_states_before_norm=False
        )

    def capture_forward(self, input_ids: list[np.ndarray], reqs: Optional[list[Any]] = None,
                        spans: Optional[DeviceSpans] = None) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        """The capture forward of one packed batch (``reqs``: its ``requests``, if built already); the states stay
        on the device.

        Every TP rank runs it (the forward is collective); followers drop the result.
        """
        reqs = self.requests(input_ids) if reqs is None else reqs
        with self._extend(reqs, self._sgl.CaptureHiddenMode.FULL, spans) as output:
            with self.times.stage("capture"):
                aux = output.hidden_states
                last = self._final_state.take(output)
        self._check_widths(aux, last, sum(len(ids) for ids in input_ids))
        return aux, last

    def forward_turn(self) -> ContextManager[None]:
        """Around a caller's wait for its forward and the forward itself (``HostCopier.forward_turn``): the batch
        before it goes to the copy engine once this forward has launched."""
        if self._host_copier is None:
            raise RuntimeError(f"TP rank {self.tp_rank} keeps no states on the host")
        return self._host_copier.forward_turn()

    def start_capture(self, input_ids: list[np.ndarray], reqs: list[Any]) -> PendingCopy:
        """Run the capture forward of ``reqs`` (``requests(input_ids)``) and queue the copy of its states to the host;
        returns at once on CUDA."""
        if self._host_copier is None:
            raise RuntimeError(f"TP rank {self.tp_rank} runs capture_forward only; rank 0 returns the states")
        spans = maybe_device_spans(self.spec.device)
        aux, last = self.capture_forward(input_ids, reqs, spans)
        with self.times.stage("capture"):
            lengths = np.fromiter((len(ids) for ids in input_ids), dtype=np.int64, count=len(input_ids))
            return self._host_copier.start(lengths, aux, last, spans)

    def fp8_relative_errors(self, input_ids: list[np.ndarray]) -> list[float]:
        """Benchmark: per captured layer (then the final state), ||fp8 round trip - x|| / ||x|| on the device."""
        aux, last = self.capture_forward(input_ids)
        errors = fp8_relative_errors(aux, len(self.info.layer_ids))
        return errors + (fp8_relative_errors(last, 1) if last is not None else [])

    def bare_prefill(self, input_ids: list[np.ndarray]) -> float:
        """Benchmark baseline: the same forward with capture off and nothing copied; returns seconds (building its
        requests included)."""
        spans = maybe_device_spans(self.spec.device)
        with self._model.capture_off():
            _synchronize(self.spec.device)
            started = time.perf_counter()
            with self._extend(self.requests(input_ids), self._sgl.CaptureHiddenMode.NULL, spans):
                with self.times.stage("sync"):
                    _synchronize(self.spec.device)
            seconds = time.perf_counter() - started
            self._final_state.take(None)  # a final-norm hook kept this forward's state: let it go
        if spans is not None:
            spans.add_to(self.times)
        return seconds

    def _check_widths(self, aux: torch.Tensor | None, last: torch.Tensor | None, tokens: int) -> None:
        info = self.info
        want = (tokens, len(info.layer_ids) * info.hidden_size)
        if aux is None or tuple(aux.shape) != want:
            got = None if aux is None else tuple(aux.shape)
            raise RuntimeError(
                f"SGLang returned aux states of shape {got}, expected {want} for layers_to_capture "
                f"{info.layers_to_capture}; this model/SGLang version does not capture as configured"
            )
        if self.spec.has_last_hidden_state and (last is None or tuple(last.shape) != (tokens, info.hidden_size)):
            raise RuntimeError(
                f"SGLang returned no {self.spec.last_hidden_state} final hidden state for every token; "
                "run with extract.last_hidden_state=none or use a supported SGLang version"
            )


def _synchronize(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


