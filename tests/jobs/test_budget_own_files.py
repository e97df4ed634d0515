"""output.disk_budget holds everything the job keeps in output.dir, its own files too, measured on the directory."""

from __future__ import annotations

import json
import re
import threading
import time
from pathlib import Path

import pytest

from inputs.demo import build_synthetic_dataset
from jobs.driver import job
from jobs.extract import main, run
from runtime.errors import EXIT_BAD_INPUT
from storage.consumed import RECORD_BYTES, consume_shard
from storage.manifest import (
    CONSUMED,
    DONE,
    MANIFEST_FILE,
    MANIFEST_JOURNAL_FILE,
    TEXT_LIMITS,
    Manifest,
    read_manifest,
    size_bound,
)
from tests.helpers import DiskSampler, job_config, read_all

SHARD_SIZE = 4
NUM_SAMPLES = 20
BUDGET = 1_000_000
SETTINGS = [f"data.shard_size={SHARD_SIZE}", "output.rescan_s=0.2", "output.max_inflight_batches=2",
            "extract.max_tokens_per_batch=200", "output.budget_wait_s=60", "progress.interval_s=0.2"]
JOB_FILES = re.compile(
    r"(\.job\.lock|\.eagle3-claim\.json(\.\d+\.tmp)?|\.manifest\.json(\.tmp)?|\.manifest\.journal(\.tmp)?"
    r"|\.summary\.json(\.tmp|\.reserve)?|\.drafter_config\.json(\.tmp)?|\.token_freq\.pt(\.tmp)?"
    r"|\.invalid_rows\.jsonl(\.tmp)?|\.?shard-\d{5}\.parquet(\.tmp|\.consumed(\.tmp)?)?)"
)
"""Every name the job (and a consumer's records) may give a file in output.dir: what the budget counts."""


@pytest.fixture(scope="module")
def dataset(tmp_path_factory) -> Path:
    return build_synthetic_dataset(
        tmp_path_factory.mktemp("own-files") / "data.parquet", num_samples=NUM_SAMPLES, min_len=40, max_len=120, seed=7
    )


