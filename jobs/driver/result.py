"""What a finished run measured, for ``.summary.json`` and the benchmarks."""

from __future__ import annotations

import dataclasses
import time
from typing import Any, Optional

from extractor.types import CaptureActivity, EngineInfo
from jobs.driver.lanes import Lanes

STEADY_MIN_SECONDS = 1.0
"""The shortest window between the first batch written and the last that gives a steady rate."""


@dataclasses.dataclass
class RunResult:
    engine: EngineInfo
    """What the model reported: loaded by this run, or, when this run extracted nothing, by the run before."""
    startup_seconds: float
    """Actors up and the model loaded: the time to the first batch."""
    seconds: float
    """From the first batch to the last file committed (and uploaded)."""
    first_batch_seconds: float
    """From the first batch sent to the first batch written: one batch's way through the pipeline (forward, copy,
    hand-on, the writer's write)."""
    steady_seconds: float
    """From the first batch written to the last: the pipeline full, the run's steady state."""
    steady_tokens: int
    """Tokens written after the first batch, up to the last: ``steady_tokens / steady_seconds`` is the rate a longer
    run of the same data keeps."""
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
    extracted_again: tuple[int, ...] = ()
    """Done shards whose files were lost while the run went on (gone, not declared consumed): written again."""
    attempts_undone: int = 0
    """Attempts whose written batches came to nothing (a shard failed, or discarded after a fault)."""

    @property
    def steady_tokens_per_second(self) -> Optional[float]:
        """Tokens per second between the first batch written and the last: the rate a longer run of the same data
        keeps. None where the figure would not be that: a window under ``STEADY_MIN_SECONDS`` (the driver hears of
        writes in bursts: two batches heard together would make any rate), or work thrown away and done again
        (an extractor restarted, an attempt undone), whose batches the window counts."""
        if self.steady_seconds < STEADY_MIN_SECONDS or self.extractor_restarts or self.attempts_undone:
            return None
        return self.steady_tokens / self.steady_seconds


class WriteClock:
    """When the run's batches were written (perf_counter): the first and the last, and the tokens written after the
    first. Between the first and the last the pipeline is full: the rate there is the run's steady state, apart from
    the first batch's way through the pipeline and the closing of the last shards, which a run pays once."""

    def __init__(self) -> None:
        self.first: Optional[float] = None
        self.last: Optional[float] = None
        self.tokens_after_first = 0

    def batch_written(self, tokens: int) -> None:
        """A batch of ``tokens`` written now (0: a writer that dropped its shard wrote nothing)."""
        if tokens <= 0:
            return
        now = time.perf_counter()
        if self.first is None:
            self.first = now
        else:
            self.tokens_after_first += tokens
        self.last = now


def node_figures(lanes: Lanes) -> dict[str, dict[str, Any]]:
    """Per lane; a lane whose actors never started (nothing to extract) has no writers."""
    return {
        lane.group.name: {
            "directory": str(lane.group.directory), "node_id": lane.group.node_id,
            "writers": len(lane.writers) if lane.writers is not None else 0,
            "writer_cpus": lane.writers.cpus if lane.writers is not None else "", "budget_peak": lane.budget.peak,
            "budget_overshoot": lane.budget.overshoot, "restarts": lane.extractor.generation,
        }
        for lane in lanes
    }
