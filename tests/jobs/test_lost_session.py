"""The ground going away under a running job, through real processes: the SSH session it was started from drops
(SIGHUP), then, under its rerun, the Ray head's GCS is stopped (as ``ray stop`` stops it). Each ends the run with a
summary and an exit code that say so, the lock released, no process of the run left; a plain rerun resumes it,
and the last one completes it, every sample once."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable

import psutil
import pytest

from inputs.demo import build_synthetic_dataset
from jobs.cluster.watch import LOST_AFTER_S
from jobs.rundir.summary import read_summary
from runtime.errors import EXIT_BAD_INPUT, EXIT_FAULT, EXIT_OK
from runtime.lock import LOCK_FILE
from storage.manifest import DONE, PENDING, read_manifest
from tests.conftest import REPO_ROOT
from tests.helpers import alive, assert_every_sample_once, descendants, python_env, session_ray_address

LONG_SAMPLES = 300
SHARD_SIZE = 4
RAY_OWN_LIMIT_S = 60
"""Ray ends a driver whose GCS has not answered for this long (``gcs_rpc_server_reconnect_timeout_s``)."""


@pytest.fixture(scope="module")
def long_dataset(tmp_path_factory) -> Path:
    """Long enough (most of a minute here) that the run is still extracting when its cluster goes, twice: the
    second time for the 10 s (``LOST_AFTER_S``) its driver takes to notice, and well beyond."""
    return build_synthetic_dataset(tmp_path_factory.mktemp("lost-cluster") / "data.parquet", num_samples=LONG_SAMPLES,
                                   min_len=20, max_len=60, seed=9)


def job_args(model: Path, data: Path, out: Path) -> list[str]:
    return [f"model.path={model}", f"data.path={data}", f"output.dir={out}", f"data.shard_size={SHARD_SIZE}",
            "model.device=cpu", "model.dtype=float32", "output.min_free=0", "output.num_writers=1"]


def extract(args: list[str], *extra: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "jobs.extract", *args, *extra], cwd=REPO_ROOT, env=python_env(),
                          capture_output=True, text=True, timeout=600)


def _name(process: psutil.Process) -> str:
    try:
        return process.name()
    except psutil.Error:
        return ""


def run_until(args: list[str], stderr, ready: Callable[[dict[int, psutil.Process]], bool]):
    """Start the job in a session of its own (as a login shell starts it); returns it and every process of its tree
    seen, once ``ready`` says so (with those processes)."""
    job = subprocess.Popen([sys.executable, "-m", "jobs.extract", *args], cwd=REPO_ROOT, env=python_env(),
                           stdout=subprocess.DEVNULL, stderr=stderr, start_new_session=True)
    started: dict[int, psutil.Process] = {}
    deadline = time.monotonic() + 300
    while job.poll() is None and time.monotonic() < deadline:
        for process in descendants(job.pid):
            started.setdefault(process.pid, process)
        if ready(started):
            return job, started
        time.sleep(0.1)
    job.kill()
    stderr.seek(0)
    raise AssertionError(f"the run never got there: {stderr.read()[-3000:]}")


def some_shard_done(out: Path) -> bool:
    try:
        states = [record["state"] for record in read_manifest(out)["shards"]]
    except ValueError:
        return False
    return DONE in states and PENDING in states


def assert_nothing_left(started: dict[int, psutil.Process], out: Path) -> None:
    assert not (out / LOCK_FILE).exists()
    gone_by = time.monotonic() + 30
    while alive(started) and time.monotonic() < gone_by:
        time.sleep(0.5)
    assert not alive(started), alive(started)


def done_count(out: Path) -> int:
    try:
        return sum(record["state"] == DONE for record in read_manifest(out)["shards"])
    except ValueError:
        return 0


def test_sighup_then_the_head_stopped_each_end_the_run_and_a_plain_rerun_resumes_it(ray_cluster, llama_fp32,
                                                                                    long_dataset, tmp_path):
    """One output.dir through both losses, each the same plain command on a private cluster of its own:

    1. A dropped SSH session: SIGHUP to the job's whole process group, the private Ray cluster it started
       included. The cluster does not die under the driver; the run winds down as on Ctrl-C: exit 129.
    2. Its plain rerun resumes it (the done shards kept, not run again); while it writes shards, SIGTERM to the
       GCS of its cluster (what ``ray stop`` sends it): the driver notices within seconds, not when Ray ends it
       after a minute (exit 1, the summary still ``running``); the summary says ``cluster_lost``, exit 4; the
       manifest keeps every done shard; ``shards=failed`` does not say "nothing to do" while shards are pending.
    3. The same command completes the run, every sample once (joined to this session's cluster: where its cluster
       comes from is not the point of this step, and a private one costs a cluster's start).
    The first two end with their summary and exit code, the lock released and no process of the run left."""
    out = tmp_path / "out"
    args = job_args(llama_fp32, long_dataset, out)
    with open(tmp_path / "stderr-sighup", "w+") as stderr:
        job, started = run_until(args, stderr, lambda started: some_shard_done(out))
        os.killpg(job.pid, signal.SIGHUP)
        job.wait(timeout=120)
        stderr.seek(0)
        errors = stderr.read()
    assert job.returncode == 128 + signal.SIGHUP, f"SIGHUP: {errors[-3000:]}"
    assert "error: stopped by SIGHUP" in errors and "Traceback" not in errors, f"SIGHUP: {errors[-3000:]}"
    summary = read_summary(out)
    assert (summary["outcome"], summary["exit_code"]) == ("interrupted", 129), f"SIGHUP: {json.dumps(summary)[:2000]}"
    assert_nothing_left(started, out)
    done_before = {record["index"] for record in read_manifest(out)["shards"] if record["state"] == DONE}

    with open(tmp_path / "stderr-head", "w+") as stderr:
        job, started = run_until(args, stderr, lambda started: done_count(out) > len(done_before))
        gcs = [process for process in started.values() if "gcs_server" in _name(process)]
        assert len(gcs) == 1, [_name(process) for process in started.values()]
        gcs[0].send_signal(signal.SIGTERM)
        stopped = time.monotonic()
        job.wait(timeout=RAY_OWN_LIMIT_S + 60)
        took = time.monotonic() - stopped
        stderr.seek(0)
        errors = stderr.read()
    print(f"the job ended {took:.1f} s after its GCS was stopped")
    assert job.returncode == EXIT_FAULT, f"head stopped: {errors[-3000:]}"
    assert took < RAY_OWN_LIMIT_S, took
    assert "error: the Ray cluster is gone" in errors and "Traceback" not in errors, f"head stopped: {errors[-3000:]}"
    summary = read_summary(out)
    assert (summary["outcome"], summary["exit_code"]) == ("cluster_lost", EXIT_FAULT), json.dumps(summary)[:2000]
    records = read_manifest(out)["shards"]
    done = [record for record in records if record["state"] == DONE]
    assert done and summary["shards_done"] == len(done)
    assert all((out / record["file"]).stat().st_size == record["bytes"] for record in done)
    resumed = {record["index"]: record["attempts"] for record in records if record["index"] in done_before}
    assert resumed == dict.fromkeys(done_before, 1), f"the rerun after SIGHUP ran done shards again: {resumed}"
    assert_nothing_left(started, out)

    pending = sum(record["state"] == PENDING for record in records)
    if not any(record["state"] == "failed" for record in records):
        failed_only = extract(args, "shards=failed")
        assert failed_only.returncode == EXIT_BAD_INPUT, failed_only.stdout + failed_only.stderr[-3000:]
        assert f"none failed, but {pending} of {len(records)} are still pending" in failed_only.stderr
        assert "Rerun without shards=failed" in failed_only.stderr
    rerun = extract(args, f"ray.address={session_ray_address()}")
    assert rerun.returncode == EXIT_OK, rerun.stderr[-3000:]
    assert_every_sample_once(out, long_dataset)
    assert LOST_AFTER_S < RAY_OWN_LIMIT_S / 2
