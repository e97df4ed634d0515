"""Every outcome tells the truth: refusals before Ray with exit 2 (or 3) naming the key, reruns that check
what they trust, a changed input caught, signals during a Ray call, upload failures that are not "complete".

Commands run as real processes where the exit code, the lack of a Ray start or what is left on disk is the
point; the rest through the job's own ``run``/``main`` on the session's Ray cluster.
"""

from __future__ import annotations

import json
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from inputs.dataset import open_tokenized_dataset
from inputs.demo import build_tiny_model
from jobs.cli import run_command
from jobs.config import load_config
from jobs.driver.job import run
from jobs.rundir.summary import read_summary
from runtime.errors import EXIT_BAD_INPUT, EXIT_BUDGET_EXHAUSTED, EXIT_SIGNAL_BASE, EXIT_VERIFY_FAILED
from runtime.lock import LOCK_FILE
from storage import ShardReader
from storage.checksum import of_bytes
from storage.consumed import consume_shard, record_name
from storage.manifest import CONSUMED, DONE, MANIFEST_FILE, read_manifest
from tests.conftest import REPO_ROOT
from tests.helpers import (
    FINISHED_RUN,
    assert_every_sample_once,
    assert_run_verifies,
    copy_of,
    fill_disk,
    job_args,
    job_config,
    python_env,
    session_ray_address,
    small_disk,
)

RAY_STARTED = ("Started a local Ray instance", "started a private Ray cluster")


def extract(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "jobs.extract", *args], cwd=REPO_ROOT, env=python_env(),
                          capture_output=True, text=True, timeout=timeout)


def base_args(model: Path, data: Path, out: Path) -> list[str]:
    return [f"model.path={model}", f"data.path={data}", f"output.dir={out}", "model.device=cpu",
            "output.min_free=0", "data.shard_size=8"]


@pytest.fixture(scope="module")
def deepseek(tmp_path_factory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("deepseek") / "model", arch="deepseek_v3", q_lora_rank=None)


