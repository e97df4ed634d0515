"""The SGLang adapter: one tensor-parallel rank's ModelRunner, driven batch by batch.

This is the only module that touches SGLang internals. Supported versions:
0.5.23 (checked on CPU in CI). Version differences are detected from what the
installed SGLang offers, not from its version string; an SGLang without a
known bootstrap fails at start-up with the list of supported versions.

One forward = one packed EXTEND batch of whole samples (no padding tokens),
run with ``CaptureHiddenMode.FULL``: SGLang returns the aux states of every
token, concatenated over the captured layers, and (with aux capture on) the
post-norm final hidden state that its logits processor sees.
"""

from __future__ import annotations

import logging
import time
from array import array

import numpy as np
import torch

from extractor.cpu_shims import install_cpu_shims, register_torch_native_mla
from extractor.layers import check_layer_ids, resolve_drafter_layer_ids
from extractor.types import CapturedBatch, EngineInfo, EngineSpec

logger = logging.getLogger(__name__)

SUPPORTED_SGLANG_VERSIONS = ("0.5.23",)


def _prepare_process(spec: EngineSpec) -> None:
    """Environment SGLang reads at import time; must run before the first sglang import."""
    if spec.device == "cpu":
        install_cpu_shims()


def _sglang():
    """Import the SGLang pieces the engine uses (after ``_prepare_process``)."""
    import sglang
    from sglang.benchmark.one_batch import TreeCacheNamespace, _init_process_global_configs
    from sglang.srt import runtime_context
    from sglang.srt.configs.model_config import ModelConfig
    from sglang.srt.distributed import bootstrap
    from sglang.srt.entrypoints.engine import _set_envs_and_config
    from sglang.srt.managers.schedule_batch import Req, ScheduleBatch
    from sglang.srt.model_executor.forward_batch_info import CaptureHiddenMode, ForwardBatch
    from sglang.srt.model_executor.model_runner import ModelRunner
    from sglang.srt.sampling.sampling_params import SamplingParams
    from sglang.srt.server_args import PortArgs, ServerArgs
    from sglang.srt.speculative.spec_info import SpeculativeAlgorithm

    return locals()


def _check_supported(sgl: dict) -> None:
    needed = ("publish", "SpawnRanks", "spawn_world_rank")
    if not all(hasattr(sgl["runtime_context"], name) for name in needed):
        raise RuntimeError(
            f"SGLang {sgl['sglang'].__version__} has no runtime_context.publish bootstrap; "
            f"this extractor supports SGLang {', '.join(SUPPORTED_SGLANG_VERSIONS)}"
        )


