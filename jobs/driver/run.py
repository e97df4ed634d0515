"""The driver: the data-parallel groups' actors, the scheduler, the disk budgets and the upload queue, run to the end.

``ExtractionRun`` starts one lane per data-parallel group (an extractor and
its writers on one node, that node's directory and disk budget), lets the
scheduler open shards and send batches, and handles each completion of the
work in flight by its type: a batch written, a shard published (or failed),
an attempt discarded after a fault, an upload verified. At most
``output.max_inflight_batches`` batches per lane sit between its extractor and
a finished write, which bounds the states held in its node's memory: a disk
slower than the extractor holds the extractor back. While no shard fits, the
budget's own wait loop settles the work in flight (writes, uploads) and
re-scans the directories for files a consumer deleted.

Faults are survived in the same run: a dead extractor is started again (at
most ``extract.max_restarts`` times; the run, and other nodes' lanes, go on
while its model loads), a dead writer is replaced, and every
shard a fault cut short is discarded (no temp file stays) and extracted again
(at most ``extract.max_attempts`` tries per shard); past those bounds the job
stops with ``JobFault`` (exit 4) and a rerun resumes.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import time
from pathlib import Path
from typing import Any

import ray

from extractor.config import ExtractConfig
from extractor.types import CaptureActivity, EngineInfo, EngineSpec
from jobs.actors.handles import ExtractorHost, WriterPool
from jobs.actors.writer import ExtractorLost, ShardDiskFull
from jobs.cluster.nodes import NodeGroup
from jobs.driver.budget import DiskBudget, format_bytes
from jobs.driver.config import OutputConfig
from jobs.driver.progress import RunProgress
from jobs.driver.scheduler import Lane, Scheduler
from jobs.driver.uploads import UploadQueue
from jobs.driver.work import Append, Discard, Finish, PendingWork, Restarted, ShardAttempt, Upload
from jobs.errors import DiskFull, JobFault
from jobs.inputs.dataset import TokenizedDataset
from jobs.planning.engine import shard_metadata
from jobs.planning.shards import Shard
from storage import ShardFileInfo, shard_file_name
from storage.manifest import CONSUMED, DONE, FAILED, LOCAL, SINK, Manifest, ShardRecord
from storage.writer import state_bytes_per_token

logger = logging.getLogger(__name__)

# Auto max_inflight_batches: one batch per writer, plus one in the extractor's forward and one
# on its way to the object store.
INFLIGHT_BEYOND_WRITERS = 2
# Objects beyond max_inflight_batches the extractor writes into the object store before the run: the
# store does not always hand a freed block to the next object of the same size.
OBJECT_STORE_WARM_EXTRA = 2
DISCARD_TIMEOUT_S = 30.0


@dataclasses.dataclass
class RunResult:
    engine: EngineInfo
    startup_seconds: float
    """Actors up and the model loaded: the time to the first batch."""
    seconds: float
    """From the first batch to the last file committed (and uploaded)."""
    drain_seconds: float
    """From the last batch written (not yet fsynced) to the end: closing, syncing, uploading."""
    budget_peak: int
    budget_overshoot: int
    blocked_seconds: float
    writers: int
    peak_open_shards: int
    """Most shards written at once (at most one per writer; fewer when the disk budget is tight)."""
    max_inflight_batches: int
    extractor: CaptureActivity
    writer_seconds: dict[str, dict[str, float]]
    """Wall and CPU seconds per stage, summed over writers (``WriterActor.stats``)."""
    extractor_restarts: int = 0
    """Times an extractor was started again after a fault in this run (all groups)."""
    nodes: dict[str, dict[str, Any]] = dataclasses.field(default_factory=dict)
    """Per data-parallel group's node: its directory, node id, writers, budget peak and overshoot, restarts."""


def resolve_device(requested: str, tp_size: int) -> str:
    gpus = int(ray.cluster_resources().get("GPU", 0))
    if requested == "auto":
        return "cuda" if gpus >= tp_size else "cpu"
    if requested == "cuda" and gpus < tp_size:
        raise ValueError(f"model.device=cuda with model.tp_size={tp_size}, but the Ray cluster has {gpus} GPUs")
    return requested


