"""Export in place (``jobs.export consume=true``) on a run of the mission's shape, scaled down: each format within
one shard of room beyond the run (the directories' sizes sampled while it runs), a real export process killed
mid-shard and resumed, a flipped byte and a wrong file caught before their shard is deleted, the run's own
commands (verify, a resumed extraction) understanding what was consumed, and the peers' own loaders reading the
result exactly as they read the run.

The runs: the job with the synthetic engine (``model.engine=synthetic``: random states of a checkpoint's
shape, through the job's own writers) on a config.json of hidden size 1024, three layers plus the final state
(8 KB of states a token, a seventh of Kimi-K2.5's 57 KB), 32 samples of 64-192 tokens in 8 shards of 4: a
run of 32 MB whose shards are about 4 MB. The per-file and per-token overheads of the exports stand to the
states about as they do at the mission's scale, within a factor of seven.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import types
from pathlib import Path

import numpy as np
import pytest
import torch

from common.checks import format_bytes
from inputs.demo import build_synthetic_dataset
from jobs import export as export_job
from jobs.extract import run
from jobs.status import status_report
from runtime.errors import EXIT_BAD_INPUT, EXIT_BUDGET_EXHAUSTED, EXIT_FAULT, EXIT_LOCKED, EXIT_OK
from storage import ShardReader
from storage.manifest import CONSUMED, LOCAL, Manifest, read_manifest
from storage.token_freq import maybe_write_token_freq, read_token_freq
from testbeds.shapes import LLAMA_8B
from tests.conftest import REPO_ROOT
from tests.helpers import (
    LOCK_HOLDER,
    fill_disk,
    flip_middle,
    job_config,
    python_env,
    same,
    small_disk,
    specforge_files,
    specforge_item,
    speculators_dataset,
)
from training import consume as consume_module
from training import destination, peer_formats
from training.dataset import HiddenStatesDataset

HIDDEN_SIZE = 1024
SAMPLES = 32
SHARD_SIZE = 4
LAYERS = 3


@pytest.fixture(scope="module")
def shaped_runs(ray_cluster, tmp_path_factory) -> dict[str, Path]:
    """Two runs of the same input, one post-norm (SpecForge) and one pre-norm (speculators); never consumed
    themselves: each test consumes a copy, and compares with these."""
    root = tmp_path_factory.mktemp("shaped")
    model = root / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({
        **LLAMA_8B, "hidden_size": HIDDEN_SIZE, "intermediate_size": 4 * HIDDEN_SIZE, "num_hidden_layers": 16,
        "num_attention_heads": 8, "num_key_value_heads": 8, "vocab_size": 512, "max_position_embeddings": 4096,
    }))
    data = build_synthetic_dataset(root / "data.parquet", num_samples=SAMPLES, min_len=64, max_len=192, seed=5)
    runs = {}
    for name, final in (("post", "post_norm"), ("pre", "pre_norm")):
        config = shaped_config(model, data, root / name, final)
        summary = run(config)
        assert summary["shards_failed"] == {} and summary["samples"] == SAMPLES
        runs[name] = root / name
    runs.update(model=model, data=data)
    return runs


def shaped_config(model: Path, data: Path, out: Path, final: str):
    return job_config(model, data, out, "model.engine=synthetic", "model.dtype=bfloat16", "extract.layers=[2,8,13]",
                      f"extract.last_hidden_state={final}", f"data.shard_size={SHARD_SIZE}",
                      "extract.max_tokens_per_batch=800", "output.num_writers=1")


def consumable_copy(shaped_runs, name: str, tmp_path: Path) -> Path:
    copy = tmp_path / f"run-{name}"
    shutil.copytree(shaped_runs[name], copy)
    return copy


def allocated(*directories: Path) -> int:
    """Bytes the directories take on the disk (allocated blocks, as du counts them)."""
    total = 0
    for directory in directories:
        for root, _, names in os.walk(directory):
            for name in names:
                try:
                    total += os.lstat(os.path.join(root, name)).st_blocks * 512
                except FileNotFoundError:
                    pass  # a temp file renamed or a shard deleted between the listing and the stat
    return total


class DirectorySizes:
    """The largest total size of ``directories`` seen, sampled every millisecond or so while it runs."""

    def __init__(self, *directories: Path) -> None:
        self.directories = directories
        self.peak = self.samples = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, allocated(*self.directories))
            self.samples += 1
            time.sleep(0.001)

    def __enter__(self) -> "DirectorySizes":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, allocated(*self.directories))


def export(run_dir, to: str, dest, *extra: str) -> int:
    return export_job.main([f"output.dir={run_dir}", f"to={to}", f"dest={dest}", *extra])


def shard_bytes(run_dir: Path) -> dict[str, int]:
    return {path.name: path.stat().st_blocks * 512 for path in sorted(run_dir.glob("shard-*.parquet"))}


def exported_shard_bytes(dest: Path, to: str) -> list[int]:
    """Bytes on disk of each shard's files in the export, from its state (the shards' sample ids)."""
    state = json.loads((dest / ".export_state.json").read_text())
    sizes, row = [], 0
    for shard in state["shards"]:
        ids = [i for start, stop in shard["sample_ids"] for i in range(start, stop)]
        if to == "specforge":
            paths = [peer_formats.specforge_path(i) for i in ids]
        else:
            paths = [peer_formats.speculators_path(row + k) for k in range(len(ids))]
        row += len(ids)
        sizes.append(sum((dest / path).stat().st_blocks * 512 for path in paths))
    return sizes


def assert_peers_read_the_run(to: str, dest: Path, pristine: Path, fp8: bool = False) -> None:
    """The trainer's own loader over the export gives, item for item and in its order, what the dataset's view
    of the untouched run gives: bit for bit (fp8: within the requantization's error)."""
    if to == "specforge":
        view = HiddenStatesDataset(pristine, view="specforge")
        files = specforge_files(dest)
        assert len(files) == len(view) == SAMPLES
        pairs = ((view[index], specforge_item(path, peer_formats.SPECFORGE_MAX_LEN)) for index, path in enumerate(files))
    else:
        view = HiddenStatesDataset(pristine, view="speculators")
        theirs = speculators_dataset(dest, fp8=fp8)
        assert len(theirs) == len(view) == SAMPLES
        pairs = ((view[index], theirs[index]) for index in range(SAMPLES))
    for mine, theirs_item in pairs:
        assert list(mine) == list(theirs_item)
        for key in mine:
            if fp8 and "hidden_states" in key:
                error = (mine[key].float() - theirs_item[key].float()).norm() / mine[key].float().norm()
                assert error < 0.05, (key, error)
            else:
                assert same(mine[key], theirs_item[key]), key


@pytest.mark.parametrize("to, run_name, extra", [
    ("specforge", "post", []),
    ("speculators", "pre", []),
    ("speculators", "pre", ["fp8=true"]),
], ids=["specforge", "speculators", "speculators-fp8"])
def test_consume_converts_the_run_within_one_shard_of_room(shaped_runs, tmp_path, monkeypatch, capsys,
                                                           to, run_name, extra):
    run_dir = consumable_copy(shaped_runs, run_name, tmp_path)
    dest, scratch = tmp_path / "dest", tmp_path / "scratch"
    scratch.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(scratch))  # speculators' dataset passes through a scratch file
    counts = HiddenStatesDataset(shaped_runs[run_name]).token_freq()  # counted from the untouched run's files
    shards = shard_bytes(run_dir)
    source = allocated(run_dir)
    started = time.perf_counter()
    with DirectorySizes(run_dir, dest, scratch) as disk:
        assert export(run_dir, to, dest, "consume=true", *extra) == 0
    seconds = time.perf_counter() - started
    assert "8 shards consumed" in capsys.readouterr().out

    # the disk: the run and its export, never both, beyond one shard
    final = allocated(dest)
    one_shard = max(max(shards.values()), max(exported_shard_bytes(dest, to)))
    with capsys.disabled():
        print(f"\nconsume to={to} {' '.join(extra)}: run {source / 1e6:.1f} MB, largest shard {one_shard / 1e6:.2f} MB, "
              f"export {final / 1e6:.1f} MB ({final / source:.4f} of the run), peak {disk.peak / 1e6:.1f} MB = run + "
              f"{(disk.peak - source) / one_shard:.2f} shards = max(run, export) + "
              f"{(disk.peak - max(source, final)) / one_shard:.2f} shards, {disk.samples} samples of the disk, "
              f"{final / 1e6 / seconds:.1f} MB/s")
    assert disk.samples > 50
    assert disk.peak <= max(source, final) + one_shard
    if not extra:  # same dtype: the export is the run plus its int64 token ids and file headers, under 3% here
        assert source < final < 1.03 * source

    # the run: every shard consumed into this export, no shard file left; verify and a resumed extraction agree
    assert not list(run_dir.glob("shard-*.parquet"))
    records = read_manifest(run_dir)["shards"]
    key = f"{to}:{dest}"
    assert [(r["location"], r["consumed_into"]) for r in records] == [(CONSUMED, key)] * len(shards)
    from jobs.verify import format_report, verify

    report = verify(run_dir)
    assert report.ok and report.rows == SAMPLES, format_report(report)
    rows_and_dataset = len(shards) + 4 if to == "speculators" else 0  # its rows files, data-*.arrow and the 3 beside it
    assert report.consumed == {key: list(range(len(shards)))}
    assert report.exported_files_checked == SAMPLES + rows_and_dataset
    summary = run(shaped_config(shaped_runs["model"], shaped_runs["data"], run_dir, run_name + "_norm"))
    assert summary["outcome"] == "nothing_to_do" and not list(run_dir.glob("shard-*.parquet"))
    assert read_token_freq(run_dir) == counts  # counted before the first shard went
    assert f"consumed:      8 shards deleted from output.dir once their samples were elsewhere: 8 into {key}" \
        in status_report(run_dir)
    with pytest.raises(ValueError, match=f"every done shard was consumed by an export \\(into {key}\\)"):
        HiddenStatesDataset(run_dir)

    if to == "specforge":  # killed between recording a shard and deleting it: verify says so, a rerun deletes it
        shutil.copy(shaped_runs[run_name] / "shard-00003.parquet", run_dir)
        report = verify(run_dir)
        assert [p.what.startswith(f"consumed into {key}, but still here") for p in report.problems] == [True]
        state = dest / ".export_state.json"
        state.write_text(state.read_text().replace('"complete": true', '"complete": false'))
        assert export(run_dir, to, dest, "consume=true") == 0 and not list(run_dir.glob("shard-*.parquet"))

    # the trainers' loaders read exactly what the run held
    assert_peers_read_the_run(to, dest, shaped_runs[run_name], fp8=bool(extra))
    if to == "speculators":
        assert torch.load(dest / "token_freq.pt") == counts
        assert len(list((dest / ".export-rows").iterdir())) == len(shards)  # kept: listed with each shard's files
    assert export(run_dir, to, dest, "consume=true", *extra) == 0
    assert "nothing to do" in capsys.readouterr().out


