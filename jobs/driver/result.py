"""What a finished run measured, for ``.summary.json`` and the benchmarks."""

from __future__ import annotations

import dataclasses
from typing import Any

from extractor.types import CaptureActivity, EngineInfo
from jobs.driver.lanes import Lanes


@dataclasses.dataclass
class RunResult:
    engine: EngineInfo
    """What the model reported: loaded by this run, or, when this run extracted nothing, by the run before."""
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
    extracted_again: tuple[int, ...] = ()
    """Done shards whose files were lost while the run went on (gone, not declared consumed): written again."""


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
