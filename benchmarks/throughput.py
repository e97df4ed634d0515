"""Throughput of the whole job against bare SGLang prefill, and where its time goes, in one run on one machine.

Rows, in this order, on one warm extractor where the engine settings allow: (a) bare prefill, (a2) the
extractor alone, (b) the job to local disk, (b2...) the same job to a tmpfs (``--memory-dir``) with
variants, (c) the disk's raw write speed, (d) the pipeline's own capacity with the synthetic states
source; ``--fp8`` adds fp8 rows, ``--rows`` picks the job rows. Then where each row's time went: the
extractor's side in seconds per million tokens, the writers' CPU seconds per GB of states, by stage.

    python -m benchmarks.throughput --shape tiny --device cpu          # CI smoke test
    python -m benchmarks.throughput --shape llama8b --device cuda --memory-dir /dev/shm --consume 16GB \
        --rows b2,b2-shared                                            # on a GPU machine

What each row and stage measures, the shapes, and how to run it on a GPU machine: docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import logging
import os
import shutil
import subprocess
import tempfile
import threading
import time
import unittest.mock
from pathlib import Path
from typing import Any, Callable, Iterator, Optional

import numpy as np
import ray

from benchmarks.workdir import work_dir, write_results
from extractor.checkpoint import read_checkpoint_info
from extractor.config import SGLangModelConfig
from extractor.layers import check_layer_ids, default_layer_ids
from extractor.types import CaptureActivity, EngineSpec, TokenBatch
from inputs.dataset import open_tokenized_dataset
from inputs.demo import build_synthetic_dataset, build_tiny_model
from jobs.actors.extractor import ExtractorHost, start_extractor
from jobs.config import load_config
from jobs.driver import startup
from jobs.extract import run
from jobs.planning.engine import build_engine_spec
from jobs.planning.shards import pack_batches
from runtime.cluster.session import ray_session, resolve_device
from storage.consumed import consume_shard
from testbeds.shapes import SHAPES, weight_bytes

logger = logging.getLogger("benchmarks.throughput")

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


def gpu_memory_bytes() -> Optional[int]:
    """The first GPU's memory as ``nvidia-smi`` gives it (without starting CUDA here); None without one."""
    try:
        mib = subprocess.run(["nvidia-smi", "--query-gpu=memory.total", "--format=csv,noheader,nounits", "-i", "0"],
                             capture_output=True, text=True, check=True, timeout=30).stdout
        return int(mib.strip()) << 20
    except (OSError, subprocess.SubprocessError, ValueError):
        return None


def refuse_shape_too_large(shape: str, model: SGLangModelConfig, gpu_bytes: Optional[int]) -> None:
    """Stop before loading a shape whose weights cannot fit what SGLang may fill (mem_fraction_static of each of
    tp_size GPUs), which would otherwise end its load a minute or more later in CUDA out of memory."""
    if shape not in SHAPES or model.device == "cpu" or gpu_bytes is None:
        return
    per_gpu = weight_bytes(SHAPES[shape]) / model.tp_size
    if per_gpu > model.mem_fraction_static * gpu_bytes:
        raise SystemExit(
            f"--shape {shape}: ~{per_gpu / 1e9:.0f} GB of weights per GPU at TP={model.tp_size}, more than "
            f"mem_fraction_static {model.mem_fraction_static} of this GPU's {gpu_bytes / 1e9:.0f} GB; run it on GPUs "
            f"of at least {per_gpu / model.mem_fraction_static / 1e9:.0f} GB (one H200 has 141) or over more of them "
            "(model.tp_size)")


def benchmark_layer_ids(num_layers: int) -> list[int]:
    """The job's default layers when valid for this depth, else the first three capturable ones
    (from 1: on deepseek_v2 layer 0's output cannot be named by a drafter config)."""
    try:
        return check_layer_ids(default_layer_ids(num_layers), num_layers)
    except ValueError:
        return check_layer_ids(list(range(1, num_layers - 1))[:3], num_layers)


