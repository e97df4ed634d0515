"""Text generation with ``sglang.Engine``: the target answers prompts again (``jobs.prepare regenerate=true``).

Only SGLang's public offline API is touched: ``sglang.Engine(**server_args)``, ``Engine.async_generate``,
its event loop (``Engine.loop``) and ``Engine.shutdown()``; besides, the limits its tokenizer manager checks each
request against (``EngineLimits``, the same attributes on 0.5.17 and 0.5.23). The engine takes and returns token ids
(``skip_tokenizer_init``), so the caller renders prompts and decodes answers with the very tokenizer
and chat template its loss mask comes from. The engine's loop runs in a thread of its own: ``submit``
hands it requests from any thread and returns at once, one future per answer, so a conversation's next
prompt goes in as soon as its last answer is back; ``submit_batch`` (and ``generate``, which waits for it)
is one request for many prompts, every answer back together, as ``Engine.generate`` sends them. On CPU
(checked with SGLang 0.5.23, torch 2.14.1) the scheduler processes are spawned, so the ``sgl_kernel``
stand-in of ``extractor.cpu_shims`` reaches them as a package on their path (``extractor/cpu_site``).

Importing this module loads neither SGLang nor torch: the driver builds a ``GeneratorSpec`` here
and the Ray actor builds the ``Generator``.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import importlib.util
import json
import logging
import os
import sys
import threading
import time
from pathlib import Path
from typing import Any, Mapping, Optional, Sequence

from extractor.checkpoint import checkpoint_on_this_node

logger = logging.getLogger(__name__)

CPU_SITE = Path(__file__).resolve().parent / "cpu_site"
"""Holds ``sgl_kernel/`` (the CPU stand-in) for the processes the engine spawns."""
CPU_KV_TOKENS = 32768
"""KV-cache tokens on CPU when none are named: SGLang would size the pool from free host memory."""
FINISH_STOP, FINISH_LENGTH = "stop", "length"


@dataclasses.dataclass(frozen=True)
class GeneratorSpec:
    """What the engine is built from (picklable: it crosses into the Ray actor)."""

    model_path: str
    dtype: str
    device: str
    """cpu | cuda (resolved, never auto)."""
    tp_size: int = 1
    attention_backend: str = ""
    """Empty: torch_native on CPU, flashinfer on CUDA (as the extractor: the GPU stack carries no FA3)."""
    cuda_graph: bool = True
    """CUDA: let SGLang capture decode graphs (much faster for small models); off where capture fails."""
    mem_fraction_static: float = 0.8
    max_total_tokens: int = 0
    """KV-cache tokens; 0: SGLang's choice from mem_fraction_static on CUDA, ``CPU_KV_TOKENS`` on CPU."""
    trust_remote_code: bool = False
    seed: int = 0
    """SGLang's random_seed (sampled answers also depend on how the engine batches the requests)."""
    server_args: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    """The serving command's applied settings (``extractor.serving``), under the engine's own above."""
    download: bool = False
    """model.download: a node without the driver's hub snapshot at ``model_path`` downloads that commit itself."""


@dataclasses.dataclass(frozen=True)
class Completion:
    """One answer: the generated ids without the stop token that ended it, and why it ended."""

    output_ids: list[int]
    finish_reason: str
    """stop (a stop token) | length (max_new_tokens) | what else SGLang reports (abort)."""


@dataclasses.dataclass(frozen=True)
class EngineLimits:
    """What the engine takes in one request; it refuses more (``Engine.async_generate`` raises ValueError)."""

    max_prompt_tokens: int
    """The longest prompt: SGLang's scheduler refuses ``max_req_input_len`` tokens or more, min(context - 1, KV
    cache - 1) less a margin of 5."""
    context_length: int
    """Prompt and answer together (less the slots speculative decoding reserves): the tokenizer manager refuses a
    request whose prompt and max_new_tokens add up to more."""


