"""Throughput of the whole job against bare SGLang prefill, measured in one run on one machine.

  (a) bare prefill: the extractor's forward on the job's batches with capture off, nothing copied
  (a2) the extractor alone: capture forward, copy to host, put in Ray's object store (no writers)
  (b) the job: Ray, extractor actor, writer actors, Parquet on local disk (fsynced), tokens/s
      from the first batch to the last committed file
  (b2) optionally the same job with output.dir on a tmpfs: what the pipeline does without the disk
  (c) the disk's raw sequential write speed (write + fsync) and the writers' bytes/s

    python -m benchmarks.throughput --shape tiny --device cpu          # CI smoke test
    python -m benchmarks.throughput --shape llama8b --device cuda      # on a GPU machine

`tiny` and `small` are saved random-weight checkpoints; `llama8b`, `deepseek_v3_reduced` and
`kimi_k25_reduced` (Kimi-K2.5's published layout with INT4 routed experts, 10 layers: one H200)
use SGLang's dummy weights built from a config.json alone (random per process and per TP layout),
see benchmarks/shapes.py. Layers default to the job's [2, N//2, N-3] when that is valid for the
shape's depth, else to the first capturable ones; `--set extract.layers=[...]` picks others.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import tempfile
import threading
import time
from pathlib import Path

import numpy as np
import ray

from benchmarks.shapes import SHAPES
from jobs.config import load_config
from jobs.dataset import open_tokenized_dataset
from jobs.demo import build_synthetic_dataset, build_tiny_model
from jobs.extract import run
from extractor.checkpoint import read_checkpoint_info
from extractor.layers import check_layer_ids, default_layer_ids
from jobs.extractor_actor import start_extractor
from jobs.cluster import ray_session
from jobs.pipeline import build_engine_spec, resolve_device
from jobs.plan import pack_batches

DISK_PROBE_CHUNK = 64 * 1024 * 1024


def measure_disk(directory: Path, total_bytes: int) -> float:
    """Sequential write + fsync, bytes/s (what a shard commit costs at best)."""
    chunk = np.random.default_rng(0).integers(0, 255, DISK_PROBE_CHUNK, dtype=np.uint8).tobytes()
    path = directory / "disk-probe.bin"
    started = time.perf_counter()
    with open(path, "wb") as file:
        for _ in range(max(1, total_bytes // len(chunk))):
            file.write(chunk)
        file.flush()
        os.fsync(file.fileno())
    seconds = time.perf_counter() - started
    written = path.stat().st_size
    path.unlink()
    return written / seconds


def build_model(shape: str, directory: Path) -> tuple[Path, str]:
    """Checkpoint directory and SGLang load format for ``shape``."""
    if shape == "tiny":
        return build_tiny_model(directory / "model", arch="llama", dtype="bfloat16"), "auto"
    if shape == "small":  # real (saved) random weights: every TP layout loads the same model
        return build_tiny_model(directory / "model", arch="llama", num_layers=8, hidden_size=1024, dtype="bfloat16"), "auto"
    config = SHAPES[shape]
    (directory / "model").mkdir(parents=True, exist_ok=True)
    (directory / "model" / "config.json").write_text(json.dumps(config))
    return directory / "model", "dummy"


def benchmark_layer_ids(num_layers: int) -> list[int]:
    """The job's default layers when valid for this depth, else the first three capturable ones
    (from 1: on deepseek_v2 layer 0's output cannot be named by a drafter config)."""
    try:
        return check_layer_ids(default_layer_ids(num_layers), num_layers)
    except ValueError:
        return check_layer_ids(list(range(1, num_layers - 1))[:3], num_layers)


def measure_extractor(job_args: list[str], data: Path, batches_of: int, samples: int) -> tuple[float, float]:
    """tok/s of (a) bare prefill and (a2) the extractor alone (capture, host copy, object store),
    on the job's batches of its first ``samples`` samples; a warm-up batch of each is not counted."""
    config = load_config(job_args)
    checkpoint = read_checkpoint_info(config.model.path)
    dataset = open_tokenized_dataset(str(data), checkpoint.vocab_size, 1 << 30)
    layer_ids = check_layer_ids(config.extract.layers, checkpoint.num_layers)  # the job's own check
    spec = build_engine_spec(
        config.model, config.extract, layer_ids, resolve_device(config.model.device, config.model.tp_size),
        int(dataset.lengths.max()),
    )
    lengths = dataset.lengths[:samples]
    tokens = int(lengths.sum())
    actor = start_extractor(spec)
    try:
        batches = [dataset.rows(a, b)[0] for a, b in pack_batches(lengths, batches_of, 256)]
        ray.get(actor.bare_prefill.remote(batches[0]))  # warm-up: JIT kernels, allocator
        bare = tokens / sum(ray.get(actor.bare_prefill.remote(batch)) for batch in batches)
        ray.get(actor.extract.remote(batches[0]))
        started = time.perf_counter()
        in_flight: list[ray.ObjectRef] = []
        for batch in batches:  # as the job feeds it: the next batch is queued while one is handed on
            in_flight.append(actor.extract.remote(batch))
            if len(in_flight) > spec.host_buffers:
                ray.get(in_flight.pop(0))
        ray.get(in_flight)
        alone = tokens / (time.perf_counter() - started)
        ray.get(actor.close.remote())
    finally:
        ray.kill(actor)
    return bare, alone


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", choices=["tiny", "small", *SHAPES], default="tiny")
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--tp-size", type=int, default=1)
    parser.add_argument("--samples", type=int, default=32)
    parser.add_argument("--tokens-per-sample", type=int, default=2048)
    parser.add_argument("--max-tokens-per-batch", type=int, default=16384)
    parser.add_argument("--shard-size", type=int, default=16, help="samples per shard file")
    parser.add_argument("--disk-probe-bytes", type=int, default=8 << 30,
                        help="large enough that a device write cache cannot hide the sustained speed")
    parser.add_argument("--memory-dir", default="",
                        help="also run the job with output.dir on this tmpfs (e.g. /dev/shm): the pipeline without the disk")
    parser.add_argument("--baseline-samples", type=int, default=0,
                        help="(a) and (a2) on the first this many samples (0: all); per-batch rates need no long run")
    parser.add_argument("--consume", default="", metavar="BUDGET",
                        help="delete shards once committed and cap output.disk_budget at BUDGET (e.g. 16GB): "
                             "runs longer than the disk holds, with the budget's backpressure at work")
    parser.add_argument("--work-dir", default="", help="kept afterwards; default: a temp dir, removed")
    parser.add_argument("--out", default="", help="also write the results as JSON here")
    parser.add_argument("--set", nargs="*", default=[], help="extra job key=value overrides")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")

    work = Path(args.work_dir or tempfile.mkdtemp(prefix="eagle3-bench-"))
    try:
        results = measure(args, work)
    finally:
        if not args.work_dir:
            shutil.rmtree(work, ignore_errors=True)
    print_table(results)
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=2) + "\n")