class CaptureEngine:
    """SGLang ModelRunner of one TP rank, set up to capture EAGLE-3 aux states."""

    def __init__(self, spec: EngineSpec, tp_rank: int, nccl_port: int) -> None:
        _prepare_process(spec)
        self.spec = spec
        self.tp_rank = tp_rank
        sgl = _sglang()
        _check_supported(sgl)
        if spec.device == "cpu":
            register_torch_native_mla()
        self._sgl = sgl
        self._runner = self._build_runner(sgl, spec, tp_rank, nccl_port)
        model = self._runner.model
        num_layers = model.config.num_hidden_layers
        layer_ids = check_layer_ids(spec.layer_ids, num_layers)
        drafter_ids, captured = resolve_drafter_layer_ids(self._set_and_read_back, layer_ids)
        self.info = EngineInfo(
            sglang_version=sgl["sglang"].__version__,
            model_architecture=type(model).__name__,
            num_layers=num_layers,
            hidden_size=model.config.hidden_size,
            dtype=spec.dtype,
            tp_size=spec.tp_size,
            layer_ids=layer_ids,
            layers_to_capture=captured,
            drafter_layer_ids=drafter_ids,
        )
        logger.info("TP rank %d ready: %s", tp_rank, self.info)

    @staticmethod
    def _build_runner(sgl: dict, spec: EngineSpec, tp_rank: int, nccl_port: int):
        on_cpu = spec.device == "cpu"
        server_args = sgl["ServerArgs"](
            model_path=spec.model_path,
            device=spec.device,
            dtype=spec.dtype,
            tp_size=spec.tp_size,
            attention_backend=spec.attention_backend,
            load_format=spec.load_format,
            skip_tokenizer_init=True,
            disable_cuda_graph=True,  # EXTEND batches of varying shape never use graphs
            disable_radix_cache=True,
            disable_custom_all_reduce=on_cpu,
            chunked_prefill_size=-1,  # a batch is one forward, never split
            context_length=spec.context_length,
            max_total_tokens=spec.max_tokens_per_batch,
            max_running_requests=spec.max_samples_per_batch,
            mem_fraction_static=spec.mem_fraction_static,
            nccl_port=nccl_port,
            host="127.0.0.1",
            # Capture-only mode: EAGLE-3 capture hooks on, no drafter loaded, and the
            # logits processor keeps the post-norm final state of every token.
            enable_return_aux_hidden_states=True,
            speculative_algorithm="EAGLE3",
            return_aux_hidden_state_layer_ids=None,
        )
        server_args.resolve_once()
        sgl["_set_envs_and_config"](server_args)
        port_args = sgl["PortArgs"].init_new(server_args)
        rc = sgl["runtime_context"]
        rc.publish(
            server_args,
            role="scheduler",
            ranks=rc.SpawnRanks(
                world_rank=rc.spawn_world_rank(server_args, tp_rank=tp_rank, pp_rank=0), gpu_id=tp_rank
            ),
        )
        sgl["_init_process_global_configs"]()
        model_config = sgl["ModelConfig"].from_server_args(server_args)
        sgl["bootstrap"].init_parallel_runtime(
            server_args=server_args, device=rc.get_device().device, dist_port=port_args.nccl_port
        )
        sgl["bootstrap"].init_layer_runtime(model_config=model_config)
        runner = sgl["ModelRunner"](
            model_config=model_config,
            mem_fraction_static=spec.mem_fraction_static,
            gpu_id=tp_rank,
            nccl_port=port_args.nccl_port,
            server_args=server_args,
        )
        runner.alloc_memory_pool()
        runner.init_attention_backends()
        runner.init_cuda_graphs()  # with graphs disabled this installs the eager runner
        return runner

    def _set_and_read_back(self, drafter_ids: list[int]) -> list[int]:
        """What SGLang's server does with a drafter config's ids; returns what the model captures."""
        model = self._runner.model
        model.set_eagle3_layers_to_capture(list(drafter_ids))
        return list(model.model.layers_to_capture)

    @torch.no_grad()
    def capture(self, input_ids: list[np.ndarray]) -> CapturedBatch:
        """Run one packed EXTEND forward over whole samples; every rank must call it."""
        sgl = self._sgl
        runner = self._runner
        started = time.perf_counter()
        reqs = []
        for index, ids in enumerate(input_ids):
            req = sgl["Req"](
                rid=str(index),
                origin_input_text="",
                origin_input_ids=array("q", np.asarray(ids, dtype=np.int64).tobytes()),
                sampling_params=sgl["SamplingParams"](temperature=0, max_new_tokens=1),
            )
            req.full_untruncated_fill_ids = req.origin_input_ids
            req.logprob_start_len = -1
            req.extend_end = len(ids)
            reqs.append(req)
        tree_cache = sgl["TreeCacheNamespace"](
            page_size=sgl["runtime_context"].get_schedule().page_size,
            device=runner.device,
            token_to_kv_pool_allocator=runner.token_to_kv_pool_allocator,
        )
        batch = sgl["ScheduleBatch"].init_new(
            reqs=reqs,
            req_to_token_pool=runner.req_to_token_pool,
            token_to_kv_pool_allocator=runner.token_to_kv_pool_allocator,
            tree_cache=tree_cache,
            model_config=runner.model_config,
            enable_overlap=False,
            spec_algorithm=sgl["SpeculativeAlgorithm"].NONE,
        )
        try:
            batch.prepare_for_extend()
            if batch.input_ids is None and getattr(batch, "prefill_input_ids_cpu", None) is not None:
                batch.input_ids = batch.prefill_input_ids_cpu.to(batch.device, non_blocking=True)
                batch.prefill_input_ids_cpu = None
            forward_batch = sgl["ForwardBatch"].init_new(
                batch,
                runner,
                capture_hidden_mode=sgl["CaptureHiddenMode"].FULL,
                return_hidden_states_before_norm=False,
            )
            output = runner.forward(forward_batch).logits_output
            aux = output.hidden_states
            last = output.last_hidden_states if self.spec.last_hidden_state else None
            self._check_widths(aux, last, sum(len(ids) for ids in input_ids))
            aux_host, last_host = _to_host(aux), (None if last is None else _to_host(last))
        finally:
            # Nothing is cached between batches: hand every KV slot back.
            runner.req_to_token_pool.clear()
            runner.token_to_kv_pool_allocator.clear()
        return CapturedBatch(
            lengths=np.fromiter((len(ids) for ids in input_ids), dtype=np.int64, count=len(input_ids)),
            aux_hidden_states=aux_host,
            last_hidden_state=last_host,
            forward_seconds=time.perf_counter() - started,
        )

    def _check_widths(self, aux: torch.Tensor | None, last: torch.Tensor | None, tokens: int) -> None:
        info = self.info
        want = (tokens, len(info.layer_ids) * info.hidden_size)
        if aux is None or tuple(aux.shape) != want:
            got = None if aux is None else tuple(aux.shape)
            raise RuntimeError(
                f"SGLang returned aux states of shape {got}, expected {want} for layers_to_capture "
                f"{info.layers_to_capture}; this model/SGLang version does not capture as configured"
            )
        if self.spec.last_hidden_state and (last is None or tuple(last.shape) != (tokens, info.hidden_size)):
            raise RuntimeError(
                "SGLang returned no final hidden state for every token; "
                "run with extract.last_hidden_state=false or use a supported SGLang version"
            )


def _to_host(states: torch.Tensor) -> np.ndarray:
    """Contiguous host copy as raw bits (numpy has no bfloat16)."""
    host = states.detach().to("cpu").contiguous()
    if host.dtype == torch.bfloat16:
        host = host.view(torch.int16)
    return host.numpy()