def _engine_args(spec: GeneratorSpec) -> dict[str, Any]:
    """The serving command's applied settings, then the engine's own: ids in and out, where it listens, its memory."""
    args: dict[str, Any] = dict(spec.server_args)
    args.update(
        model_path=spec.model_path,
        dtype=spec.dtype,
        device=spec.device,
        tp_size=spec.tp_size,
        trust_remote_code=spec.trust_remote_code,
        random_seed=spec.seed,
        mem_fraction_static=spec.mem_fraction_static,
        skip_tokenizer_init=True,  # prompts arrive as ids, answers leave as ids
        host="127.0.0.1",
        log_level="warning",
    )
    if spec.device == "cpu":
        # sleep_on_idle: an idle scheduler otherwise polls its sockets in a loop, taking a whole core from the
        # engine's other processes, the driver and the writers for as long as it waits (at its start too)
        args.update(attention_backend=spec.attention_backend or "torch_native", disable_cuda_graph=True,
                    max_total_tokens=spec.max_total_tokens or CPU_KV_TOKENS, sleep_on_idle=True)
    else:
        args.update(attention_backend=spec.attention_backend or "flashinfer", disable_cuda_graph=not spec.cuda_graph)
        if spec.max_total_tokens:
            args["max_total_tokens"] = spec.max_total_tokens
    return args


def _has_real_sgl_kernel() -> bool:
    from extractor.cpu_shims import SHIM_MODULE_NAME

    module = sys.modules.get(SHIM_MODULE_NAME)
    if module is not None:
        return getattr(module, "__file__", None) is not None  # the stand-in has no file
    return importlib.util.find_spec(SHIM_MODULE_NAME) is not None


def _prepare_cpu_environment(tp_size: int) -> None:
    """Before the engine spawns its processes: they inherit this environment."""
    from extractor.cpu_shims import install_cpu_shims

    if not _has_real_sgl_kernel():
        # The spawned schedulers import sgl_kernel before any code of ours runs there. multiprocessing
        # hands a spawned child its parent's sys.path, other children read PYTHONPATH: both get the
        # stand-in's directory, and the one holding extractor (which the stand-in imports).
        paths = [str(CPU_SITE), str(CPU_SITE.parent.parent)]
        sys.path[:0] = [path for path in paths if path not in sys.path]
        os.environ["PYTHONPATH"] = os.pathsep.join([*paths, *filter(None, [os.environ.get("PYTHONPATH")])])
    install_cpu_shims()  # sets SGLANG_USE_CPU_ENGINE and the no-NCCL path, inherited by the children
    if tp_size > 1:
        from extractor.tensor_parallel import cpu_thread_binding

        os.environ.setdefault("SGLANG_CPU_OMP_THREADS_BIND", cpu_thread_binding(tp_size, sorted(os.sched_getaffinity(0))))
        os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")  # as extractor.tensor_parallel: a compile not worth its time


