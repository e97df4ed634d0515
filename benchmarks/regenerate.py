"""Regeneration through jobs.prepare against SGLang's own offline throughput, on the same model, prompts and engine.

    python -m benchmarks.regenerate [--device cpu|cuda] [--model DIR | --gguf FILE] [--prompts N]
                                    [--max-new-tokens 128] [--shard-size 500] [--set key=value ...]

Writes ``--prompts`` one-question conversations, runs ``python -m jobs.prepare ... regenerate=true`` on
them as a user would, then one ``Engine.generate`` over the same prompts with the same chat template,
sampling, engine and process settings; prints both rates, their ratio, and how many answers are the
same text. Both run on one private Ray cluster, which ``jobs.prepare`` joins (``ray.address``): one
cluster's start-up, not two. What each rate counts and the check on CPU: docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Optional

import ray

from common.pythonpath import checkout_first
from conversations.pipeline import read_inputs
from conversations.regenerate import REGENERATOR_CPUS
from extractor.checkpoint import read_checkpoint_info
from jobs.prepare import load_config
from runtime.cluster.session import ray_session, resolve_device
from runtime.display.timeline import wall_time_line
from testbeds.smollm2 import build_checkpoint, checkpoint_dir, default_dir

REPO_ROOT = Path(__file__).resolve().parent.parent
QUESTIONS = [
    "What is the capital of France?", "Name {n} primary colors.", "How many days are in {n} weeks?",
    "What is {n} times 3?", "Give me {n} tips for sleeping well.", "What do bees make?",
    "Translate 'thank you' into Spanish.", "Which planet is known as the red planet?",
    "Write a short poem of {n} lines about the sea.", "Explain in {n} sentences why the sky is blue.",
    "List {n} animals that live in the ocean.", "Tell a story about a cat in {n} sentences.",
]


def questions(count: int) -> list[str]:
    """``count`` questions, the first the Paris one; the others vary (their numbers too) so answers differ in length."""
    return [QUESTIONS[i % len(QUESTIONS)].format(n=2 + (i // len(QUESTIONS)) % 7) for i in range(count)]


class OfflineEngine:
    """SGLang's own offline path in a Ray actor like the regenerator's: one ``Engine.generate`` over every prompt."""

    def __init__(self, spec: Any) -> None:
        from extractor.generator import Generator

        self.generator = Generator(spec)

    def generate(self, prompts: list[list[int]], params: list[dict[str, Any]]) -> tuple[float, list[list[int]]]:
        started = time.perf_counter()
        completions = self.generator.generate(prompts, params)
        return time.perf_counter() - started, [completion.output_ids for completion in completions]

    def close(self) -> None:
        self.generator.close()


def run_prepare(model: Path, data: Path, out: Path, keys: list[str], log: Path) -> tuple[float, dict]:
    """``python -m jobs.prepare`` on this process's Ray cluster (its auth settings are in the environment); its output
    goes to ``log`` (where its wall time went: its stage lines and timestamps)."""
    env = dict(os.environ, PYTHONPATH=checkout_first(REPO_ROOT), RAY_AUTH_MODE=os.environ.get("RAY_AUTH_MODE", "disabled"))
    env.pop("RAY_ADDRESS", None)
    address = ray.get_runtime_context().gcs_address
    started = time.perf_counter()
    result = subprocess.run(
        [sys.executable, "-m", "jobs.prepare", f"model.path={model}", f"data.path={data}", f"output.dir={out}", *keys,
         f"ray.address={address}"],
        cwd=REPO_ROOT, env=env, capture_output=True, text=True)
    seconds = time.perf_counter() - started
    log.write_text(result.stdout + result.stderr)
    if result.returncode != 0:
        raise SystemExit(f"jobs.prepare failed (exit {result.returncode}):\n{result.stderr[-3000:]}")
    return seconds, json.loads((out / "_prepare.json").read_text())


def sglang_offline(keys: list[str], model: Path, data: Path, asked: list[str]) -> dict[str, Any]:
    """SGLang's own rate on the prompts ``jobs.prepare`` answered, with the engine, chat template and sampling it
    used (its own ``read_inputs`` and ``generator_spec``), on this process's Ray cluster."""
    inputs = read_inputs(load_config([f"model.path={model}", f"data.path={data}", "output.dir=unused", *keys]))
    config, chat = inputs.config, inputs.chat
    context = read_checkpoint_info(str(model)).max_position_embeddings
    prompts = chat.prompt_ids([[{"role": "user", "content": text}] for text in asked])
    sampling = dict(config.generation.sampling_params(), stop_token_ids=sorted(chat.stop_ids))
    params = [dict(sampling, max_new_tokens=min(config.generation.max_new_tokens, context - len(ids))) for ids in prompts]
    spec = inputs.generator_spec(resolve_device(config.model.device, config.model.tp_size))
    started = time.perf_counter()
    actor = ray.remote(OfflineEngine).options(
        num_gpus=spec.tp_size if spec.device == "cuda" else 0, num_cpus=REGENERATOR_CPUS).remote(spec)
    try:
        seconds, outputs = ray.get(actor.generate.remote(prompts, params))
        ray.get(actor.close.remote(), timeout=60)
    finally:
        ray.kill(actor)
    return {"seconds": seconds, "wall_seconds": time.perf_counter() - started,
            "generated_tokens": sum(len(ids) for ids in outputs),
            "answers": [chat.decode(ids) for ids in outputs]}


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.regenerate", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--model", default="", help="checkpoint (default: SmolLM2-135M-Instruct)")
    parser.add_argument("--gguf", default="", help="build the default model from this SmolLM2 GGUF (no registry)")
    parser.add_argument("--prompts", type=int, default=0, help="0: 3,000 on CUDA, 24 on CPU")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--shard-size", type=int, default=500, help="jobs.prepare's output.shard_size")
    parser.add_argument("--work-dir", default="regenerate-bench")
    parser.add_argument("--out", default="", help="write the results here as JSON")
    parser.add_argument("--set", nargs="*", default=[], metavar="key=value", help="more jobs.prepare keys")
    args = parser.parse_args(argv)
    prompts = args.prompts or (3000 if args.device == "cuda" else 24)
    model = Path(args.model) if args.model else (build_checkpoint(default_dir(), Path(args.gguf)) if args.gguf
                                                 else checkpoint_dir())
    work = Path(args.work_dir).absolute()
    work.mkdir(parents=True, exist_ok=True)
    asked = questions(prompts)
    data = work / f"questions-{prompts}.jsonl"
    data.write_text("".join(json.dumps({"conversations": [{"from": "human", "value": q}]}) + "\n" for q in asked))
    device = [f"model.device={args.device}"] + (["model.dtype=float32"] if args.device == "cpu" else [])
    keys = [*device, "regenerate=true", f"generation.max_new_tokens={args.max_new_tokens}",
            f"output.shard_size={args.shard_size}", *args.set]
    with ray_session(""):
        prepare_log = Path(args.out).with_suffix(".prepare.log") if args.out else work / "prepare.log"
        regenerated_dir = work / f"regenerated-{int(time.time())}"
        command_seconds, record = run_prepare(model, data, regenerated_dir, keys, prepare_log)
        own = sglang_offline(keys, model, data, asked)
    out = Path(record["output_path"])
    stats = record["regeneration_stats"]
    regenerated = [json.loads(line) for path in sorted((out / "_regenerated").glob("part-*.jsonl"))
                   for line in path.read_text().splitlines()]
    own_rate = own["generated_tokens"] / own["seconds"]
    answers = [r["messages"][-1]["content"] if "messages" in r else None for r in regenerated]
    same = sum(a == b for a, b in zip(answers, own["answers"]))
    results = {
        "model": str(model), "device": args.device, "prompts": prompts, "shard_size": args.shard_size,
        "max_new_tokens": args.max_new_tokens, "settings": keys, "sglang": stats["sglang_version"],
        "prepare": {"answers": stats["answers"], "generated_tokens": stats["generated_tokens"],
                    "generation_seconds": round(stats["seconds"], 2), "tokens_per_s": stats["tokens_per_second"],
                    "shards": stats["shards"], "command_seconds": round(command_seconds, 1),
                    "wall_seconds": record["wall_seconds"]},
        "sglang_offline": {"generated_tokens": own["generated_tokens"], "seconds": round(own["seconds"], 2),
                           "tokens_per_s": round(own_rate, 1), "wall_seconds": round(own["wall_seconds"], 1)},
        "command_over_sglang_wall": round(command_seconds / own["wall_seconds"], 3),
        "prepare_over_sglang": round(stats["tokens_per_second"] / own_rate, 3),
        "same_answers": same,
    }
    print(f"\n{prompts} prompts, SGLang {stats['sglang_version']} on {args.device}, {len(regenerated)} answers in "
          f"{stats['shards']} shards of {args.shard_size}, at most {args.max_new_tokens} new tokens, {' '.join(keys)}")
    print(f"  jobs.prepare regenerate=true   {stats['generated_tokens']:>9,} tokens in {stats['seconds']:7.1f} s: "
          f"{stats['tokens_per_second']:>9,.0f} tokens/s (whole command {command_seconds:.0f} s)")
    print(f"    jobs.prepare's {wall_time_line(record['wall_seconds'])}")
    print(f"  SGLang Engine.generate, once   {own['generated_tokens']:>9,} tokens in {own['seconds']:7.1f} s: "
          f"{own_rate:>9,.0f} tokens/s")
    print(f"    SGLang alone from the actor's start to the engine's shutdown: {own['wall_seconds']:.0f} s; the whole "
          f"jobs.prepare command takes {results['command_over_sglang_wall']:.2f} x that")
    print(f"  prepare / SGLang = {results['prepare_over_sglang']:.3f}; the same answer text for {same} of {prompts} prompts")
    for question, answer in list(zip(asked, answers))[:4]:
        print(f"  {question!r} -> {answer!r}")
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=2) + "\n")
    if not args.model and args.device == "cpu" and "paris" not in (answers[0] or "").lower():
        print("the answer to the capital of France does not name Paris: is this a trained model?", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
