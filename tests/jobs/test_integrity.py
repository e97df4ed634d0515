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

import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from inputs.demo import build_synthetic_dataset
from jobs.export import main as export_main
from jobs.extract import main
from jobs.rundir.summary import read_summary
from runtime.errors import EXIT_BUDGET_EXHAUSTED, EXIT_OK
from storage.manifest import DONE, read_manifest
from storage.writer import TEMP_GLOB
from tests.conftest import REPO_ROOT
from tests.helpers import FINISHED_RUN, assert_every_sample_once, copy_of, job_args, python_env
from tests.helpers import small_disk as tmpfs_at

NUM_SAMPLES = 24


@pytest.fixture(scope="module")
def dataset(tmp_path_factory) -> Path:
    return build_synthetic_dataset(
        tmp_path_factory.mktemp("integrity") / "data.parquet", num_samples=NUM_SAMPLES, min_len=40, max_len=90, seed=5
    )


def filled_disk_args(model: Path, data: Path, out: Path, *extra: str) -> list[str]:
    """Shards of a few batches each, for the run whose disk is filled while it writes."""
    return [
        f"model.path={model}", f"data.path={data}", f"output.dir={out}", "data.shard_size=4", "model.device=cpu",
        "model.dtype=float32", "output.min_free=0", "output.budget_wait_s=30", "output.rescan_s=0.2",
        "extract.max_tokens_per_batch=100", *extra,
    ]


def temp_files(directory: Path) -> list[str]:
    return sorted(path.name for path in directory.rglob("*.tmp"))


# -- a disk another process fills ------------------------------------------------------------------

@pytest.fixture
def small_disk(tmp_path):
    """An 8 MB tmpfs to fill (``tests.helpers.small_disk``)."""
    with tmpfs_at(tmp_path / "disk", "8m") as disk:
        yield disk


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

    watcher = threading.Thread(target=fill_when_writing, daemon=True)
    watcher.start()
    try:
        code = main(filled_disk_args(llama_fp32, dataset, out, *one_shard))
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
    assert main(filled_disk_args(llama_fp32, dataset, out, *one_shard)) == EXIT_OK
    assert_every_sample_once(out, dataset)


# -- links planted where the job and its export write; the export that is the only copy ----------------

RUN_FILES_A_RERUN_WRITES = (
    ".manifest.json.tmp", ".manifest.journal", ".summary.json.tmp", ".summary.json.reserve", ".summary.json",
    ".drafter_config.json.tmp", ".drafter_config.json", ".token_freq.pt.tmp", ".job.lock", ".eagle3-claim.json",
    ".shard-00001.parquet.tmp", "shard-00001.parquet", f".eagle3-claim.json.{os.getpid()}.tmp",
)
"""Every name a rerun of shard 1 creates or replaces in output.dir (the driver runs in this process: the claim's
temp file is named after its pid)."""


def plant(directory: Path, names, victim: Path) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    for name in names:
        path = directory / name
        path.parent.mkdir(parents=True, exist_ok=True)
        if path.exists() or path.is_symlink():
            path.unlink()
        path.symlink_to(victim)


def export_command(capsys, out: Path, dest: Path, *extra: str) -> tuple[int, str]:
    """``jobs.export`` in this process (its exit code and its stderr): torch, which it imports, is loaded here."""
    capsys.readouterr()
    code = export_main([f"output.dir={out}", "to=specforge", f"dest={dest}", *extra])
    return code, capsys.readouterr().err


def verify_command(out: Path, *extra: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "jobs.verify", f"output.dir={out}", *extra], cwd=REPO_ROOT,
                          env=python_env(), capture_output=True, text=True, timeout=120)


def test_links_are_never_followed_and_a_consumed_export_is_checked(
    ray_cluster, llama_fp32, demo_dataset, finished_run, tmp_path, capsys,
):
    """Links planted at every name a rerun (of a copy of a finished run), then ``jobs.export consume=true``, write:
    the rerun and the export complete, the files the links point to are untouched, no link is left. Then a byte
    flipped in the export (the only copy of the consumed shards' samples) is found by ``jobs.verify`` (exit 6) and by
    the export's rerun (exit 4), each naming the file; verify sums the consumed shards up per destination."""
    out, victim = copy_of(finished_run, tmp_path), tmp_path / "victim"
    victim.write_bytes(b"not the job's\n")
    args = job_args(llama_fp32, demo_dataset, out, *FINISHED_RUN, "output.num_writers=1")
    shards, samples = len(read_manifest(out)["shards"]), read_summary(out)["samples"]

    (out / ".token_freq.pt").unlink()  # written again at the end of the rerun
    plant(out, RUN_FILES_A_RERUN_WRITES, victim)
    assert main([*args, "shards=[1]"]) == EXIT_OK
    assert victim.read_bytes() == b"not the job's\n"
    assert [path.name for path in out.iterdir() if path.is_symlink()] == []
    assert_every_sample_once(out, demo_dataset)

    # jobs.export consume=true, with links where it writes in the run and in dest
    dest = tmp_path / "dest"
    first_ckpt = "rows_0-2000/data_0.ckpt"
    plant(out, [".manifest.json.tmp", ".manifest.journal"], victim)
    plant(dest, ["..export_state.json.tmp", "rows_0-2000/.data_0.ckpt.tmp", ".export-files/.shard-00000.json.tmp"],
          victim)
    code, errors = export_command(capsys, out, dest, "consume=true")
    assert code == EXIT_OK, errors[-3000:]
    assert victim.read_bytes() == b"not the job's\n"
    assert [p for p in [*out.rglob("*"), *dest.rglob("*")] if p.is_symlink()] == []
    assert not list(out.glob("shard-*.parquet"))

    checked = verify_command(out)
    assert checked.returncode == EXIT_OK, checked.stdout + checked.stderr
    notes = [line for line in checked.stdout.splitlines() if "consumed into" in line]
    assert len(notes) == 1 and notes[0].startswith(f"note: {shards} shards consumed into specforge:{dest} "), \
        checked.stdout
    assert f"note: {samples} files of the exports that consumed shards checked" in checked.stdout
    assert f"shards 0-{shards - 1}" in verify_command(out, "--details").stdout

    with open(dest / first_ckpt, "r+b") as file:  # the disk changes one byte of the only copy
        file.seek(200)
        byte = file.read(1)
        file.seek(200)
        file.write(bytes([byte[0] ^ 0x01]))
    checked = verify_command(out)
    assert checked.returncode == 6, checked.stdout + checked.stderr
    assert f"{dest}/{first_ckpt}: its checksum is not the one recorded when shard-00000.parquet was exported" \
        in checked.stdout, checked.stdout
    assert "rerun the job's command with shards=[0]" in checked.stdout
    code, errors = export_command(capsys, out, dest, "consume=true")
    assert code == 4, errors[-3000:]
    assert f"{dest}/{first_ckpt}: its checksum is not the one recorded" in errors, errors[-3000:]


