"""The driver's own work at a million samples: open and check the input, plan, read rows, record the manifest.

No model runs here: every step is what the driver does per run, per shard or per batch, on a real
Parquet file of synthetic token ids (random lengths around --mean-tokens). The steps (``open``, ``plan``,
``rows``, ``manifest``, ``schedule``: the whole job with the synthetic states source, its CPU time the
driver's) are functions of a shared context, run in order (``STEPS``); what each measures: docs/benchmarks.md.

    python -m benchmarks.driver_scale --rows 1000000 --shards 10000 --mean-tokens 8 --max-samples-per-batch 32
    python -m benchmarks.driver_scale --rows 5000 --shards 50 --mean-tokens 8        # CI smoke test

``--profile FILE`` runs the schedule step's full run under cProfile (slower) and prints where the
driver's Python time goes.
"""

from __future__ import annotations

import argparse
import cProfile
import dataclasses
import json
import logging
import pickle
import pstats
import resource
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

import numpy as np
import psutil
import pyarrow as pa
import pyarrow.parquet as pq

from inputs.dataset import TokenizedDataset, open_tokenized_dataset
from jobs.config import load_config
from jobs.extract import run
from jobs.outdir.budget import DiskBudget
from jobs.planning.shards import Shard, plan_shards, shard_ranges
from jobs.status import status_report
from storage.manifest import CONSUMED, DONE, LOCAL, MANIFEST_FILE, Manifest

VOCAB_SIZE = 128_256
MAX_TOKENS_PER_BATCH = 16_384
ROW_GROUP_ROWS = 10_000
# The stand-in checkpoint of the schedule step: config.json alone (the synthetic source reads nothing
# else). A tiny hidden size keeps the states small (3 layers + final state, bf16: 64 B per token), so
# the writer and the tmpfs are not what limits a run on a 2-core machine.
SYNTHETIC_HIDDEN_SIZE = 8
SYNTHETIC_LAYERS = [1, 2, 3]
PROFILE_TOP = 25
RESCAN_LOCAL_FILES = 20
JOURNAL_LOOK_EVERY = 97
"""A prime: the looks do not fall in step with the folds."""
"""Done shards whose files are still on the disk at the bookkeeping step's rescan: a budget's worth of them."""


@dataclasses.dataclass
class Context:
    args: argparse.Namespace
    work: Path
    results: dict[str, Any]
    data: Path = Path()
    dataset: TokenizedDataset | None = None
    plan: list[Shard] = dataclasses.field(default_factory=list)


def build_data(context: Context) -> None:
    """A real Parquet file: --rows rows of random ids, lengths uniform in [1, 2 * mean - 1], with masks."""
    rng = np.random.default_rng(0)
    mean = context.args.mean_tokens
    lengths = rng.integers(1, 2 * mean, context.args.rows)
    offsets = np.concatenate([[0], np.cumsum(lengths)])
    values = rng.integers(0, VOCAB_SIZE, int(offsets[-1]), dtype=np.int32)
    masks = (rng.random(len(values)) < 0.7).astype(np.uint8)
    lists = pa.LargeListArray.from_arrays if offsets[-1] >= 2**31 else pa.ListArray.from_arrays
    table = pa.table({"input_ids": lists(offsets, values), "loss_mask": lists(offsets, masks)})
    context.data = context.work / "data.parquet"
    started = time.perf_counter()
    pq.write_table(table, context.data, row_group_size=ROW_GROUP_ROWS)
    context.results["data"] = {
        "rows": context.args.rows, "tokens": int(lengths.sum()), "file_bytes": context.data.stat().st_size,
        "write_seconds": round(time.perf_counter() - started, 2),
    }


def open_step(context: Context) -> None:
    process = psutil.Process()
    before = process.memory_info().rss
    started, cpu = time.perf_counter(), time.process_time()
    dataset = open_tokenized_dataset(str(context.data), VOCAB_SIZE, 1 << 20)
    seconds, cpu = time.perf_counter() - started, time.process_time() - cpu
    after = process.memory_info().rss
    context.dataset = dataset
    held = dataset.sample_ids.nbytes + dataset.lengths.nbytes
    context.results["open"] = {
        "seconds": round(seconds, 2),
        "cpu_seconds": round(cpu, 2),
        "rows_per_second": round(len(dataset) / seconds),
        "arrays_bytes": held,
        "pickled_bytes": len(pickle.dumps(dataset)),
        "rss_growth_bytes": after - before,
        "arrow_allocated_bytes": pa.total_allocated_bytes(),
    }


