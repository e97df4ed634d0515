"""Throughput of the whole job against bare SGLang prefill, measured in one run on one machine.

  (a) bare prefill: the extractor's forward on the job's batches with capture off, nothing copied
  (a2) the extractor alone: capture forward, copy to host, put in Ray's object store (no writers)
  (b) the job: Ray, extractor actor, writer actors, Parquet on local disk (fsynced), tokens/s
      from the first batch to the last committed file
  (b2) optionally the same job with output.dir on a tmpfs: what the pipeline does without the disk
  (c) the disk's raw sequential write speed (write + fsync) and the writers' bytes/s
  (d) the pipeline's own capacity: the same job with the synthetic states source (no model; states
      of the shape's real layout copied from device memory through the same host copy), to the
      disk and, with --memory-dir, to a tmpfs; in GB/s of states
  --fp8 adds (b-fp8) on disk and (d-fp8) on the tmpfs (else the disk) with
      output.state_dtype=float8_e4m3fn, and the fp8 relative error of every stored layer against
      the model-dtype states of the same batches, measured on the device
  Every job row reports where its time went: the extractor's object-store puts and, summed over
  the writers, fetching from the object store, building the Arrow table, Parquet encode + write,
  sha256, fdatasync/fsync and commit.

    python -m benchmarks.throughput --shape tiny --device cpu          # CI smoke test
    python -m benchmarks.throughput --shape llama8b --device cuda      # on a GPU machine

`tiny` and `small` are saved random-weight checkpoints; `llama8b`, `deepseek_v3_reduced` and
`kimi_k25_reduced` (Kimi-K2.5's published layout with INT4 routed experts, 10 layers: one H200)
use SGLang's dummy weights built from a config.json alone (random per process and per TP layout),
see testbeds/shapes.py. Layers default to the job's [2, N//2, N-3] when that is valid for the
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

from extractor.checkpoint import read_checkpoint_info
from extractor.layers import check_layer_ids, default_layer_ids
from extractor.types import TokenBatch
from jobs.actors.extractor import start_extractor
from jobs.cluster.session import ray_session, resolve_device
from jobs.config import load_config
from jobs.extract import run
from jobs.inputs.dataset import open_tokenized_dataset
from jobs.inputs.demo import build_synthetic_dataset, build_tiny_model
from jobs.planning.engine import build_engine_spec
from jobs.planning.shards import pack_batches
from testbeds.shapes import SHAPES

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


FP8_ERROR_BATCHES = 4


def measure_extractor(job_args: list[str], data: Path, batches_of: int, samples: int,
                      fp8_error: bool) -> tuple[float, float, list[float]]:
    """tok/s of (a) bare prefill and (a2) the extractor alone (capture, host copy, object store),
    on the job's batches of its first ``samples`` samples; a warm-up batch of each is not counted.
    With ``fp8_error``, also the fp8 relative error per stored layer (mean over the first batches)."""
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
        ray.get(actor.extract.remote(TokenBatch.of(batches[0])))
        ray.get(actor.warm_object_store.remote(spec.host_buffers + 2))  # as the job does before its clock starts
        started = time.perf_counter()
        in_flight: list[ray.ObjectRef] = []
        for batch in batches:  # as the job feeds it: the next batch is queued while one is handed on
            in_flight.append(actor.extract.remote(TokenBatch.of(batch)))
            if len(in_flight) > spec.host_buffers:
                ray.get(in_flight.pop(0))
        ray.get(in_flight)
        alone = tokens / (time.perf_counter() - started)
        errors: list[float] = []
        if fp8_error:
            per_batch = [ray.get(actor.fp8_relative_errors.remote(batch)) for batch in batches[:FP8_ERROR_BATCHES]]
            errors = [float(np.mean(column)) for column in zip(*per_batch)]
        ray.get(actor.close.remote())
    finally:
        ray.kill(actor)
    return bare, alone, errors


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
    parser.add_argument("--fp8", action="store_true",
                        help="add the fp8 rows (output.state_dtype=float8_e4m3fn) and the per-layer fp8 error")
    parser.add_argument("--synthetic-tokens-per-s", type=float, default=0.0,
                        help="rate of the synthetic source in (d); 0: as fast as the host copy goes (capacity)")
    parser.add_argument("--capacity-only", action="store_true",
                        help="only the (d) rows: no model is loaded (any shape runs on CPU from its config.json)")
    parser.add_argument("--rows", default="",
                        help="comma-separated job rows to run (b,b2,b-fp8,d,d2,d-fp8,d2-fp8); default: all that apply. "
                             "Splits one shape's rows over several calls of a time-limited machine")
    parser.add_argument("--work-dir", default="", help="kept afterwards; default: a temp dir, removed")
    parser.add_argument("--out", default="", help="also write the results as JSON here")
    parser.add_argument("--set", nargs="*", default=[], help="extra job key=value overrides")
    args = parser.parse_args()
    unknown = set(args.rows.split(",")) - set(ROW_TITLES) if args.rows else set()
    if unknown:
        parser.error(f"--rows: unknown {sorted(unknown)}; known: {','.join(ROW_TITLES)}")
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


def tmpfs_dir(memory_dir: str) -> Path:
    return Path(tempfile.mkdtemp(prefix="eagle3-bench-", dir=memory_dir))


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
    fp8 = [*job_args, "output.state_dtype=float8_e4m3fn"]
    synthetic = ["model.engine=synthetic", f"model.synthetic_tokens_per_s={args.synthetic_tokens_per_s}"]
    # (row, job arguments, on tmpfs), in the order they run; fp8 adds the job on disk (where the
    # bytes it saves matter) and the pipeline's capacity where it is highest
    plan = [] if args.capacity_only else [("b", job_args, False), ("b2", job_args, True)]
    if args.fp8 and not args.capacity_only:
        plan.append(("b-fp8", fp8, False))
    plan += [("d", [*job_args, *synthetic], False), ("d2", [*job_args, *synthetic], True)]
    if args.fp8:
        plan.append(("d2-fp8", [*fp8, *synthetic], True) if args.memory_dir else ("d-fp8", [*fp8, *synthetic], False))
    if args.rows:
        plan = [step for step in plan if step[0] in args.rows.split(",")]
    results: dict = {"shape": args.shape, "device": args.device, "tp_size": args.tp_size, "samples": args.samples,
                     "disk_probe_bytes": args.disk_probe_bytes,
                     "disk_write_bytes_per_s": round(measure_disk(work, args.disk_probe_bytes))}
    rows: dict[str, dict] = {}
    bare = None
    with ray_session(""):
        if not args.capacity_only:
            bare, extractor_alone, fp8_errors = measure_extractor(
                job_args, data, args.max_tokens_per_batch, args.baseline_samples or args.samples, args.fp8
            )
            results.update(bare_prefill_tokens_per_s=round(bare, 1), extractor_alone_tokens_per_s=round(extractor_alone, 1),
                           extractor_alone_over_bare=round(extractor_alone / bare, 3))
        for name, arguments, in_memory in plan:
            if in_memory and not args.memory_dir:
                continue
            output_dir = tmpfs_dir(args.memory_dir) if in_memory else work / f"out-{name}"
            rows[name] = job_row(run_job(arguments, output_dir, args.consume), bare)
    first = next(iter(rows.values()))
    results.update({key: first[key] for key in ("tokens", "writers", "last_hidden_state", "layer_ids", "sglang")})
    results["rows"] = rows
    job = rows.get("b") or rows.get("b-fp8")
    if bare is not None and job is not None:
        results.update(
            bytes=job["bytes"], job_tokens_per_s=job["tokens_per_s"], job_over_bare=job["over_bare"],
            job_in_memory_tokens_per_s=rows["b2"]["tokens_per_s"] if "b2" in rows else None,
            job_in_memory_over_bare=rows["b2"]["over_bare"] if "b2" in rows else None,
            states_at_bare_speed_bytes_per_s=round(bare * job["bytes_per_token"]), bytes_per_token=job["bytes_per_token"],
            writer_bytes_per_s=job["bytes_per_s"],
            writer_over_disk=round(job["bytes_per_s"] / results["disk_write_bytes_per_s"], 3),
            startup_seconds=job["startup_seconds"], drain_seconds=job["drain_seconds"],
            extractor_busy_fraction=job["extractor_busy_fraction"],
            fp8_relative_error=dict(zip(error_names(job), fp8_errors)) if fp8_errors else None,
        )
    return results


def error_names(row: dict) -> list[str]:
    return [f"layer {k}" for k in row["layer_ids"]] + ([f"final ({row['last_hidden_state']})"]
                                                       if row["last_hidden_state"] != "none" else [])


def job_row(summary: dict, bare: float | None) -> dict:
    """One job run's rates and where its time went."""
    seconds = summary["seconds"]
    stages = {"put": summary["extractor"]["hand_on_seconds"], **summary["writer_seconds"].get("wall", {})}
    return {
        "tokens": summary["tokens"], "bytes": summary["bytes"], "seconds": seconds,
        "tokens_per_s": summary["tokens_per_second"],
        "over_bare": round(summary["tokens_per_second"] / bare, 3) if bare else None,
        "bytes_per_s": round(summary["bytes"] / seconds), "bytes_per_token": round(summary["bytes"] / summary["tokens"], 1),
        "writers": summary["writers"], "last_hidden_state": summary["last_hidden_state"],
        "state_dtype": summary["state_dtype"], "layer_ids": summary["engine"]["layer_ids"],
        "sglang": summary["engine"]["sglang_version"], "startup_seconds": summary["startup_seconds"],
        "drain_seconds": summary["drain_seconds"],
        "extractor_busy_fraction": round(summary["extractor"]["busy_seconds"] / seconds, 3),
        "stage_seconds": {stage: round(value, 3) for stage, value in stages.items()},
        "stage_cpu_seconds": summary["writer_seconds"].get("cpu", {}),
    }