def test_the_writers_of_prepare_and_of_an_export_replace_or_refuse_planted_links(tmp_path):
    """jobs.prepare's files (its record, parts, skipped rows, regenerated answers) and an export's files go through
    temp names where a planted link is replaced, never followed; a directory below dest (or prepare's
    ``_regenerated``) that is a link is refused, naming it."""
    from conversations import output
    from conversations.reader import RowSource
    from conversations.template import Encoded
    from training.destination import Destination

    victim = tmp_path / "victim"
    victim.write_bytes(b"not the job's\n")
    out = tmp_path / "prepared"
    plant(out, ["._prepare.json.tmp", ".part-00000.parquet.tmp", "._skipped_rows.jsonl.tmp", "_prepare.json"],
          victim)
    output.write_record(out, {"format": output.RECORD_FORMAT, "state": output.RUNNING})
    temp = output.write_part(out, 0, [7], ["row-7"], [Encoded([1, 2, 3], bytearray([0, 1, 1]), 1)], {"shard": 0})
    skipped = output.SkippedRows(out)
    skipped.add(3, RowSource("chat.jsonl", 3, 4), "invalid", "no assistant turn")
    skipped.publish()
    output.publish_parts(out, [0])
    assert temp.name == ".part-00000.parquet.tmp" and output.read_record(out)["state"] == output.RUNNING
    assert output.is_own_part(out / "part-00000.parquet") and (out / output.SKIPPED_FILE).read_text().count("\n") == 1
    assert victim.read_bytes() == b"not the job's\n" and not [p for p in out.iterdir() if p.is_symlink()]
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (out / output.REGENERATED_DIR).symlink_to(elsewhere)
    with pytest.raises(ValueError, match="_regenerated is a symbolic link"):
        output.write_regenerated(out, 0, [{"answer": "x"}])
    assert list(elsewhere.iterdir()) == []

    dest = Destination(str(tmp_path / "dest"))
    plant(tmp_path / "dest", ["rows_0-2000/.data_0.ckpt.tmp", "rows_0-2000/data_1.ckpt"], victim)
    dest.write_bytes("rows_0-2000/data_0.ckpt", b"zero")
    dest.write_bytes("rows_0-2000/data_1.ckpt", b"one")
    assert victim.read_bytes() == b"not the job's\n"
    assert (tmp_path / "dest/rows_0-2000/data_1.ckpt").read_bytes() == b"one"
    (tmp_path / "dest/hidden_states").symlink_to(elsewhere)
    with pytest.raises(ValueError, match="hidden_states is a symbolic link"):
        dest.write_bytes("hidden_states/hs_0.safetensors", b"zero")
    assert list(elsewhere.iterdir()) == []


def test_a_consumption_record_is_written_and_read_without_following_a_link(tmp_path):
    """``consume_shard`` replaces links planted at its record's names; the job reads a record without following
    a link, so a link planted in place of one (to a file that looks like a record) declares nothing."""
    from storage.consumed import consume_shard, read_records, record_name

    run = tmp_path / "run"
    run.mkdir()
    fake = tmp_path / "fake-record"
    fake.write_text('{"file": "shard-00000.parquet", "bytes": 1, "into": "nowhere"}\n')
    (run / "shard-00000.parquet").write_bytes(b"0" * 10)
    (run / record_name("shard-00000.parquet")).symlink_to(fake)
    (run / "shard-00000.parquet").unlink()  # lost: the planted link declares nothing
    assert read_records(run, ["shard-00000.parquet"]) == {}

    (run / "shard-00001.parquet").write_bytes(b"1" * 10)
    plant(run, [record_name("shard-00001.parquet"), record_name("shard-00001.parquet") + ".tmp"], fake)
    consume_shard(run / "shard-00001.parquet", "trainer run 7")
    assert fake.read_text().endswith('"into": "nowhere"}\n') and not (run / "shard-00001.parquet").exists()
    assert read_records(run, ["shard-00001.parquet"])["shard-00001.parquet"]["into"] == "trainer run 7"
    consume_shard(run / "shard-00001.parquet", "trainer run 7")  # again: done already, nothing happens
    with pytest.raises(FileNotFoundError):
        consume_shard(run / "shard-00002.parquet", "trainer run 7")
