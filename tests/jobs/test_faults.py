"""Faults survived in the same run, through the real job: real Ray, real processes killed with SIGKILL.

Each test ends with every sample of the dataset in the output exactly once and no temp file left.
The processes are this test session's own Ray workers (descendants of this process), found by
the title Ray gives them (``ray::ExtractorActor``, ``ray::WriterActor``).
"""

from __future__ import annotations

import collections
import dataclasses
import errno
import http.server
import logging
import shutil
import threading
import time
from pathlib import Path
from typing import Callable, Optional

import psutil
import pytest
import ray

from inputs.demo import build_synthetic_dataset
from jobs.config import load_config
from jobs.extract import main
from jobs.outdir.budget import DiskBudget
from jobs.planning.engine import planned_metadata
from jobs.planning.inputs import read_inputs
from jobs.planning.shards import plan_shards
from jobs.rundir.summary import read_summary
from runtime.errors import EXIT_BAD_INPUT, EXIT_BUDGET_EXHAUSTED, EXIT_FAULT, EXIT_OK, EXIT_UPLOADS_FAILED
from storage.consumed import consume_shard
from storage.manifest import CONSUMED, DONE, FAILED, LOCAL, MANIFEST_FILE, SINK, read_manifest
from storage.writer import TEMP_GLOB, state_bytes_per_token
from tests.helpers import (
    Beside,
    When,
    assert_every_sample_once,
    assert_run_verifies,
    checksum_of,
    own_files_bytes,
    sigkill,
)
from tests.helpers import small_disk as tmpfs_at

SHARD_SIZE = 4
NUM_SAMPLES = 24
SHARDS = NUM_SAMPLES // SHARD_SIZE


@pytest.fixture(scope="module")
def dataset(tmp_path_factory) -> Path:
    return build_synthetic_dataset(
        tmp_path_factory.mktemp("faults") / "data.parquet", num_samples=NUM_SAMPLES, min_len=40, max_len=90, seed=3
    )


def job_args(model: Path, data: Path, out: Path, *extra: str) -> list[str]:
    """A few batches per shard, so that a fault lands in the middle of one."""
    return [
        f"model.path={model}", f"data.path={data}", f"output.dir={out}", f"data.shard_size={SHARD_SIZE}",
        "extract.max_tokens_per_batch=100", "model.device=cpu", "model.dtype=float32", "output.min_free=0",
        "output.budget_wait_s=30", "output.rescan_s=0.2", "output.max_inflight_batches=2", *extra,
    ]


def ray_processes(title: str) -> list[psutil.Process]:
    """This session's Ray worker processes whose title starts with ``title``."""
    found = []
    for process in psutil.Process().children(recursive=True):
        try:
            if " ".join(process.cmdline()).startswith(title):
                found.append(process)
        except psutil.Error:
            pass  # exited while we looked
    return found


def done_shards(out: Path) -> int:
    try:
        return sum(record["state"] == DONE for record in read_manifest(out)["shards"])
    except (ValueError, KeyError, OSError):  # no manifest yet
        return 0


def extractor_after_first_shard(out: Path) -> Callable[[], Optional[psutil.Process]]:
    def find() -> Optional[psutil.Process]:
        if done_shards(out) < 1:
            return None
        extractors = ray_processes("ray::ExtractorActor")
        return extractors[0] if extractors else None
    return find


class Writing:
    """A writer with a shard's temp file open (it is in the middle of writing it), and that shard's index."""

    def __init__(self, writer: psutil.Process, shard: int) -> None:
        self.writer, self.shard = writer, shard


def writer_writing(out: Path, after: Callable[[], bool] = lambda: True) -> Callable[[], Optional[Writing]]:
    """Once ``after()`` holds, a writer caught writing a shard of ``out``."""
    def find() -> Optional[Writing]:
        if not after() or next(out.glob(TEMP_GLOB), None) is None:
            return None
        for writer in ray_processes("ray::WriterActor"):
            for file in writer.open_files():
                path = Path(file.path)
                if path.parent == out and path.match(TEMP_GLOB):
                    return Writing(writer, int(path.name.split("-")[1].split(".")[0]))
        return None
    return find


