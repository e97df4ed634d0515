"""The job's start through real processes: the writers up while the model loads; faults while it starts (the
extractor killed while its model loads, a signal while the driver starts its private Ray cluster).

The actors are this test session's own Ray workers (descendants of this process), found by the titles Ray
gives them: ``ray::ExtractorActor.__init__`` while the extractor's constructor runs (the model is loading),
``ray::WriterActor`` and ``ray::WriterActor.<method>`` once a writer's constructor has returned.
"""

from __future__ import annotations

import logging
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from inputs.demo import build_synthetic_dataset
from jobs.extract import main
from jobs.rundir.summary import read_summary
from runtime.errors import EXIT_OK
from runtime.lock import LOCK_FILE
from storage.reader import ShardReader
from tests.conftest import REPO_ROOT
from tests.helpers import When, alive, assert_every_sample_once, descendants, python_env, sigkill

LOADING = "ray::ExtractorActor.__init__"
"""Ray's title for the extractor's process while its constructor (the model load) runs."""
WRITER = "ray::WriterActor"
NUM_SAMPLES = 16
SHARD_SIZE = 4


@pytest.fixture(scope="module")
def dataset(tmp_path_factory) -> Path:
    return build_synthetic_dataset(tmp_path_factory.mktemp("start-faults") / "data.parquet", num_samples=NUM_SAMPLES,
                                   min_len=20, max_len=60, seed=5)


def titles() -> list[tuple[psutil.Process, str]]:
    """This session's processes with the titles they have now."""
    found = []
    for process in psutil.Process().children(recursive=True):
        try:
            found.append((process, " ".join(process.cmdline())))
        except psutil.Error:
            pass  # exited while we looked
    return found


def loading_extractors() -> list[psutil.Process]:
    return [process for process, title in titles() if title.startswith(LOADING)]


def writer_up_while_loading() -> psutil.Process | None:
    """A writer seen up (its constructor returned) while an extractor still loads its model, if one is."""
    now = titles()
    if not any(title.startswith(LOADING) for _, title in now):
        return None
    return next((process for process, title in now
                 if title.startswith(WRITER) and not title.startswith(f"{WRITER}.__init__")), None)


def test_the_writers_are_up_while_the_model_loads(ray_cluster, llama_fp32, dataset, tmp_path, caplog):
    """The writers need nothing of the model before its first batch but what the shard files record of it (known
    once it has loaded): their processes start and answer while the extractor's constructor still loads the model,
    and the progress line says so; the shards record what the loaded model reported."""
    caplog.set_level(logging.INFO)
    out = tmp_path / "out"
    args = [f"model.path={llama_fp32}", f"data.path={dataset}", f"output.dir={out}", f"data.shard_size={SHARD_SIZE}",
            "model.device=cpu", "model.dtype=float32", "output.min_free=0", "output.num_writers=2",
            "progress.interval_s=0.2"]
    with When(writer_up_while_loading, lambda _: None) as watch:
        code = main(args)
    summary = read_summary(out)
    assert code == EXIT_OK, summary["message"]
    assert watch.done, "no writer was seen up while the extractor loaded its model"
    stages = [record.getMessage() for record in caplog.records if record.name == "runtime.display.stages"]
    assert any("0 of 1 extractors ready" in line and "2 of 2 writers ready" in line for line in stages), stages
    assert [phase for phase, _ in summary["wall_seconds"]["phases"]][4:6] == [
        "loading the model and starting the writers", "warming the object store"]
    metadata = ShardReader(next(out.glob("shard-*.parquet"))).metadata
    assert (metadata.sglang_version, metadata.layers_to_capture) == (
        summary["engine"]["sglang_version"], summary["engine"]["layers_to_capture"])
    assert_every_sample_once(out, dataset)


def test_a_writer_killed_while_the_model_loads_is_replaced_and_the_run_completes(ray_cluster, llama_fp32, dataset,
                                                                                 tmp_path, caplog):
    """The writers start with the model's load, so a writer can die in it (the load of a large model takes minutes):
    a new writer takes its slot and the run completes, every sample once."""
    caplog.set_level(logging.INFO)
    out = tmp_path / "out"
    args = [f"model.path={llama_fp32}", f"data.path={dataset}", f"output.dir={out}", f"data.shard_size={SHARD_SIZE}",
            "model.device=cpu", "model.dtype=float32", "output.min_free=0", "output.num_writers=2"]
    with When(writer_up_while_loading, sigkill) as killer:
        code = main(args)
    assert killer.done is not None, "no writer was seen up while the extractor loaded its model"
    summary = read_summary(out)
    assert code == EXIT_OK, summary["message"]
    assert any("died while the model loaded; starting a new one in its place" in record.getMessage()
               for record in caplog.records)
    assert summary["shards_done"] == NUM_SAMPLES // SHARD_SIZE
    assert_every_sample_once(out, dataset)


