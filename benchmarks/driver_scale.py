"""The driver's own work at a million samples: open and check the input, plan, read rows, record the manifest.

No model runs here: every step is what the driver does per run, per shard or per batch, on a real
Parquet file of synthetic token ids (random lengths around --mean-tokens).

  open      open_tokenized_dataset: one streaming pass that checks every row, keeps lengths, sample
            ids and the fingerprint; the memory the dataset object holds afterwards
  plan      plan_shards: shards of --rows/--shards rows, each packed into batches
  rows      dataset.rows() for every batch of every shard, in plan order (what sending batches reads)
  manifest  Manifest.update once per shard (the journal), against one full rewrite of the manifest
            (what every update cost before the journal)

    python -m benchmarks.driver_scale --rows 1000000 --shards 10000
    python -m benchmarks.driver_scale --rows 20000 --shards 200      # CI smoke test

Steps are functions of a shared context, run in order (``STEPS``): a later step (e.g. scheduling
against a stand-in extractor) adds itself there.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import pickle
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

import numpy as np
import psutil
import pyarrow as pa
import pyarrow.parquet as pq

from jobs.dataset import TokenizedDataset, open_tokenized_dataset
from jobs.plan import Shard, plan_shards
from storage.manifest import DONE, LOCAL, Manifest

VOCAB_SIZE = 128_256
MAX_TOKENS_PER_BATCH = 16_384
MAX_SAMPLES_PER_BATCH = 256
ROW_GROUP_ROWS = 10_000


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
    started = time.perf_counter()
    dataset = open_tokenized_dataset(str(context.data), VOCAB_SIZE, 1 << 20)
    seconds = time.perf_counter() - started
    after = process.memory_info().rss
    context.dataset = dataset
    held = dataset.sample_ids.nbytes + dataset.lengths.nbytes
    context.results["open"] = {
        "seconds": round(seconds, 2),
        "rows_per_second": round(len(dataset) / seconds),
        "arrays_bytes": held,
        "pickled_bytes": len(pickle.dumps(dataset)),
        "rss_growth_bytes": after - before,
        "arrow_allocated_bytes": pa.total_allocated_bytes(),
    }


def plan_step(context: Context) -> None:
    assert context.dataset is not None
    shard_size = -(-len(context.dataset) // context.args.shards)
    started = time.perf_counter()
    context.plan = plan_shards(context.dataset.lengths, shard_size, MAX_TOKENS_PER_BATCH, MAX_SAMPLES_PER_BATCH)
    seconds = time.perf_counter() - started
    context.results["plan"] = {
        "seconds": round(seconds, 3), "shards": len(context.plan), "shard_size": shard_size,
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
    plan = [(shard.index, shard.start, shard.stop) for shard in context.plan]
    manifest = Manifest.open(directory, {"data.fingerprint": "benchmark"}, plan)
    started = time.perf_counter()
    for shard in context.plan:
        manifest.update(
            shard.index, state=DONE, error="", file=f"shard-{shard.index:05d}.parquet", rows=shard.stop - shard.start,
            tokens=shard.tokens, bytes=shard.tokens * 1000, sha256="0" * 64, location=LOCAL, sink_url="",
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


STEPS: list[tuple[str, Callable[[Context], None]]] = [
    ("build data", build_data),
    ("open", open_step),
    ("plan", plan_step),
    ("rows", rows_step),
    ("manifest", manifest_step),
]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=1_000_000)
    parser.add_argument("--shards", type=int, default=10_000)
    parser.add_argument("--mean-tokens", type=int, default=64, help="mean tokens per row (the data is written once)")
    parser.add_argument("--work-dir", default="", help="where the data and manifest go (default: a temp dir)")
    parser.add_argument("--out", default="", help="also write the results as JSON here")
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    with tempfile.TemporaryDirectory(dir=args.work_dir or None) as work:
        context = Context(args=args, work=Path(work), results={})
        for name, step in STEPS:
            step(context)
            print(f"{name:>10}: {json.dumps(context.results.get(name.split()[-1], {}))}", flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps(context.results, indent=2) + "\n")


if __name__ == "__main__":
    main()
