"""Everything that differs between the supported SGLang releases, detected by what is installed.

Supported: 0.5.23 (``runtime_context.publish`` bootstrap, capture-only mode that
returns the post-norm final state) and 0.5.17 (``ParallelState`` passed to
``ModelRunner(ps=...)``, no capture-only mode). The branch is chosen by what
the installed SGLang offers (``runtime_context.SpawnRanks``; ``ModelRunner``'s
``ps`` parameter), never by comparing version strings. ``MetaModels`` starts the
same runtime without a ModelRunner to build model classes on the meta device.
``ServingParser`` reads a serving command (``model.serving``) with the installed
release's own ``sglang serve`` parser: 0.5.17's ServerArgs is a dataclass,
0.5.23's a record of namespaced fields, and SGLang's ``--config`` reader moved.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import difflib
import inspect
import io
import json
import logging
import os
import re
import warnings
from types import SimpleNamespace
from typing import Any, Mapping, Sequence

from extractor.serving import ServingSettings, runner_server_args
from extractor.types import EngineSpec

logger = logging.getLogger(__name__)

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


def import_sglang() -> SimpleNamespace:
    """The SGLang pieces the engine uses; call after ``cpu_shims.install_cpu_shims`` on CPU."""
    quiet_import_noise()
    import sglang
    from sglang.benchmark.one_batch import TreeCacheNamespace
    from sglang.srt import runtime_context
    from sglang.srt.configs.model_config import ModelConfig
    from sglang.srt.entrypoints.engine import _set_envs_and_config
    from sglang.srt.managers.schedule_batch import Req, ScheduleBatch
    from sglang.srt.model_executor.forward_batch_info import CaptureHiddenMode, ForwardBatch
    from sglang.srt.model_executor.model_runner import ModelRunner
    from sglang.srt.sampling.sampling_params import SamplingParams
    from sglang.srt.server_args import PortArgs, ServerArgs
    from sglang.srt.speculative.spec_info import SpeculativeAlgorithm

    sgl = SimpleNamespace(
        version=sglang.__version__, TreeCacheNamespace=TreeCacheNamespace, runtime_context=runtime_context,
        ModelConfig=ModelConfig, set_envs_and_config=_set_envs_and_config, Req=Req, ScheduleBatch=ScheduleBatch,
        CaptureHiddenMode=CaptureHiddenMode, ForwardBatch=ForwardBatch, ModelRunner=ModelRunner,
        SamplingParams=SamplingParams, PortArgs=PortArgs, ServerArgs=ServerArgs,
        SpeculativeAlgorithm=SpeculativeAlgorithm,
    )
    sgl.publishes_runtime = hasattr(runtime_context, "SpawnRanks")  # 0.5.23
    sgl.takes_parallel_state = "ps" in inspect.signature(ModelRunner.__init__).parameters  # 0.5.17
    if not (sgl.publishes_runtime or sgl.takes_parallel_state):
        raise RuntimeError(
            f"SGLang {sgl.version} has neither the runtime_context.publish nor the ParallelState runner "
            f"bootstrap; this extractor supports SGLang {', '.join(SUPPORTED_SGLANG_VERSIONS)}"
        )
    return sgl


def build_model_runner(sgl: SimpleNamespace, spec: EngineSpec, tp_rank: int, nccl_port: int) -> Any:
    """A loaded ModelRunner for ``tp_rank`` with memory pools, attention backend and eager runner.

    Its ServerArgs: the serving command's applied settings (``spec.server_args``), then the
    extractor's own (``extractor.serving.runner_server_args``); 0.5.23 captures in its
    capture-only mode (EAGLE-3 hooks on, no drafter loaded, the post-norm final state kept).
    """
    server_args = sgl.ServerArgs(**runner_server_args(spec, nccl_port, capture_only=sgl.publishes_runtime))
    bootstrap = _bootstrap_0523 if sgl.publishes_runtime else _bootstrap_0517
    runner = bootstrap(sgl, spec, server_args, tp_rank)
    runner.alloc_memory_pool()
    runner.init_attention_backends()
    runner.init_cuda_graphs()  # with graphs disabled this installs the eager runner
    return runner


def _bootstrap_0523(sgl: SimpleNamespace, spec: EngineSpec, server_args: Any, tp_rank: int) -> Any:
    """The sequence of sglang.benchmark.one_batch (0.5.23) load_model()/latency_test()."""
    model_config, nccl_port = _init_runtime_0523(sgl, server_args, tp_rank)
    return sgl.ModelRunner(
        model_config=model_config, mem_fraction_static=spec.mem_fraction_static, gpu_id=tp_rank,
        nccl_port=nccl_port, server_args=server_args,
    )


def _init_runtime_0523(sgl: SimpleNamespace, server_args: Any, tp_rank: int) -> tuple[Any, int]:
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


def _bootstrap_0517(sgl: SimpleNamespace, spec: EngineSpec, server_args: Any, tp_rank: int) -> Any:
    """The sequence of sglang.benchmark.one_batch (0.5.17) load_model()/latency_test().

    ServerArgs resolves itself in __post_init__; ModelRunner publishes the args and
    initialises torch.distributed from the ParallelState it is given.
    """
    model_config, nccl_port = _init_configs_0517(sgl, server_args)
    return sgl.ModelRunner(
        model_config=model_config, mem_fraction_static=spec.mem_fraction_static, gpu_id=tp_rank,
        ps=_parallel_state_0517(server_args, tp_rank), nccl_port=nccl_port, server_args=server_args,
    )


def _init_configs_0517(sgl: SimpleNamespace, server_args: Any) -> tuple[Any, int]:
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


def _init_runtime_0517(sgl: SimpleNamespace, server_args: Any, tp_rank: int) -> tuple[Any, int]:
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

    def __init__(self, sgl: SimpleNamespace, target_path: str) -> None:
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

    def __init__(self, sgl: SimpleNamespace, kind: str, logits_processor: Any, final_norm: Any) -> None:
        """``logits_processor``: the language model's (inside a multimodal wrapper, not the wrapper's);
        ``final_norm``: its decoder stack's final norm (needed for pre_norm only)."""
        self._kind = kind
        self._kept: Any = None
        if kind == "pre_norm":
            final_norm.register_forward_hook(self._keep_norm_input)
        elif kind == "post_norm" and not sgl.publishes_runtime:
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


