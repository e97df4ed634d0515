"""Faults while the job starts, through real processes: the extractor killed while its model loads.

The extractor is this test session's own Ray worker (a descendant of this process), found by the title
Ray gives it while its constructor runs (``ray::ExtractorActor.__init__``: the model is loading).
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
from pathlib import Path
from typing import Optional

import psutil
import pytest

from jobs.errors import EXIT_OK
from jobs.extract import main
from jobs.inputs.demo import build_synthetic_dataset
from jobs.rundir.summary import read_summary
from tests.helpers import assert_every_sample_once

LOADING = "ray::ExtractorActor.__init__"
"""Ray's title for the extractor's process while its constructor (the model load) runs."""
NUM_SAMPLES = 16
SHARD_SIZE = 4


@pytest.fixture(scope="module")
def dataset(tmp_path_factory) -> Path:
    return build_synthetic_dataset(
        tmp_path_factory.mktemp("start-faults") / "data.parquet", num_samples=NUM_SAMPLES, min_len=20, max_len=60, seed=5
    )


def loading_extractors() -> list[psutil.Process]:
    found = []
    for process in psutil.Process().children(recursive=True):
        try:
            if " ".join(process.cmdline()).startswith(LOADING):
                found.append(process)
        except psutil.Error:
            pass  # exited while we looked
    return found


class KillWhileLoading(threading.Thread):
    """SIGKILLs the first extractor seen loading its model (once), while the job runs in the main thread."""

    def __init__(self) -> None:
        super().__init__(daemon=True)
        self.killed: Optional[int] = None
        self._quit = threading.Event()

    def run(self) -> None:
        deadline = time.monotonic() + 300
        while not self._quit.is_set() and time.monotonic() < deadline:
            for process in loading_extractors():
                os.kill(process.pid, signal.SIGKILL)
                self.killed = process.pid
                return
            time.sleep(0.01)

    def __enter__(self) -> "KillWhileLoading":
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self._quit.set()
        self.join()


def test_the_extractor_killed_while_its_model_loads_is_started_again(ray_cluster, llama_fp32, dataset, tmp_path, caplog):
    """A death during the first load counts as one of extract.max_restarts, as a death later does; the run
    completes in the same process, every sample once."""
    caplog.set_level(logging.INFO)
    out = tmp_path / "out"
    args = [f"model.path={llama_fp32}", f"data.path={dataset}", f"output.dir={out}", f"data.shard_size={SHARD_SIZE}",
            "model.device=cpu", "model.dtype=float32", "output.min_free_bytes=0", "extract.max_restarts=1"]
    with KillWhileLoading() as killer:
        code = main(args)
    assert killer.killed is not None, "no extractor was seen loading its model"
    summary = read_summary(out)
    assert code == EXIT_OK, summary["message"]
    assert summary["extractor_restarts"] == 1 and summary["shards_done"] == NUM_SAMPLES // SHARD_SIZE
    died = [record.getMessage() for record in caplog.records if "starting it again (1 of at most 1" in record.getMessage()]
    assert died and "while loading the model" in died[0], died
    assert_every_sample_once(out, dataset)
