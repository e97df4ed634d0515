"""Everything that differs between the supported SGLang releases, detected by what is installed.

Supported: 0.5.23 (``runtime_context.publish`` bootstrap, capture-only mode that
returns the post-norm final state) and 0.5.17 (``ParallelState`` passed to
``ModelRunner(ps=...)``, no capture-only mode). The branch is chosen by what
the installed SGLang offers (``SGLang``'s capabilities, each probed from what is
installed), never by comparing version strings. ``MetaModels`` starts the same
runtime without a ModelRunner to build model classes on the meta device. For the
``sglang serve`` parser (``extractor.serving``): 0.5.17's ServerArgs is a dataclass,
0.5.23's a record of namespaced fields (``server_args_fields``), and SGLang's
``--config`` reader moved (``config_merger``).
"""

from __future__ import annotations

import dataclasses
import importlib.util
import inspect
import logging
import os
import re
import warnings
from pathlib import Path
from typing import Any, Iterable, Mapping

from extractor.types import EngineSpec

SUPPORTED_SGLANG_VERSIONS = ("0.5.17", "0.5.23")

# SGLang imports every model module to build its registry and logs each one that cannot be
# imported on this platform (kernels of another accelerator, torchaudio...): 15 warnings per
# start on 0.5.23 CPU, about models this run does not load. A model the run needs and cannot
# import still fails, in ModelRunner's own "not supported" check.
REGISTRY_LOGGER = "sglang.srt.models.registry"
REGISTRY_IMPORT_ERROR = "Ignore import error when loading"
# Import-time notices that a quantization method or Triton has no kernels on this device.
PLATFORM_WARNINGS = r"Only CUDA.* support|Triton is not supported on current platform"
# What SGLang logs at every start about this platform or a setting the extractor chose, none of it
# actionable (on 0.5.23 CPU, with its INFO lines, about 19 lines per run): no CUDA to detect, the open-files
# limit already at the hard limit, the CPU thread binding and torch_native attention the extractor sets, one
# NUMA node for two ranks, no NVIDIA driver for multimem all-gather.
# SGLang's INFO lines go too: the extractor logs what it loaded once it is ready.
SGLANG_LOGGER = "sglang"
PLATFORM_NOTICES = (
    "Cannot detect CUDA architecture", "Fail to set RLIMIT_NOFILE", "SGLANG_CPU_OMP_THREADS_BIND is set",
    "Cuda graph is disabled because of using torch native attention backend",
    "init_cpu_threads_env and shared memory based AllReduce is disabled", "The total number of ranks",
    "multimem all-gather disabled",
)


class _DropPrefix(logging.Filter):
    def __init__(self, prefix: str) -> None:
        super().__init__()
        self.prefix = prefix

    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith(self.prefix)


class _DropPlatformNotices(logging.Filter):
    """On a handler: SGLang's records that start with one of PLATFORM_NOTICES (its loggers are many)."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not (record.name.startswith(SGLANG_LOGGER) and record.getMessage().startswith(PLATFORM_NOTICES))


def quiet_import_noise() -> None:
    """Drop SGLang's import-time and start-up noise (above) from this process's log; every other warning stays."""
    registry = logging.getLogger(REGISTRY_LOGGER)
    if not any(isinstance(existing, _DropPrefix) for existing in registry.filters):
        registry.addFilter(_DropPrefix(REGISTRY_IMPORT_ERROR))
    warnings.filterwarnings("ignore", message=PLATFORM_WARNINGS, category=UserWarning, module=r"sglang\.")
    logging.getLogger(SGLANG_LOGGER).setLevel(logging.WARNING)
    for handler in logging.getLogger().handlers:
        if not any(isinstance(existing, _DropPlatformNotices) for existing in handler.filters):
            handler.addFilter(_DropPlatformNotices())


DISABLED_MODEL_MODULES = "SGLANG_DISABLED_MODEL_ARCHS"
"""SGLang's setting (0.5.17 and 0.5.23): the modules of ``sglang.srt.models`` its model registry skips."""