class _RefusingParser(argparse.ArgumentParser):
    """argparse's complaints as ValueError, never its SystemExit or its usage text."""

    def error(self, message: str) -> None:  # type: ignore[override]
        raise ValueError(message)

    def exit(self, status: int = 0, message: str | None = None) -> None:  # type: ignore[override]
        raise ValueError((message or "").strip() or f"SGLang's argument parser exited with status {status}")


class ServingParser:
    """The installed SGLang's own ``sglang serve`` parser (``ServerArgs.add_cli_args``), for ``model.serving``.

    Both releases register every ServerArgs flag there; 0.5.23's ServerArgs is a record of
    namespaced fields (``arg_groups.arg_utils.record_fields``), 0.5.17's a dataclass. No flag is
    required here (the extractor names the model itself), and ``--help`` is an unknown flag.
    """

    def __init__(self) -> None:
        quiet_import_noise()
        import sglang
        from sglang.srt.server_args import ServerArgs

        self.version = sglang.__version__
        self._parser = _RefusingParser(prog="sglang serve", add_help=False)
        ServerArgs.add_cli_args(self._parser)
        self._actions = [action for action in self._parser._actions if action.option_strings]
        for action in self._actions:
            action.required = False
        self._fields = set(_server_args_fields(ServerArgs))
        self._defaults = vars(self._parser.parse_args([]))
        self._keep_flags()

    def _keep_flags(self) -> None:
        """The parser's flags, kept for ``extractor.serving.refuse_unknown_flags`` (a later check without SGLang)."""
        from extractor.serving import known_flags_file
        from storage.atomic import replace_atomically

        flags = sorted(option for action in self._actions for option in action.option_strings)
        path = known_flags_file(self.version)
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            replace_atomically(path, json.dumps(flags), temp_suffix=f".{os.getpid()}.tmp")
        except OSError as error:  # a read-only home costs only the early check
            logger.debug("could not keep SGLang's flags in %s: %s", path, error)

    def words_of(self, fields: Mapping[str, Any]) -> tuple[str, ...]:
        """A mapping of ServerArgs fields as the command-line words that set them."""
        words: list[str] = []
        for name, value in fields.items():
            action = self._action(name)
            flag = _long_flag(action)
            if action.nargs == 0:  # store_true, store_false, store_const
                if value == action.const:
                    words.append(flag)
                elif value != action.default:
                    raise ValueError(f"model.serving: {name}={value!r}: {flag} takes no value; give true or false")
            elif isinstance(value, (list, tuple)) and action.nargs not in (None, "?"):
                words += [flag, *(_word(item) for item in value)]
            else:
                words += [flag, _word(value)]
        return tuple(words)

    def _action(self, name: str) -> argparse.Action:
        for action in self._actions:
            if action.dest == name:
                return action
        if name in self._fields:
            raise ValueError(f"model.serving: {name} has no command-line flag in SGLang {self.version}; the "
                             "extractor takes what `sglang serve` takes")
        close = difflib.get_close_matches(name, sorted(self._fields), n=1)
        hint = f"; did you mean {close[0]}?" if close else ""
        raise ValueError(f"model.serving: {name} is not a ServerArgs field of SGLang {self.version}{hint}")

    def parse(self, words: Sequence[str]) -> ServingSettings:
        """The command as ``sglang serve`` reads it; ValueError with SGLang's own complaint, naming the flag."""
        words = list(words)
        said = io.StringIO()
        try:
            with contextlib.redirect_stdout(said), contextlib.redirect_stderr(said):
                if "--config" in words:  # as SGLang's prepare_server_args: the file's options join the words
                    words = _config_merger()(self._parser).merge_config_with_args(words)
                namespace = self._parser.parse_args(words)
        except ValueError as error:
            raise ValueError(f"model.serving: SGLang {self.version} refuses the serving command: {error}") from None
        except (OSError, SystemExit) as error:
            said_lines = " ".join(filter(None, map(_plain_text, said.getvalue().splitlines())))
            raise ValueError(f"model.serving: SGLang {self.version} cannot read the serving command: "
                             f"{said_lines or error}") from None
        for line in filter(None, (_plain_text(line) for line in said.getvalue().splitlines())):
            logger.warning("SGLang %s on the serving command: %s", self.version, line)
        given, flags, ignored = {}, {}, {}
        for name, value in vars(namespace).items():
            if value == self._defaults.get(name):
                continue
            flag = _long_flag(next(action for action in self._actions if action.dest == name))
            if name not in self._fields:
                if name != "config":
                    ignored[flag] = f"SGLang {self.version} parses it but has no ServerArgs field for it"
                continue
            if not _is_json(value):
                raise ValueError(f"model.serving: {flag} {value!r} cannot be recorded as JSON")
            given[name], flags[name] = json.loads(json.dumps(value)), flag
        defaults = {name: value for name, value in self._defaults.items() if name in self._fields and _is_json(value)}
        return ServingSettings(tuple(words), self.version, given, flags, defaults, ignored)