class Trainer:
    """Consumes every committed shard file as a trainer would (``storage.consumed``): declared, then deleted."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self.taken: dict[str, bytes] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)

    def _loop(self) -> None:
        while not self._stop.is_set():
            for path in self.directory.glob("shard-*.parquet"):
                self.taken[path.name] = path.read_bytes()
                consume_shard(path, "a test trainer")
            time.sleep(0.05)

    def __enter__(self) -> "Trainer":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()


def test_a_1mb_budget_holds_to_the_byte_with_every_file_the_job_keeps(ray_cluster, llama_fp32, dataset, tmp_path):
    out = tmp_path / "out"
    with DiskSampler(out, every_file=True, interval_s=0.05) as sampler, Trainer(out) as trainer:
        summary = run(job_config(llama_fp32, dataset, out, f"output.disk_budget={BUDGET}", *SETTINGS))
    print(f"budget {BUDGET} B: own files up to {summary['disk_budget']['own_files']} B; sampled peak "
          f"{sampler.peak} B (blocks {sampler.peak_blocks} B) over {sampler.samples} samples; accounted peak "
          f"{summary['disk_budget']['peak']} B; at the peak: {sorted(sampler.at_peak.items())}")
    assert summary["outcome"] == "complete" and summary["shards_done"] == NUM_SAMPLES // SHARD_SIZE
    # the sampler looked the whole time (a look that failed would have failed the with block)
    assert sampler.samples >= 10
    assert sampler.peak <= BUDGET, sorted(sampler.at_peak.items())
    assert sampler.peak_blocks <= BUDGET
    assert sampler.peak > summary["disk_budget"]["own_files"] // 4  # the own files and a shard were there
    assert summary["disk_budget"]["peak"] <= BUDGET and summary["disk_budget"]["overshoot"] == 0
    # every file seen is one the budget counts; the summary's reserve and the records were among them
    assert {name for name in sampler.names if not JOB_FILES.fullmatch(name)} == set()
    assert {".summary.json.reserve", ".manifest.journal", ".shard-00000.parquet.consumed"} <= sampler.names
    # every shard went through the one-shard room, consumed, and every sample is there once
    assert [r["location"] for r in read_manifest(out)["shards"]].count(CONSUMED) >= 3
    for name, data in trainer.taken.items():
        (out / name).write_bytes(data)
    assert sorted(read_all(out)) == list(range(NUM_SAMPLES))


def test_a_budget_without_room_for_the_own_files_and_a_shard_is_refused_before_ray(
    llama_fp32, dataset, tmp_path, monkeypatch, capsys,
):
    def no_ray(*args, **kwargs):
        raise AssertionError("Ray was started")

    monkeypatch.setattr(job, "ray_session", no_ray)
    out = tmp_path / "out"
    args = [f"model.path={llama_fp32}", f"data.path={dataset}", f"output.dir={out}", "model.device=cpu",
            "output.min_free=1GB", *SETTINGS]
    assert main([*args, "output.disk_budget=700KB"]) == EXIT_BAD_INPUT
    error = capsys.readouterr().err.strip().splitlines()[-1]
    found = re.fullmatch(
        r"error: shard \d+ needs about .+ but output.disk_budget is 700\.0 KB, of which the job's own files in "
        r"output.dir take up to .+ \(manifest .+, summary and its reserve .+, lock and claim .+, other files .+\), "
        r"which leaves .+ for shard files: a shard must fit the budget whole\. Raise output.disk_budget to at least "
        r"(\d+) bytes, or lower data.shard_size", error)
    assert found, error
    assert not (out / MANIFEST_FILE).exists()
    # the figure it names is enough: the run gets past every check before Ray with it
    with pytest.raises(AssertionError, match="Ray was started"):
        run(job_config(llama_fp32, dataset, out, f"output.disk_budget={found.group(1)}", *SETTINGS))


def test_the_manifest_stays_within_its_bound_whatever_its_records_hold(tmp_path):
    """Every record at its widest: long and non-ASCII texts (cut to their limits), every sample non-finite, a sink
    URL; the snapshot stays within ``size_bound`` and the journal within the snapshot and a line."""
    plan = [(index, 4 * index, 4 * index + 4) for index in range(3)]
    reason = "NaN/Inf in layer 2, layer 4, layer 5"
    snapshot_bound, line_bound = size_bound({"k": "v"}, plan, "s3://bucket/run", reason)
    manifest = Manifest.open(tmp_path, {"k": "v"}, plan)
    for index, start, stop in plan:
        manifest.update(index, error="é" * 10_000, consumed_into="ü" * 10_000, node="n" * 10_000)
        manifest.update(index, state=DONE, file=f"shard-{index:05d}.parquet", rows=2**62, tokens=2**62, bytes=2**62,
                        checksum="sha256:" + "f" * 64, location=CONSUMED, sink_url=f"s3://bucket/run/shard-{index:05d}",
                        nonfinite=[{"sample_id": 2**62, "action": "skipped", "reason": reason}] * (stop - start),
                        exported_files_checksum="sha256:" + "f" * 64, attempts=2**62)
        journal = (tmp_path / MANIFEST_JOURNAL_FILE).stat().st_size
        assert journal <= (tmp_path / MANIFEST_FILE).stat().st_size + line_bound
    manifest.close()
    assert (tmp_path / MANIFEST_FILE).stat().st_size <= snapshot_bound
    record = read_manifest(tmp_path)["shards"][0]
    assert record["error"].endswith("...") and len(json.dumps(record["error"])) <= TEXT_LIMITS["error"]


def test_a_consumer_says_where_the_samples_went_in_at_most_a_kilobyte(tmp_path):
    shard = tmp_path / "shard-00000.parquet"
    shard.write_bytes(b"x" * 100)
    with pytest.raises(ValueError, match="at most 1024"):
        consume_shard(shard, "x" * 1100)
    assert shard.exists()
    consume_shard(shard, "a trainer")
    assert (tmp_path / ".shard-00000.parquet.consumed").stat().st_size <= RECORD_BYTES