def register_only_models_naming(architectures: Iterable[str]) -> list[str]:
    """Have SGLang's model registry import only the model modules whose source names one of ``architectures``
    (the checkpoint's classes); returns the modules it skips. Call before the first sglang import.

    The registry imports every model module SGLang ships (about 250 on 0.5.23, 3 CPU seconds of every
    rank's start) to find the one class a run loads; a module that does not name the class cannot
    register it. Nothing is skipped when no module names one (a class SGLang serves under another name, or
    none: SGLang then decides as before), or when the environment sets the list itself."""
    names = [name for name in architectures if name]
    package = importlib.util.find_spec("sglang")  # found, not imported: its import-time noise is not filtered yet
    if not names or os.environ.get(DISABLED_MODEL_MODULES) or package is None:
        return []
    named = re.compile(r"\b(" + "|".join(map(re.escape, names)) + r")\b")
    skipped, kept = [], 0
    for directory in package.submodule_search_locations or []:
        for path in sorted((Path(directory) / "srt" / "models").glob("*.py")):
            if path.stem in ("__init__", "registry"):
                continue
            if named.search(path.read_text(encoding="utf-8", errors="replace")):
                kept += 1
            else:
                skipped.append(path.stem)
    if kept:
        os.environ[DISABLED_MODEL_MODULES] = ",".join(skipped)
        return skipped
    return []


@dataclasses.dataclass(frozen=True)
class SGLang:
    """The installed SGLang: the pieces the engine uses, and what its release can do. Each capability is
    probed from what is installed, never read from the version string."""

    version: str
    runtime_context: Any
    ModelConfig: Any
    ModelRunner: Any
    PortArgs: Any
    ServerArgs: Any
    Req: Any
    ScheduleBatch: Any
    ForwardBatch: Any
    CaptureHiddenMode: Any
    SamplingParams: Any
    SpeculativeAlgorithm: Any
    TreeCacheNamespace: Any
    set_envs_and_config: Any
    publishes_runtime: bool
    """The ranks' runtime is published before the ModelRunner is built (``runtime_context.publish`` with
    ``SpawnRanks``, 0.5.23); otherwise the ModelRunner is given a ``ParallelState`` (``ps``, 0.5.17)."""
    capture_only: bool
    """ServerArgs has the EAGLE-3 capture mode without a drafter (``enable_return_aux_hidden_states``, 0.5.23)."""
    returns_final_state: bool
    """The logits processor hands back the post-norm final state (``LogitsProcessorOutput.last_hidden_states``,
    0.5.23); otherwise ``FinalStateTap`` keeps it from the processor's input."""


def import_sglang() -> SGLang:
    """The SGLang pieces the engine uses; call after ``cpu_shims.install_cpu_shims`` on CPU."""
    quiet_import_noise()
    import sglang
    from sglang.benchmark.one_batch import TreeCacheNamespace
    from sglang.srt import runtime_context
    from sglang.srt.configs.model_config import ModelConfig
    from sglang.srt.entrypoints.engine import _set_envs_and_config
    from sglang.srt.layers.logits_processor import LogitsProcessorOutput
    from sglang.srt.managers.schedule_batch import Req, ScheduleBatch
    from sglang.srt.model_executor.forward_batch_info import CaptureHiddenMode, ForwardBatch
    from sglang.srt.model_executor.model_runner import ModelRunner
    from sglang.srt.sampling.sampling_params import SamplingParams
    from sglang.srt.server_args import PortArgs, ServerArgs
    from sglang.srt.speculative.spec_info import SpeculativeAlgorithm

    publishes_runtime = hasattr(runtime_context, "SpawnRanks")
    takes_parallel_state = "ps" in inspect.signature(ModelRunner.__init__).parameters
    if not (publishes_runtime or takes_parallel_state):
        raise RuntimeError(
            f"SGLang {sglang.__version__} has neither the runtime_context.publish nor the ParallelState runner "
            f"bootstrap; this extractor supports SGLang {', '.join(SUPPORTED_SGLANG_VERSIONS)}"
        )
    return SGLang(
        version=sglang.__version__, runtime_context=runtime_context, ModelConfig=ModelConfig,
        ModelRunner=ModelRunner, PortArgs=PortArgs, ServerArgs=ServerArgs, Req=Req, ScheduleBatch=ScheduleBatch,
        ForwardBatch=ForwardBatch, CaptureHiddenMode=CaptureHiddenMode, SamplingParams=SamplingParams,
        SpeculativeAlgorithm=SpeculativeAlgorithm, TreeCacheNamespace=TreeCacheNamespace,
        set_envs_and_config=_set_envs_and_config, publishes_runtime=publishes_runtime,
        capture_only="enable_return_aux_hidden_states" in server_args_fields(ServerArgs),
        returns_final_state="last_hidden_states" in {f.name for f in dataclasses.fields(LogitsProcessorOutput)},
    )