def test_the_extractor_killed_while_its_model_loads_is_started_again(ray_cluster, llama_fp32, dataset, tmp_path,
                                                                    caplog):
    """A death during the first load counts as one of extract.max_restarts, as a death later does; the run
    completes in the same process, every sample once."""
    caplog.set_level(logging.INFO)
    out = tmp_path / "out"
    args = [f"model.path={llama_fp32}", f"data.path={dataset}", f"output.dir={out}", f"data.shard_size={SHARD_SIZE}",
            "model.device=cpu", "model.dtype=float32", "output.min_free=0", "extract.max_restarts=1",
            "output.num_writers=1"]  # the extractor's restart is the point: a second writer is a second actor's start
    with When(lambda: next(iter(loading_extractors()), None), sigkill) as killer:
        code = main(args)
    assert killer.done is not None, "no extractor was seen loading its model"
    summary = read_summary(out)
    assert code == EXIT_OK, summary["message"]
    assert summary["extractor_restarts"] == 1 and summary["shards_done"] == NUM_SAMPLES // SHARD_SIZE
    logged = [record.getMessage() for record in caplog.records]
    died = [text for text in logged if "starting it again (1 of at most 1" in text]
    assert died and "while loading the model" in died[0], died
    assert_every_sample_once(out, dataset)


@pytest.mark.parametrize("signum", [
    signal.SIGTERM, pytest.param(signal.SIGINT, marks=pytest.mark.extended),
])
def test_a_signal_while_ray_starts_ends_the_run_interrupted_with_no_process_left(llama_fp32, demo_dataset, tmp_path,
                                                                                 signum):
    """The signal comes while the driver starts its private cluster (its GCS is up, the raylet and the
    dashboard's agents are starting): the cluster comes up whole, is shut down, and the run ends as
    interrupted with its summary; every process it started is gone."""
    out = tmp_path / "out"
    args = [f"model.path={llama_fp32}", f"data.path={demo_dataset}", f"output.dir={out}", "model.device=cpu",
            "output.min_free=0", "data.shard_size=8"]
    with open(tmp_path / "stderr", "w+") as stderr:
        job = subprocess.Popen([sys.executable, "-m", "jobs.extract", *args], cwd=REPO_ROOT, env=python_env(),
                               stdout=subprocess.DEVNULL, stderr=stderr)
        started: dict[int, psutil.Process] = {}  # every process of the driver's tree, seen while it ran
        names: set[str] = set()
        sent = False
        deadline = time.monotonic() + 300
        while job.poll() is None and time.monotonic() < deadline:
            for process in descendants(job.pid):
                started.setdefault(process.pid, process)
                names.add(_name(process))  # again each time: a process seen between its fork and exec is "python"
            if not sent and any(_is_gcs(process) for process in started.values()):
                job.send_signal(signum)  # ray.init has started the GCS and goes on with the rest
                sent = True
            time.sleep(0.02)
        job.wait(timeout=60)
        stderr.seek(0)
        errors = stderr.read()
    assert sent, "the driver's GCS was never seen"
    assert job.returncode == 128 + signum, errors[-3000:]
    assert f"error: stopped by {signal.Signals(signum).name}" in errors, errors[-3000:]
    assert "Traceback" not in errors, errors[-3000:]
    summary = read_summary(out)
    assert summary is not None, "no .summary.json"
    assert (summary["outcome"], summary["exit_code"]) == ("interrupted", 128 + signum)
    assert not (out / LOCK_FILE).exists()
    assert "raylet" in names, names  # the cluster really was starting
    gone_by = time.monotonic() + 30
    while alive(started) and time.monotonic() < gone_by:
        time.sleep(0.5)
    assert not alive(started), alive(started)


def _name(process: psutil.Process) -> str:
    try:
        return process.name()
    except psutil.Error:
        return ""


def _is_gcs(process: psutil.Process) -> bool:
    return "gcs_server" in _name(process)