def benchmark_job_args(args: argparse.Namespace, model: Path, load_format: str, data: Path, num_layers: int) -> list[str]:
    """The job's keys every benchmark run of ``model`` over ``data`` shares (``--set`` last: it wins)."""
    return [
        f"model.path={model}", f"data.path={data}", f"model.device={args.device}", f"model.tp_size={args.tp_size}",
        f"model.load_format={load_format}", f"extract.max_tokens_per_batch={args.max_tokens_per_batch}",
        f"data.shard_size={args.shard_size}", "model.dtype=bfloat16", "output.min_free=1GB",
        f"extract.layers={benchmark_layer_ids(num_layers)}", *args.set,
    ]


FP8_ERROR_BATCHES = 4
ROW_TOKENS_ON_CUDA = 2_000_000
"""--samples 0 on CUDA: rows long enough that ramp-up and drain (about two batches) are under 1% of them."""
FP8 = ["output.state_dtype=float8_e4m3fn"]
SYNTHETIC = ["model.engine=synthetic"]


@dataclasses.dataclass(frozen=True)
class Row:
    title: str
    overrides: tuple[str, ...] = ()
    """Job keys beyond the shape's (the synthetic rows' rate is added where they run)."""
    in_memory: bool = False
    """output.dir on --memory-dir (a tmpfs) instead of the disk."""


ROWS = {
    "b": Row("(b) full job (Ray + Parquet, fsync)"),
    "b2": Row("(b2) full job, output.dir on tmpfs (no disk)", (), True),
    "b2-shared": Row("(b2-shared) as b2, writers on the extractor's cores", ("output.writer_cpus=all",), True),
    "b2-sha256": Row("(b2-sha256) as b2, output.checksum=sha256", ("output.checksum=sha256",), True),
    "b2-whole": Row("(b2-whole) as b2, the host copy of a batch at once", ("extract.copy_piece_mb=0",), True),
    "b2-kernel": Row("(b2-kernel) as b2, the host copy by a kernel", ("extract.copy_by=kernel",), True),
    **{f"b2-piece{mb}": Row(f"(b2-piece{mb}) as b2, the host copy in {mb} MB pieces", (f"extract.copy_piece_mb={mb}",),
                            True) for mb in (1, 16)},
    "b-fp8": Row("(b-fp8) full job, fp8 states", tuple(FP8)),
    "b2-fp8": Row("(b2-fp8) full job, fp8 states, tmpfs", tuple(FP8), True),
    "d": Row("(d) pipeline capacity, synthetic states, disk", tuple(SYNTHETIC)),
    "d2": Row("(d) pipeline capacity, synthetic states, tmpfs", tuple(SYNTHETIC), True),
    "d-fp8": Row("(d-fp8) pipeline capacity, fp8, disk", tuple(SYNTHETIC + FP8)),
    "d2-fp8": Row("(d-fp8) pipeline capacity, fp8, tmpfs", tuple(SYNTHETIC + FP8), True),
}
"""In the order they run: the model's rows on one warm extractor, then fp8's, then the synthetic source's."""


def default_rows(args: argparse.Namespace) -> list[str]:
    """What a run without --rows measures: as many rows as apply to the options given."""
    rows = [] if args.capacity_only else ["b"] + (["b2"] if args.memory_dir else []) + (["b-fp8"] if args.fp8 else [])
    rows += ["d"] + (["d2"] if args.memory_dir else [])
    if args.fp8:
        rows.append("d2-fp8" if args.memory_dir else "d-fp8")
    return rows


class WarmExtractor:
    """One extractor actor, kept across the benchmark's rows while their engine settings are the same: a model
    loads (and compiles its kernels) once, not once per row. A row with other settings replaces it (the GPU
    holds one model at a time)."""

    def __init__(self) -> None:
        self.spec: Optional[EngineSpec] = None
        self.actor: Any = None
        self.starts = 0

    def for_spec(self, spec: EngineSpec) -> Any:
        if spec != self.spec:
            self.close()
            self.actor = start_extractor(spec)
            self.starts += 1
            ray.get(self.actor.info.remote())
            self.spec = spec
        return self.actor

    def close(self) -> None:
        if self.actor is not None:
            with contextlib.suppress(Exception):
                ray.get(self.actor.close.remote(), timeout=60)
            ray.kill(self.actor)
        self.actor, self.spec = None, None