def build_model_runner(sgl: SGLang, server_args: Mapping[str, Any], spec: EngineSpec, tp_rank: int) -> Any:
    """A loaded ModelRunner for ``tp_rank`` with memory pools, attention backend and eager runner, built with
    ``server_args`` (``extractor.serving.runner_server_args``: in the capture-only mode where ``sgl`` has it)."""
    bootstrap = _bootstrap_0523 if sgl.publishes_runtime else _bootstrap_0517
    runner = bootstrap(sgl, spec, sgl.ServerArgs(**server_args), tp_rank)
    runner.alloc_memory_pool()
    runner.init_attention_backends()
    runner.init_cuda_graphs()  # with graphs disabled this installs the eager runner
    return runner


def _bootstrap_0523(sgl: SGLang, spec: EngineSpec, server_args: Any, tp_rank: int) -> Any:
    """The sequence of sglang.benchmark.one_batch (0.5.23) load_model()/latency_test()."""
    model_config, nccl_port = _init_runtime_0523(sgl, server_args, tp_rank)
    return sgl.ModelRunner(
        model_config=model_config, mem_fraction_static=spec.mem_fraction_static, gpu_id=tp_rank,
        nccl_port=nccl_port, server_args=server_args,
    )


def _init_runtime_0523(sgl: SGLang, server_args: Any, tp_rank: int) -> tuple[Any, int]:
    """0.5.23: publish the server args, start the parallel groups; returns (ModelConfig, nccl port)."""
    from sglang.benchmark.one_batch import _init_process_global_configs
    from sglang.srt.distributed import bootstrap

    rc = sgl.runtime_context
    server_args.resolve_once()
    sgl.set_envs_and_config(server_args)
    port_args = sgl.PortArgs.init_new(server_args)
    rc.publish(
        server_args,
        role="scheduler",
        ranks=rc.SpawnRanks(world_rank=rc.spawn_world_rank(server_args, tp_rank=tp_rank, pp_rank=0), gpu_id=tp_rank),
    )
    _init_process_global_configs()
    model_config = sgl.ModelConfig.from_server_args(server_args)
    bootstrap.init_parallel_runtime(server_args=server_args, device=rc.get_device().device, dist_port=port_args.nccl_port)
    bootstrap.init_layer_runtime(model_config=model_config)
    return model_config, port_args.nccl_port


def _bootstrap_0517(sgl: SGLang, spec: EngineSpec, server_args: Any, tp_rank: int) -> Any:
    """The sequence of sglang.benchmark.one_batch (0.5.17) load_model()/latency_test().

    ServerArgs resolves itself in __post_init__; ModelRunner publishes the args and
    initialises torch.distributed from the ParallelState it is given.
    """
    model_config, nccl_port = _init_configs_0517(sgl, server_args)
    return sgl.ModelRunner(
        model_config=model_config, mem_fraction_static=spec.mem_fraction_static, gpu_id=tp_rank,
        ps=_parallel_state_0517(server_args, tp_rank), nccl_port=nccl_port, server_args=server_args,
    )