def sigkill_writer(writing: Writing) -> None:
    sigkill(writing.writer)


def attempts(out: Path) -> dict[int, int]:
    return {record["index"]: record["attempts"] for record in read_manifest(out)["shards"]}


class ThenWriter:
    """The extractor killed once the first shard is done, then (once a shard is done after that) a writer
    killed while it writes a shard: two faults of one run, each recovery checked on its own."""

    def __init__(self, out: Path) -> None:
        self.out = out
        self.done_at_kill = 0
        self.extractor = When(extractor_after_first_shard(out), self._kill_extractor)
        self.writer = When(writer_writing(out, self._extractor_replaced), sigkill_writer)

    def _kill_extractor(self, process: psutil.Process) -> None:
        self.done_at_kill = done_shards(self.out)
        sigkill(process)

    def _extractor_replaced(self) -> bool:
        """A shard was done since the kill: the new extractor runs, and its writers hold only new attempts."""
        return self.extractor.done is not None and done_shards(self.out) > self.done_at_kill

    def __enter__(self) -> "ThenWriter":
        self.extractor.__enter__()
        self.writer.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self.writer.__exit__(*exc)
        self.extractor.__exit__(*exc)


def lost_shards(messages: list[str], reason: str) -> set[int]:
    """The shards the driver logged as cut short for ``reason`` (``shard N: <reason>...; it will be written again``)."""
    return {int(text.split()[1].rstrip(":")) for text in messages
            if text.startswith("shard ") and f": {reason}" in text and text.endswith("it will be written again")}


@pytest.mark.extended
def test_tp_follower_sigkill_ends_the_extractor_which_restarts(ray_cluster, llama_fp32, dataset, tmp_path):
    out = tmp_path / "out"

    def follower() -> Optional[psutil.Process]:
        extractor = extractor_after_first_shard(out)()
        if extractor is None:
            return None
        ranks = [p for p in extractor.children() if "spawn_main" in " ".join(p.cmdline())]
        return ranks[0] if ranks else None

    with When(follower, sigkill) as killer:
        code = main(job_args(llama_fp32, dataset, out, "model.tp_size=2"))
    assert killer.done is not None, "the job ended before the TP rank could be killed"
    summary = read_summary(out)
    assert code == EXIT_OK, summary["message"]
    assert summary["extractor_restarts"] == 1 and summary["engine"]["tp_size"] == 2
    assert_every_sample_once(out, dataset)


@pytest.mark.extended
def test_faults_beyond_the_bounds_stop_with_the_fault_code_and_a_rerun_resumes(ray_cluster, llama_fp32, dataset, tmp_path):
    out = tmp_path / "out"
    with When(extractor_after_first_shard(out), sigkill) as killer:
        code = main(job_args(llama_fp32, dataset, out, "extract.max_restarts=0"))
    assert killer.done is not None
    summary = read_summary(out)
    assert (code, summary["outcome"]) == (EXIT_FAULT, "fault"), summary["message"]
    assert "extract.max_restarts=0" in summary["message"]
    assert summary["message"].endswith("rerun the same command to resume")
    assert not list(out.glob(TEMP_GLOB))

    with When(writer_writing(out), sigkill_writer) as killer:
        code = main(job_args(llama_fp32, dataset, out, "extract.max_attempts=1"))
    assert killer.done is not None
    summary = read_summary(out)
    assert (code, summary["outcome"]) == (EXIT_FAULT, "fault"), summary["message"]
    assert "extract.max_attempts=1" in summary["message"] and "its writer died" in summary["message"]
    assert summary["message"].endswith("rerun the same command to resume")
    assert not list(out.glob(TEMP_GLOB))

    done_before = {r["index"]: r["attempts"] for r in read_manifest(out)["shards"] if r["state"] == DONE}
    assert main(job_args(llama_fp32, dataset, out)) == EXIT_OK
    assert {i: attempts(out)[i] for i in done_before} == done_before, "done shards must not run again"
    assert_every_sample_once(out, dataset)