class ShardConsumer(threading.Thread):
    """Deletes shard files as they are committed, as a trainer consuming them would.

    Lets a run write far more than the disk holds: the disk budget holds the
    extractor back until the job's periodic re-scan sees the space freed.
    """

    def __init__(self, directory: Path, period_s: float = 0.5) -> None:
        super().__init__(name="shard-consumer", daemon=True)
        self.directory = directory
        self.period_s = period_s
        self.stopping = threading.Event()

    def run(self) -> None:
        while not self.stopping.wait(self.period_s):
            for path in self.directory.glob("shard-*.parquet"):  # committed names only, never *.tmp
                path.unlink(missing_ok=True)


def run_job(job_args: list[str], output_dir: Path, consume_budget: str) -> dict:
    """(b): the job into ``output_dir`` (removed afterwards), consuming its shards if a budget is given."""
    extra = [f"output.dir={output_dir}"]
    consumer = None
    if consume_budget:
        extra += [f"output.disk_budget={consume_budget}", "output.rescan_s=0.5"]
        output_dir.mkdir(parents=True, exist_ok=True)
        consumer = ShardConsumer(output_dir)
        consumer.start()
    try:
        return run(load_config([*job_args, *extra]))
    finally:
        if consumer is not None:
            consumer.stopping.set()
            consumer.join()
        shutil.rmtree(output_dir, ignore_errors=True)


