"""The run's lanes, one per data-parallel group; starting their actors, and stopping them.

Every node loads its model at the same time, and the writers start meanwhile: they need nothing of the
model until what every shard file records of it (``ShardMetadata``, known once it has loaded), which
they receive before their first batch. Once the model has loaded, the batches in flight (plus a little
more) touch the object store's pages before the first real batch, so that start-up costs stay out of
the run's clock.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
from pathlib import Path
from typing import Any, Callable, Optional

import ray

from common.checks import format_bytes
from extractor.config import ExtractConfig
from extractor.types import CaptureActivity, EngineInfo, EngineSpec
from jobs.actors import uploader
from jobs.actors.cpus import writer_cpus
from jobs.actors.extractor import ExtractorHost
from jobs.actors.writer import WriterPool, WriterSettings
from jobs.cluster.nodes import NodeGroup
from jobs.driver.lanes import Lane, Lanes, ShardAttempt
from jobs.outdir.budget import DiskBudget
from jobs.outdir.config import OutputConfig
from jobs.planning.engine import shard_metadata
from runtime.errors import JobFault
from storage.writer import state_bytes_per_token

logger = logging.getLogger(__name__)

# Auto max_inflight_batches: one batch per writer, plus one in the extractor's forward and one
# on its way to the object store.
INFLIGHT_BEYOND_WRITERS = 2
STARTING = "loading the model and starting the writers"
"""The start's phases as the stage line and the wall-time table name them: the writers start while the model
loads (the phase ends when both are up), then what needs the loaded model."""
WARMING = "warming the object store"
# Objects beyond max_inflight_batches the extractor writes into the object store before the run: the
# store does not always hand a freed block to the next object of the same size.
OBJECT_STORE_WARM_EXTRA = 2


def plan_lanes(
    spec: EngineSpec, groups: list[NodeGroup], extract: ExtractConfig, output: OutputConfig, budget: DiskBudget,
    output_dir: Path,
) -> Lanes:
    """One lane per data-parallel group: its node's budget and its extractor's host. No actor runs before
    ``start_actors``: a run with nothing to extract (only uploads left) never starts one."""
    budgets: dict[Path, DiskBudget] = {}
    lanes = []
    for group in groups:
        if group.directory not in budgets:
            budgets[group.directory] = budget.for_disk(group.disk())
        extractor = ExtractorHost(spec, extract.max_restarts, group.placement(), f"node {group.name}")
        max_inflight = output.max_inflight_batches or group.writers + INFLIGHT_BEYOND_WRITERS
        lanes.append(Lane(group, extractor, budgets[group.directory], max_inflight))
    return Lanes(lanes, output_dir)


def start_actors(
    lanes: Lanes, spec: EngineSpec, groups: list[NodeGroup], extract: ExtractConfig, output: OutputConfig,
    stage: Callable[[str, Optional[Callable[[], str]]], None],
) -> EngineInfo:
    """Every lane's extractor and writers, ready; returns what the model reported. ``stage`` is told what the
    start does (``RunProgress.stage``). The writers start while the model loads: only what needs the loaded
    model waits for it (their metadata, the object store's warm-up, where the extractor runs). If the start
    fails half-way (or a signal stops it), ``stop_lanes`` stops what it started: every actor it starts is its
    lane's at once."""
    extractors = [lane.extractor for lane in lanes]
    for extractor in extractors:  # every node loads its model at the same time
        extractor.launch()
    for group, lane in zip(groups, lanes):
        lane.start_writers(WriterPool(group.directory, _writer_settings(spec, groups, group, extract, output),
                                      group.writers, group.placement()))
    stage(STARTING, lambda: _starting(list(lanes)))
    engine = [extractor.ready() for extractor in extractors][0]
    nodes = {id(lane): lane.writers.wait_ready() for lane in lanes}
    stage(WARMING, None)
    metadata = shard_metadata(engine, spec.model_path, spec.state_dtype, spec.last_hidden_state)
    for lane in lanes:
        lane.writers.set_metadata(metadata)
    warmed = [lane.extractor.warm_object_store(lane.max_inflight + OBJECT_STORE_WARM_EXTRA) for lane in lanes]
    for lane in lanes:
        _check_node(lane, nodes[id(lane)])
        logger.info(
            "node %s: %d writers on %s, at most %d batches in flight (about %s of states in memory) -> %s",
            lane.group.name, len(lane.writers), lane.writers.cpus, lane.max_inflight,
            format_bytes(lane.max_inflight * spec.max_tokens_per_batch * state_bytes_per_token(metadata)),
            lane.group.directory,
        )
    ray.get(warmed)
    return engine


def _starting(lanes: list[Lane]) -> str:
    """``1 of 2 extractors ready (node b: loading the weights), 16 of 16 writers ready``."""
    extractors = [lane.extractor for lane in lanes]
    loads = [f"{e.where}: {stage}" for e in extractors if not e.is_loaded for stage in [e.load_stage()] if stage]
    shown = "; ".join(loads[:2]) + (f"; {len(loads) - 2} more" if len(loads) > 2 else "")
    ready = sum(e.is_loaded for e in extractors)
    writers = sum(lane.writers.ready_count() for lane in lanes)
    return (f"{ready} of {len(extractors)} extractors ready" + (f" ({shown})" if shown else "")
            + f", {writers} of {sum(len(lane.writers) for lane in lanes)} writers ready")


def _writer_settings(spec: EngineSpec, groups: list[NodeGroup], group: NodeGroup, extract: ExtractConfig,
                     output: OutputConfig) -> WriterSettings:
    on_node = sum(other.node_id == group.node_id for other in groups)
    gpus = on_node * spec.tp_size if spec.device == "cuda" else 0
    return WriterSettings(extract.on_nonfinite, output.checksum, writer_cpus(output.writer_cpus, gpus))


def stop_lanes(lanes: Lanes, collect_stats: bool) -> tuple[CaptureActivity, dict[str, dict[str, float]]]:
    """Stop every actor; with ``collect_stats``, first ask each what it did (the run's figures)."""
    activity = CaptureActivity(batches=0, tokens=0, busy_seconds=0.0)
    writer_seconds: dict[str, dict[str, float]] = {}
    for lane in lanes:
        activity = _add_activity(activity, lane.extractor.stop(collect_stats))
        if lane.writers is None:
            continue
        for clock, stages in lane.writers.stop(collect_stats).items():
            totals = writer_seconds.setdefault(clock, {})
            for stage, seconds in stages.items():
                totals[stage] = totals.get(stage, 0.0) + seconds
    return activity, writer_seconds


def stop_extractors(lanes: Lanes) -> None:
    """Kill every lane's extractor now (a run ending early): the batches the writers still wait for fail at
    once, so that their shards can be discarded without waiting for them to be extracted."""
    for lane in lanes:
        lane.extractor.stop(collect_stats=False)


def start_uploaders(output: OutputConfig, lanes: Lanes) -> dict[str, list[Any]]:
    """Each node's uploaders, on the node whose files they upload; none without a sink."""
    if not output.sink:
        return {}
    return {
        lane.group.name: uploader.start_uploaders(
            output.sink, output.sink_options, output.num_uploaders, lane.group.placement()
        )
        for lane in lanes
    }


def stop_uploaders(uploaders: dict[str, list[Any]]) -> None:
    for actors in uploaders.values():
        for actor in actors:
            ray.kill(actor)


def discard_all(attempts: list[ShardAttempt], timeout_s: float) -> None:
    """Ask the writers to drop every shard still open (the run is ending early): no temp file stays."""
    discards = [
        attempt.writer.discard.remote(attempt.index) for attempt in attempts
        if attempt.lane.writers is not None and attempt.lane.writers.is_member(attempt.writer)
    ]
    with contextlib.suppress(Exception):
        ray.get(discards, timeout=timeout_s)


def _check_node(lane: Lane, writer_nodes: list[str]) -> None:
    """States never cross the network: the extractor and every writer of a lane run on its node."""
    extractor_node = lane.extractor.node_id()
    if {extractor_node, *writer_nodes} != {lane.group.node_id}:
        raise JobFault(
            f"node {lane.group.name}: its extractor and writers were placed on other nodes ({extractor_node}, "
            f"{writer_nodes}); the Ray cluster changed while the job started. Rerun the same command to resume"
        )


def _add_activity(total: CaptureActivity, more: CaptureActivity) -> CaptureActivity:
    stages = {clock: dict(seconds) for clock, seconds in total.stage_seconds.items()}
    for clock, seconds in more.stage_seconds.items():
        for stage, value in seconds.items():
            stages.setdefault(clock, {})[stage] = stages.get(clock, {}).get(stage, 0.0) + value
    return dataclasses.replace(
        total, batches=total.batches + more.batches, tokens=total.tokens + more.tokens,
        busy_seconds=total.busy_seconds + more.busy_seconds,
        hand_on_seconds=total.hand_on_seconds + more.hand_on_seconds, stage_seconds=stages,
        process_cpu_seconds=total.process_cpu_seconds + more.process_cpu_seconds,
    )
