"""Serving: each arm's drafter with SGLang's EAGLE3 over the held-out prompts, in a process of its own."""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import importlib.metadata
import json
import multiprocessing
import time
from pathlib import Path
from typing import Any, Callable, Iterable, Sequence

from benchmarks.acceptance.files import write_json
from benchmarks.acceptance.prompts import render_prompts

SPEC_STEPS, SPEC_TOPK, SPEC_DRAFT_TOKENS = 3, 1, 4
SERVE_MEMORY = 0.75
"""Fraction of the GPU's memory the serving engines take together (SGLang's mem_fraction_static, shared)."""
ANSWER_SAMPLES = 3
"""The first held-out prompts whose answer text each engine keeps: what a quantized target says, read beside the bf16
target's (its answers should still be answers)."""
SERVE_PARALLEL = 2
"""Serving engines at once by default: on the H200 (2026-12-02) five at 0.15 each failed (the engines started
last found less than SGLang's minimum viable fraction, 0.156-0.164, left); two at 0.375 each served fine,
except when started at the same moment: two fp8 targets with their drafters (2026-12-02, "Raise
--mem-fraction-static above 0.381") and two bf16 ones (2026-12-04, above 0.379) did not start. SGLang sizes an
engine's KV pool against the memory free when its own load began, so an engine that starts while another is still
loading counts that one's pool as its own: ``start_serving`` starts the next engine only once the one before
holds its memory."""


def versions() -> dict[str, str]:
    """The versions of the packages a result depends on, as this Python has them."""
    found = {}
    for name in ("sglang", "torch", "transformers", "flashinfer-python", "specforge", "ray"):
        with contextlib.suppress(importlib.metadata.PackageNotFoundError):
            found[name] = importlib.metadata.version(name)
    return found


@dataclasses.dataclass(frozen=True)
class PromptResult:
    verify_ct: int
    correct_drafts: int
    completion_tokens: int
    output_sha: str


def prompt_results(outputs: Iterable[dict[str, Any]]) -> list[PromptResult]:
    """Per prompt, from SGLang's ``meta_info``: verify steps, correct drafts (SGLang omits both when no
    verify step ran), completion tokens, and a hash of the output ids (greedy serving is lossless: every
    arm should give the target's own answers)."""
    results = []
    for out in outputs:
        meta = out["meta_info"]
        ids = json.dumps(out.get("output_ids", [])).encode()
        results.append(PromptResult(int(meta.get("spec_verify_ct", 0)), int(meta.get("spec_num_correct_drafts", 0)),
                                    int(meta["completion_tokens"]), hashlib.sha256(ids).hexdigest()[:16]))
    return results


ENGINE_OWN = ("model_path", "speculative_algorithm", "speculative_draft_model_path", "speculative_num_steps",
              "speculative_eagle_topk", "speculative_num_draft_tokens", "disable_cuda_graph", "mem_fraction_static",
              "random_seed", "log_level")
"""What every arm's engine sets itself, whatever the serving command says: the drafter and how it drafts (the same
for every arm), no CUDA graphs, its share of the GPU."""


@dataclasses.dataclass(frozen=True)
class ServeSpec:
    """One engine's run: a drafter on a target over prompts, with the serving command of the target."""

    target: Path
    drafter: Path
    prompts: Path
    out: Path
    max_new_tokens: int
    attention_backend: str
    mem_fraction_static: float
    serving: tuple[str, ...] = ()
    """The serving command's words (``--quantization fp8 ...``); empty: the bf16 target."""


def serving_fields(serving: Sequence[str]) -> dict[str, Any]:
    """The ``sglang.Engine`` fields a serving command sets, as the installed SGLang's own parser reads it
    (``extractor.serving``, the parser behind ``model.serving``): what changes the target's numerics, the model
    keys (dtype, attention backend...) and the drafter's own (``--speculative-draft-model-quantization``: without
    it SGLang quantizes the drafter as it quantizes the target); not ports, logging, scheduling."""
    if not serving:
        return {}
    from extractor.serving import parse_serving

    settings = parse_serving(list(serving))
    if settings is None:
        return {}
    fields = {**settings.of_kind("applied"), **settings.of_kind("model"), **settings.of_kind("drafter")}
    return {field: value for field, value in fields.items() if field not in ENGINE_OWN}


