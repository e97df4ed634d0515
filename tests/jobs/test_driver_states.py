"""The driver's state machine with fake actors and no Ray: faults x waits for disk x uploads x retries.

The scheduler, completions, upload queue, rescanner, disk wait and loop are the
real ones, over a real manifest, real disk budget (real files in a temp dir) and a
real tokenized dataset; only the actors are fakes, and ``FakeRuntime`` completes
their calls in the order they were made (as one actor's calls complete), with
faults scripted per call. Each test ends by counting what the manifest and the
directory hold: every shard done exactly once, or the run stopped, naming why.
"""

from __future__ import annotations

import dataclasses
import itertools
import time
import types
from pathlib import Path
from typing import Any, Callable, Optional

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import ray

from inputs.dataset import open_tokenized_dataset
from jobs.actors.extractor import ExtractorHost
from jobs.actors.writer import ExtractorLost, ShardFailed
from jobs.cluster.nodes import NodeGroup
from jobs.driver.completions import Completions
from jobs.driver.disk_wait import DiskWait
from jobs.driver.lanes import Lane, Lanes
from jobs.driver.loop import DriverLoop
from jobs.driver.progress import RunProgress
from jobs.driver.rescan import Rescanner
from jobs.driver.result import STEADY_MIN_SECONDS, RunResult
from jobs.driver.scheduler import Scheduler
from jobs.driver.uploads import UploadQueue
from jobs.driver.work import Append, Finish, PendingWork
from jobs.outdir.budget import DiskBudget
from jobs.planning.shards import plan_shards
from runtime.errors import BudgetExhausted, JobFault
from storage import ShardFileInfo, checksum, shard_file_name
from storage.consumed import consume_shard
from storage.manifest import CONSUMED, DONE, FAILED, LOCAL, SINK, Manifest

BYTES_PER_TOKEN = 1000
SAMPLES, SHARD_SIZE, TOKENS = 40, 10, 20
UPLOAD_RETRY_S = 0.02
"""output.rescan_s in the upload queue: the pause after a first failed upload."""
"""Four shards of ten 20-token samples, two batches each."""


# -- fakes ------------------------------------------------------------------------------------------

@dataclasses.dataclass(eq=False)
class FakeRef:
    compute: Callable[[], Any]
    """Runs when the reference completes: what it returns is the result, what it raises the error."""
    done: bool = False
    value: Any = None
    error: Optional[BaseException] = None


class FakeRuntime:
    """Completes references in the order they were made; each call's effect happens then."""

    def __init__(self) -> None:
        self.made: list[FakeRef] = []
        self.hooks: list[Callable[[], None]] = []
        """Run before each completion (a consumer deleting files, say)."""

    def ref(self, compute: Callable[[], Any]) -> FakeRef:
        ref = FakeRef(compute)
        self.made.append(ref)
        return ref

    def _complete(self, ref: FakeRef) -> None:
        if not ref.done:
            ref.done = True
            try:
                ref.value = ref.compute()
            except BaseException as error:  # noqa: BLE001 - it is the reference's result
                ref.error = error

    def wait(self, refs: list[Any], timeout: float | None, num_returns: int = 1) -> list[Any]:
        for hook in self.hooks:
            hook()
        wanted = set(map(id, refs))
        pending = [ref for ref in self.made if id(ref) in wanted]
        ready = [ref for ref in pending if ref.done][:num_returns]
        if len(ready) < num_returns and timeout != 0:
            for ref in pending:
                if not ref.done:
                    self._complete(ref)
                    ready.append(ref)
                    if len(ready) == num_returns:
                        break
        return ready

    def get(self, ref: FakeRef) -> Any:
        self._complete(ref)
        if ref.error is not None:
            raise ref.error
        return ref.value


class Method:
    def __init__(self, runtime: FakeRuntime, function: Callable[..., Any]) -> None:
        self._runtime, self._function = runtime, function

    def remote(self, *args: Any) -> FakeRef:
        return self._runtime.ref(lambda: self._function(*args))