def _server_args_fields(server_args_class: type) -> list[str]:
    if dataclasses.is_dataclass(server_args_class):  # 0.5.17
        return [field.name for field in dataclasses.fields(server_args_class)]
    from sglang.srt.arg_groups.arg_utils import record_fields  # 0.5.23

    return [field.name for field in record_fields(server_args_class)]


def _config_merger() -> Any:
    try:
        from sglang.srt.utils.server_args_config_parser import ConfigArgumentMerger  # 0.5.23
    except ImportError:
        from sglang.srt.server_args_config_parser import ConfigArgumentMerger  # 0.5.17
    return ConfigArgumentMerger


def _long_flag(action: argparse.Action) -> str:
    return next((option for option in action.option_strings if option.startswith("--")), action.option_strings[0])


def _is_json(value: Any) -> bool:
    try:
        json.dumps(value)
    except (TypeError, ValueError):
        return False
    return True


def _word(value: Any) -> str:
    return json.dumps(value) if isinstance(value, (dict, list)) else str(value)


def _plain_text(line: str) -> str:
    return re.sub(r"\x1b\[[0-9;]*m", "", line).strip()


def auto_dtype(checkpoint_config: Mapping[str, Any]) -> str:
    """What ``--dtype auto`` computes in for a checkpoint (its text config), by SGLang's own rule."""
    quiet_import_noise()
    from sglang.srt.configs.model_config import _get_and_verify_dtype

    return str(_get_and_verify_dtype(dict(checkpoint_config), "auto")).removeprefix("torch.")