def test_killed_consume_resumes_where_it_stopped(shaped_runs, tmp_path, capsys):
    """A real export process, SIGKILLed in the middle of a shard (some shards consumed, files of the next one
    written), then the same command again: nothing consumed is read again, no file there is rewritten."""
    run_dir = consumable_copy(shaped_runs, "pre", tmp_path)
    dest = tmp_path / "dest"
    source = allocated(run_dir)
    command = [sys.executable, "-m", "jobs.export", f"output.dir={run_dir}", "to=speculators", f"dest={dest}",
               "consume=true", "threads=1"]
    with DirectorySizes(run_dir, dest) as disk:
        process = subprocess.Popen(command, cwd=REPO_ROOT, env=python_env(), stdout=subprocess.PIPE,
                                   stderr=subprocess.PIPE)
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline and process.poll() is None:
            consumed = [r for r in read_manifest(run_dir)["shards"] if r["location"] == CONSUMED]
            files = list((dest / "hidden_states").glob("hs_*.safetensors")) if (dest / "hidden_states").exists() else []
            if consumed and len(files) > SHARD_SIZE * len(consumed):  # files of a shard not consumed yet
                process.send_signal(signal.SIGKILL)
                break
            time.sleep(0.002)
        process.wait()
    assert process.returncode == -signal.SIGKILL, process.stderr.read().decode()[-3000:]

    consumed = {r["file"] for r in read_manifest(run_dir)["shards"] if r["location"] == CONSUMED}
    left = {path.name for path in run_dir.glob("shard-*.parquet")}
    assert consumed and left and not consumed & left and len(consumed | left) == SAMPLES // SHARD_SIZE
    present = {path: path.stat().st_mtime_ns for path in (dest / "hidden_states").glob("hs_*.safetensors")}
    assert len(present) > SHARD_SIZE * len(consumed)

    with DirectorySizes(run_dir, dest) as resumed_disk:
        assert export(run_dir, "speculators", dest, "consume=true") == 0
    out = capsys.readouterr().out
    assert f"{SAMPLES - len(present)} written, {len(present)} already there" in out, out
    assert {path: path.stat().st_mtime_ns for path in present} == present  # read back and kept, not rewritten
    assert not list(run_dir.glob("shard-*.parquet")) and not list(dest.rglob("*.tmp"))
    one_shard = max(shard_bytes(shaped_runs["pre"]).values())
    final = allocated(dest)
    assert max(disk.peak, resumed_disk.peak) <= max(source, final) + max(one_shard, *exported_shard_bytes(dest, "speculators"))
    assert_peers_read_the_run("speculators", dest, shaped_runs["pre"])