class FakeWriter:
    """Writes each shard to a real file of ``tokens * BYTES_PER_TOKEN`` bytes, as a real writer's size."""

    def __init__(self, world: "World") -> None:
        self.world = world
        self.alive = True
        self.tokens: dict[int, int] = {}
        self.failed: set[int] = set()
        self.append = Method(world.runtime, self._append)
        self.finish = Method(world.runtime, self._finish)
        self.discard = Method(world.runtime, self._discard)

    def _check_alive(self) -> None:
        if not self.alive:
            raise ray.exceptions.RayActorError()

    def _append(self, rows: Any, captured: list[FakeRef]) -> int:
        self._check_alive()
        if rows.shard in self.world.lost_shards:
            self.failed.add(rows.shard)
            raise ExtractorLost(f"shard {rows.shard}: the extractor died with its batch")
        try:
            tokens = self.world.runtime.get(captured[0])
        except ExtractorLost:
            self.failed.add(rows.shard)
            raise
        if rows.shard in self.failed:
            return 0
        self.tokens[rows.shard] = self.tokens.get(rows.shard, 0) + tokens
        return tokens

    def _finish(self, shard: int) -> ShardFileInfo:
        self._check_alive()
        if shard in self.failed:
            self.failed.discard(shard)
            raise ExtractorLost(f"shard {shard}: lost")
        if shard in self.world.fail_shards:
            self.tokens.pop(shard, None)
            raise ShardFailed(f"shard {shard}: the writer's error")
        tokens = self.tokens.pop(shard)
        path = self.world.directory / shard_file_name(shard)
        data = bytes(tokens * BYTES_PER_TOKEN)
        path.write_bytes(data)
        self.world.published.append(shard)
        return ShardFileInfo(str(path), tokens // TOKENS, tokens, len(data), checksum.of_bytes(data))

    def _discard(self, shard: int) -> None:
        self._check_alive()
        self.tokens.pop(shard, None)
        self.failed.discard(shard)


class FakeWriters:
    def __init__(self, world: "World", count: int) -> None:
        self.world = world
        self.writers = [FakeWriter(world) for _ in range(count)]
        self.replaced = 0

    def __len__(self) -> int:
        return len(self.writers)

    def is_member(self, writer: Any) -> bool:
        return any(writer is current for current in self.writers)

    def replace(self, dead: Any) -> Any:
        for slot, writer in enumerate(self.writers):
            if writer is dead:
                self.writers[slot] = FakeWriter(self.world)
                self.replaced += 1
                return self.writers[slot]
        return None


class FakeExtractor(ExtractorHost):
    """The real host's restarts over a fake actor: the states of a batch are its token count; ``die_at`` (the n-th
    batch overall) kills this generation."""

    def __init__(self, world: "World") -> None:
        super().__init__(spec=None, max_restarts=world.max_restarts, placement={}, where="node n1")
        self.world = world
        self.batches = 0
        self.dead_generation: Optional[int] = None
        self.launch()

    def launch(self) -> None:
        engine = types.SimpleNamespace(model_architecture="Fake", layers_to_capture=[], layer_ids=[], drafter_layer_ids=[])
        self.actor = types.SimpleNamespace(info=Method(self.world.runtime, lambda: engine))

    def extract(self, tokens: Any) -> FakeRef:
        self.batches += 1
        generation = self.generation
        if self.batches in self.world.extractor_dies_at:
            self.dead_generation = generation

        def compute() -> int:
            if self.dead_generation == generation:
                raise ExtractorLost("the extractor died")
            return len(tokens.ids)

        return self.world.runtime.ref(compute)


class FakeUploader:
    def __init__(self, world: "World") -> None:
        self.world = world
        self.upload = Method(world.runtime, self._upload)

    def _upload(self, path: str, nbytes: int, checksum: str) -> str:
        now = time.monotonic()
        self.world.upload_tries.setdefault(Path(path).name, []).append(now)
        first = min(tries[0] for tries in self.world.upload_tries.values())
        if self.world.sink_broken or now - first < self.world.sink_down_s:
            raise OSError(30, "Read-only file system")
        self.world.uploaded.append(Path(path).name)
        return f"file:///sink/{Path(path).name}"


@dataclasses.dataclass
class World:
    directory: Path
    runtime: FakeRuntime = dataclasses.field(default_factory=FakeRuntime)
    extractor_dies_at: set[int] = dataclasses.field(default_factory=set)
    fail_shards: set[int] = dataclasses.field(default_factory=set)
    lost_shards: set[int] = dataclasses.field(default_factory=set)
    """Shards whose every batch meets a dead extractor."""
    max_restarts: int = 3
    sink_broken: bool = False
    sink_down_s: float = 0.0
    """The sink refuses every upload for this long from the first (real seconds)."""
    upload_tries: dict[str, list[float]] = dataclasses.field(default_factory=dict)
    """Each file's upload calls, when (monotonic)."""
    published: list[int] = dataclasses.field(default_factory=list)
    uploaded: list[str] = dataclasses.field(default_factory=list)


# -- the harness ------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def dataset_path(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("data") / "tokens.parquet"
    rng = np.random.default_rng(0)
    pq.write_table(pa.table({"input_ids": [rng.integers(0, 100, TOKENS).tolist() for _ in range(SAMPLES)]}), path)
    return path


@pytest.fixture(autouse=True)
def hooks_while_sleeping(monkeypatch):
    """The run's waits (for disk, for a rescan) sleep; the world's hooks (a consumer) act meanwhile."""
    worlds: list[World] = []

    def sleep(seconds: float) -> None:
        for world in worlds:
            for hook in world.runtime.hooks:
                hook()

    monkeypatch.setattr("time.sleep", sleep)
    # The host's restart kills its old actor: a fake here. Ray's own kill would first connect this process to a Ray
    # cluster (any one it finds), and a later test's ray.init in the same process would then fail.
    monkeypatch.setattr(ray, "kill", lambda actor, no_restart=True: None)
    return worlds


@dataclasses.dataclass
class Run:
    world: World
    manifest: Manifest
    loop: DriverLoop
    budget: DiskBudget
    writers: FakeWriters
    extractor: FakeExtractor
    starts: list[int]
    """One entry per time the loop started the lane's actors (those of a run made with actors_started=False)."""
    scheduler: Scheduler
    completions: Completions
    work: PendingWork

    def shard_files(self) -> list[str]:
        return sorted(p.name for p in self.world.directory.glob("shard-*.parquet"))


def make_run(
    tmp_path: Path, dataset_path: Path, worlds: list[World], world_options: dict[str, Any] | None = None, budget_shards: float = 100.0,
    writers: int = 1, sink: bool = False, max_attempts: int = 3, upload_attempts: int = 2, budget_wait_s: float = 0.2,
    rescan_s: float = 0.01, actors_started: bool = True,
) -> Run:
    """``actors_started=False``: the lane's writers start only when the loop asks (``Run.starts`` counts it)."""
    directory = tmp_path / "out"
    directory.mkdir(exist_ok=True)  # a rerun: the same directory and manifest
    world = World(directory, **(world_options or {}))
    worlds.append(world)
    dataset = open_tokenized_dataset(str(dataset_path), 100, 4096)
    plan = plan_shards(dataset.lengths, SHARD_SIZE, 10 * TOKENS // 2, 256)
    manifest = Manifest.open(directory, {"test": True}, [(s.index, s.start, s.stop) for s in plan])
    shard_bytes = DiskBudget(directory, 1, 0).predict(SHARD_SIZE * TOKENS, BYTES_PER_TOKEN, 2)
    budget = DiskBudget(directory, int(budget_shards * shard_bytes), 0)
    group = NodeGroup(node_id="node-1", name="n1", directory=directory, writers=writers)
    pool, extractor = FakeWriters(world, writers), FakeExtractor(world)
    lane = Lane(group, extractor, budget, max_inflight=writers + 2)
    lanes = Lanes([lane], directory)
    starts: list[int] = []

    def start_actors() -> None:
        starts.append(1)
        lane.start_writers(pool)

    if actors_started:
        lane.start_writers(pool)
    work = PendingWork(world.runtime)
    progress = RunProgress(manifest, budget, {s.index: s.tokens for s in plan}, [s.index for s in plan],
                           run=str(directory), interval_s=3600, interactive=False)
    uploaders = {"n1": [FakeUploader(world)]} if sink else {}
    uploads = UploadQueue("file:///sink" if sink else "", uploaders, upload_attempts, lanes, manifest, work,
                          retry_s=UPLOAD_RETRY_S)
    scheduler = Scheduler(dataset, plan, manifest.in_state("pending"), manifest, lanes, work, progress,
                          BYTES_PER_TOKEN, max_attempts)
    completions = Completions(scheduler, uploads, work, lanes)
    rescanner = Rescanner(manifest, lanes, uploads, scheduler, rescan_s=rescan_s)
    disk_wait = DiskWait(budget_wait_s, 0.01, progress, lambda lane, state: f"no disk: {state}")
    progress.begin([budget])
    loop = DriverLoop(lanes, scheduler, completions, uploads, rescanner, disk_wait, progress, work, start_actors)
    return Run(world, manifest, loop, budget, pool, extractor, starts, scheduler, completions, work)


def consumer(run: Run, keep: int = 1) -> Callable[[], None]:
    """A trainer consuming committed shard files (declared, then deleted), oldest first, keeping ``keep`` of them."""
    def consume() -> None:
        done = [r for r in run.manifest.in_state(DONE) if r.location == LOCAL and r.file]
        for record in done[:max(0, len(done) - keep)]:
            if (run.world.directory / record.file).exists():
                consume_shard(run.world.directory / record.file, "a test trainer")
    return consume


def assert_every_shard_done_once(run: Run, consumed: bool = False) -> None:
    records = run.manifest.shards.values()
    assert [r.state for r in records] == [DONE] * len(records)
    assert sorted(run.world.published) == sorted(set(run.world.published)), "a shard was published twice"
    assert set(run.world.published) == {r.index for r in records}
    assert sum(r.rows for r in records) == SAMPLES
    if not consumed:
        assert run.shard_files() == sorted(shard_file_name(r.index) for r in records)


# -- the cases --------------------------------------------------------------------------------------

def test_plain_run_writes_every_shard_once(tmp_path, dataset_path, hooks_while_sleeping):
    run = make_run(tmp_path, dataset_path, hooks_while_sleeping, writers=2)
    run.loop.run()
    assert_every_shard_done_once(run)
    # the steady state's tokens: every batch's but the first's (batches of half a shard), nothing undone
    writes = run.completions.writes
    assert writes.tokens_after_first == SAMPLES * TOKENS - SHARD_SIZE * TOKENS // 2 and writes.last >= writes.first
    assert run.scheduler.attempts_undone == 0


def test_the_steady_rate_is_given_only_where_a_longer_run_would_keep_it():
    """Tokens over the window between the first batch written and the last; none for a window too short to time
    (writes heard in a burst), nor where work was thrown away and done again (the window counts its batches)."""
    def result(**changes: Any) -> RunResult:
        fields = dict(engine=None, startup_seconds=1.0, seconds=3.0, first_batch_seconds=0.5, steady_seconds=2.0,
                      steady_tokens=1000, drain_seconds=0.5, budget_peak=0, budget_overshoot=0, blocked_seconds=0.0,
                      writers=1, peak_open_shards=1, max_inflight_batches=3, extractor=None, writer_seconds={})
        return RunResult(**{**fields, **changes})

    assert result().steady_tokens_per_second == 500.0
    assert result(steady_seconds=STEADY_MIN_SECONDS * 0.99).steady_tokens_per_second is None
    assert result(extractor_restarts=1).steady_tokens_per_second is None
    assert result(attempts_undone=1).steady_tokens_per_second is None


@pytest.mark.parametrize("dies_at", [1, 2, 3, 4, 6, 8])
def test_extractor_death_while_waiting_for_disk_loses_no_shard(tmp_path, dataset_path, hooks_while_sleeping, dies_at):
    """A defect once: with the budget at ~1.5 shards and a consumer freeing space, a fault while the run waited
    for disk sent a shard back to the queue as the scheduler was opening the next: one shard was never
    written, and the run said complete."""
    run = make_run(tmp_path, dataset_path, hooks_while_sleeping, {"extractor_dies_at": {dies_at}}, budget_shards=1.5)
    run.world.runtime.hooks.append(consumer(run, keep=0))
    run.loop.run()
    assert_every_shard_done_once(run, consumed=True)
    assert run.extractor.generation == 1
    assert {r.location for r in run.manifest.shards.values()} <= {LOCAL, CONSUMED}
    assert run.scheduler.attempts_undone == 1  # the attempt the fault cut short, discarded and written again


def test_extractor_deaths_with_batches_extracted_between_never_add_up(tmp_path, dataset_path, hooks_while_sleeping):
    """With extract.max_restarts=1, deaths apart (a batch extracted by the new extractor before the next) each
    restart it: a fault a day over a week-long run never stops it."""
    run = make_run(tmp_path, dataset_path, hooks_while_sleeping, {"extractor_dies_at": {2, 7, 12}, "max_restarts": 1})
    run.loop.run()
    assert_every_shard_done_once(run)
    assert run.extractor.generation == 3


def test_an_extractor_dying_at_every_start_stops_the_run(tmp_path, dataset_path, hooks_while_sleeping):
    run = make_run(tmp_path, dataset_path, hooks_while_sleeping, {"extractor_dies_at": set(range(2, 100))})
    with pytest.raises(JobFault, match=r"died 4 times in a row with no batch extracted in between \(extract.max_restarts=3\)"):
        run.loop.run()
    assert run.extractor.generation == 3


@pytest.mark.parametrize("dies_at", [1, 3, 7])
def test_writer_death_while_waiting_for_disk_loses_no_shard(tmp_path, dataset_path, hooks_while_sleeping, dies_at):
    run = make_run(tmp_path, dataset_path, hooks_while_sleeping, budget_shards=1.5)
    calls = itertools.count(1)

    def kill_writer() -> None:
        if next(calls) == dies_at:
            run.writers.writers[0].alive = False

    run.world.runtime.hooks += [kill_writer, consumer(run, keep=0)]
    run.loop.run()
    assert_every_shard_done_once(run, consumed=True)
    assert run.writers.replaced == 1


def test_faults_and_an_upload_sink_with_a_tight_budget(tmp_path, dataset_path, hooks_while_sleeping):
    """Uploads free the space; two extractor deaths on the way: every shard ends in the sink, once."""
    run = make_run(tmp_path, dataset_path, hooks_while_sleeping, {"extractor_dies_at": {2, 5}}, budget_shards=1.5, sink=True)
    run.loop.run()
    assert [r.location for r in run.manifest.shards.values()] == [SINK] * 4
    assert sorted(run.world.uploaded) == [shard_file_name(i) for i in range(4)]
    assert run.shard_files() == []
    assert_every_shard_done_once(run, consumed=True)


def test_no_consumer_and_no_sink_stops_for_disk_with_the_rest_pending(tmp_path, dataset_path, hooks_while_sleeping):
    run = make_run(tmp_path, dataset_path, hooks_while_sleeping, budget_shards=1.5)
    with pytest.raises(BudgetExhausted, match="no disk"):
        run.loop.run()
    states = [r.state for r in run.manifest.shards.values()]
    assert states == [DONE, "pending", "pending", "pending"]


def test_a_sink_outage_longer_than_quick_retries_strands_no_shard(tmp_path, dataset_path, hooks_while_sleeping):
    """The sink refuses everything for 0.3 s (a sink down for half an hour, at the test's scale): each shard's
    tries come 1, 4 and 16 pauses apart, so the fourth of four lands after the outage, where four tries a rescan
    apart would all have met it and left the shards local for the rest of the run."""
    run = make_run(tmp_path, dataset_path, hooks_while_sleeping, {"sink_down_s": 0.3}, sink=True, upload_attempts=4)
    run.loop.run()
    assert [r.location for r in run.manifest.shards.values()] == [SINK] * 4
    first = run.world.upload_tries[shard_file_name(0)]
    gaps = [later - earlier for earlier, later in zip(first, first[1:])]
    assert len(first) == 4 and [round(gap / UPLOAD_RETRY_S) >= pause for gap, pause in zip(gaps, (1, 4, 16))] == [True] * 3
    assert_every_shard_done_once(run, consumed=True)


def test_an_upload_due_again_keeps_a_wait_for_disk_from_stopping_the_run(tmp_path, dataset_path, hooks_while_sleeping):
    """The budget holds 1.5 shards and only uploads free it; the sink is down for 0.35 s, longer than
    output.budget_wait_s (0.2 s): while a failed upload waits out its pause, the run is not idle (the upload will
    free space), and every shard reaches the sink once the sink is back."""
    run = make_run(tmp_path, dataset_path, hooks_while_sleeping, {"sink_down_s": 0.35}, sink=True, upload_attempts=4,
                   budget_shards=1.5, budget_wait_s=0.2)
    run.loop.run()
    assert [r.location for r in run.manifest.shards.values()] == [SINK] * 4


def test_a_file_lost_while_its_upload_waits_to_be_tried_again_is_uploaded_once_written_again(
    tmp_path, dataset_path, hooks_while_sleeping, monkeypatch,
):
    """A shard's upload failed and waits out a long pause; meanwhile its file is deleted without a declaration:
    the shard is extracted again, and its new file is offered to the sink at once, not turned away by the old
    file's pause (the run ended with it local, tries left)."""
    monkeypatch.setattr(__name__ + ".UPLOAD_RETRY_S", 0.5)
    run = make_run(tmp_path, dataset_path, hooks_while_sleeping, {"sink_down_s": 0.1}, sink=True, upload_attempts=4,
                   rescan_s=0)
    run.world.runtime.hooks.append(deleter(run, {3}))
    run.loop.run()
    assert [r.location for r in run.manifest.shards.values()] == [SINK] * 4
    assert run.manifest.shards[3].attempts == 2


def test_a_broken_sink_leaves_the_shards_local_after_their_tries(tmp_path, dataset_path, hooks_while_sleeping):
    run = make_run(tmp_path, dataset_path, hooks_while_sleeping, {"sink_broken": True}, sink=True, upload_attempts=2)
    run.loop.run()
    records = list(run.manifest.shards.values())
    assert [r.state for r in records] == [DONE] * 4 and [r.location for r in records] == [LOCAL] * 4
    assert all("Read-only file system" in r.error for r in records)
    assert run.shard_files() == [shard_file_name(i) for i in range(4)]


def test_a_rerun_with_only_uploads_left_uploads_them(tmp_path, dataset_path, hooks_while_sleeping):
    """Nothing is left to extract, but the sink lacks every file: the rerun's loop still runs, for the uploads."""
    first = make_run(tmp_path, dataset_path, hooks_while_sleeping, {"sink_broken": True}, sink=True, upload_attempts=1)
    first.loop.run()
    first.manifest.close()
    # the sink works again; the rerun's actors start only if the loop asks for them
    rerun = make_run(tmp_path, dataset_path, hooks_while_sleeping, sink=True, actors_started=False)
    rerun.loop.run()
    records = list(rerun.manifest.shards.values())
    assert [r.state for r in records] == [DONE] * 4 and [r.location for r in records] == [SINK] * 4
    assert rerun.world.published == [] and sorted(rerun.world.uploaded) == [shard_file_name(i) for i in range(4)]
    assert rerun.shard_files() == []  # each deleted locally once it was in the sink
    assert rerun.starts == [] and rerun.extractor.batches == 0, "an uploads-only rerun started its actors"


def test_a_file_lost_in_an_uploads_only_rerun_starts_the_actors_and_is_extracted_again(
    tmp_path, dataset_path, hooks_while_sleeping,
):
    first = make_run(tmp_path, dataset_path, hooks_while_sleeping, {"sink_broken": True}, sink=True, upload_attempts=1)
    first.loop.run()
    first.manifest.close()
    rerun = make_run(tmp_path, dataset_path, hooks_while_sleeping, {"sink_broken": True}, sink=True,
                     upload_attempts=2, actors_started=False, rescan_s=0)
    rerun.world.runtime.hooks.append(deleter(rerun, {0}))  # while the loop waits to offer the failed uploads again
    rerun.loop.run()
    records = rerun.manifest.shards
    assert rerun.starts == [1], "the actors start once, when the lost shard is to be extracted"
    assert rerun.world.published == [0] and records[0].state == DONE and records[0].attempts == 2
    assert [r.location for r in records.values()] == [LOCAL] * 4  # the sink still refuses every upload
    assert rerun.shard_files() == [shard_file_name(i) for i in range(4)]


def test_a_shard_cut_short_too_often_fails_the_run(tmp_path, dataset_path, hooks_while_sleeping):
    run = make_run(tmp_path, dataset_path, hooks_while_sleeping, {"lost_shards": {0}, "max_restarts": 10}, max_attempts=3)
    with pytest.raises(JobFault, match=r"shard 0 was cut short by faults 3 times"):
        run.loop.run()
    assert run.manifest.shards[0].state == FAILED


def test_a_shard_published_before_its_writers_death_was_heard_is_written_once(
    tmp_path, dataset_path, hooks_while_sleeping,
):
    """The writer published shard 0, then died; the driver heard of the death first (the attempt is lost, a discard
    is queued), then of the publish (the file is whole: done). The discard that completes after that must leave the
    done shard alone: sent back to the queue, it was written and published a second time."""
    run = make_run(tmp_path, dataset_path, hooks_while_sleeping)
    run.scheduler.open_what_fits()
    [attempt] = run.scheduler.active()
    while not attempt.all_sent:
        run.scheduler.send_batch(attempt.lane)
    for ref in list(run.world.runtime.made):  # the writer wrote every batch and published the file
        run.world.runtime.get(ref)
    for item, ref in run.work.completed(Append):
        run.completions.handle(item, ref)
    attempt.writer.alive = False
    run.scheduler.writer_died(attempt.lane, attempt.writer, "RayActorError: the actor died")
    [(finish, ref)] = run.work.completed(Finish)
    run.completions.handle(finish, ref)
    run.loop.run()  # the discard completes first
    assert_every_shard_done_once(run)
    assert run.manifest.shards[0].attempts == 1 and run.scheduler.attempts_undone == 0


def test_a_writer_error_fails_its_shard_and_the_others_are_written(tmp_path, dataset_path, hooks_while_sleeping):
    run = make_run(tmp_path, dataset_path, hooks_while_sleeping, {"fail_shards": {2}}, writers=2)
    run.loop.run()
    assert [r.state for r in run.manifest.shards.values()] == [DONE, DONE, FAILED, DONE]
    assert run.scheduler.attempts_undone == 1  # the failed shard's batches came to nothing
    assert run.budget.used == sum(DiskBudget.taken(r.bytes) for r in run.manifest.in_state(DONE))


def deleter(run: Run, shards: set[int], times: int = 1) -> Callable[[], None]:
    """Something that deletes done shard files without declaring them consumed (a mistaken rm, a disk tool)."""
    left = {shard: times for shard in shards}

    def delete() -> None:
        for record in run.manifest.in_state(DONE):
            path = run.world.directory / record.file
            if left.get(record.index) and record.location == LOCAL and path.exists():
                path.unlink()
                left[record.index] -= 1
    return delete


def test_a_done_file_deleted_without_a_declaration_is_extracted_again_in_the_same_run(
    tmp_path, dataset_path, hooks_while_sleeping,
):
    """Lost, not consumed: the shard is pending again and written again, its bytes counted once; a declared one
    beside it is recorded as consumed into what its consumer said."""
    run = make_run(tmp_path, dataset_path, hooks_while_sleeping, budget_shards=2.5, rescan_s=0)
    run.world.runtime.hooks += [deleter(run, {1}), consumer(run, keep=2)]
    run.loop.run()
    records = run.manifest.shards
    assert [r.state for r in records.values()] == [DONE] * 4
    assert run.world.published.count(1) == 2 and sorted(set(run.world.published)) == [0, 1, 2, 3]
    assert records[1].attempts == 2 and records[1].error == ""
    consumed = [r for r in records.values() if r.location == CONSUMED]
    assert consumed and all(r.consumed_into == "a test trainer" for r in consumed)
    local = [r for r in records.values() if r.location == LOCAL]
    assert run.shard_files() == sorted(r.file for r in local)
    assert run.budget.used == sum(DiskBudget.taken(r.bytes) for r in local)
    assert not list(run.world.directory.glob(".shard-*.consumed")), "declarations left after they were recorded"


def test_a_file_lost_again_and_again_fails_its_shard(tmp_path, dataset_path, hooks_while_sleeping):
    run = make_run(tmp_path, dataset_path, hooks_while_sleeping, max_attempts=2, rescan_s=0)
    run.world.runtime.hooks.append(deleter(run, {0}, times=5))
    run.loop.run()
    record = run.manifest.shards[0]
    assert record.state == FAILED and "something deletes the run's files" in record.error
    assert [r.state for r in run.manifest.shards.values()][1:] == [DONE] * 3