ROW_TITLES = {
    "b": "(b) full job (Ray + Parquet, fsync)",
    "b2": "(b2) full job, output.dir on tmpfs (no disk)",
    "b-fp8": "(b-fp8) full job, fp8 states",
    "d": "(d) pipeline capacity, synthetic states, disk",
    "d2": "(d) pipeline capacity, synthetic states, tmpfs",
    "d-fp8": "(d-fp8) pipeline capacity, fp8, disk",
    "d2-fp8": "(d-fp8) pipeline capacity, fp8, tmpfs",
}


def format_rate(bytes_per_s: float) -> str:
    return f"{bytes_per_s / 1e9:.2f} GB/s" if bytes_per_s >= 1e9 else f"{bytes_per_s / 1e6:.0f} MB/s"


def stage_lines(row: dict) -> list[str]:
    """Where the row's time went: wall seconds per stage (the extractor's puts, then summed over the
    writers: waiting for the extractor, fetching from the object store, stages of ``ShardWriter``)
    with how busy the writers' main threads were, and the writers' CPU seconds per GB of states."""
    wall = " | ".join(f"{stage} {seconds:.2f}" for stage, seconds in row["stage_seconds"].items())
    main = sum(v for k, v in row["stage_seconds"].items() if k in ("fetch", "encode", "write", "commit"))
    gigabytes = row["bytes"] / 1e9
    cpu = " | ".join(f"{stage} {seconds / gigabytes:.3f}" for stage, seconds in row["stage_cpu_seconds"].items()
                     if stage != "wait")
    return [
        f"      wall s: {wall}; writers' main threads busy {100 * main / (row['writers'] * row['seconds']):.0f}% "
        f"of {row['writers']} x {row['seconds']:.1f} s",
        f"      writers' CPU s per GB: {cpu}",
    ]


