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
import sys
import time
from pathlib import Path
from typing import Any, Optional

from benchmarks.commands import add_model_arguments, add_run_arguments, resolve_model, run_on_cluster, sglang_alone
from benchmarks.workdir import write_results
from conversations.output import read_record
from conversations.pipeline import read_inputs
from extractor.checkpoint import read_checkpoint_info
from jobs.prepare import load_config
from runtime.cluster.session import ray_session, resolve_device
from runtime.display.timeline import wall_time_line

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


def run_prepare(model: Path, data: Path, out: Path, keys: list[str], log: Path) -> tuple[float, dict]:
    """``python -m jobs.prepare`` on this process's Ray cluster; its output goes to ``log`` (where its wall time
    went: its stage lines and timestamps)."""
    seconds = run_on_cluster("jobs.prepare", [f"model.path={model}", f"data.path={data}", f"output.dir={out}", *keys],
                             log)
    record = read_record(out)
    if record is None:
        raise SystemExit(f"jobs.prepare exited 0 but left no record in {out}; its output is in {log}")
    return seconds, record


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
    own = sglang_alone(spec, prompts, params)
    return {"seconds": own["seconds"], "wall_seconds": own["wall_seconds"],
            "generated_tokens": sum(len(ids) for ids in own["outputs"]),
            "answers": [chat.decode(ids) for ids in own["outputs"]]}


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.regenerate", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_arguments(parser)
    parser.add_argument("--prompts", type=int, default=0, help="0: 3,000 on CUDA, 24 on CPU")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--shard-size", type=int, default=500, help="jobs.prepare's output.shard_size")
    add_run_arguments(parser, "regenerate-bench", "jobs.prepare")
    args = parser.parse_args(argv)
    prompts = args.prompts or (3000 if args.device == "cuda" else 24)
    model = resolve_model(args)
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
    write_results(results, args.out)
    if not args.model and args.device == "cpu" and "paris" not in (answers[0] or "").lower():
        print("the answer to the capital of France does not name Paris: is this a trained model?", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