@contextlib.contextmanager
def jobs_on(warm: WarmExtractor) -> Iterator[None]:
    """Jobs run in the body take their extractor from ``warm`` (and leave it running), and report what it did
    during the job alone."""

    class WarmHost(ExtractorHost):
        def launch(self) -> None:
            self._started = time.perf_counter()
            self.actor = warm.for_spec(self.spec)
            self._before = ray.get(self.actor.activity.remote())

        def stop(self, collect_stats: bool = True) -> CaptureActivity:
            after = ray.get(self.actor.activity.remote()) if collect_stats else self._before
            return activity_between(self._before, after)

    with unittest.mock.patch.object(startup, "ExtractorHost", WarmHost):
        yield


def activity_between(before: CaptureActivity, after: CaptureActivity) -> CaptureActivity:
    """What the extractor did between two snapshots of its (cumulative) activity."""
    stages = {clock: {stage: seconds - before.stage_seconds.get(clock, {}).get(stage, 0.0)
                      for stage, seconds in values.items()} for clock, values in after.stage_seconds.items()}
    return CaptureActivity(
        batches=after.batches - before.batches, tokens=after.tokens - before.tokens,
        busy_seconds=after.busy_seconds - before.busy_seconds,
        hand_on_seconds=after.hand_on_seconds - before.hand_on_seconds, stage_seconds=stages,
        process_cpu_seconds=after.process_cpu_seconds - before.process_cpu_seconds,
    )


