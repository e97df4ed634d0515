"""One extraction over the data-parallel groups: the lanes, and the owners the driver's loop turns over.

``ExtractionRun`` starts one lane per data-parallel group (``jobs.driver.startup``) and composes small
owners, each of which alone changes what it holds: the scheduler (shards, batches, lanes, attempts),
``Completions``, the upload queue, the rescanner and ``DiskWait``; ``jobs.driver.loop.DriverLoop``
turns over them until every shard is settled. At most ``output.max_inflight_batches`` batches per
lane sit between its extractor and a finished write, which bounds the states held in its node's memory.
A run with nothing to extract (a rerun that only uploads done files to the sink) starts no extractor and no
writer while it has nothing to extract, and reports the model as the run before it recorded; a file lost
meanwhile starts them then.

Faults are survived in the same run (an extractor started again, a writer replaced, a shard cut short
extracted again) up to ``extract.max_restarts`` and ``extract.max_attempts``; past them the job stops
with ``JobFault`` (exit 4) and a rerun resumes. A run that ends early winds down on leaving the
``with`` block: open shards are discarded and any shard already published is recorded, so that no
whole file is left unrecorded.
"""

from __future__ import annotations

import logging
import time
from types import TracebackType
from typing import Any, Callable, Optional

from common.checks import format_bytes
from extractor.types import CaptureActivity, EngineInfo, EngineSpec
from jobs.cluster.nodes import NodeGroup
from jobs.driver.completions import Completions
from jobs.driver.context import RunContext
from jobs.driver.disk_wait import DiskWait
from jobs.driver.lanes import Lane, Lanes
from jobs.driver.loop import DriverLoop
from jobs.driver.progress import RunProgress
from jobs.driver.rescan import Rescanner
from jobs.driver.result import RunResult, node_figures
from jobs.driver.scheduler import Scheduler
from jobs.driver.startup import (
    discard_all,
    plan_lanes,
    start_actors,
    start_uploaders,
    stop_extractors,
    stop_lanes,
    stop_uploaders,
)
from jobs.driver.uploads import UploadQueue
from jobs.driver.work import PendingWork
from jobs.planning.engine import shard_metadata
from runtime.errors import ClusterLost, stop_in
from runtime.interrupts import signals_deferred
from storage.manifest import DONE, Manifest, ShardRecord
from storage.writer import state_bytes_per_token

logger = logging.getLogger(__name__)

DISCARD_TIMEOUT_S = 1.5
"""How long a run ending early waits for its writers to drop their open shards. ``ray job stop`` sends
SIGKILL 3 s after its SIGTERM (``RAY_JOB_STOP_WAIT_TIME_S``): the whole wind-down must fit. A writer that
does not answer in time is killed; what it leaves (a temp file) the next run removes."""