def measure(args: argparse.Namespace, work: Path) -> dict:
    model, load_format = build_model(args.shape, work)
    checkpoint = read_checkpoint_info(str(model))
    data = build_synthetic_dataset(
        work / "data.parquet", args.samples, vocab_size=checkpoint.vocab_size, min_len=args.tokens_per_sample,
        max_len=args.tokens_per_sample,
    )
    job_args = [
        f"model.path={model}", f"data.path={data}", f"model.device={args.device}", f"model.tp_size={args.tp_size}",
        f"model.load_format={load_format}", f"extract.max_tokens_per_batch={args.max_tokens_per_batch}",
        f"data.shard_size={args.shard_size}", "model.dtype=bfloat16", "output.min_free_bytes=1GB",
        f"extract.layers={benchmark_layer_ids(checkpoint.num_layers)}", *args.set,
    ]
    disk_bps = measure_disk(work, args.disk_probe_bytes)
    with ray_session(""):
        bare, extractor_alone = measure_extractor(
            job_args, data, args.max_tokens_per_batch, args.baseline_samples or args.samples
        )
        summary = run_job(job_args, work / "out", args.consume)
        in_memory = None
        if args.memory_dir:
            in_memory = run_job(job_args, Path(tempfile.mkdtemp(prefix="eagle3-bench-", dir=args.memory_dir)),
                                args.consume)
    job_tps = summary["tokens_per_second"]
    bytes_per_token = summary["bytes"] / summary["tokens"]
    writer_bps = summary["bytes"] / summary["seconds"]
    return {
        "shape": args.shape, "device": args.device, "tp_size": args.tp_size, "samples": args.samples,
        "tokens": summary["tokens"], "bytes": summary["bytes"], "writers": summary["writers"],
        "last_hidden_state": summary["last_hidden_state"],
        "layer_ids": summary["engine"]["layer_ids"], "sglang": summary["engine"]["sglang_version"],
        "bare_prefill_tokens_per_s": round(bare, 1), "job_tokens_per_s": job_tps,
        "extractor_alone_tokens_per_s": round(extractor_alone, 1),
        "extractor_alone_over_bare": round(extractor_alone / bare, 3), "job_over_bare": round(job_tps / bare, 3),
        "job_in_memory_tokens_per_s": in_memory["tokens_per_second"] if in_memory else None,
        "job_in_memory_over_bare": round(in_memory["tokens_per_second"] / bare, 3) if in_memory else None,
        "states_at_bare_speed_bytes_per_s": round(bare * bytes_per_token), "disk_probe_bytes": args.disk_probe_bytes,
        "disk_write_bytes_per_s": round(disk_bps), "writer_bytes_per_s": round(writer_bps),
        "writer_over_disk": round(writer_bps / disk_bps, 3), "startup_seconds": summary["startup_seconds"],
        "drain_seconds": summary["drain_seconds"],
        "extractor_busy_fraction": round(summary["extractor"]["busy_seconds"] / summary["seconds"], 3),
        "bytes_per_token": round(bytes_per_token, 1),
    }


def print_table(results: dict) -> None:
    states_bps, disk_bps = results["states_at_bare_speed_bytes_per_s"], results["disk_write_bytes_per_s"]
    rows = [
        ("(a) bare SGLang prefill", f"{results['bare_prefill_tokens_per_s']:,.0f} tok/s", ""),
        ("(a2) extractor alone (copy + object store)", f"{results['extractor_alone_tokens_per_s']:,.0f} tok/s",
         f"a2/a = {results['extractor_alone_over_bare']:.3f}"),
        ("(b) full job (Ray + Parquet, fsync)", f"{results['job_tokens_per_s']:,.0f} tok/s",
         f"b/a = {results['job_over_bare']:.3f}"),
        *([("(b2) full job, output.dir on tmpfs (no disk)", f"{results['job_in_memory_tokens_per_s']:,.0f} tok/s",
            f"b2/a = {results['job_in_memory_over_bare']:.3f}")] if results["job_in_memory_tokens_per_s"] else []),
        ("    states at (a)'s speed", f"{states_bps / 1e6:,.0f} MB/s",
         f"{results['bytes_per_token']:,.0f} B/token"),
        ("(c) disk sequential write (fsync)", f"{disk_bps / 1e6:,.0f} MB/s",
         f"{results['disk_probe_bytes'] / 1e9:.1f} GB written"),
        (f"    writer pool ({results['writers']} writers)", f"{results['writer_bytes_per_s'] / 1e6:,.0f} MB/s",
         f"writer/disk = {results['writer_over_disk']:.3f}"),
        ("    extractor busy during (b)", f"{100 * results['extractor_busy_fraction']:.1f} %",
         "forward start to states on the host"),
        ("    last file committed after the last write", f"{results['drain_seconds']:.1f} s", ""),
        ("    time to first batch (model load)", f"{results['startup_seconds']:.1f} s", ""),
    ]
    print(f"\n{results['shape']} on {results['device']} (TP={results['tp_size']}), SGLang {results['sglang']}, "
          f"layers {results['layer_ids']}{' + final state' if results['last_hidden_state'] else ''}, "
          f"{results['tokens']:,} tokens in {results['samples']} samples")
    for name, value, ratio in rows:
        print(f"  {name:<44} {value:>16}  {ratio}")
    if disk_bps < states_bps:
        print(f"  the disk ({disk_bps / 1e6:,.0f} MB/s) is slower than the states arrive "
              f"({states_bps / 1e6:,.0f} MB/s): the job runs at the disk's pace, "
              "the in-flight cap holds the extractor back")


if __name__ == "__main__":
    main()