def measure_extractor(warm: WarmExtractor, job_args: list[str], data: Path, samples: int,
                      fp8_error: bool) -> dict:
    """(a) bare prefill and (a2) the extractor alone (capture, host copy, object store), on the job's batches
    of its first ``samples`` samples, each with where its time went; a warm-up batch of each is not counted.
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
    actor = warm.for_spec(spec)
    batches = [dataset.rows(a, b)[0]
               for a, b in pack_batches(lengths, config.extract.max_tokens_per_batch, config.extract.max_samples_per_batch)]
    ray.get(actor.bare_prefill.remote(batches[0]))  # warm-up: JIT kernels, allocator
    before = ray.get(actor.activity.remote())
    started = time.perf_counter()
    bare = tokens / sum(ray.get(actor.bare_prefill.remote(batch)) for batch in batches)
    bare_wall = time.perf_counter() - started
    after_bare = ray.get(actor.activity.remote())
    ray.get(actor.extract.remote(TokenBatch.of(batches[0])))
    ray.get(actor.warm_object_store.remote(spec.host_buffers + 2))  # as the job does before its clock starts
    before_alone = ray.get(actor.activity.remote())
    started = time.perf_counter()
    in_flight: list[ray.ObjectRef] = []
    first_done: Optional[float] = None
    for batch in batches:  # as the job feeds it: the next batch is queued while one is handed on
        in_flight.append(actor.extract.remote(TokenBatch.of(batch)))
        if len(in_flight) > spec.host_buffers:
            ray.get(in_flight.pop(0))
            first_done = first_done or time.perf_counter()
    ray.get(in_flight)
    ended = time.perf_counter()
    alone_seconds = ended - started
    # the steady state as the job's: from the first batch done to the last, the first batch's tokens left out
    steady = ((tokens - sum(len(ids) for ids in batches[0])) / (ended - first_done)
              if first_done is not None and ended > first_done else None)
    results = {
        "tokens": tokens, "bare_prefill_tokens_per_s": round(bare, 1),
        "extractor_alone_tokens_per_s": round(tokens / alone_seconds, 1),
        "extractor_alone_over_bare": round(tokens / alone_seconds / bare, 3),
        "extractor_alone_steady_over_bare": round(steady / bare, 3) if steady else None,
        "a_time": time_report(activity_between(before, after_bare), tokens, bare_wall, tokens / bare),
        "a2_time": time_report(activity_between(before_alone, ray.get(actor.activity.remote())), tokens, alone_seconds),
    }
    if fp8_error:
        per_batch = [ray.get(actor.fp8_relative_errors.remote(batch)) for batch in batches[:FP8_ERROR_BATCHES]]
        results["fp8_errors"] = [float(np.mean(column)) for column in zip(*per_batch)]
    return results


def time_report(activity: CaptureActivity, tokens: int, wall: float, counted: Optional[float] = None) -> dict:
    """Where a row's time went, in seconds per million tokens: ``counted`` is the row's own measure of its time
    (bare prefill: the sum of its forwards) when it is not its wall time."""
    per = 1e6 / max(tokens, 1)
    stages = {clock: {stage: seconds for stage, seconds in values.items() if seconds > 0}
              for clock, values in activity.stage_seconds.items()}
    report = {"seconds_per_mtok": round((counted or wall) * per, 3), "extractor_tokens": activity.tokens}
    forward_thread = [stage for stage in ("prepare", "forward", "capture", "sync") if stage in stages.get("wall", {})]
    if forward_thread:  # the synthetic source has none
        for clock in ("cpu", "wall"):
            report[f"forward_thread_{clock}"] = round(sum(stages[clock].get(s, 0.0) for s in forward_thread) * per, 3)
    report.update({f"{clock}_{stage}": round(seconds * per, 3) for clock, values in stages.items()
                   for stage, seconds in values.items()})
    if activity.process_cpu_seconds > 0:  # measured over capture batches, not bare prefill
        report["extractor_process_cpu"] = round(activity.process_cpu_seconds * per, 3)
    return report


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", choices=["tiny", "small", *SHAPES], default="tiny")
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--tp-size", type=int, default=1)
    parser.add_argument("--samples", type=int, default=0,
                        help=f"samples per row; 0: {ROW_TOKENS_ON_CUDA:,} tokens' worth on CUDA, 32 on CPU")
    parser.add_argument("--tokens-per-sample", type=int, default=2048)
    parser.add_argument("--max-tokens-per-batch", type=int, default=16384)
    parser.add_argument("--shard-size", type=int, default=16, help="samples per shard file")
    parser.add_argument("--disk-probe-bytes", type=int, default=8 << 30,
                        help="large enough that a device write cache cannot hide the sustained speed; 0: no probe")
    parser.add_argument("--memory-dir", default="",
                        help="tmpfs (e.g. /dev/shm) for the rows without the disk (b2..., d2...)")
    parser.add_argument("--baseline-samples", type=int, default=0,
                        help="(a) and (a2) on the first this many samples (0: as many as the job rows)")
    parser.add_argument("--consume", default="", metavar="BUDGET",
                        help="delete shards once committed and cap output.disk_budget at BUDGET (e.g. 16GB): "
                             "runs longer than the disk (or the tmpfs) holds, with the budget's backpressure at work")
    parser.add_argument("--fp8", action="store_true",
                        help="add the fp8 rows (output.state_dtype=float8_e4m3fn) and the per-layer fp8 error")
    parser.add_argument("--synthetic-tokens-per-s", type=float, default=0.0,
                        help="rate of the synthetic source in (d); 0: as fast as the host copy goes (capacity)")
    parser.add_argument("--capacity-only", action="store_true",
                        help="only the (d) rows: no model is loaded (any shape runs on CPU from its config.json)")
    parser.add_argument("--rows", default="", help=f"comma-separated job rows, run in this order: {','.join(ROWS)}; "
                                                   "default: b, b2 with --memory-dir, b-fp8 with --fp8, the (d) rows")
    parser.add_argument("--work-dir", default="", help="kept afterwards; default: a temp dir, removed")
    parser.add_argument("--out", default="", help="also write the results as JSON here")
    parser.add_argument("--set", nargs="*", default=[], help="extra job key=value overrides")
    args = parser.parse_args()
    unknown = set(args.rows.split(",")) - set(ROWS) if args.rows else set()
    if unknown:
        parser.error(f"--rows: unknown {sorted(unknown)}; known: {','.join(ROWS)}")
    rows = [name for name in ROWS if name in (args.rows.split(",") if args.rows else default_rows(args))]
    if any(ROWS[name].in_memory for name in rows) and not args.memory_dir:
        parser.error(f"--rows {args.rows}: rows on a tmpfs need --memory-dir")
    if not args.samples:
        args.samples = -(-ROW_TOKENS_ON_CUDA // args.tokens_per_sample) if args.device == "cuda" else 32
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")

    with work_dir(args.work_dir, "eagle3-bench-") as work:
        results = measure(args, rows, work)
    print_table(results)
    write_results(results, args.out)
    if failed := sorted(set(results["rows"]) - set(measured_rows(results))):
        raise SystemExit(f"rows failed: {', '.join(failed)} (their errors above; the other rows' numbers stand)")


class ShardConsumer(threading.Thread):
    """Consumes shard files as they are committed, as a trainer would: declared consumed, then deleted
    (``storage.consumed``; a file deleted without a declaration is lost, and the job writes it again).

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
                consume_shard(path, "benchmarks.throughput --consume")


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