def test_a_flipped_byte_or_a_wrong_file_is_caught_before_its_shard_is_deleted(shaped_runs, tmp_path, monkeypatch,
                                                                              capsys):
    run_dir = consumable_copy(shaped_runs, "post", tmp_path)
    dest = tmp_path / "dest"
    first_of_shard_1 = ShardReader(run_dir / "shard-00001.parquet").sample_ids()[0]
    target = peer_formats.specforge_path(first_of_shard_1)
    write_bytes = destination.Destination.write_bytes

    def flip_after_writing(self, relpath, data):  # the disk changes one bit of the file once it is written
        size = write_bytes(self, relpath, data)
        if relpath == target:
            with open(self.path(relpath), "r+b") as file:
                file.seek(size // 2)
                byte = file.read(1)
                file.seek(size // 2)
                file.write(bytes([byte[0] ^ 0x10]))
        return size

    monkeypatch.setattr(destination.Destination, "write_bytes", flip_after_writing)
    assert export(run_dir, "specforge", dest, "consume=true") == EXIT_FAULT
    error = capsys.readouterr().err
    assert f"{dest}/{target} reads back as" in error and "shard-00001.parquet is kept" in error, error
    locations = [r["location"] for r in read_manifest(run_dir)["shards"]]
    assert locations[:2] == [CONSUMED, LOCAL] and (run_dir / "shard-00001.parquet").exists()
    monkeypatch.undo()

    # a file whose bytes are what was written but whose content is not the sample's (a formatter gone wrong)
    specforge_file = peer_formats.specforge_file
    last_of_shard_2 = ShardReader(run_dir / "shard-00002.parquet").sample_ids()[-1]

    def wrong_states(sample):
        payload = specforge_file(sample)
        if sample.sample_id == last_of_shard_2:
            payload["aux_hidden_state"] = payload["aux_hidden_state"].flip(1)  # the tokens' states reversed
        return payload

    monkeypatch.setattr(peer_formats, "specforge_file", wrong_states)
    assert export(run_dir, "specforge", dest, "consume=true") == EXIT_FAULT
    error = capsys.readouterr().err
    assert f"{peer_formats.specforge_path(last_of_shard_2)} loads with" in error, error
    assert "shard-00002.parquet is kept" in error and (run_dir / "shard-00002.parquet").exists()
    assert [r["location"] for r in read_manifest(run_dir)["shards"]][:3] == [CONSUMED, CONSUMED, LOCAL]
    monkeypatch.undo()

    assert export(run_dir, "specforge", dest, "consume=true") == 0  # both files written again, verified
    assert not list(run_dir.glob("shard-*.parquet"))
    assert_peers_read_the_run("specforge", dest, shaped_runs["post"])


def test_consume_refuses_what_it_cannot_do_safely(shaped_runs, tmp_path, capsys):
    run_dir = consumable_copy(shaped_runs, "post", tmp_path)
    holder = subprocess.Popen([sys.executable, "-c", LOCK_HOLDER.format(root=str(REPO_ROOT)), str(run_dir)],
                              stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        assert export(run_dir, "specforge", tmp_path / "dest", "consume=true") == EXIT_LOCKED
        assert "is in use by another job" in capsys.readouterr().err
    finally:
        holder.kill()
        holder.wait()
    # a dest without room for the export's peak: refused before anything is written, saying what would fit
    run_bytes = allocated(run_dir)
    for free, consume, message in ((run_bytes // 2, "false", "with consume=true .* it needs .*, which fits"),
                                   (run_bytes // 100, "true", r"needs about .* more at its peak, but that filesystem has")):
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(consume_module.shutil, "disk_usage", lambda path, free=free: types.SimpleNamespace(free=free))
            assert export(run_dir, "specforge", tmp_path / "dest", f"consume={consume}") == EXIT_BUDGET_EXHAUSTED
        errors = capsys.readouterr().err
        assert re.search(message, errors) and f"has {format_bytes(free)} free" in errors, errors
        assert not (tmp_path / "dest").exists()
    listed = tmp_path / "listed"  # shard files without a manifest: nothing to record the consumption in
    listed.mkdir()
    shutil.copy(run_dir / "shard-00000.parquet", listed)
    assert export(listed, "specforge", tmp_path / "dest", "consume=true") == 2
    assert "not a local output.dir with a .manifest.json" in capsys.readouterr().err
    assert (listed / "shard-00000.parquet").exists() and len(shard_bytes(run_dir)) == SAMPLES // SHARD_SIZE


def test_a_full_disk_under_dest_stops_with_exit_3_and_the_rerun_resumes(shaped_runs, tmp_path, capsys):
    """dest's filesystem really full: refused before writing (exit 3, the sizes named); full once writing (the
    estimate passed, another process took the room): exit 3 naming dest, no traceback; freed, the rerun completes."""
    run_dir = consumable_copy(shaped_runs, "post", tmp_path)
    with small_disk(tmp_path / "disk", "64m") as disk:
        dest = disk / "dest"
        fill_disk(disk / "filler")
        free = shutil.disk_usage(disk).free
        assert export(run_dir, "specforge", dest, "consume=true") == EXIT_BUDGET_EXHAUSTED
        errors = capsys.readouterr().err
        assert f"but that filesystem has {format_bytes(free)} free. Free space there, then rerun" in errors, errors
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(consume_module.shutil, "disk_usage", lambda path: types.SimpleNamespace(free=1 << 40))
            assert export(run_dir, "specforge", dest, "consume=true") == EXIT_BUDGET_EXHAUSTED
        errors = capsys.readouterr().err
        assert f"error: the disk under {dest} is full (OSError: [Errno 28] No space left on device" in errors, errors
        assert "rerun the same command: it resumes" in errors and "Traceback" not in errors
        (disk / "filler").unlink()
        assert export(run_dir, "specforge", dest, "consume=true") == EXIT_OK, capsys.readouterr().err
        assert not list(run_dir.glob("shard-*.parquet")) and not list(dest.rglob("*.tmp"))
        assert_peers_read_the_run("specforge", dest, shaped_runs["post"])


def test_the_token_count_is_made_only_while_the_whole_run_is_there(shaped_runs, tmp_path):
    """maybe_write_token_freq (the end of a run; consume=true before its first deletion) writes .token_freq.pt
    only for a complete run with every shard file in output.dir, and never over one already there."""
    run_dir = consumable_copy(shaped_runs, "pre", tmp_path)
    made_by_the_run = read_token_freq(run_dir)  # the job wrote it at the end of the run that completed it
    (run_dir / ".token_freq.pt").unlink()
    moved = run_dir / "shard-00002.parquet"
    moved.rename(tmp_path / moved.name)  # on another node's disk, say
    assert maybe_write_token_freq(run_dir) is None and read_token_freq(run_dir) is None
    (tmp_path / moved.name).rename(moved)
    manifest = Manifest.open(run_dir, read_manifest(run_dir)["content"], [])
    manifest.update(5, state="failed", error="a test")
    manifest.close()
    assert maybe_write_token_freq(run_dir) is None
    manifest = Manifest.open(run_dir, read_manifest(run_dir)["content"], [])
    manifest.update(5, state="done", error="")
    manifest.close()
    assert maybe_write_token_freq(run_dir) == run_dir / ".token_freq.pt"
    counts = read_token_freq(run_dir)
    assert counts == made_by_the_run and sum(counts.values()) > 0
    assert maybe_write_token_freq(run_dir) is None and read_token_freq(run_dir) == counts


@pytest.mark.parametrize("link", ["symbolic", "hard"])
def test_a_link_planted_as_the_token_count_is_never_read_or_written_through(shaped_runs, tmp_path, link):
    """A planted ``.token_freq.pt`` (a link to a count that is not the run's) is not read: the dataset counts from
    the shards; the next count replaces the link, and the file it pointed to is untouched."""
    import torch

    run_dir = consumable_copy(shaped_runs, "pre", tmp_path)
    counts = read_token_freq(run_dir)
    fake = tmp_path / "fake.pt"
    torch.save({1: 999}, fake)
    fake_bytes = fake.read_bytes()
    (run_dir / ".token_freq.pt").unlink()
    if link == "symbolic":
        (run_dir / ".token_freq.pt").symlink_to(fake)
    else:
        os.link(fake, run_dir / ".token_freq.pt")
    assert read_token_freq(run_dir) is None
    assert HiddenStatesDataset(run_dir).token_freq() == counts
    assert maybe_write_token_freq(run_dir) == run_dir / ".token_freq.pt"
    assert read_token_freq(run_dir) == counts and not (run_dir / ".token_freq.pt").is_symlink()
    assert fake.read_bytes() == fake_bytes and os.stat(fake).st_nlink == 1


@pytest.mark.parametrize("to", ["specforge", "speculators"])
def test_a_rerun_of_a_complete_export_writes_again_what_is_gone_or_cut_short(shaped_runs, tmp_path, capsys, to):
    """A complete export with one file deleted and another of another shard cut short (speculators: its dataset's
    Arrow file deleted too): the plain rerun (a real process, knowing only what is on disk) does not call it
    complete; it writes exactly those again, and the export is as it was."""
    run_dir = shaped_runs["pre" if to == "speculators" else "post"]
    dest = tmp_path / "dest"

    assert export(run_dir, to, dest) == EXIT_OK
    files = {path.relative_to(dest): path.read_bytes() for path in sorted(dest.rglob("*")) if path.is_file()
             and not path.name.startswith(".")}
    samples = sorted(path for path in files if path.suffix in (".ckpt", ".safetensors"))
    deleted, cut = dest / samples[0], dest / samples[-1]  # the first and the last shard's
    deleted.unlink()
    cut.write_bytes(files[samples[-1]][: len(files[samples[-1]]) // 2])
    for arrow in dest.glob("data-*.arrow"):
        arrow.unlink()
    again = subprocess.run([sys.executable, "-m", "jobs.export", f"output.dir={run_dir}", f"to={to}", f"dest={dest}"],
                           cwd=REPO_ROOT, env=python_env(), capture_output=True, text=True, timeout=600)
    assert again.returncode == EXIT_OK, again.stderr[-3000:]
    assert "holds the complete" not in again.stdout and "written" in again.stdout, again.stdout
    after = {path.relative_to(dest): path.read_bytes() for path in sorted(dest.rglob("*")) if path.is_file()
             and not path.name.startswith(".")}
    assert after.keys() == files.keys()  # the dataset's state.json names a new fingerprint; its files are the same
    assert {path: data for path, data in after.items() if path.name != "state.json"} == \
        {path: data for path, data in files.items() if path.name != "state.json"}
    assert_peers_read_the_run(to, dest, run_dir)
    capsys.readouterr()
    assert export(run_dir, to, dest) == EXIT_OK
    assert "holds the complete" in capsys.readouterr().out


def flip_first_loss_mask_one(arrow: Path, loss_mask: list[int]) -> None:
    """Change, in the dataset's Arrow file, the first 1 of a row's loss mask (its int64 values found in the file) to 0."""
    data = bytearray(arrow.read_bytes())
    where = bytes(data).find(np.asarray(loss_mask, dtype=np.int64).tobytes())
    assert where >= 0
    data[where + 8 * loss_mask.index(1)] = 0
    arrow.write_bytes(bytes(data))


def test_the_token_rows_of_a_consumed_speculators_export_are_checked(shaped_runs, tmp_path, capsys):
    """After consume=true to speculators the loss masks are in the export only: in its dataset (data-*.arrow and the
    files beside it, recorded when the export completed) and in the rows files it is made from (.export-rows/, listed
    with each shard's files). A loss-mask byte changed in the dataset, or a dataset file deleted, is found by
    jobs.verify (naming the file) and by the export's rerun, which writes the dataset again from the rows files; a
    rows file changed is found by both, the rerun stopping with exit 4 and naming it."""
    import datasets

    from jobs.verify import format_report, verify

    run_dir = consumable_copy(shaped_runs, "pre", tmp_path)
    dest = tmp_path / "dest"
    assert export(run_dir, "speculators", dest, "consume=true") == EXIT_OK
    report = verify(run_dir)
    assert report.ok and report.exported_files_checked == SAMPLES + SAMPLES // SHARD_SIZE + 4, format_report(report)
    mask = list(datasets.load_from_disk(str(dest))[0]["loss_mask"])
    arrow = next(dest.glob("data-*.arrow"))

    flip_first_loss_mask_one(arrow, mask)
    assert list(datasets.load_from_disk(str(dest))[0]["loss_mask"]) != mask
    report = verify(run_dir)
    assert [problem.where for problem in report.problems] == [str(arrow)], format_report(report)
    assert "its checksum is not the one recorded when the export completed" in report.problems[0].what
    capsys.readouterr()
    assert export(run_dir, "speculators", dest, "consume=true") == EXIT_OK
    assert "nothing to do" not in capsys.readouterr().out
    assert list(datasets.load_from_disk(str(dest))[0]["loss_mask"]) == mask and verify(run_dir).ok

    arrow.unlink()
    report = verify(run_dir)
    assert [(problem.where, problem.what.split(":")[0]) for problem in report.problems] == [(str(arrow), "missing")]
    assert export(run_dir, "speculators", dest) == EXIT_OK and verify(run_dir).ok
    assert_peers_read_the_run("speculators", dest, shaped_runs["pre"])

    rows = dest / ".export-rows" / "shard-00002.arrow"
    data = bytearray(rows.read_bytes())
    data[len(data) // 2] ^= 0x01
    rows.write_bytes(bytes(data))
    report = verify(run_dir)
    assert [problem.where for problem in report.problems] == [str(rows)], format_report(report)
    assert export(run_dir, "speculators", dest, "consume=true") == EXIT_FAULT
    assert f"{dest}/.export-rows/shard-00002.arrow: " in capsys.readouterr().err


def test_a_damaged_shard_is_refused_naming_it_not_taken_for_a_stop(shaped_runs, tmp_path, capsys):
    """A shard file whose page fails its CRC, met mid-export (consume=true): a refusal (exit 2) naming the file, the
    shard and the commands that restore it, not a fault that a rerun would meet again; the shards before it are
    consumed, it and those after it kept. A shard cut short is refused the same way before anything is written."""
    run_dir = consumable_copy(shaped_runs, "post", tmp_path)
    dest = tmp_path / "dest"
    flip_middle(run_dir / "shard-00003.parquet")
    assert export(run_dir, "specforge", dest, "consume=true") == EXIT_BAD_INPUT
    error = capsys.readouterr().err
    assert f"{run_dir / 'shard-00003.parquet'} (shard 3, row group 0: sample ids " in error, error
    assert f"python -m jobs.verify output.dir={run_dir}`" in error and "with shards=[3]" in error, error
    assert "resume" not in error, error
    assert [r["location"] for r in read_manifest(run_dir)["shards"]] == [CONSUMED] * 3 + [LOCAL] * 5

    cut = run_dir / "shard-00005.parquet"
    cut.write_bytes(cut.read_bytes()[:1000])
    assert export(run_dir, "specforge", dest, "consume=true") == EXIT_BAD_INPUT
    error = capsys.readouterr().err
    assert f"{cut} (shard 5): cannot be read (Parquet magic bytes not found" in error and "shards=[5]" in error, error
