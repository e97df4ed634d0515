"""Regeneration through jobs.prepare: the target answers prompts again with sglang.Engine; tokens/s and the answers.

    python -m benchmarks.regenerate [--model DIR] [--prompts 64] [--max-new-tokens 128] [--set key=value ...]

Writes ``--prompts`` one-question conversations (a fixed list of questions, repeated), runs
``python -m jobs.prepare ... regenerate=true`` on them as a user would (default model:
SmolLM2-135M-Instruct, ``testbeds.smollm2.checkpoint_dir()``; on a GPU machine the engine takes
``model.tp_size`` GPUs, on CPU add ``--set model.device=cpu model.dtype=float32``), and prints the
engine's generated tokens/s, the command's wall time and the first answers. It fails (exit 1) if
the answer to "What is the capital of France?" does not name Paris: a trained model answers that.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Optional

from testbeds.smollm2 import checkpoint_dir

REPO_ROOT = Path(__file__).resolve().parent.parent
QUESTIONS = [
    "What is the capital of France?", "Name three primary colors.", "How many days are in a week?",
    "What is 12 times 3?", "Give me one tip for sleeping well.", "What do bees make?",
    "Translate 'thank you' into Spanish.", "Which planet is known as the red planet?",
]


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.regenerate", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="", help="checkpoint (default: SmolLM2-135M-Instruct)")
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--work-dir", default="regenerate-bench")
    parser.add_argument("--out", default="", help="write the results here as JSON")
    parser.add_argument("--set", nargs="*", default=[], metavar="key=value", help="more jobs.prepare keys")
    args = parser.parse_args(argv)
    model = Path(args.model) if args.model else checkpoint_dir()
    work = Path(args.work_dir).absolute()
    work.mkdir(parents=True, exist_ok=True)
    data = work / f"questions-{args.prompts}.jsonl"
    data.write_text("".join(json.dumps({"conversations": [{"from": "human", "value": QUESTIONS[i % len(QUESTIONS)]}]})
                            + "\n" for i in range(args.prompts)))
    out = work / f"regenerated-{int(time.time())}"
    env = dict(os.environ, PYTHONPATH=str(REPO_ROOT), RAY_AUTH_MODE=os.environ.get("RAY_AUTH_MODE", "disabled"))
    started = time.perf_counter()
    result = subprocess.run(
        [sys.executable, "-m", "jobs.prepare", f"model.path={model}", f"data.path={data}", f"output.path={out}",
         "regenerate=true", f"generation.max_new_tokens={args.max_new_tokens}", *args.set],
        cwd=REPO_ROOT, env=env, capture_output=True, text=True)
    seconds = time.perf_counter() - started
    if result.returncode != 0:
        print(f"jobs.prepare failed (exit {result.returncode}):\n{result.stderr[-3000:]}", file=sys.stderr)
        return 1
    record = json.loads((out / "_prepare.json").read_text())
    stats = record["regeneration_stats"]
    answers = [json.loads(line) for path in sorted((out / "_regenerated").glob("part-*.jsonl"))
               for line in path.read_text().splitlines()]
    results = {"model": str(model), "prompts": args.prompts, "answers": stats["answers"],
               "generated_tokens": stats["generated_tokens"], "generation_seconds": round(stats["seconds"], 2),
               "generated_tokens_per_s": stats["tokens_per_second"], "cut_at_max_new_tokens": stats["cut_at_max_new_tokens"],
               "command_seconds": round(seconds, 1), "sglang": stats["sglang_version"], "settings": args.set}
    print(f"{stats['answers']} answers, {stats['generated_tokens']} tokens in {stats['seconds']:.1f} s of generation: "
          f"{stats['tokens_per_second']} tokens/s ({stats['cut_at_max_new_tokens']} cut at max_new_tokens); "
          f"whole command {seconds:.0f} s (SGLang {stats['sglang_version']})")
    for answer in answers[: len(QUESTIONS)]:
        print(f"  {answer['messages'][0]['content']!r} -> {answer['messages'][-1]['content']!r}")
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=2) + "\n")
    if "paris" not in answers[0]["messages"][-1]["content"].lower():
        print("the answer to the capital of France does not name Paris: is this a trained model?", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
