"""jobs.extract's whole wall time against SGLang alone doing the same prefill, on the same model, tokens and engine.

    python -m benchmarks.extract_wall [--device cpu|cuda] [--model DIR | --gguf FILE] [--samples N]
                                      [--tokens-per-sample 256] [--set key=value ...]

Writes ``--samples`` random token sequences (lengths from half to one and a half times ``--tokens-per-sample``) as
a tokenized dataset, runs ``python -m jobs.extract`` on them as a user would, then SGLang alone in a Ray actor like
the extractor: its engine started with the same model, dtype, device, tensor parallelism, attention backend, memory
fraction and model.serving settings, one ``Engine.generate`` over the same token ids with ``max_new_tokens=1`` (the
prefill of every token, and one decode step each), its shutdown. Prints the command's wall time phase by phase (its
own summary's table), SGLang alone's from the actor's start to the engine's shutdown, and their ratio: the bound a
command's fixed costs are held to is 1.25. Both run on one private Ray cluster that ``jobs.extract`` joins
(``ray.address``): one cluster's start-up, not two.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any, Optional

import pyarrow.parquet as pq

from benchmarks.commands import add_model_arguments, add_run_arguments, resolve_model, run_on_cluster, sglang_alone
from benchmarks.workdir import write_results
from extractor.checkpoint import read_checkpoint_info
from extractor.generator import GeneratorSpec
from extractor.serving import with_serving
from inputs.demo import build_synthetic_dataset
from jobs.config import load_config
from jobs.rundir.summary import read_summary
from runtime.cluster.session import ray_session, resolve_device
from runtime.display.timeline import wall_time_line

BOUND = 1.25
"""A command's wall time within this many times SGLang alone's (its engine's start and the same work)."""


def run_extract(keys: list[str], log: Path) -> tuple[float, dict[str, Any]]:
    """``python -m jobs.extract`` on this process's Ray cluster; its output goes to ``log``; returns its wall time
    seen from outside and the run's summary."""
    seconds = run_on_cluster("jobs.extract", keys, log)
    output_dir = next(key.split("=", 1)[1] for key in keys if key.startswith("output.dir="))
    summary = read_summary(Path(output_dir))
    if summary is None:
        raise SystemExit(f"jobs.extract exited 0 but left no readable summary in {output_dir}; its output is in {log}")
    return seconds, summary


def engine_alone(keys: list[str]) -> GeneratorSpec:
    """The engine jobs.extract's config gives its model: its model.* keys with model.serving's values in them,
    and the serving command's other settings (a quantized server's, say), as the job's own engine takes them."""
    model, serving = with_serving(load_config(keys).model)
    return GeneratorSpec(model_path=model.path, dtype=model.dtype, device=resolve_device(model.device, model.tp_size),
                         tp_size=model.tp_size, attention_backend=model.attention_backend,
                         mem_fraction_static=model.mem_fraction_static, trust_remote_code=model.trust_remote_code,
                         server_args=serving.server_args_for(model) if serving else {})


def prefill_alone(keys: list[str], data: Path) -> dict[str, Any]:
    """SGLang alone over the same token ids, prefill only (one new token each), on ``engine_alone(keys)``."""
    spec = engine_alone(keys)
    prompts = pq.read_table(data, columns=["input_ids"]).column("input_ids").to_pylist()
    own = sglang_alone(spec, prompts, [{"temperature": 0.0, "max_new_tokens": 1}] * len(prompts))
    return {"seconds": own["seconds"], "wall_seconds": own["wall_seconds"], "tokens": sum(map(len, prompts))}


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.extract_wall", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_arguments(parser)
    parser.add_argument("--samples", type=int, default=0, help="0: 8,000 on CUDA (~2M tokens), 24 on CPU")
    parser.add_argument("--tokens-per-sample", type=int, default=256)
    add_run_arguments(parser, "extract-wall-bench", "jobs.extract")
    args = parser.parse_args(argv)
    samples = args.samples or (8000 if args.device == "cuda" else 24)
    model = resolve_model(args)
    work = Path(args.work_dir).absolute()
    data = build_synthetic_dataset(
        work / f"tokens-{samples}x{args.tokens_per_sample}.parquet", samples,
        vocab_size=read_checkpoint_info(str(model)).vocab_size, min_len=max(2, args.tokens_per_sample // 2),
        max_len=args.tokens_per_sample * 3 // 2)
    output_dir = work / f"states-{int(time.time())}"
    keys = [f"model.path={model}", f"data.path={data}", f"output.dir={output_dir}", f"model.device={args.device}",
            *(["model.dtype=float32"] if args.device == "cpu" else []), *args.set]
    with ray_session(""):
        log = Path(args.out).with_suffix(".extract.log") if args.out else work / "extract.log"
        command_seconds, summary = run_extract(keys, log)
        alone = prefill_alone(keys, data)
    results = {
        "model": str(model), "device": args.device, "samples": samples, "tokens": summary["tokens"],
        "settings": keys[3:],
        "extract": {"command_seconds": round(command_seconds, 1), "wall_seconds": summary["wall_seconds"],
                    "extract_seconds": summary["this_run"]["seconds"]},
        "sglang_alone": {"wall_seconds": round(alone["wall_seconds"], 1), "prefill_seconds": round(alone["seconds"], 2),
                         "tokens": alone["tokens"]},
        "command_over_sglang_wall": round(command_seconds / alone["wall_seconds"], 3),
    }
    print(f"\n{samples} samples, {summary['tokens']:,} tokens, on {args.device}: {' '.join(keys[3:])}")
    print(f"  jobs.extract, the whole command {command_seconds:.1f} s; its {wall_time_line(summary['wall_seconds'])}")
    print(f"  SGLang alone, the actor's start to the engine's shutdown: {alone['wall_seconds']:.1f} s "
          f"(the prefill itself {alone['seconds']:.1f} s)")
    print(f"  command / SGLang alone = {results['command_over_sglang_wall']:.2f} (bound {BOUND})")
    write_results(results, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