def print_table(results: dict) -> None:
    disk_bps = results["disk_write_bytes_per_s"]

    def line(name: str, value: str, note: str = "") -> None:
        print(f"  {name:<48} {value:>16}  {note}")

    final = results["last_hidden_state"]
    print(f"\n{results['shape']} on {results['device']} (TP={results['tp_size']}), SGLang {results['sglang']}, "
          f"layers {results['layer_ids']}{'' if final == 'none' else f' + final state ({final})'}, "
          f"{results['tokens']:,} tokens in {results['samples']} samples")
    if "bare_prefill_tokens_per_s" in results:
        line("(a) bare SGLang prefill", f"{results['bare_prefill_tokens_per_s']:,.0f} tok/s")
        line("(a2) extractor alone (copy + object store)", f"{results['extractor_alone_tokens_per_s']:,.0f} tok/s",
             f"a2/a = {results['extractor_alone_over_bare']:.3f}")
    for name, row in results["rows"].items():
        rates = f"{format_rate(row['bytes_per_s'])}, {row['bytes_per_token']:,.0f} B/token"
        if name.startswith("b"):
            line(ROW_TITLES[name], f"{row['tokens_per_s']:,.0f} tok/s",
                 f"{name.split('-')[0]}/a = {row['over_bare']:.3f}, {rates}")
        else:
            line(ROW_TITLES[name], format_rate(row["bytes_per_s"]), f"{row['tokens_per_s']:,.0f} tok/s, "
                 f"{row['bytes_per_token']:,.0f} B/token")
        print("\n".join(stage_lines(row)))
    line("(c) disk sequential write (fsync)", format_rate(disk_bps), f"{results['disk_probe_bytes'] / 1e9:.1f} GB written")
    if "states_at_bare_speed_bytes_per_s" not in results:
        return
    states_bps = results["states_at_bare_speed_bytes_per_s"]
    line("    states at (a)'s speed", format_rate(states_bps), f"{results['bytes_per_token']:,.0f} B/token")
    line(f"    writer pool in (b) ({results['writers']} writers)", format_rate(results["writer_bytes_per_s"]),
         f"writer/disk = {results['writer_over_disk']:.3f}")
    line("    extractor busy during (b)", f"{100 * results['extractor_busy_fraction']:.1f} %",
         "forward start to states on the host")
    line("    last file committed after the last write", f"{results['drain_seconds']:.1f} s")
    line("    time to first batch (model load)", f"{results['startup_seconds']:.1f} s")
    if results["fp8_relative_error"]:
        errors = ", ".join(f"{name} {100 * error:.2f}%" for name, error in results["fp8_relative_error"].items())
        print(f"  fp8 relative error ||x_fp8 - x|| / ||x|| on the device, first {FP8_ERROR_BATCHES} batches: {errors}")
    if disk_bps < states_bps:
        print(f"  the disk ({format_rate(disk_bps)}) is slower than the states arrive ({format_rate(states_bps)}): "
              "the job runs at the disk's pace, the in-flight cap holds the extractor back")


if __name__ == "__main__":
    main()