def measure(args: argparse.Namespace, rows: list[str], work: Path) -> dict:
    model, load_format = build_model(args.shape, work)
    checkpoint = read_checkpoint_info(str(model))
    data = build_synthetic_dataset(
        work / "data.parquet", args.samples, vocab_size=checkpoint.vocab_size, min_len=args.tokens_per_sample,
        max_len=args.tokens_per_sample,
    )
    job_args = benchmark_job_args(args, model, load_format, data, checkpoint.num_layers)
    if not args.capacity_only:
        refuse_shape_too_large(args.shape, load_config(job_args).model, gpu_memory_bytes())
    results: dict = {"shape": args.shape, "device": args.device, "tp_size": args.tp_size, "samples": args.samples,
                     "set": list(args.set),
                     "cpus": len(os.sched_getaffinity(0)), "disk_probe_bytes": args.disk_probe_bytes,
                     "disk_write_bytes_per_s": round(measure_disk(work, args.disk_probe_bytes)) if args.disk_probe_bytes else None}
    measured: dict[str, dict] = {}
    warm = WarmExtractor()
    with ray_session(""):
        try:
            if not args.capacity_only:
                results.update(measure_extractor(warm, job_args, data, args.baseline_samples or args.samples, args.fp8))
            bare = results.get("bare_prefill_tokens_per_s")

            def measure_row(name: str) -> dict:
                row = ROWS[name]
                synthetic = ([f"model.synthetic_tokens_per_s={args.synthetic_tokens_per_s}"]
                             if SYNTHETIC[0] in row.overrides else [])
                output_dir = tmpfs_dir(args.memory_dir) if row.in_memory else work / f"out-{name}"
                return job_row(run_job([*job_args, *row.overrides, *synthetic], output_dir, args.consume), bare)

            with jobs_on(warm):
                measured = run_rows(rows, measure_row, after_failure=warm.close)
        finally:
            warm.close()
    results["rows"] = measured
    results["extractor_starts"] = warm.starts
    results.update(headline(results))
    return results


def run_rows(rows: list[str], measure_row: Callable[[str], dict], after_failure: Callable[[], None]) -> dict[str, dict]:
    """Each row measured in turn. A row that fails is recorded with its error (``{"failed": ...}``) and the rows after
    it still run, after ``after_failure`` (the warm extractor goes: the failure may have been its): a row on a path
    new to the device costs that row, not the call's other numbers."""
    measured: dict[str, dict] = {}
    for name in rows:
        try:
            measured[name] = measure_row(name)
        except Exception as error:
            logger.exception("row %s failed; the next rows still run", name)
            measured[name] = {"failed": f"{type(error).__name__}: {error}"}
            after_failure()
    return measured


def measured_rows(results: dict) -> dict[str, dict]:
    """The rows that ran to their end."""
    return {name: row for name, row in results["rows"].items() if "failed" not in row}


def headline(results: dict) -> dict:
    """The figures the result table leads with: the run's shape and the first job row against (a)."""
    rows = measured_rows(results)
    first = next(iter(rows.values()), None)
    if first is None:
        return {}
    figures = {key: first[key] for key in ("writers", "last_hidden_state", "layer_ids", "sglang")}
    figures["tokens"] = first["tokens"]
    job = rows.get("b") or rows.get("b2") or rows.get("b-fp8")
    bare = results.get("bare_prefill_tokens_per_s")
    if bare is None or job is None:
        return figures
    errors = results.get("fp8_errors")
    return {
        **figures, "bytes": job["bytes"], "job_tokens_per_s": job["tokens_per_s"], "job_over_bare": job["over_bare"],
        "states_at_bare_speed_bytes_per_s": round(bare * job["bytes_per_token"]), "bytes_per_token": job["bytes_per_token"],
        "writer_bytes_per_s": job["bytes_per_s"],
        "writer_over_disk": round(job["bytes_per_s"] / disk, 3) if (disk := results["disk_write_bytes_per_s"]) else None,
        "startup_seconds": job["startup_seconds"], "drain_seconds": job["drain_seconds"],
        "extractor_busy_fraction": job["extractor_busy_fraction"],
        "fp8_relative_error": dict(zip(error_names(job), errors)) if errors else None,
    }