@pytest.mark.parametrize("case", [
    "output_dir_unwritable", "output_dir_inside_data", "output_dir_holds_data", "output_dir_matched_by_glob",
    "min_free_above_disk", "negative_shard", "unknown_shard", "nan_wait", "inf_interval", "sink_unwritable",
    "unreadable_input",
])
def test_setup_errors_are_refused_before_ray_naming_the_key(llama_fp32, demo_dataset, tmp_path, case):
    out, data = tmp_path / "out", demo_dataset
    extra: list[str] = []
    code, key = EXIT_BAD_INPUT, ""
    if case == "output_dir_unwritable":
        (tmp_path / "a-file").write_text("")
        out, key = tmp_path / "a-file" / "out", "output.dir"
    elif case == "output_dir_inside_data":
        data = tmp_path / "data"
        data.mkdir()
        shutil.copy2(demo_dataset, data / "part-0.parquet")
        out, key = data / "run", "is inside data.path"
    elif case == "output_dir_holds_data":  # a glob over it, or the directory as data.path, would read the shards
        data = tmp_path / "tokens.parquet"
        shutil.copy2(demo_dataset, data)
        out, key = tmp_path, f"output.dir={tmp_path} is the directory that holds data.path={data}"
    elif case == "output_dir_matched_by_glob":
        (tmp_path / "tokens-a").mkdir()
        shutil.copy2(demo_dataset, tmp_path / "tokens-a" / "part.parquet")
        data, out = f"{tmp_path}/tokens-*/*.parquet", tmp_path / "tokens-states"
        key = f"output.dir={out} is matched by the glob data.path={data}"
    elif case == "min_free_above_disk":
        extra, code, key = ["output.min_free=1PB"], EXIT_BUDGET_EXHAUSTED, "output.min_free"
    elif case == "negative_shard":
        extra, key = ["shards=[-1]"], "shards=[-1]"
    elif case == "unknown_shard":  # a new output.dir: known before Ray from the plan alone
        extra, key = ["shards=[999]"], "shards=[999]: the plan has shards 0..2, not [999]"
    elif case == "nan_wait":
        extra, key = ["output.budget_wait_s=nan"], "output.budget_wait_s=nan: must be a finite number"
    elif case == "inf_interval":
        extra, key = ["progress.interval_s=inf"], "progress.interval_s=inf: must be a finite number"
    elif case == "sink_unwritable":
        (tmp_path / "a-file").write_text("")
        extra, key = [f"output.sink=file://{tmp_path}/a-file/sink"], "output.sink="
    elif case == "unreadable_input":
        data = tmp_path / "data"
        data.mkdir()
        shutil.copy2(demo_dataset, data / "part-0.parquet")
        (data / "part-1.parquet").write_bytes(b"PAR1 this is not a parquet file")
        key = f"{data / 'part-1.parquet'}: cannot be read as parquet"
    args = base_args(llama_fp32, data, out)
    args = [a for a in args if not a.startswith("output.min_free")] + (
        [] if case == "min_free_above_disk" else ["output.min_free=0"]) + extra
    started = time.monotonic()
    result = extract(*args)
    assert result.returncode == code, result.stderr[-3000:]
    errors = [line for line in result.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and key in errors[0], result.stderr[-3000:]
    assert not any(text in result.stderr + result.stdout for text in RAY_STARTED), "Ray was started"
    assert not (out / MANIFEST_FILE).exists() and not (out / LOCK_FILE).exists()
    print(f"{case}: exit {result.returncode} after {time.monotonic() - started:.1f} s: {errors[0][:160]}")


def test_layers_sglang_cannot_capture_are_refused_before_ray(deepseek, demo_dataset, tmp_path):
    """deepseek_v2 adds +1 only when the first id is 1: no drafter ids make it capture [0, 2, 4]. The job
    refuses them with exit 2 before Ray starts, not as a fault (exit 4) after loading the model on every node."""
    out = tmp_path / "out"
    result = extract(*base_args(deepseek, demo_dataset, out), "extract.layers=[0,2,4]")
    assert result.returncode == EXIT_BAD_INPUT, result.stderr[-3000:]
    errors = [line for line in result.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and errors[0].startswith("error: extract.layers=[0, 2, 4]: no drafter layer ids"), errors
    assert not any(text in result.stderr for text in RAY_STARTED)
    assert not (out / MANIFEST_FILE).exists()


def test_a_refused_ray_address_leaves_no_lock_file(llama_fp32, demo_dataset, tmp_path):
    out = tmp_path / "out"
    result = extract(*base_args(llama_fp32, demo_dataset, out), "ray.address=127.0.0.1:1")
    assert result.returncode == EXIT_BAD_INPUT, result.stderr[-3000:]
    assert not (out / LOCK_FILE).exists() and not (out / MANIFEST_FILE).exists()


def test_a_rerun_extracts_again_the_shards_whose_files_are_damaged_or_lost(
    ray_cluster, llama_fp32, demo_dataset, finished_run, tmp_path,
):
    """Truncated, replaced or deleted files: the rerun looks before it says "nothing to do", and never takes a
    deleted file for consumed (exit 0, its samples gone, jobs.verify OK). A file is consumed only when its consumer
    declared it (``storage.consumed.consume_shard``); gone without that, it was lost: jobs.verify reports it missing
    (exit 6) and the rerun writes it again. ``shards=[i]`` writes a consumed one again on request. A rerun starts
    no more writers than it has shards to write."""
    out = copy_of(finished_run, tmp_path)
    config = job_config(llama_fp32, demo_dataset, out, *FINISHED_RUN)
    files = sorted(out.glob("shard-*.parquet"))
    untouched = {files[4].name: files[4].stat().st_mtime_ns}
    with open(files[0], "r+b") as handle:  # truncated
        handle.truncate(files[0].stat().st_size // 2)
    files[1].unlink()  # deleted, by no consumer
    data = bytearray(files[2].read_bytes())  # same size, other content: only the checksum sees it
    data[len(data) // 2] ^= 0xFF
    files[2].write_bytes(bytes(data))

    verify = subprocess.run([sys.executable, "-m", "jobs.verify", f"output.dir={out}"], cwd=REPO_ROOT,
                            env=python_env(), capture_output=True, text=True, timeout=120)
    assert verify.returncode == EXIT_VERIFY_FAILED, verify.stdout + verify.stderr
    assert f"{files[1]}: missing: the manifest lists shard 1 as done here and no consumer declared it consumed" \
        in verify.stdout, verify.stdout
    assert "rerun the job's command with shards=[0,1,2]" in verify.stdout, verify.stdout

    consume_shard(files[3], "trainer run 7")  # declared, then deleted
    rerun = run(config)  # sizes only (the default): shards 0 and 1 again; shard 3 consumed, as its trainer said
    assert rerun["outcome"] == "complete" and rerun["this_run"]["shards_selected"] == 2
    records = {r["index"]: r for r in read_manifest(out)["shards"]}
    assert {i: r["attempts"] for i, r in records.items()} == {0: 2, 1: 2, 2: 1, 3: 1, 4: 1}
    assert (records[3]["state"], records[3]["location"]) == (DONE, CONSUMED)
    assert records[3]["consumed_into"] == "trainer run 7"
    assert not list(out.glob(".shard-*.consumed")), "the declaration is removed once the manifest records it"

    # with checksums: shard 2 too, written again with sha256 beside the others' xxh3_128, each checked with its own
    checksum = job_config(llama_fp32, demo_dataset, out, *FINISHED_RUN,
                          "output.resume_check=checksum", "output.checksum=sha256")
    again = run(checksum)
    assert again["this_run"]["shards_selected"] == 1
    assert (rerun["writers"], again["writers"]) == (2, 1), "a writer per shard to write, at most the node's two"
    records = {r["index"]: r for r in read_manifest(out)["shards"]}
    assert records[2]["attempts"] == 2 and records[2]["checksum"].startswith("sha256:")
    assert records[4]["checksum"].startswith("xxh3_128:")
    assert {files[4].name: files[4].stat().st_mtime_ns} == untouched
    assert run(checksum)["outcome"] == "nothing_to_do"
    assert run(job_config(llama_fp32, demo_dataset, out, *FINISHED_RUN,
                          "shards=[3]"))["this_run"]["shards_done"] == 1  # a consumed shard on request
    assert_every_sample_once(out, demo_dataset)


def test_an_input_file_changed_in_place_is_noticed(tmp_path):
    """Same size, other tokens: only the size was checked, and the states of the new tokens were written."""
    path = tmp_path / "tokens.parquet"
    rng = np.random.default_rng(0)
    rows = [rng.integers(0, 100, 16).tolist() for _ in range(8)]

    def write(rows: list[list[int]]) -> None:  # fixed-width pages: a changed token keeps the file's size
        pq.write_table(pa.table({"input_ids": pa.array(rows, pa.list_(pa.int32()))}), path, row_group_size=4,
                       compression="none", use_dictionary=False, write_statistics=False)

    write(rows)
    dataset = open_tokenized_dataset(str(path), vocab_size=100, max_length=64)
    assert dataset.rows(0, 4)[0][0].tolist() == rows[0]
    size = path.stat().st_size
    rows[6][3] = (rows[6][3] + 1) % 100
    write(rows)
    assert path.stat().st_size == size
    with pytest.raises(ValueError, match=r"tokens.parquet changed while the job ran \(the tokens of the rows from "
                                         r"sample id 4 on are not the ones checked"):
        dataset.rows(4, 8)


def test_a_full_disk_no_step_named_is_exit_3_not_a_fault(tmp_path, capsys):
    """Any command's write that meets a really full disk ends with exit 3 and what to do, without a traceback."""
    with small_disk(tmp_path / "disk", "1m") as disk:
        fill_disk(disk / "filler")
        code = run_command(lambda argv: (disk / "more").write_bytes(b"x" * 65536), [], fault_hint="rerun: it resumes")
    errors = capsys.readouterr().err
    assert code == EXIT_BUDGET_EXHAUSTED, errors
    assert errors == ("error: the disk is full (OSError: [Errno 28] No space left on device): free space on it; "
                      "rerun: it resumes\n")


def test_sigterm_during_the_model_load_ends_interrupted(ray_cluster, llama_fp32, demo_dataset, tmp_path):
    """The driver waits inside a Ray call while the extractor loads: the signal ends the run as interrupted,
    not as ``SystemError: <cyfunction CoreWorker.wait> returned a result with an exception set``, exit 4. The
    driver joins the session's cluster: where the cluster comes from is not the point (a signal while a private
    one starts: tests/jobs/test_start_faults.py)."""
    out = tmp_path / "out"
    args = [*base_args(llama_fp32, demo_dataset, out), f"ray.address={session_ray_address()}"]
    job = subprocess.Popen([sys.executable, "-m", "jobs.extract", *args],
                           cwd=REPO_ROOT, env=python_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline and read_summary(out) is None:  # written once Ray runs, before the load
        time.sleep(0.2)
    assert read_summary(out) is not None, job.communicate(timeout=60)[1][-3000:]
    job.send_signal(signal.SIGTERM)
    stdout, stderr = job.communicate(timeout=120)
    assert job.returncode == EXIT_SIGNAL_BASE + signal.SIGTERM, stderr[-3000:]
    assert "SystemError" not in stderr, stderr[-3000:]
    assert not any(line.startswith("Traceback") for line in stderr.splitlines()), stderr[-3000:]  # the driver's own
    summary = read_summary(out)
    assert (summary["outcome"], summary["exit_code"]) == ("interrupted", 143)
    assert not (out / LOCK_FILE).exists()
    assert all(r["state"] != DONE for r in read_manifest(out)["shards"])


def test_every_done_shard_of_a_run_that_exits_0_is_there_once(llama_fp32, demo_dataset, finished_run):
    summary = read_summary(finished_run)
    records = read_manifest(finished_run)["shards"]
    assert summary["exit_code"] == 0 and summary["shards_done"] == len(records) == 5
    assert sorted(p.name for p in finished_run.glob("shard-*.parquet")) == sorted(r["file"] for r in records)
    assert json.loads((finished_run / ".summary.json").read_text())["outcome"] == "complete"
    assert_every_sample_once(finished_run, demo_dataset)


def test_a_sink_where_the_run_keeps_its_shards_is_refused_before_ray(llama_fp32, demo_dataset, finished_run, tmp_path):
    """output.sink at output.dir (by name, through a link, or inside it) or at a node's output.node_dir: every
    upload would copy a shard onto itself (or into the run's own directory), then delete the local file.
    Refused before Ray starts, exit 2, and the done files of the run already there (a copy of a done run)
    untouched."""
    out = copy_of(finished_run, tmp_path)
    args = job_args(llama_fp32, demo_dataset, out, *FINISHED_RUN)
    before = {path.name: path.read_bytes() for path in out.glob("shard-*.parquet")}
    assert len(before) == 5
    (tmp_path / "link").symlink_to(out)
    cases = [
        ([f"output.sink=file://{out}"], f"output.sink=file://{out} is output.dir={out}"),
        ([f"output.sink={out}/"], "is output.dir="),
        ([f"output.sink=file://{tmp_path}/link"], f"output.sink=file://{tmp_path}/link is output.dir="),
        ([f"output.sink=file://{out}/uploads"], "is inside output.dir="),
        ([f"output.sink=file://{tmp_path}/nodes/gpu-3", f"output.node_dir={tmp_path}/nodes/{{node}}"],
         "is a node's directory (output.node_dir="),
        ([f"output.sink=file://{tmp_path}/nodes/gpu-3/up", f"output.node_dir={tmp_path}/nodes/{{node}}"],
         "is inside a node's directory (output.node_dir="),
        ([f"output.sink={tmp_path}/nvme/up", f"output.node_dir={tmp_path}/nvme"], "is inside a node's directory"),
    ]
    for extra, key in cases:
        result = extract(*args, *extra)
        assert result.returncode == EXIT_BAD_INPUT, (extra, result.stderr[-3000:])
        errors = [line for line in result.stderr.splitlines() if line.startswith("error: ")]
        assert len(errors) == 1 and key in errors[0], (extra, result.stderr[-3000:])
        assert not any(text in result.stderr + result.stdout for text in RAY_STARTED), "Ray was started"
        assert {path.name: path.read_bytes() for path in out.glob("shard-*.parquet")} == before
    assert not (out / "uploads").exists() and not (out / LOCK_FILE).exists()
    assert_every_sample_once(out, demo_dataset)


def test_a_sink_another_run_holds_is_refused_before_ray(llama_fp32, demo_dataset, finished_run, tmp_path):
    """An upload replaces a file of the same name and then deletes the local copy: a sink that is another run's
    (its claim: here a run's output.dir, which a run claims too) or that holds shard files no run of this output.dir
    uploaded would lose the other run's only copy. Refused before Ray starts, exit 2, the files there untouched."""
    other = copy_of(finished_run, tmp_path)
    loose = tmp_path / "loose"
    loose.mkdir()
    for path in other.glob("shard-*.parquet"):
        shutil.copy(path, loose / path.name)
    before = {path: path.read_bytes() for path in [*other.glob("shard-*.parquet"), *loose.iterdir()]}
    args = job_args(llama_fp32, demo_dataset, tmp_path / "mine", *FINISHED_RUN)
    cases = [
        (f"output.sink=file://{other}", f"output.sink=file://{other} belongs to the run whose output.dir is {finished_run}"),
        (f"output.sink={loose}", f"output.sink={loose} holds 5 shard files (e.g. shard-00000.parquet) that this run "
                                 "did not upload; nothing there was touched"),
    ]
    for sink, message in cases:
        result = extract(*args, sink)
        assert result.returncode == EXIT_BAD_INPUT, (sink, result.stderr[-3000:])
        errors = [line for line in result.stderr.splitlines() if line.startswith("error: ")]
        assert len(errors) == 1 and message in errors[0], (sink, result.stderr[-3000:])
        assert not any(text in result.stderr + result.stdout for text in RAY_STARTED), "Ray was started"
    assert {path: path.read_bytes() for path in before} == before
    assert sorted(path.name for path in loose.iterdir()) == sorted(path.name for path in other.glob("shard-*.parquet"))


def test_a_consumption_record_vouches_only_for_the_file_it_names(ray_cluster, llama_fp32, demo_dataset, finished_run,
                                                                tmp_path):
    """A ``.shard-N.parquet.consumed`` record is trusted only when it names the size and checksum the run recorded
    for that file: one left beside a file of another content (or written by hand) is dropped with a warning, at the
    next run while its file is there, or once the file is gone (then the shard was lost, and is written again);
    jobs.verify calls such a file missing. A consumer's own declaration still counts."""
    out = copy_of(finished_run, tmp_path)
    config = job_config(llama_fp32, demo_dataset, out, *FINISHED_RUN, "output.num_writers=1")  # records, not writers
    files = sorted(out.glob("shard-*.parquet"))
    samples = {path.name: sorted(s.sample_id for s in ShardReader(path)) for path in files}

    def declare(path: Path, size: int, checksum: str | None) -> None:
        """A record like the one consume_shard writes, for a file of ``size`` bytes and ``checksum``."""
        record = {"file": path.name, "bytes": size, "into": "an earlier trainer"}
        record.update({"checksum": checksum} if checksum else {})
        path.with_name(record_name(path.name)).write_text(json.dumps(record))

    other = bytearray(files[0].read_bytes())  # another file of that name and size: another content
    other[len(other) // 2] ^= 0xFF
    declare(files[0], len(other), of_bytes(bytes(other)))  # left beside a file that is still there
    declare(files[1], files[1].stat().st_size, of_bytes(bytes(other)))  # another file's, and its file then lost
    files[1].unlink()
    declare(files[2], files[2].stat().st_size, None)  # by hand: no checksum; its file then lost
    files[2].unlink()
    consume_shard(files[3], "trainer run 7")  # the consumer's own declaration

    verify = subprocess.run([sys.executable, "-m", "jobs.verify", f"output.dir={out}"], cwd=REPO_ROOT,
                            env=python_env(), capture_output=True, text=True, timeout=120)
    assert verify.returncode == EXIT_VERIFY_FAILED, verify.stdout + verify.stderr
    for lost in (1, 2):
        assert f"{files[lost]}: missing: the manifest lists shard {lost} as done here and no consumer declared it" \
            in verify.stdout, verify.stdout

    rerun = run(config)
    assert rerun["outcome"] == "complete" and rerun["this_run"]["shards_selected"] == 2
    records = {r["index"]: r for r in read_manifest(out)["shards"]}
    assert {i: r["attempts"] for i, r in records.items()} == {0: 1, 1: 2, 2: 2, 3: 1, 4: 1}
    assert (records[3]["location"], records[3]["consumed_into"]) == (CONSUMED, "trainer run 7")
    assert all(records[i]["location"] == "local" for i in (0, 1, 2, 4))
    assert not list(out.glob(".shard-*.consumed")), "every record was either recorded or dropped"
    # the shard whose stale record was dropped: lost now, it is lost (not consumed into nobody)
    files[0].unlink()
    assert run(config)["this_run"]["shards_selected"] == 1
    assert read_manifest(out)["shards"][0]["attempts"] == 2
    on_disk = {path.name: sorted(s.sample_id for s in ShardReader(path)) for path in sorted(out.glob("shard-*.parquet"))}
    assert on_disk == {name: ids for name, ids in samples.items() if name != files[3].name}  # each sample once
    assert_run_verifies(out)


def test_a_checkpoint_replaced_at_the_same_path_is_refused(ray_cluster, demo_dataset, tmp_path):
    """The manifest records what the checkpoint is (config.json and its weight files), not only where: weights
    replaced in place (same config, same sizes) are refused before Ray starts, exit 2, saying what changed and what
    to do, and jobs.verify notes it. A run recorded before the identity was resumes, and records it."""
    model = build_tiny_model(tmp_path / "model", arch="llama", dtype="float32", seed=1)
    out = tmp_path / "out"
    args = [*base_args(model, demo_dataset, out), "output.num_writers=1"]  # its three shards: one writer's start
    assert run(load_config(args))["shards_done"] == 3
    snapshot = json.loads((out / MANIFEST_FILE).read_text())
    identity = snapshot["content"].pop("model.checkpoint")  # as a run recorded before the identity wrote it
    assert identity.startswith("blake2b:")
    (out / MANIFEST_FILE).write_text(json.dumps(snapshot))
    assert run(load_config(args))["outcome"] == "nothing_to_do"
    assert read_manifest(out)["content"]["model.checkpoint"] == identity, "recorded by the resume"

    sizes = {path.name: path.stat().st_size for path in model.iterdir()}
    build_tiny_model(model, arch="llama", dtype="float32", seed=2)  # other weights, same path, config and sizes
    assert {path.name: path.stat().st_size for path in model.iterdir()} == sizes
    (out / "shard-00001.parquet").unlink()  # a rerun would write it again: with the other weights
    result = extract(*args)
    assert result.returncode == EXIT_BAD_INPUT, result.stderr[-3000:]
    errors = [line for line in result.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and f"model.path={model}: the checkpoint there is not the one the run in" in errors[0] \
        and "Point model.path at the checkpoint the run was extracted with" in errors[0], result.stderr[-3000:]
    assert not any(text in result.stderr + result.stdout for text in RAY_STARTED), "Ray was started"
    assert not (out / "shard-00001.parquet").exists() and read_manifest(out)["shards"][1]["attempts"] == 1
    verify = subprocess.run([sys.executable, "-m", "jobs.verify", f"output.dir={out}"], cwd=REPO_ROOT,
                            env=python_env(), capture_output=True, text=True, timeout=120)
    assert f"note: the checkpoint at model.path={model} is not the one this run was extracted with" in verify.stdout, \
        verify.stdout

    build_tiny_model(model, arch="llama", dtype="float32", seed=1)  # the run's own checkpoint back: it resumes
    assert run(load_config(args))["this_run"]["shards_done"] == 1
    assert_every_sample_once(out, demo_dataset)