class Generator:
    """An ``sglang.Engine`` over the model's TP ranks, answering batches of tokenized prompts."""

    def __init__(self, spec: GeneratorSpec) -> None:
        if spec.device == "cpu":
            _prepare_cpu_environment(spec.tp_size)
        from extractor.sglang_compat import quiet_import_noise

        quiet_import_noise()
        import sglang

        started = time.perf_counter()
        spec = dataclasses.replace(spec, model_path=checkpoint_on_this_node(spec.model_path, spec.download))
        self.spec = spec
        self.sglang_version = sglang.__version__
        self._engine: Optional[Any] = sglang.Engine(**_engine_args(spec))
        self._loop = self._engine.loop
        requests = self._engine.tokenizer_manager
        self.limits = EngineLimits(max_prompt_tokens=requests.max_req_input_len - 1,
                                   context_length=requests.context_len - requests.num_reserved_tokens)
        self._tasks: set[asyncio.Task] = set()
        """Answers being waited for in the loop's thread (only that thread touches the set)."""
        self._loop_thread = threading.Thread(target=self._loop.run_forever, name="sglang-engine-loop", daemon=True)
        self._loop_thread.start()
        logger.info("SGLang %s engine for %s (%s, tp %d) ready in %.0f s", self.sglang_version, spec.model_path,
                    spec.device, spec.tp_size, time.perf_counter() - started)
        if spec.server_args:
            logger.info("the engine runs the serving settings %s", json.dumps(dict(spec.server_args), sort_keys=True))

    def generate(self, prompts: Sequence[Sequence[int]], sampling_params: Sequence[dict[str, Any]]) -> list[Completion]:
        """One answer per prompt, in order. ``sampling_params`` are SGLang's (max_new_tokens, temperature,
        top_p, top_k, stop_token_ids); the engine schedules all prompts together (``Engine.generate``)."""
        return self.submit_batch(prompts, sampling_params).result()

    def submit_batch(self, prompts: Sequence[Sequence[int]],
                     sampling_params: Sequence[dict[str, Any]]) -> "concurrent.futures.Future[list[Completion]]":
        """All prompts as one request, queued at once (thread-safe); the future holds every answer, in order, once
        the last is back. One request is the engine's cheapest way in: its scheduler gets the prompts in one
        message, and the engine's loop handles them in one pass."""
        engine = self._engine_or_raise()

        async def answer() -> list[Completion]:
            if not prompts:
                return []
            outputs = await engine.async_generate(input_ids=[list(p) for p in prompts],
                                                  sampling_params=list(sampling_params))
            return [_completion(output) for output in outputs]

        return self._run(answer())

    def submit(self, prompts: Sequence[Sequence[int]],
               sampling_params: Sequence[dict[str, Any]]) -> "list[concurrent.futures.Future[Completion]]":
        """Each prompt its own request, all queued at once (thread-safe) in one hand-over to the engine's loop; each
        future holds its answer (or the engine's error) as soon as that answer is back."""
        engine = self._engine_or_raise()
        futures: list[concurrent.futures.Future[Completion]] = [concurrent.futures.Future() for _ in prompts]

        async def answer(prompt: Sequence[int], params: dict[str, Any], future: concurrent.futures.Future) -> None:
            try:
                future.set_result(_completion(await engine.async_generate(input_ids=list(prompt),
                                                                          sampling_params=params)))
            except BaseException as error:  # the engine's error goes to whoever waits for this answer
                future.set_exception(error)

        def start() -> None:
            for prompt, params, future in zip(prompts, sampling_params, futures):
                if future.set_running_or_notify_cancel():
                    task = self._loop.create_task(answer(prompt, params, future))
                    self._tasks.add(task)  # the loop keeps only a weak reference to a task
                    task.add_done_callback(self._tasks.discard)

        if futures:
            self._loop.call_soon_threadsafe(start)
        return futures

    def close(self) -> None:
        engine, self._engine = self._engine, None
        if engine is not None:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._loop_thread.join(timeout=30)
            engine.shutdown()

    def _engine_or_raise(self) -> Any:
        if self._engine is None:
            raise RuntimeError("the generator was closed")
        return self._engine

    def _run(self, coroutine: Any) -> "concurrent.futures.Future[Any]":
        return asyncio.run_coroutine_threadsafe(coroutine, self._loop)


def _completion(output: dict[str, Any]) -> Completion:
    ids = list(output["output_ids"])
    finish = output["meta_info"].get("finish_reason") or {}
    reason = str(finish.get("type", "")) if isinstance(finish, dict) else str(finish)
    # SGLang ends the answer with the token that stopped it (one of ours, or the model's own eos);
    # the chat template writes the end-of-turn token itself.
    matched = finish.get("matched") if isinstance(finish, dict) else None
    if reason == FINISH_STOP and ids and ids[-1] == matched:
        ids.pop()
    return Completion(output_ids=ids, finish_reason=reason)