def error_names(row: dict) -> list[str]:
    return [f"layer {k}" for k in row["layer_ids"]] + ([f"final ({row['last_hidden_state']})"]
                                                       if row["last_hidden_state"] != "none" else [])


def job_row(summary: dict, bare: float | None) -> dict:
    """One job run's rates and where its time went."""
    seconds = summary["seconds"]
    extractor = summary["extractor"]
    stages = {"put": extractor["hand_on_seconds"], **summary["writer_seconds"].get("wall", {})}
    activity = CaptureActivity(**extractor)
    return {
        "tokens": summary["tokens"], "bytes": summary["bytes"], "seconds": seconds,
        "tokens_per_s": summary["tokens_per_second"],
        "over_bare": round(summary["tokens_per_second"] / bare, 3) if bare else None,
        "steady_tokens_per_s": (steady := summary["steady_tokens_per_second"]),
        "steady_over_bare": round(steady / bare, 3) if bare and steady else None,
        "first_batch_seconds": summary["first_batch_seconds"],
        "bytes_per_s": round(summary["bytes"] / seconds), "bytes_per_token": round(summary["bytes"] / summary["tokens"], 1),
        "writers": summary["writers"], "writer_cpus": sorted({n["writer_cpus"] for n in summary["nodes"].values()}),
        "last_hidden_state": summary["last_hidden_state"],
        "state_dtype": summary["state_dtype"], "layer_ids": summary["engine"]["layer_ids"],
        "sglang": summary["engine"]["sglang_version"], "startup_seconds": summary["startup_seconds"],
        "drain_seconds": summary["drain_seconds"], "extracted_again": summary["this_run"]["shards_selected"] - summary["plan"]["shards"],
        "extractor_busy_fraction": round(extractor["busy_seconds"] / seconds, 3),
        "stage_seconds": {stage: round(value, 3) for stage, value in stages.items()},
        "stage_cpu_seconds": summary["writer_seconds"].get("cpu", {}),
        "time": time_report(activity, summary["tokens"], seconds),
    }


def format_rate(bytes_per_s: float) -> str:
    return f"{bytes_per_s / 1e9:.2f} GB/s" if bytes_per_s >= 1e9 else f"{bytes_per_s / 1e6:.0f} MB/s"


EXTRACTOR_COLUMNS = (
    ("time", "seconds_per_mtok"), ("thread cpu", "forward_thread_cpu"), ("thread wall", "forward_thread_wall"),
    ("prepare", "cpu_prepare"), ("launch", "cpu_forward"), ("capture", "cpu_capture"),
    ("dev fwd", "device_forward"), ("dev capture", "device_capture"), ("dev copy", "device_copy"),
    ("copy wait", "wall_copy_wait"), ("put", "wall_hand_on"), ("put cpu", "cpu_hand_on"),
    ("process cpu", "extractor_process_cpu"),
)
"""The extractor's side of each row, seconds per million tokens: the row's time; the forward thread's CPU and wall
under the forward lock, and its CPU per stage; device time per span; waiting for the copy; the put (wall, CPU)."""
WRITER_STAGES = ("fetch", "encode", "write", "hash", "sync", "commit")


def extractor_lines(results: dict) -> list[str]:
    timed = [("a", results.get("a_time")), ("a2", results.get("a2_time"))]
    timed += [(name, row["time"]) for name, row in measured_rows(results).items()]
    header = f"  {'row':<10}" + "".join(f"{title:>12}" for title, _ in EXTRACTOR_COLUMNS)
    lines = ["  where the extractor's time goes, seconds per million tokens (thread: the forward thread under its lock; "
             "dev: CUDA events)", header]
    for name, time_report in timed:
        if time_report:
            cells = "".join(f"{time_report[key]:>12.3f}" if key in time_report else f"{'-':>12}"
                            for _, key in EXTRACTOR_COLUMNS)
            lines.append(f"  {name:<10}{cells}")
    return lines