def plan_step(context: Context) -> None:
    assert context.dataset is not None
    shard_size = -(-len(context.dataset) // context.args.shards)
    started, cpu = time.perf_counter(), time.process_time()
    context.plan = plan_shards(
        context.dataset.lengths, shard_size, MAX_TOKENS_PER_BATCH, context.args.max_samples_per_batch
    )
    seconds, cpu = time.perf_counter() - started, time.process_time() - cpu
    context.results["plan"] = {
        "seconds": round(seconds, 3), "cpu_seconds": round(cpu, 3), "shards": len(context.plan), "shard_size": shard_size,
        "batches": sum(len(shard.batches) for shard in context.plan),
    }


def rows_step(context: Context) -> None:
    assert context.dataset is not None
    batches = 0
    started = time.perf_counter()
    for shard in context.plan:
        for start, stop in shard.batches:
            context.dataset.rows(shard.start + start, shard.start + stop)
            batches += 1
    seconds = time.perf_counter() - started
    context.results["rows"] = {"seconds": round(seconds, 2), "ms_per_batch": round(1000 * seconds / batches, 4)}


def manifest_step(context: Context) -> None:
    directory = context.work / "output"
    directory.mkdir()
    plan = shard_ranges(context.plan)
    manifest = Manifest.open(directory, {"data.fingerprint": "benchmark"}, plan)
    started = time.perf_counter()
    for shard in context.plan:
        manifest.update(
            shard.index, state=DONE, error="", file=f"shard-{shard.index:05d}.parquet", rows=shard.stop - shard.start,
            tokens=shard.tokens, bytes=shard.tokens * 1000, checksum="xxh3_128:" + "0" * 32, location=LOCAL, sink_url="",
        )
    seconds = time.perf_counter() - started
    rewrites = 5
    started = time.perf_counter()
    for _ in range(rewrites):
        manifest.save()
    rewrite = (time.perf_counter() - started) / rewrites
    manifest.close()
    context.results["manifest"] = {
        "shards": len(plan), "seconds": round(seconds, 2), "ms_per_update": round(1000 * seconds / len(plan), 3),
        "ms_per_full_rewrite": round(1000 * rewrite, 2),
    }


def bookkeeping_step(context: Context) -> None:
    """The run's bookkeeping at a tenth of --shards and at --shards shards over --rows samples, each operation timed
    at both; the growth per shard is the difference over the shards between."""
    sizes = sorted({max(1, context.args.shards // 10), context.args.shards})
    measured = {size: _bookkeeping(context, size) for size in sizes}
    small, large = sizes[0], sizes[-1]
    growth = {key: round((measured[large][key] - measured[small][key]) / max(large - small, 1), 4)
              for key in measured[large] if key.endswith(("_ms", "_bytes"))}
    context.results["bookkeeping"] = {"rows": context.args.rows, "sizes": {str(size): measured[size] for size in sizes},
                                      "growth_per_shard": growth}


def _bookkeeping(context: Context, shards: int) -> dict[str, Any]:
    """One run's records of ``shards`` shards, as a consuming run makes them: every shard done, then all but
    ``RESCAN_LOCAL_FILES`` consumed. Times (ms): the manifest's creation, one update (an fsynced journal line,
    the fold into the snapshot amortised), reopening it (load, replay, rewrite: a resume's start), one rescan
    (the done records still local, their files looked at on the disk), one ``jobs.status`` report; sizes: the
    snapshot and the journal's peak."""
    root = Path(context.args.output_dir or ("/dev/shm" if Path("/dev/shm").is_dir() else context.work))
    directory = Path(tempfile.mkdtemp(prefix="eagle3-driver-scale-bookkeeping-", dir=root))
    rows = context.args.rows
    plan = [(i, i * rows // shards, (i + 1) * rows // shards) for i in range(shards)]
    content = {"data.fingerprint": "benchmark"}
    try:
        started = time.perf_counter()
        manifest = Manifest.open(directory, content, plan)
        create = time.perf_counter() - started
        journal_peak = 0
        started = time.perf_counter()
        for index, start, stop in plan:
            manifest.update(index, state=DONE, error="", file=f"shard-{index:05d}.parquet", rows=stop - start,
                            tokens=(stop - start) * context.args.mean_tokens, bytes=1 << 30,
                            checksum="xxh3_128:" + "0" * 32, location=LOCAL, sink_url="", node="gpu-node-17")
            journal_peak = _journal_peak(manifest, index, journal_peak)
        for index, _, _ in plan[:-RESCAN_LOCAL_FILES]:
            manifest.update(index, location=CONSUMED, consumed_into="trainer 3 on gpu-node-17")
            journal_peak = _journal_peak(manifest, index, journal_peak)
        updates = len(plan) + max(len(plan) - RESCAN_LOCAL_FILES, 0)
        update = (time.perf_counter() - started) / updates
        manifest.close()
        started = time.perf_counter()
        manifest = Manifest.open(directory, content, plan)
        reopen = time.perf_counter() - started
        for record in manifest.in_state(DONE):
            if record.location == LOCAL:
                (directory / record.file).write_bytes(b"")
        budget = DiskBudget(directory, 1 << 50, 0)
        rescan = _median_seconds(lambda: budget.rescan(
            (r.index, r.file, r.bytes) for r in manifest.in_state(DONE) if r.location == LOCAL))
        status = _median_seconds(lambda: status_report(directory))
        manifest.close()
        return {
            "shards": shards, "create_ms": round(1000 * create, 2), "update_ms": round(1000 * update, 4),
            "updates": updates, "reopen_ms": round(1000 * reopen, 2), "rescan_ms": round(1000 * rescan, 3),
            "status_ms": round(1000 * status, 2), "manifest_bytes": (directory / MANIFEST_FILE).stat().st_size,
            "journal_peak_bytes": journal_peak,
        }
    finally:
        shutil.rmtree(directory, ignore_errors=True)


def _journal_peak(manifest: Manifest, index: int, peak: int) -> int:
    """The journal's largest size seen so far, looked at every ``JOURNAL_LOOK_EVERY`` updates (it is folded into the
    snapshot at intervals, so the last look is not its peak)."""
    if index % JOURNAL_LOOK_EVERY:
        return peak
    return max(peak, manifest.journal_path.stat().st_size)


def _median_seconds(operation: Callable[[], Any], repeats: int = 5) -> float:
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        operation()
        times.append(time.perf_counter() - started)
    return sorted(times)[len(times) // 2]


def schedule_step(context: Context) -> None:
    model = context.work / "synthetic-model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "num_hidden_layers": 2 * len(SYNTHETIC_LAYERS) + 2,
        "hidden_size": SYNTHETIC_HIDDEN_SIZE, "num_attention_heads": 2, "intermediate_size": 16,
        "vocab_size": VOCAB_SIZE, "max_position_embeddings": 1 << 20,
    }))
    # The one-shard run first: it also pays the imports a first run in a process does.
    once = _driver_run(context, model, "one-shard", profile=False, extra=["shards=[0]"])
    full = _driver_run(context, model, "full", profile=False)
    shards, batches = len(context.plan), context.results["plan"]["batches"]
    first_batches = len(context.plan[0].batches)
    scheduling = full["driver_cpu_seconds"] - once["driver_cpu_seconds"]
    context.results["schedule"] = {
        "shards": shards, "batches": batches, "samples": full["samples"], "tokens": full["tokens"],
        "bytes": full["bytes"], "wall_seconds": full["wall_seconds"], "extract_seconds": full["extract_seconds"],
        "batches_per_second": round(batches / full["extract_seconds"], 1),
        "driver_cpu_seconds": full["driver_cpu_seconds"], "driver_user_seconds": full["driver_user_seconds"],
        "driver_system_seconds": full["driver_system_seconds"],
        "driver_main_thread_cpu_seconds": full["driver_main_thread_cpu_seconds"],
        "one_shard_run_cpu_seconds": once["driver_cpu_seconds"],
        "open_plan_cpu_seconds": round(
            context.results["open"]["cpu_seconds"] + context.results["plan"]["cpu_seconds"], 2),
        "driver_ms_per_batch": round(1000 * scheduling / (batches - first_batches), 3),
        "driver_ms_per_shard": round(1000 * scheduling / (shards - 1), 3),
    }
    if context.args.profile:
        context.results["schedule"]["profile"] = _driver_run(context, model, "profiled", profile=True)["profile"]


def _driver_run(context: Context, model: Path, name: str, profile: bool, extra: tuple | list = ()) -> dict[str, Any]:
    """One job run in this process; the driver's CPU time (every thread of this process) across it."""
    root = Path(context.args.output_dir or ("/dev/shm" if Path("/dev/shm").is_dir() else context.work))
    output = Path(tempfile.mkdtemp(prefix=f"eagle3-driver-scale-{name}-", dir=root))
    config = load_config([
        f"model.path={model}", f"data.path={context.data}", f"output.dir={output}", "model.engine=synthetic",
        "model.device=cpu", "model.dtype=bfloat16", f"extract.layers={SYNTHETIC_LAYERS}",
        f"data.shard_size={context.results['plan']['shard_size']}",
        f"extract.max_tokens_per_batch={MAX_TOKENS_PER_BATCH}",
        f"extract.max_samples_per_batch={context.args.max_samples_per_batch}",
        "output.disk_budget=100GB", "output.min_free=100MB", *extra,
    ])
    # CPU time of this thread, not wall time: waiting in ray.wait/ray.get costs the driver nothing.
    profiler = cProfile.Profile(time.thread_time) if profile else None
    usage, started, thread = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter(), time.thread_time()
    try:
        if profiler:
            profiler.enable()
        summary = run(config)
        if profiler:
            profiler.disable()
        wall, thread = time.perf_counter() - started, time.thread_time() - thread
        after = resource.getrusage(resource.RUSAGE_SELF)
    finally:
        shutil.rmtree(output, ignore_errors=True)
    if summary.get("shards_failed"):
        raise RuntimeError(f"{name} run: shards failed: {summary['shards_failed']}")
    user, system = after.ru_utime - usage.ru_utime, after.ru_stime - usage.ru_stime
    result = {
        "samples": summary["samples"], "tokens": summary["tokens"], "bytes": summary["bytes"],
        "wall_seconds": round(wall, 2), "extract_seconds": summary["this_run"]["seconds"],
        "driver_cpu_seconds": round(user + system, 2), "driver_user_seconds": round(user, 2),
        "driver_system_seconds": round(system, 2), "driver_main_thread_cpu_seconds": round(thread, 2),
    }
    if profiler:
        result["profile"] = _top_functions(profiler, context.results["plan"]["batches"])
    return result


def _top_functions(profiler: cProfile.Profile, batches: int) -> list[dict[str, Any]]:
    """The driver's Python functions by their own CPU time, in ms per batch (cProfile's overhead included)."""
    stats = pstats.Stats(profiler)
    rows = []
    for (file, line, function), (_, calls, own, cumulative, _) in stats.stats.items():  # type: ignore[attr-defined]
        rows.append({
            "function": f"{Path(file).name}:{line}({function})", "calls": calls,
            "own_ms_per_batch": round(1000 * own / batches, 4), "cumulative_ms_per_batch": round(1000 * cumulative / batches, 4),
        })
    rows.sort(key=lambda row: row["own_ms_per_batch"], reverse=True)
    return rows[:PROFILE_TOP]


STEPS: list[tuple[str, Callable[[Context], None]]] = [
    ("build data", build_data),
    ("open", open_step),
    ("plan", plan_step),
    ("rows", rows_step),
    ("manifest", manifest_step),
    ("bookkeeping", bookkeeping_step),
    ("schedule", schedule_step),
]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=1_000_000)
    parser.add_argument("--shards", type=int, default=10_000)
    parser.add_argument("--mean-tokens", type=int, default=64, help="mean tokens per row (the data is written once)")
    parser.add_argument("--max-samples-per-batch", type=int, default=256, help="extract.max_samples_per_batch")
    parser.add_argument("--work-dir", default="", help="where the data and manifest go (default: a temp dir)")
    parser.add_argument("--output-dir", default="", help="where the schedule step's runs write (default: /dev/shm)")
    parser.add_argument("--steps", default="", help="comma-separated steps to run (data, open, plan, rows, manifest, "
                                                     "bookkeeping, schedule; each needs the ones before it it reads, "
                                                     "bookkeeping none); default: all")
    parser.add_argument("--profile", action="store_true", help="also profile a full run (cProfile) and print the top")
    parser.add_argument("--out", default="", help="also write the results as JSON here")
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    with tempfile.TemporaryDirectory(dir=args.work_dir or None) as work:
        context = Context(args=args, work=Path(work), results={})
        for name, step in STEPS:
            if args.steps and name.split()[-1] not in args.steps.split(","):
                continue
            step(context)
            shown = {k: v for k, v in context.results.get(name.split()[-1], {}).items() if k != "profile"}
            print(f"{name:>10}: {json.dumps(shown)}", flush=True)
    for row in context.results.get("schedule", {}).get("profile", []):
        print(f"{row['own_ms_per_batch']:>9.4f} {row['cumulative_ms_per_batch']:>9.4f} {row['calls']:>9} {row['function']}")
    if args.out:
        Path(args.out).write_text(json.dumps(context.results, indent=2) + "\n")


if __name__ == "__main__":
    main()