def engine_args(target: Path, drafter: Path, attention_backend: str, mem_fraction_static: float,
                serving: Sequence[str] = ()) -> dict[str, Any]:
    """``sglang.Engine``'s arguments for one arm: EAGLE3 with the drafter, greedy-ready, on the bf16 target or on
    the target as ``serving`` serves it."""
    own = dict(
        model_path=str(target), speculative_algorithm="EAGLE3",
        speculative_draft_model_path=str(drafter), speculative_num_steps=SPEC_STEPS,
        speculative_eagle_topk=SPEC_TOPK, speculative_num_draft_tokens=SPEC_DRAFT_TOKENS,
        # CUDA graphs: the draft worker's capture imports deep_gemm, which the GPU lock does not install
        # (requirements/gpu-lock.txt).
        disable_cuda_graph=True, mem_fraction_static=mem_fraction_static, random_seed=0, log_level="warning")
    # flashinfer: the default FA3 (sgl_kernel's flash_ops) is what the Hopper trim of the carried sglang-kernel
    # leaves out (benchmarks/gpu/stage.py)
    return {"dtype": "bfloat16", "attention_backend": attention_backend, **serving_fields(serving), **own}


def serve_arm(spec: ServeSpec, ready: Any) -> None:
    """GPU only, in a process of its own: SGLang's EAGLE3 over the held-out prompts, all submitted at once
    (greedy: batching changes no answer); writes per-prompt results and the engine's settings. Sets ``ready``
    (a multiprocessing Event) once the engine holds its GPU memory."""
    import sglang
    import transformers

    input_ids = render_prompts(transformers.AutoTokenizer.from_pretrained(str(spec.target)), spec.prompts)
    questions = [json.loads(line)["prompt"] for line in spec.prompts.read_text().splitlines()[:ANSWER_SAMPLES]]
    args = engine_args(spec.target, spec.drafter, spec.attention_backend, spec.mem_fraction_static, spec.serving)
    engine = sglang.Engine(**args)
    ready.set()
    started = time.perf_counter()
    try:
        outputs = engine.generate(input_ids=input_ids,
                                  sampling_params={"temperature": 0.0, "max_new_tokens": spec.max_new_tokens})
    finally:
        engine.shutdown()
    results = [dataclasses.asdict(r) for r in prompt_results(outputs)]
    settings = {key: value for key, value in args.items() if key not in ("model_path", "speculative_draft_model_path")}
    answers = [{"prompt": question, "answer": out.get("text") or ""} for question, out in zip(questions, outputs)]
    write_json({"seconds": time.perf_counter() - started, "engine": settings, "versions": versions(),
                "prompts": results, "answers": answers}, spec.out)


def start_serving(spec: ServeSpec, serve: Callable[[ServeSpec, Any], None] = serve_arm) -> multiprocessing.Process:
    """``serve`` in a fresh spawned process (each arm's engine starts clean and frees the GPU after), returned
    once its engine holds its GPU memory or the process has ended: an engine started beside it after that sizes
    its KV pool from what this one left (SERVE_PARALLEL)."""
    context = multiprocessing.get_context("spawn")
    ready = context.Event()
    process = context.Process(target=serve, args=(spec, ready))
    process.start()
    while not ready.wait(timeout=1.0) and process.is_alive():
        pass
    return process


def served_results(process: multiprocessing.Process, out: Path) -> list[PromptResult]:
    process.join()
    if process.exitcode != 0 or not out.is_file():
        raise RuntimeError(f"serving for {out.stem} failed (exit {process.exitcode}); its log is above. Rerun "
                           "with --serve-parallel 1 if engines sharing the GPU were the cause")
    return read_results(out)


def read_results(out: Path) -> list[PromptResult]:
    return [PromptResult(**r) for r in json.loads(out.read_text())["prompts"]]


def read_versions(out: Path) -> dict[str, str]:
    """The package versions the engine served with (none from runs before they were kept)."""
    return json.loads(out.read_text()).get("versions", {})


def read_answers(out: Path) -> list[dict[str, str]]:
    """The first held-out prompts and the answer text the engine gave them (none from runs before they were kept)."""
    return json.loads(out.read_text()).get("answers", [])