def predicted_shard_bytes(model: Path, data: Path, out: Path, *extra: str) -> int:
    """What the job's budget predicts for its largest shard (the same functions, no run)."""
    config = load_config(job_args(model, data, out, *extra))
    inputs = read_inputs(config)
    plan = plan_shards(inputs.dataset.lengths, config.data.shard_size, config.extract.max_tokens_per_batch,
                       config.extract.max_samples_per_batch)
    per_token = state_bytes_per_token(planned_metadata(inputs.config, inputs.checkpoint, inputs.layer_ids))
    budget = DiskBudget(out, 1, 0)
    return max(budget.predict(shard.tokens, per_token, len(shard.batches)) for shard in plan)


class Consumer(Beside):
    """A trainer taking committed shard files out of output.dir (copied to ``into``, then declared consumed and
    deleted) while the job runs."""

    def __init__(self, out: Path, into: Path) -> None:
        super().__init__()
        self.out, self.into = out, into

    def run(self) -> None:
        self.into.mkdir(parents=True, exist_ok=True)
        while not self.quitting.is_set():
            try:
                records = read_manifest(self.out)["shards"]
            except (ValueError, KeyError, OSError):
                records = []
            for record in records:
                if record["state"] == DONE and record["location"] == LOCAL and (self.out / record["file"]).exists():
                    shutil.copyfile(self.out / record["file"], self.into / record["file"])
                    consume_shard(self.out / record["file"], f"{self.into} (a test trainer)")
            time.sleep(0.05)


