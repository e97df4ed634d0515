"""Nothing lost, nothing written outside output.dir, every exit code true: the run's integrity under what
a shared machine does to it.

- A done shard's file that disappears without a consumer declaring it consumed is damage: extracted again
  (during the run and on a rerun), reported missing by ``jobs.verify``. A trainer consumes by declaring first
  (``storage.consumed.consume_shard``).
- A disk filled by another process while the run writes: exit 3, a true summary, no temp file, the manifest's
  last whole state kept.
- Symbolic links planted in the directories the job, the export and ``jobs.prepare`` write to are replaced or
  refused, never followed.
- The files of a shard consumed into an export are checked against the checksums recorded when it was consumed.
"""

from __future__ import annotations

import errno
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from jobs.errors import EXIT_BUDGET_EXHAUSTED, EXIT_OK
from jobs.extract import main
from jobs.inputs.demo import build_synthetic_dataset
from jobs.rundir.summary import read_summary
from storage.manifest import DONE, read_manifest
from storage.writer import TEMP_GLOB
from tests.helpers import assert_every_sample_once

NUM_SAMPLES = 24


@pytest.fixture(scope="module")
def dataset(tmp_path_factory) -> Path:
    return build_synthetic_dataset(
        tmp_path_factory.mktemp("integrity") / "data.parquet", num_samples=NUM_SAMPLES, min_len=40, max_len=90, seed=5
    )


def job_args(model: Path, data: Path, out: Path, *extra: str) -> list[str]:
    return [
        f"model.path={model}", f"data.path={data}", f"output.dir={out}", "data.shard_size=4", "model.device=cpu",
        "model.dtype=float32", "output.min_free_bytes=0", "output.budget_wait_s=30", "output.rescan_s=0.2",
        "extract.max_tokens_per_batch=100", *extra,
    ]


def temp_files(directory: Path) -> list[str]:
    return sorted(path.name for path in directory.rglob("*.tmp"))


# -- a disk another process fills ------------------------------------------------------------------

@pytest.fixture
def small_disk(tmp_path):
    disk = tmp_path / "disk"
    disk.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=8m", "tmpfs", str(disk)], capture_output=True,
                             text=True)
    if mounted.returncode != 0:
        reason = f"cannot mount a tmpfs here (needs root): {mounted.stderr.strip()}"
        if os.environ.get("CI"):  # CI runs as root: a skip there would hide the case
            pytest.fail(reason)
        pytest.skip(reason)
    try:
        yield disk
    finally:
        subprocess.run(["umount", "-l", str(disk)], check=False)


FILLER = """
import sys, time
with open(sys.argv[1], "wb", buffering=0) as file:
    print("filling", flush=True)
    while True:  # takes every block the disk frees, as another job writing its own output would
        try:
            file.write(b"\\0" * 4096)
        except OSError:
            time.sleep(0.001)
"""


def test_a_disk_filled_by_another_process_stops_with_exit_3_and_a_true_summary(
    ray_cluster, llama_fp32, dataset, small_disk, capfd,
):
    """Another process fills the disk while a shard is written, and takes every block the job frees: the shard
    fails, then the manifest's and the summary's own writes meet ENOSPC too. Exit 3 (disk_full), not a fault
    with a traceback; the summary says so (written into the room set aside when the run started); no temp file
    is left; the manifest reads back in its last whole state; freed, a rerun completes."""
    out, filler_path = small_disk / "out", small_disk / "filler"
    one_shard = (f"data.shard_size={NUM_SAMPLES}", "output.num_writers=1", "extract.max_tokens_per_batch=60")
    filler: list[subprocess.Popen] = []

    def fill_when_writing() -> None:
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline and not list(out.glob(TEMP_GLOB)):
            time.sleep(0.005)
        filler.append(subprocess.Popen([sys.executable, "-c", FILLER, str(filler_path)], stdout=subprocess.PIPE))
        filler[0].stdout.readline()

    import threading

    watcher = threading.Thread(target=fill_when_writing, daemon=True)
    watcher.start()
    try:
        code = main(job_args(llama_fp32, dataset, out, *one_shard))
    finally:
        watcher.join()
        for process in filler:
            process.kill()
            process.wait()
    assert filler, "the disk was not filled while a shard was written"
    stderr = capfd.readouterr().err
    assert code == EXIT_BUDGET_EXHAUSTED, stderr[-3000:]
    assert "Traceback" not in stderr, stderr[-3000:]
    summary = read_summary(out)
    assert (summary["outcome"], summary["exit_code"]) == ("disk_full", EXIT_BUDGET_EXHAUSTED), summary
    assert temp_files(out) == [], "temp files left behind"
    assert not (out / ".summary.json.reserve").exists()
    records = read_manifest(out)["shards"]  # the last whole state: snapshot + fsynced journal lines
    assert [r["state"] for r in records] != [DONE]

    filler_path.unlink()
    assert main(job_args(llama_fp32, dataset, out, *one_shard)) == EXIT_OK
    assert_every_sample_once(out, dataset)
