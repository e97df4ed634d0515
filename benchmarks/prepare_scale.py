"""jobs.prepare over many short conversations: rate and peak memory (the run must stay bounded in memory).

    python -m benchmarks.prepare_scale [--conversations 1000000] [--model DIR] [--work-dir DIR] [--out results.json]

Writes ``--conversations`` ShareGPT rows (one to three exchanges of a few words, a third with a system
prompt; streamed to a JSONL file, never all in memory), runs ``python -m jobs.prepare`` on them as a
user would (default tokenizer: SmolLM2-135M-Instruct's, ``testbeds.smollm2.checkpoint_dir()``) and
samples the memory of the command and its worker processes every second (RSS, and USS: what each process holds
alone, shared library pages not counted once per process). Prints conversations/s of the tokenizing pass and of
the whole command, tokens/s, and peak RSS; ``--out`` keeps them as JSON.
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

import psutil

from common.pythonpath import checkout_first
from inputs.demo_chat import demo_conversations
from testbeds.smollm2 import checkpoint_dir

REPO_ROOT = Path(__file__).resolve().parent.parent
SAMPLE_S = 1.0
WRITE_BATCH = 10_000


def write_conversations(path: Path, count: int) -> int:
    """``count`` rows, written in batches; returns the file's bytes."""
    with open(path, "w") as handle:
        for start in range(0, count, WRITE_BATCH):
            rows = demo_conversations(min(WRITE_BATCH, count - start), seed=start)
            handle.write("".join(json.dumps(row) + "\n" for row in rows))
    return path.stat().st_size


def run_prepare(model: Path, data: Path, out: Path, extra: list[str]) -> tuple[int, float, dict[str, int], str]:
    """(exit code, seconds, peak RSS and USS of the command and its worker processes in bytes, log tail)."""
    env = dict(os.environ, PYTHONPATH=checkout_first(REPO_ROOT))
    log = out.with_suffix(".log")
    started = time.perf_counter()
    with open(log, "w") as handle:
        process = subprocess.Popen([sys.executable, "-m", "jobs.prepare", f"model.path={model}", f"data.path={data}",
                                    f"output.dir={out}", *extra], cwd=REPO_ROOT, env=env, stdout=handle,
                                   stderr=subprocess.STDOUT)
        watched = psutil.Process(process.pid)
        peak = {"rss": 0, "uss": 0}
        while process.poll() is None:
            try:
                memory = [p.memory_full_info() for p in [watched, *watched.children(recursive=True)]]
            except psutil.Error:  # a process ended between the listing and the reading
                continue
            for kind in peak:  # RSS counts shared library pages once per process; USS is each one's own memory
                peak[kind] = max(peak[kind], sum(getattr(m, kind) for m in memory))
            time.sleep(SAMPLE_S)
    return process.returncode, time.perf_counter() - started, peak, log.read_text()[-3000:]


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.prepare_scale", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--conversations", type=int, default=1_000_000)
    parser.add_argument("--model", default="", help="checkpoint with the tokenizer (default: SmolLM2-135M-Instruct)")
    parser.add_argument("--work-dir", default="prepare-scale")
    parser.add_argument("--out", default="", help="write the results here as JSON")
    parser.add_argument("--set", nargs="*", default=[], metavar="key=value", help="more jobs.prepare keys")
    args = parser.parse_args(argv)
    model = Path(args.model) if args.model else checkpoint_dir()
    work = Path(args.work_dir).absolute()
    work.mkdir(parents=True, exist_ok=True)
    data = work / f"conversations-{args.conversations}.jsonl"
    if not data.exists():
        write_conversations(data, args.conversations)
    out = work / f"tokens-{args.conversations}-{int(time.time())}"
    code, seconds, peak, tail = run_prepare(model, data, out, list(args.set))
    if code != 0:
        print(f"jobs.prepare failed (exit {code}):\n{tail}", file=sys.stderr)
        return 1
    record = json.loads((out / "_prepare.json").read_text())
    results = {
        "conversations": record["counts"]["conversations"], "kept": record["counts"]["kept"],
        "input_bytes": data.stat().st_size, "tokens": record["tokens"]["total"],
        "masked_tokens": record["tokens"]["masked"], "parts": len(record["parts"]),
        "tokenize_seconds": record["seconds"], "tokenize_conversations_per_s": record["conversations_per_second"],
        "tokens_per_s": round(record["tokens"]["total"] / max(record["seconds"], 1e-9), 1),
        "command_seconds": round(seconds, 2), "command_conversations_per_s": round(record["counts"]["conversations"] / seconds, 1),
        "peak_rss_bytes": peak["rss"], "peak_uss_bytes": peak["uss"], "workers": record.get("workers"), "cpus": len(os.sched_getaffinity(0)), "tokenizer": record["tokenizer"]["class"],
        "model": str(model),
    }
    print(f"{results['conversations']:,} conversations ({results['input_bytes'] / 1e6:.0f} MB of JSONL) -> "
          f"{results['tokens']:,} tokens in {results['parts']} parts")
    print(f"tokenizing pass: {results['tokenize_seconds']:.1f} s, {results['tokenize_conversations_per_s']:,.0f} "
          f"conversations/s, {results['tokens_per_s']:,.0f} tokens/s")
    print(f"whole command: {results['command_seconds']:.1f} s; peak RSS {peak['rss'] / 2**20:.0f} MiB, "
          f"USS {peak['uss'] / 2**20:.0f} MiB (with its workers)")
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