class Logged(logging.Handler):
    """Every log record of the job (its loggers propagate to the root logger) as (logger, message)."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.records: list[tuple[str, str]] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append((record.name, record.getMessage()))


@dataclasses.dataclass
class FaultedRun:
    """The job run through two faults (``ThenWriter``) while it waits for disk, and what it left."""

    out: Path
    consumed: Path
    """Where the test trainer put the shard files it consumed."""
    code: int
    extractor_killed: bool
    writing: Optional[Writing]
    """The writer killed, and the shard it was writing (None: none was caught mid-write)."""
    logged: list[tuple[str, str]]


@pytest.fixture(scope="module")
def faulted_run(ray_cluster, llama_fp32, dataset, tmp_path_factory) -> FaultedRun:
    """With the budget at 1.5 shards beside the job's own files and a trainer consuming, the run waits for disk
    before most shards; the extractor is SIGKILLed once a shard is done, then a writer mid-write once a shard is
    done after that. One run (each is a model's start and a restart): the tests below assert each recovery and the
    disk waits on it."""
    work = tmp_path_factory.mktemp("faulted")
    out, consumed = work / "out", work / "consumed"
    tight = ("output.num_writers=1", "progress.interval_s=0.2")
    own = own_files_bytes(load_config(job_args(llama_fp32, dataset, out, *tight)))
    budget = own + int(1.5 * predicted_shard_bytes(llama_fp32, dataset, out, *tight))
    logged, root = Logged(), logging.getLogger()
    level = root.level
    root.setLevel(logging.INFO)
    root.addHandler(logged)
    try:
        with Consumer(out, consumed), ThenWriter(out) as faults:
            code = main(job_args(llama_fp32, dataset, out, *tight, f"output.disk_budget={budget}"))
    finally:
        root.removeHandler(logged)
        root.setLevel(level)
    return FaultedRun(out, consumed, code, faults.extractor.done is not None, faults.writer.done, logged.records)


def test_an_extractor_then_a_writer_sigkilled_mid_shard_are_recovered_in_the_same_run(faulted_run, dataset):
    """The extractor killed mid-shard is started again and the shards it cut short are written again, while the
    driver goes on reporting progress; a writer killed mid-write is replaced and its shard written again, without
    an extractor restart. One run, every sample once."""
    run = faulted_run
    assert run.extractor_killed, "the job ended before the extractor could be killed"
    assert run.writing is not None, "no writer was caught mid-write after the extractor's restart"
    summary = read_summary(run.out)
    assert run.code == EXIT_OK, summary["message"]
    assert summary["shards_done"] == SHARDS
    assert summary["extractor_restarts"] == 1, "only the extractor's death restarts it, a writer's does not"
    messages = [text for _, text in run.logged]
    # the extractor's fault: the shards it cut short were written again, in the same run
    by_extractor = lost_shards(messages, "the extractor died")
    assert by_extractor, messages
    # the writer's fault: the shard it was writing (and any other it held), by a new writer
    by_writer = lost_shards(messages, "its writer died")
    assert run.writing.shard in by_writer, (by_writer, run.writing.shard)
    expected = {index: 1 + (index in by_extractor) + (index in by_writer) for index in range(SHARDS)}
    assert attempts(run.out) == expected, "each cut-short shard written once more, every other shard once"
    assert_run_verifies(run.out)  # the shards consumed are declared; the rest are whole
    assert_every_sample_once([run.out, run.consumed], dataset)
    # While the new extractor loaded, the driver went on reporting progress (gauges, status file, log)
    died = next(i for i, (_, text) in enumerate(run.logged) if "died" in text and "starting it again" in text)
    ready = next(i for i, (_, text) in enumerate(run.logged) if i > died and "ready after" in text)
    assert any(name == "jobs.driver.progress" for name, _ in run.logged[died:ready]), run.logged[died:ready + 1]


def test_faults_while_waiting_for_disk_lose_no_shard(faulted_run, dataset):
    """The faults of ``faulted_run`` come while the run waits for disk before most shards: neither must send a
    shard back as the next one is opened (one shard never written, the run saying complete, exit 0): every shard
    is written exactly once, in the same run. The trainer consuming shard files (declared, then deleted:
    ``storage.consumed``) is what keeps the budget of 1.5 shards flowing: the run notices them consumed as it goes."""
    run = faulted_run
    assert run.extractor_killed and run.writing is not None, "a fault did not happen"
    summary = read_summary(run.out)
    assert run.code == EXIT_OK, summary["message"]
    records = read_manifest(run.out)["shards"]
    assert [r["state"] for r in records] == [DONE] * SHARDS
    locations = [r["location"] for r in records]
    assert locations.count(CONSUMED) >= 3 and set(locations) <= {CONSUMED, LOCAL}, locations
    assert summary["shards_done"] == summary["plan"]["shards"] == SHARDS
    assert attempts(run.out)[run.writing.shard] >= 2, "the killed writer's shard was not written again"
    assert summary["disk_budget"]["blocked_seconds"] > 0, "the run never waited for disk: the case is not covered"
    assert_every_sample_once([run.out, run.consumed], dataset)


def test_writers_beyond_the_clusters_cpus_are_refused(ray_cluster, llama_fp32, dataset, tmp_path, capsys):
    """Instead of waiting forever for CPU slots Ray does not have; refused before the manifest or any actor."""
    out = tmp_path / "out"
    assert main(job_args(llama_fp32, dataset, out, "output.num_writers=64")) == EXIT_BAD_INPUT
    assert "output.num_writers=64, but node 127.0.0.1 has 2 CPUs" in capsys.readouterr().err
    assert not (out / MANIFEST_FILE).exists() and not list(out.glob("shard-*"))


@pytest.fixture
def small_disk(tmp_path):
    """An 8 MB tmpfs to fill (``tests.helpers.small_disk``)."""
    with tmpfs_at(tmp_path / "disk", "8m") as disk:
        yield disk


@pytest.mark.extended
def test_disk_really_full_fails_the_shard_and_stops_then_rerun_completes(ray_cluster, llama_fp32, dataset, small_disk):
    out = small_disk / "out"
    filler = small_disk / "filler"
    slack = 64 * 1024  # for the manifest and summary: the shard's next batch needs more

    def fill(_: object) -> None:
        """Write until the disk is full, then give ``slack`` back."""
        with open(filler, "wb", buffering=0) as file:
            try:
                while True:
                    file.write(b"\0" * slack)
            except OSError as error:
                assert error.errno == errno.ENOSPC, error
            file.truncate(max(0, file.tell() - 2 * slack))

    # One shard of every sample, one sample per batch: the fill lands while ~20 batches (~1.5 MB) are
    # still to come, however late the polling thread runs (with 4-sample shards, a shard was once
    # written whole before the fill came, and the next shard's budget check stopped the job instead).
    # One writer: the space the failed shard frees is what the job's own files then use.
    one_shard = (f"data.shard_size={NUM_SAMPLES}", "output.num_writers=1", "extract.max_tokens_per_batch=60")
    with When(lambda: next(out.glob(TEMP_GLOB), None), fill) as killer:
        code = main(job_args(llama_fp32, dataset, out, *one_shard))
    assert killer.done is not None, "the disk was not filled while a shard was written"
    summary = read_summary(out)
    assert (code, summary["outcome"]) == (EXIT_BUDGET_EXHAUSTED, "disk_full"), summary["message"]
    assert "is full" in summary["message"] and summary["message"].endswith("resumes where this run stopped")
    failed = [r for r in read_manifest(out)["shards"] if r["state"] == FAILED]
    assert len(failed) == 1 and "No space left on device" in failed[0]["error"]
    assert not list(out.glob(TEMP_GLOB))

    filler.unlink()
    assert main(job_args(llama_fp32, dataset, out, *one_shard)) == EXIT_OK
    assert_every_sample_once(out, dataset)


class SinkServer(http.server.ThreadingHTTPServer):
    """An object store on loopback that fsspec's http filesystem uploads to (POST) and verifies from
    (HEAD, ranged GET). ``mode``: ok, down (every request answers 503) or corrupt (GET returns a shard
    file with one byte flipped); past ``uploads_accepted`` uploads, it refuses more (503)."""

    daemon_threads = True

    def __init__(self) -> None:
        super().__init__(("127.0.0.1", 0), SinkHandler)
        self.objects: dict[str, bytes] = {}
        self.posts: collections.Counter = collections.Counter()
        self.mode = "ok"
        self.uploads_accepted: Optional[int] = None
        self.url = f"http://127.0.0.1:{self.server_address[1]}/sink"

    def __enter__(self) -> "SinkServer":
        threading.Thread(target=self.serve_forever, daemon=True).start()
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()
        self.server_close()


class SinkHandler(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server: SinkServer

    def log_message(self, *args) -> None:
        pass

    def do_POST(self) -> None:
        data = self._body()
        self.server.posts[self.path] += 1
        accepted = self.server.uploads_accepted
        if self.server.mode == "down" or (accepted is not None and len(self.server.objects) >= accepted):
            return self._reply(503)
        self.server.objects[self.path] = data
        self._reply(200)

    def do_HEAD(self) -> None:
        data = self.server.objects.get(self.path)
        if self.server.mode == "down" or data is None:
            return self._reply(503 if self.server.mode == "down" else 404)
        self._reply(200, length=len(data))

    def do_GET(self) -> None:
        data = self.server.objects.get(self.path)
        if self.server.mode == "down" or data is None:
            return self._reply(503 if self.server.mode == "down" else 404)
        if self.server.mode == "corrupt" and "shard-" in self.path:  # the job's test write reads back whole
            middle = len(data) // 2
            data = data[:middle] + bytes([data[middle] ^ 0xFF]) + data[middle + 1 :]
        wanted = self.headers.get("Range", "")
        if wanted.startswith("bytes="):
            first, last = wanted[len("bytes="):].split("-")
            start, stop = int(first), min(len(data), int(last) + 1 if last else len(data))
            return self._reply(206, data[start:stop], {"Content-Range": f"bytes {start}-{stop - 1}/{len(data)}"})
        self._reply(200, data)

    def _body(self) -> bytes:
        if self.headers.get("Transfer-Encoding", "").lower() != "chunked":
            return self.rfile.read(int(self.headers.get("Content-Length", 0)))
        chunks = []
        while size := int(self.rfile.readline().split(b";")[0].strip(), 16):
            chunks.append(self.rfile.read(size))
            self.rfile.readline()
        self.rfile.readline()
        return b"".join(chunks)

    def _reply(self, status: int, data: bytes = b"", headers: Optional[dict] = None, length: Optional[int] = None) -> None:
        self.send_response(status)
        self.send_header("Content-Length", str(len(data) if length is None else length))
        self.send_header("Accept-Ranges", "bytes")
        for key, value in (headers or {}).items():
            self.send_header(key, value)
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(data)


def extractors_created() -> int:
    """Extractor actors this process's Ray cluster has created so far (alive or dead)."""
    return sum(actor["ActorClassName"] == "ExtractorActor" for actor in ray._private.state.actors().values())


def local_files_are_whole(out: Path) -> list[dict]:
    """The manifest's local shards, each checked against its file (size and checksum)."""
    local = [r for r in read_manifest(out)["shards"] if r["state"] == DONE and r["location"] == LOCAL]
    for record in local:
        data = (out / record["file"]).read_bytes()
        assert len(data) == record["bytes"] and checksum_of(data, "xxh3_128") == record["checksum"]
    return local


def test_sink_down_or_corrupt_keeps_shards_local_until_verified(ray_cluster, llama_fp32, dataset, tmp_path):
    out = tmp_path / "out"
    with SinkServer() as sink:
        args = job_args(llama_fp32, dataset, out, f"output.sink={sink.url}", "output.upload_attempts=2")
        # down mid-run: after the job's test write, its claim and the first upload, every upload fails; the run
        # says so (exit 7), naming the shards it kept
        sink.uploads_accepted = 3
        assert main(args) == EXIT_UPLOADS_FAILED
        extractors = extractors_created()
        summary = read_summary(out)
        assert summary["outcome"] == "uploads_failed" and f"{SHARDS - 1} shards are written but not in" in summary["message"]
        local = local_files_are_whole(out)
        assert len(local) == SHARDS - 1
        assert all("upload to" in r["error"] and "failed, the file stays local" in r["error"] for r in local)
        assert all(sink.posts[f"/sink/{r['file']}"] == 2 for r in local)  # tried again in the same run

        # up again, but every object reads back corrupted: nothing local goes before it verifies
        sink.mode, sink.uploads_accepted = "corrupt", None
        assert main(args) == EXIT_UPLOADS_FAILED
        local = local_files_are_whole(out)
        assert len(local) == SHARDS - 1 and all("checksum" in r["error"] for r in local)
        # nothing to extract: the reruns start no extractor (no model load) and no writer
        assert extractors_created() == extractors and read_summary(out)["writers"] == 0

        # a healthy sink: the rerun uploads and verifies the rest, then deletes them locally
        sink.mode = "ok"
        assert main(args) == EXIT_OK
        assert extractors_created() == extractors and read_summary(out)["engine"] == summary["engine"]
        records = read_manifest(out)["shards"]
        assert all(r["location"] == SINK and r["error"] == "" for r in records)
        assert not list(out.glob("shard-*.parquet"))
        downloaded = tmp_path / "downloaded"
        downloaded.mkdir()
        for record in records:
            (downloaded / record["file"]).write_bytes(sink.objects[f"/sink/{record['file']}"])
        assert_run_verifies(out)  # reads every file back from the sink
    assert_every_sample_once(downloaded, dataset)