def _init_configs_0517(sgl: SGLang, server_args: Any) -> tuple[Any, int]:
    from sglang.srt.layers.moe import initialize_moe_config
    from sglang.srt.layers.quantization.fp4_utils import initialize_fp4_gemm_config
    from sglang.srt.layers.quantization.fp8_utils import initialize_fp8_gemm_config
    from sglang.srt.layers.quantization.unquant import initialize_bf16_gemm_config

    sgl.set_envs_and_config(server_args)
    port_args = sgl.PortArgs.init_new(server_args)
    for initialize in (initialize_moe_config, initialize_fp8_gemm_config, initialize_fp4_gemm_config,
                       initialize_bf16_gemm_config):
        initialize(server_args)
    return sgl.ModelConfig.from_server_args(server_args), port_args.nccl_port


def _parallel_state_0517(sa: Any, tp_rank: int) -> Any:
    from sglang.srt.distributed.parallel_state_wrapper import ParallelState
    from sglang.srt.layers.dp_attention import compute_dp_attention_world_info

    attn_tp_rank, attn_tp_size, attn_dp_rank, attn_dp_size = compute_dp_attention_world_info(
        sa.enable_dp_attention, tp_rank, sa.tp_size, sa.dp_size, sa.attn_cp_size
    )
    return ParallelState(
        tp_rank=tp_rank, tp_size=sa.tp_size, pp_rank=0, pp_size=1, dp_rank=None, dp_size=sa.dp_size,
        attn_tp_rank=attn_tp_rank, attn_tp_size=attn_tp_size, attn_cp_rank=0, attn_cp_size=sa.attn_cp_size,
        attn_dp_rank=attn_dp_rank, attn_dp_size=attn_dp_size,
        moe_ep_rank=tp_rank // (sa.tp_size // sa.ep_size), moe_ep_size=sa.ep_size, moe_dp_rank=None,
        moe_dp_size=sa.moe_dp_size, dcp_size=sa.dcp_size, gpu_id=tp_rank,
    )


def _init_runtime_0517(sgl: SGLang, server_args: Any, tp_rank: int) -> tuple[Any, int]:
    """0.5.17 without a ModelRunner: what its __init__ does before loading (global args, parallel groups)."""
    from sglang.srt.distributed import bootstrap
    from sglang.srt.server_args import set_global_server_args_for_scheduler

    model_config, nccl_port = _init_configs_0517(sgl, server_args)
    set_global_server_args_for_scheduler(server_args)
    bootstrap.init_torch_distributed(
        server_args=server_args, model_config=model_config, device=server_args.device,
        ps=_parallel_state_0517(server_args, tp_rank), dist_port=nccl_port, is_draft_worker=False,
        local_omp_cpuid=None,
    )
    return model_config, nccl_port


class MetaModels:
    """Model classes as SGLang builds them for serving, on the meta device: no weight is read or allocated.

    A 1T-parameter target builds in about a second on a CPU box. It starts SGLang's
    runtime for one CPU rank, so a process holds one instance. Construction follows
    ``DummyModelLoader.load_model`` (model_loader/loader.py): the quantization config,
    ``set_default_torch_dtype(model_config.dtype)``, then ``_initialize_model``.
    """

    def __init__(self, sgl: SGLang, target_path: str) -> None:
        import socket

        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        self._sgl = sgl
        self._server_args = sgl.ServerArgs(
            model_path=target_path, device="cpu", tp_size=1, attention_backend="torch_native",
            skip_tokenizer_init=True, disable_cuda_graph=True, disable_radix_cache=True,
            disable_custom_all_reduce=True, chunked_prefill_size=-1, max_total_tokens=64, nccl_port=port,
            host="127.0.0.1",
        )
        init_runtime = _init_runtime_0523 if sgl.publishes_runtime else _init_runtime_0517
        self.target_config, _ = init_runtime(sgl, self._server_args, 0)
        self.target = self._build(self.target_config)

    def draft_config(self, drafter_dir: str) -> Any:
        """The drafter's ModelConfig, parsed as the EAGLE-3 server parses ``--speculative-draft-model-path``."""
        return self._sgl.ModelConfig.from_server_args(self._server_args, model_path=drafter_dir, is_draft_model=True)

    def build_drafter(self, draft_config: Any) -> Any:
        return self._build(draft_config)

    @staticmethod
    def _build(model_config: Any) -> Any:
        import torch
        from sglang.srt.configs.load_config import LoadConfig
        from sglang.srt.model_loader.loader import (
            _get_quantization_config,
            _initialize_model,
            set_default_torch_dtype,
        )

        load_config = LoadConfig(load_format="dummy")
        quant_config = _get_quantization_config(model_config, load_config)
        with set_default_torch_dtype(model_config.dtype), torch.device("meta"):
            return _initialize_model(model_config, load_config, quant_config)