class ExtractionRun:
    """Extracts ``shards`` over the data-parallel ``groups`` and keeps the manifest and budgets true at every step."""

    def __init__(
        self, spec: EngineSpec, dataset: TokenizedDataset, plan: list[Shard], shards: list[ShardRecord],
        extract: ExtractConfig, output: OutputConfig, output_dir: Path, manifest: Manifest, budget: DiskBudget,
        groups: list[NodeGroup], progress: RunProgress,
    ) -> None:
        self.spec = spec
        self.dataset = dataset
        self.plan = plan
        self.shards = shards
        self.extract = extract
        self.output = output
        self.output_dir = output_dir
        self.manifest = manifest
        self.budget = budget
        """The budget of output.dir; every other node directory gets its own with the same limits."""
        self.groups = groups
        self.progress = progress
        self.work = PendingWork()
        self.last_write_done = 0.0
        self.last_rescan = 0.0
        # Built once Ray runs, by _start_actors.
        self.lanes: list[Lane] = []
        self.uploads: UploadQueue | None = None
        self.scheduler: Scheduler | None = None

    # -- setup and teardown ----------------------------------------------------------------------

    def _start_actors(self) -> EngineInfo:
        extractors = [
            ExtractorHost(self.spec, self.extract.max_restarts, group.placement(), f"node {group.name}")
            for group in self.groups
        ]
        for extractor in extractors:  # every node loads its model at the same time
            extractor.launch()
        engines = [extractor.ready() for extractor in extractors]
        engine = engines[0]
        metadata = shard_metadata(engine, self.spec)
        self.bytes_per_token = state_bytes_per_token(metadata)
        budgets: dict[Path, DiskBudget] = {}
        for group, extractor in zip(self.groups, extractors):
            writers = WriterPool(group.directory, metadata, self.extract.on_nonfinite, group.writers, group.placement())
            if group.directory not in budgets:
                budgets[group.directory] = self.budget.for_disk(group.disk())
            budget = budgets[group.directory]
            max_inflight = self.output.max_inflight_batches or len(writers) + INFLIGHT_BEYOND_WRITERS
            self.lanes.append(Lane(group, extractor, writers, budget, max_inflight))
        # While the writers start: the batches in flight, and a little more, touch the object store's pages.
        warmed = [lane.extractor.warm_object_store(lane.max_inflight + OBJECT_STORE_WARM_EXTRA) for lane in self.lanes]
        for lane in self.lanes:
            _check_node(lane, lane.writers.wait_ready())
            logger.info(
                "node %s: %d writers, at most %d batches in flight (about %s of states in memory) -> %s",
                lane.group.name, len(lane.writers), lane.max_inflight,
                format_bytes(lane.max_inflight * self.spec.max_tokens_per_batch * self.bytes_per_token),
                lane.group.directory,
            )
        ray.get(warmed)
        self.uploads = UploadQueue(
            self.output.sink, self.output.sink_options, self.output.num_uploaders, self.extract.max_attempts,
            {group.name: group.placement() for group in self.groups},
        )
        self.scheduler = Scheduler(
            self.dataset, self.plan, self.shards, self.manifest, self.lanes, self.work, self.bytes_per_token,
            self.extract.max_attempts,
        )
        return engine

    def _stop_actors(self) -> tuple[CaptureActivity, dict[str, dict[str, float]]]:
        activity = CaptureActivity(batches=0, tokens=0, busy_seconds=0.0)
        writer_seconds: dict[str, dict[str, float]] = {}
        for lane in self.lanes:
            activity = _add_activity(activity, lane.extractor.stop())
            for clock, stages in lane.writers.stop().items():
                totals = writer_seconds.setdefault(clock, {})
                for stage, seconds in stages.items():
                    totals[stage] = totals.get(stage, 0.0) + seconds
        if self.uploads is not None:
            self.uploads.stop()
        return activity, writer_seconds

    def _discard_active(self) -> None:
        """Shards cut short leave no temp file behind (the next run would remove it anyway)."""
        discards = [
            attempt.writer.discard.remote(index) for index, attempt in self.scheduler.active.items()
            if attempt.lane.writers.is_member(attempt.writer)
        ]
        with contextlib.suppress(Exception):
            ray.get(discards, timeout=DISCARD_TIMEOUT_S)

    # -- main loop -------------------------------------------------------------------------------

    def run(self) -> RunResult:
        started = time.perf_counter()
        try:
            engine = self._start_actors()
            startup = time.perf_counter() - started
            started = time.perf_counter()
            self.progress.begin(self._budgets())
            self._rescan(force=True)
            self._extract_shards()
            while self.work or self.uploads.retries:
                if self.work:
                    self._settle_one(timeout=self.output.rescan_s)
                else:  # only failed uploads left: the next rescan offers them again
                    time.sleep(self.output.rescan_s)
                self._rescan_and_report()
        except BaseException:
            if self.scheduler is not None:
                self._discard_active()
            raise
        finally:
            self.progress.close()
            activity, writer_seconds = self._stop_actors()
        ended = time.perf_counter()
        budgets = self._budgets()
        return RunResult(
            engine=engine,
            startup_seconds=startup,
            seconds=ended - started,
            drain_seconds=ended - max(started, self.last_write_done),
            budget_peak=max(budget.peak for budget in budgets),
            budget_overshoot=max(budget.overshoot for budget in budgets),
            blocked_seconds=sum(budget.blocked_seconds for budget in budgets),
            writers=sum(len(lane.writers) for lane in self.lanes),
            peak_open_shards=self.scheduler.peak_open_shards,
            max_inflight_batches=sum(lane.max_inflight for lane in self.lanes),
            extractor=activity,
            writer_seconds=writer_seconds,
            extractor_restarts=sum(lane.extractor.generation for lane in self.lanes),
            nodes={
                lane.group.name: {
                    "directory": str(lane.group.directory), "node_id": lane.group.node_id,
                    "writers": len(lane.writers), "budget_peak": lane.budget.peak,
                    "budget_overshoot": lane.budget.overshoot, "restarts": lane.extractor.generation,
                }
                for lane in self.lanes
            },
        )

    def _extract_shards(self) -> None:
        while self.scheduler.has_work:
            self.progress.tick()
            self.scheduler.open_shards(self._wait_for_disk)
            lane = self.scheduler.ready_lane()
            if lane is None:
                # Every lane is at its batches in flight, or nothing is open: shards cut short by a
                # fault come back once discarded. Bounded, so that progress is reported while nothing
                # completes (an extractor loading its model after a fault holds every batch of its lane).
                self._settle_one(timeout=self.progress.refresh_s if self.scheduler.any_open else self.output.rescan_s)
                continue
            self.scheduler.send_batch(lane)

    def _wait_for_disk(self, lane: Lane, nbytes: int) -> None:
        """Hold the next shard until its bytes fit the lane's budget; BudgetExhausted if nothing can free any."""
        if lane.budget.blocking_policy(nbytes) is None:
            return
        self.progress.disk_wait_started()
        blocked_before = lane.budget.blocked_seconds
        try:
            lane.budget.wait_until_fits(
                nbytes, self._settle_one_if_any, self._rescan_and_report, self.output.budget_wait_s,
                self.output.rescan_s, lambda state: self._exhausted_message(lane, state),
            )
        finally:  # the budget's own clock of this wait, also when it ends in BudgetExhausted
            self.progress.disk_wait_ended(lane.budget.blocked_seconds - blocked_before)

    def _exhausted_message(self, lane: Lane, state: str) -> str:
        remaining = [r for r in self.manifest.shards.values() if r.state != DONE]
        tokens = sum(self.plan[r.index].tokens for r in remaining)
        where = "output.dir" if lane.group.directory == self.output_dir else f"{lane.group.directory} (node {lane.group.name})"
        return (
            f"stopped after waiting {self.output.budget_wait_s:.0f} s for disk budget ({state}) with nothing "
            f"in flight that could free space. {len(remaining)} shards remain, about "
            f"{format_bytes(tokens * self.bytes_per_token)} to write. Raise output.disk_budget, set "
            f"output.sink, or free space under {where} (e.g. let the trainer consume shards), then "
            "rerun the same command: it resumes where this run stopped"
        )

    # -- completions -----------------------------------------------------------------------------

    def _settle_one_if_any(self, timeout: float) -> bool:
        """Handle one completion within ``timeout``; False if nothing is in flight."""
        if not self.work:
            return False
        self._settle_one(timeout)
        return True

    def _settle_one(self, timeout: float | None) -> None:
        done = self.work.next_done(timeout)
        if done is None:
            return
        item, ref = done
        if isinstance(item, Append):
            self._on_append(item, ref)
        elif isinstance(item, Finish):
            self._on_finish(item.attempt, ref)
        elif isinstance(item, Discard):
            self._on_discard(item.attempt, ref)
        elif isinstance(item, Upload):
            self._on_upload(item.shard, ref)
        elif isinstance(item, Restarted):
            self._on_restarted(item, ref)

    def _on_append(self, item: Append, ref: ray.ObjectRef) -> None:
        attempt, lane = item.attempt, item.attempt.lane
        attempt.inflight -= 1
        lane.inflight -= 1
        try:
            tokens = ray.get(ref)
        except ExtractorLost as error:
            if item.generation == lane.extractor.generation:
                self._restart_extractor(lane, _error_text(error))
            self._lose(attempt, f"the extractor died: {_error_text(error)}")
            return
        except ray.exceptions.RayActorError as error:
            self._writer_died(lane, attempt.writer, error)
            return
        if tokens == 0 and not attempt.lost:  # the writer dropped the shard: spend no more extraction on it
            self.scheduler.close(attempt)
        self.last_write_done = time.perf_counter()
        self.progress.tokens_written(attempt.index, tokens)

    def _on_finish(self, attempt: ShardAttempt, ref: ray.ObjectRef) -> None:
        lane = attempt.lane
        try:
            info: ShardFileInfo = ray.get(ref)
        except ExtractorLost as error:  # the extractor's restart follows the batch that met the fault
            self._lose(attempt, f"the extractor died: {_error_text(error)}")
            return
        except ray.exceptions.RayActorError as error:
            self._writer_died(lane, attempt.writer, error)
            return
        except Exception as error:
            if not attempt.lost:  # a lost attempt is settled by its Discard
                self._shard_failed(attempt, error)
            return
        if attempt.lost:  # every batch was written before the fault hit: the file is whole
            logger.info("shard %d was published before the fault reached it", attempt.index)
        self.scheduler.settled(attempt)
        lane.budget.commit(attempt.index, info.bytes, info.tokens, self.bytes_per_token)
        record = self.manifest.update(
            attempt.index, state=DONE, error="", file=Path(info.path).name, rows=info.rows, tokens=info.tokens,
            bytes=info.bytes, sha256=info.sha256, location=LOCAL, sink_url="", node=lane.group.name,
            nonfinite=list(info.nonfinite),
        )
        self.uploads.offer(record, lane.group.name, lane.group.directory / record.file, self.work)
        self.progress.shard_settled(attempt.index)

    def _on_restarted(self, item: Restarted, ref: ray.ObjectRef) -> None:
        extractor = item.lane.extractor
        if item.generation != extractor.generation:
            return  # a later fault already replaced it
        try:
            extractor.loaded(ray.get(ref))
        except ray.exceptions.RayError as error:  # died while loading: its queued batches died with it
            self._restart_extractor(item.lane, _error_text(error))

    def _shard_failed(self, attempt: ShardAttempt, error: Exception) -> None:
        lane = attempt.lane
        self.scheduler.settled(attempt)
        lane.budget.release(attempt.index)
        message = _error_text(error)
        self.manifest.update(attempt.index, state=FAILED, error=message)
        logger.error("shard %d failed: %s", attempt.index, message)
        self.progress.shard_settled(attempt.index)
        if isinstance(error, ShardDiskFull):
            where = "output.dir" if lane.group.directory == self.output_dir else f"output.node_dir of node {lane.group.name}"
            raise DiskFull(
                f"{where}={lane.group.directory} is full: {message}. The shard's temp file was removed. Free space "
                "there (or set output.sink, or lower output.disk_budget below the space the disk has), then "
                "rerun the same command: it resumes where this run stopped"
            )

    # -- faults ----------------------------------------------------------------------------------

    def _restart_extractor(self, lane: Lane, reason: str) -> None:
        """A new extractor for the lane; the run goes on while it loads (see ``ExtractorHost.restart``)."""
        loaded = lane.extractor.restart(reason)
        self.work.add(loaded, Restarted(lane, lane.extractor.generation))

    def _writer_died(self, lane: Lane, writer: Any, error: Exception) -> None:
        """Replace the writer; every attempt it held is lost (once: its other failures change nothing)."""
        if lane.writers.replace(writer) is None:
            return
        for attempt in list(self.scheduler.active.values()):
            if attempt.writer is writer:
                self._lose(attempt, f"its writer died: {_error_text(error)}")

    def _lose(self, attempt: ShardAttempt, reason: str) -> None:
        """A fault cut the attempt short: stop sending its batches and discard what its writer holds."""
        if attempt.lost:
            return
        attempt.lost = reason
        logger.warning("shard %d: %s; it will be written again", attempt.index, reason)
        self.scheduler.drop(attempt)
        writers = attempt.lane.writers
        # After the writer's calls for this shard (one caller's calls run in order): no write of
        # the attempt can follow the discard, which also removes a temp file a dead writer left
        # (a writer of the same node: the file is on its disk).
        if not writers.is_member(attempt.writer):
            attempt.writer = writers.writers[0]
        self.work.add(attempt.writer.discard.remote(attempt.index), Discard(attempt))

    def _on_discard(self, attempt: ShardAttempt, ref: ray.ObjectRef) -> None:
        try:
            ray.get(ref)
        except ray.exceptions.RayActorError as error:  # the writer asked to clean up died too
            self._writer_died(attempt.lane, attempt.writer, error)
            attempt.lost, reason = "", attempt.lost
            self._lose(attempt, reason)
            return
        attempt.lane.budget.release(attempt.index)
        self.progress.shard_discarded(attempt.index)
        self.scheduler.retry(attempt)

    # -- uploads and rescans ---------------------------------------------------------------------

    def _on_upload(self, shard: int, ref: ray.ObjectRef) -> None:
        try:
            url = ray.get(ref)
        except Exception as error:
            left = self.uploads.failed(shard)
            message = f"upload to {self.output.sink} failed, the file stays local: {_error_text(error)}"
            self.manifest.update(shard, error=message)
            logger.error("shard %d: %s (%s)", shard, message,
                         f"tried again in {self.output.rescan_s:.0f} s" if left else "a rerun tries again")
            return
        self.uploads.succeeded(shard)
        record = self.manifest.shards[shard]
        lane = self._home(record)
        # Record first, then delete: a crash in between leaves a local copy the next run removes.
        self.manifest.update(shard, location=SINK, sink_url=url, error="")
        if lane is not None:
            lane.budget.disk.remove([shard_file_name(shard)])
            lane.budget.forget(shard)

    def _home(self, record: ShardRecord) -> Lane | None:
        """The lane on the node holding a done shard's file (records of single-node runs name no node:
        output.dir's); None if that node is not in this run's cluster."""
        for lane in self.lanes:
            if record.node == lane.group.name or (not record.node and lane.group.directory == self.output_dir):
                return lane
        return None

    def _rescan(self, force: bool = False) -> None:
        """Notice committed files someone else deleted (a trainer consuming them); offer failed uploads again."""
        now = time.monotonic()
        if not force and now - self.last_rescan < self.output.rescan_s:
            return
        self.last_rescan = now
        by_lane: dict[int, list[ShardRecord]] = {}
        for record in self.manifest.in_state(DONE):
            if record.location == LOCAL and not self.uploads.uploading(record.index):
                lane = self._home(record)
                if lane is not None:
                    by_lane.setdefault(id(lane.budget), []).append(record)
        for lane in {id(lane.budget): lane for lane in self.lanes}.values():
            records = by_lane.get(id(lane.budget), [])
            for shard in lane.budget.rescan((r.index, r.file, r.bytes) for r in records):
                logger.info("shard %d: %s was removed from %s; its bytes are free", shard, shard_file_name(shard),
                            lane.group.directory)
                self.manifest.update(shard, location=CONSUMED)
                self.uploads.gone(shard)
            for record in records:
                if record.location == LOCAL:
                    home = self._home(record)
                    self.uploads.offer(record, home.group.name, home.group.directory / record.file, self.work)

    def _rescan_and_report(self) -> None:
        self._rescan()
        self.progress.tick()

    def _budgets(self) -> list[DiskBudget]:
        """Each directory's budget once (lanes of one node may share a directory)."""
        return list({id(lane.budget): lane.budget for lane in self.lanes}.values())


def _check_node(lane: Lane, writer_nodes: list[str]) -> None:
    """States never cross the network: the extractor and every writer of a lane run on its node."""
    extractor_node = lane.extractor.node_id()
    if {extractor_node, *writer_nodes} != {lane.group.node_id}:
        raise JobFault(
            f"node {lane.group.name}: its extractor and writers were placed on other nodes ({extractor_node}, "
            f"{writer_nodes}); the Ray cluster changed while the job started. Rerun the same command to resume"
        )


def _add_activity(total: CaptureActivity, more: CaptureActivity) -> CaptureActivity:
    return dataclasses.replace(
        total, batches=total.batches + more.batches, tokens=total.tokens + more.tokens,
        busy_seconds=total.busy_seconds + more.busy_seconds,
        hand_on_seconds=total.hand_on_seconds + more.hand_on_seconds,
    )


def _error_text(error: Exception) -> str:
    cause = getattr(error, "cause", None) or error
    return f"{type(cause).__name__}: {cause}"