def writer_lines(results: dict) -> list[str]:
    """The writers' CPU seconds per GB of states by stage, and how busy their main threads were."""
    lines = ["  the writers' CPU seconds per GB of states (main threads busy: wall of fetch..commit over writers x run)",
             f"  {'row':<10}" + "".join(f"{stage:>9}" for stage in WRITER_STAGES) + f"{'total':>9}{'busy':>7}  cores"]
    for name, row in measured_rows(results).items():
        gigabytes = row["bytes"] / 1e9
        cpu = row["stage_cpu_seconds"]
        main = sum(v for k, v in row["stage_seconds"].items() if k in ("fetch", "encode", "write", "commit"))
        busy = 100 * main / (row["writers"] * row["seconds"])
        cells = "".join(f"{cpu.get(stage, 0.0) / gigabytes:>9.3f}" for stage in WRITER_STAGES)
        total = sum(cpu.get(stage, 0.0) for stage in WRITER_STAGES) / gigabytes
        lines.append(f"  {name:<10}{cells}{total:>9.3f}{busy:>6.0f}%  {'; '.join(row['writer_cpus'])}")
    return lines


def _steady(over_bare: Optional[float]) -> str:
    """The steady state's ratio beside a whole row's: the pipeline full, its first batch and drain left out."""
    return f" (steady {over_bare:.3f})" if over_bare else ""


def print_table(results: dict) -> None:
    def line(name: str, value: str, note: str = "") -> None:
        print(f"  {name:<52} {value:>16}  {note}")

    rows = results["rows"]
    final = results.get("last_hidden_state", "none")
    print(f"\n{results['shape']} on {results['device']} (TP={results['tp_size']}), SGLang {results.get('sglang', '?')}, "
          f"layers {results.get('layer_ids')}{'' if final == 'none' else f' + final state ({final})'}, "
          f"{results.get('tokens', 0):,} tokens in {results['samples']} samples per row, {results['cpus']} CPUs")
    if results.get("set"):
        print(f"  settings: {' '.join(results['set'])}")
    if "bare_prefill_tokens_per_s" in results:
        line("(a) bare SGLang prefill", f"{results['bare_prefill_tokens_per_s']:,.0f} tok/s")
        line("(a2) extractor alone (copy + object store)", f"{results['extractor_alone_tokens_per_s']:,.0f} tok/s",
             f"a2/a = {results['extractor_alone_over_bare']:.3f}{_steady(results.get('extractor_alone_steady_over_bare'))}")
    for name, row in rows.items():
        if "failed" in row:
            line(ROWS[name].title, "FAILED", row["failed"][:300])
            continue
        rates = f"{format_rate(row['bytes_per_s'])}, {row['bytes_per_token']:,.0f} B/token, {row['writers']} writers"
        if name.startswith("b"):
            line(ROWS[name].title, f"{row['tokens_per_s']:,.0f} tok/s",
                 f"{name}/a = {row['over_bare']}{_steady(row.get('steady_over_bare'))}, {rates}")
        else:
            line(ROWS[name].title, format_rate(row["bytes_per_s"]), f"{row['tokens_per_s']:,.0f} tok/s, {rates}")
    disk_bps = results["disk_write_bytes_per_s"]
    if disk_bps:
        line("(c) disk sequential write (fsync)", format_rate(disk_bps), f"{results['disk_probe_bytes'] / 1e9:.1f} GB written")
    if "states_at_bare_speed_bytes_per_s" in results:
        states_bps = results["states_at_bare_speed_bytes_per_s"]
        line("    states at (a)'s speed", format_rate(states_bps), f"{results['bytes_per_token']:,.0f} B/token")
        line("    extractor busy in the first job row", f"{100 * results['extractor_busy_fraction']:.1f} %",
             f"forward start to states on the host; drain {results['drain_seconds']:.1f} s, "
             f"start-up {results['startup_seconds']:.1f} s")
        if results["fp8_relative_error"]:
            errors = ", ".join(f"{name} {100 * error:.2f}%" for name, error in results["fp8_relative_error"].items())
            print(f"  fp8 relative error ||x_fp8 - x|| / ||x|| on the device, first {FP8_ERROR_BATCHES} batches: {errors}")
        if disk_bps and disk_bps < states_bps and any(not ROWS[name].in_memory for name in rows):
            print(f"  the disk ({format_rate(disk_bps)}) is slower than the states arrive ({format_rate(states_bps)}): "
                  "rows on it run at its pace, the in-flight cap holds the extractor back")
    print("\n".join(extractor_lines(results)))
    if measured_rows(results):
        print("\n".join(writer_lines(results)))


if __name__ == "__main__":
    main()