def set_extend_length(req: Any, length: int) -> None:
    """Mark the whole sample as this forward's EXTEND range (no cached prefix)."""
    if hasattr(req, "set_extend_range"):  # 0.5.17
        req.set_extend_range(len(req.prefix_indices), length)
    else:
        req.extend_end = length


class FinalStateTap:
    """The final hidden state of every token, after the model's final norm or entering it.

    post_norm: 0.5.23 returns it as ``LogitsProcessorOutput.last_hidden_states``; 0.5.17
    does not, so a forward pre-hook keeps the ``hidden_states`` the model hands its logits
    processor, which is the same tensor (llama.py, deepseek_v2.py: norm, then
    ``self.logits_processor(input_ids, hidden_states, ...)``).

    pre_norm: the residual stream entering the final norm (HF: the input of
    ``model.norm``). Neither release returns it for these models: 0.5.23's
    ``ForwardBatch.return_hidden_states_before_norm`` is honoured only by model files
    that hand ``hidden_states_before_norm`` to the logits processor (DeepSeek-V4,
    MiMo-V2), and 0.5.17's logits processor takes that argument but llama.py,
    qwen2/3.py and deepseek_v2.py never pass it. In both releases those models call
    the final norm as ``norm(hidden_states, residual)`` (0.5.23 through
    ``residual.batch.final_norm`` -> ``access.final_norm_pair``), and RMSNorm returns
    ``(normed, hidden_states + residual)``; the fused CUDA kernel writes that sum into
    ``residual`` in place and returns it. A forward hook on the norm keeps the second
    output: the sum the norm itself normalised. Called with no residual (a stack that
    hands over one tensor), the norm's input is that state.
    """

    def __init__(self, sgl: SGLang, kind: str, logits_processor: Any, final_norm: Any) -> None:
        """``logits_processor``: the language model's (inside a multimodal wrapper, not the wrapper's);
        ``final_norm``: its decoder stack's final norm (needed for pre_norm only)."""
        self._kind = kind
        self._kept: Any = None
        if kind == "pre_norm":
            final_norm.register_forward_hook(self._keep_norm_input)
        elif kind == "post_norm" and not (sgl.capture_only and sgl.returns_final_state):
            logits_processor.register_forward_pre_hook(self._keep_logits_input, with_kwargs=True)

    def _keep_logits_input(self, module: Any, args: tuple, kwargs: dict) -> None:
        self._kept = kwargs["hidden_states"] if "hidden_states" in kwargs else args[1]

    def _keep_norm_input(self, module: Any, args: tuple, output: Any) -> None:
        self._kept = output[1] if isinstance(output, tuple) else args[0]

    def take(self, logits_output: Any) -> Any:
        """This forward's final state (None when not asked for); forget it for the next one."""
        kept, self._kept = self._kept, None
        if self._kind == "post_norm":
            returned = getattr(logits_output, "last_hidden_states", None)
            return returned if returned is not None else kept
        return kept


def server_args_fields(server_args_class: type) -> list[str]:
    """The field names of ``ServerArgs``: a dataclass in 0.5.17, a record of namespaced fields in 0.5.23."""
    if dataclasses.is_dataclass(server_args_class):  # 0.5.17
        return [field.name for field in dataclasses.fields(server_args_class)]
    from sglang.srt.arg_groups.arg_utils import record_fields  # 0.5.23

    return [field.name for field in record_fields(server_args_class)]


def config_merger() -> Any:
    """SGLang's reader of ``sglang serve --config FILE`` (it moved between the releases)."""
    try:
        from sglang.srt.utils.server_args_config_parser import ConfigArgumentMerger  # 0.5.23
    except ImportError:
        from sglang.srt.server_args_config_parser import ConfigArgumentMerger  # 0.5.17
    return ConfigArgumentMerger