class ExtractionRun:
    """Extracts ``shards`` over the data-parallel ``groups`` and keeps the manifest and budgets true at every step."""

    def __init__(
        self, context: RunContext, spec: EngineSpec, groups: list[NodeGroup], shards: list[ShardRecord],
        manifest: Manifest, progress: RunProgress, reported_engine: Optional[EngineInfo] = None,
    ) -> None:
        """``context``: the run's inputs, plan and budget; ``shards``: those it extracts. ``reported_engine``: what
        the model reported to the run before (its summary), if it did; with it, a run with no shard to extract
        starts no actor unless a file is lost meanwhile."""
        config = context.config
        self._spec, self._dataset, self._plan, self._shards = spec, context.inputs.dataset, context.plan, shards
        self._extract, self._output, self._output_dir = config.extract, config.output, context.output_dir
        self._manifest, self._budget, self._groups, self._progress = manifest, context.budget, groups, progress
        self._timeline = context.stages.timeline
        self._work = PendingWork()
        self._lanes: Optional[Lanes] = None
        self._engine = reported_engine
        self._scheduler: Optional[Scheduler] = None
        self._completions: Optional[Completions] = None
        self._uploads: Optional[UploadQueue] = None
        self._uploaders: dict[str, list[Any]] = {}
        self._disk_wait = DiskWait(self._output.budget_wait_s, self._output.rescan_s, progress, self._exhausted)
        self._stopped: Optional[tuple[CaptureActivity, dict[str, dict[str, float]]]] = None
        self._clock = {"start": 0.0, "first_batch": 0.0, "end": 0.0}
        """perf_counter at the actors' start, the first batch, and the last shard settled."""

    def __enter__(self) -> "ExtractionRun":
        return self

    def __exit__(self, kind: Optional[type], error: Optional[BaseException], trace: Optional[TracebackType]) -> None:
        """Stop the actors. After an early end, first stop the extractors (a writer's batch still waiting for
        its states then fails at once instead of being extracted first), discard the open shards and record
        those already published: a few seconds at most, run whole (a second signal waits). With the cluster
        lost there is no actor to stop or ask: a shard a writer published unrecorded, and the temp files of open
        ones, are removed by the next run's start."""
        ended_early = error is not None
        self._writes_on_the_timeline(ended_early)
        self._timeline.enter("winding down")
        lanes = self._lanes if self._lanes is not None else Lanes([], self._output_dir)
        if error is not None and isinstance(stop_in(error), ClusterLost):  # the actors went with the cluster
            with signals_deferred(reraise=False):
                self._progress.close()
            return
        with signals_deferred(reraise=not ended_early):
            try:
                if ended_early and self._scheduler is not None and self._completions is not None:
                    stop_extractors(lanes)
                    discard_all(self._scheduler.active(), DISCARD_TIMEOUT_S)
                    for shard in self._completions.record_published():
                        logger.info("shard %d was published as the run stopped; it is recorded done", shard)
                self._progress.close()
            finally:
                stop_uploaders(self._uploaders)
                self._stopped = stop_lanes(lanes, collect_stats=not ended_early)

    def run(self) -> None:
        """Start the actors and drive every shard to done (or failed); ``result`` tells what the run
        measured once the ``with`` block has stopped the actors."""
        self._clock["start"] = time.perf_counter()
        self._lanes = lanes = plan_lanes(
            self._spec, self._groups, self._extract, self._output, self._budget, self._output_dir
        )
        if self._shards or self._engine is None:
            self._start_actors(self._progress.stage)
        else:
            logger.info("no shard to extract: the extractor and writers are not started (model as the run before "
                        "reported it: %s)", self._engine.model_architecture)
        self._uploaders = start_uploaders(self._output, lanes)
        self._uploads = UploadQueue(
            self._output.sink, self._uploaders, self._output.upload_attempts, lanes, self._manifest, self._work,
            retry_s=self._output.rescan_s,
        )
        self._scheduler = Scheduler(
            self._dataset, self._plan, self._shards, self._manifest, lanes, self._work, self._progress,
            self._bytes_per_token(), self._extract.max_attempts,
        )
        self._completions = Completions(self._scheduler, self._uploads, self._work, lanes)
        rescanner = Rescanner(self._manifest, lanes, self._uploads, self._scheduler, self._output.rescan_s)
        self._clock["first_batch"] = time.perf_counter()
        self._progress.begin(lanes.budgets())
        DriverLoop(
            lanes, self._scheduler, self._completions, self._uploads, rescanner, self._disk_wait, self._progress,
            self._work, self._start_late,
        ).run()
        self._clock["end"] = time.perf_counter()

    def _writes_on_the_timeline(self, ended_early: bool) -> None:
        """The phases the batches' writes bound, known only afterwards: extracting with the pipeline full from the
        first batch written and, after a run that went to its end, closing the last shards from the last one (from
        the first batch sent where none was written: the run only closed, or uploaded, what it had)."""
        if self._completions is None:  # stopped before its first batch
            return
        writes, now = self._completions.writes, time.perf_counter()
        if writes.first is not None:
            self._timeline.enter("extracting", seconds_ago=now - writes.first)
        if not ended_early:
            last = self._clock["first_batch"] if writes.last is None else writes.last
            self._timeline.enter("closing the last shards", seconds_ago=now - last)

    def _start_actors(self, stage: Callable[[str, Optional[Callable[[], str]]], None]) -> None:
        self._engine = start_actors(self._lanes, self._spec, self._groups, self._extract, self._output, stage)

    def _start_late(self) -> None:
        """A shard to extract in a run that started no actor (a done file was lost while it uploaded)."""
        logger.info("a shard is to be extracted again: starting the extractor and writers")
        self._start_actors(lambda stage, detail=None: logger.info("%s", stage))

    def _bytes_per_token(self) -> int:
        return state_bytes_per_token(
            shard_metadata(self._engine, self._spec.model_path, self._spec.state_dtype, self._spec.last_hidden_state)
        )

    def result(self) -> RunResult:
        """What the run measured; only after it ran to its end and the ``with`` block stopped its actors."""
        lanes, budgets = self._lanes, self._lanes.budgets()
        activity, writer_seconds = self._stopped
        clock, writes = self._clock, self._completions.writes
        first_written = clock["first_batch"] if writes.first is None else writes.first
        last_written = clock["first_batch"] if writes.last is None else writes.last
        return RunResult(
            engine=self._engine,
            startup_seconds=clock["first_batch"] - clock["start"],
            seconds=clock["end"] - clock["first_batch"],
            first_batch_seconds=first_written - clock["first_batch"],
            steady_seconds=last_written - first_written,
            steady_tokens=writes.tokens_after_first,
            drain_seconds=clock["end"] - max(clock["first_batch"], last_written),
            budget_peak=max(budget.peak for budget in budgets),
            budget_overshoot=max(budget.overshoot for budget in budgets),
            blocked_seconds=self._disk_wait.blocked_seconds,
            writers=sum(len(lane.writers) for lane in lanes if lane.writers is not None),
            peak_open_shards=self._scheduler.peak_open_shards,
            max_inflight_batches=sum(lane.max_inflight for lane in lanes),
            extractor=activity,
            writer_seconds=writer_seconds,
            extractor_restarts=sum(lane.extractor.generation for lane in lanes),
            nodes=node_figures(lanes),
            extracted_again=tuple(sorted(self._scheduler.extracted_again)),
            attempts_undone=self._scheduler.attempts_undone,
        )

    def _exhausted(self, lane: Lane, state: str) -> str:
        remaining = [r for r in self._manifest.shards.values() if r.state != DONE]
        tokens = sum(self._plan[r.index].tokens for r in remaining)
        return (
            f"stopped after waiting {self._output.budget_wait_s:.0f} s for disk budget ({state}) with nothing "
            f"in flight that could free space and nothing consumed. {len(remaining)} shards remain, about "
            f"{format_bytes(tokens * self._bytes_per_token())} to write. Raise output.disk_budget, set "
            f"output.sink, or free space under {self._lanes.where(lane)} (e.g. let the trainer consume "
            "shards; a trainer that pauses longer between shards needs a larger output.budget_wait_s), then "
            "rerun the same command: it resumes where this run stopped"
        )
