"""One extraction job from its config to its summary: inputs, checks, lock, Ray, the run, the outcome.

``run`` is what ``python -m jobs.extract`` runs. Before Ray starts it reads and
checks the inputs (``jobs.planning``), output.dir (writable, outside the input,
holding no run of other content), the layers (would SGLang capture them), the
sink (a test write), takes output.dir's lock, checks every done shard's file a
rerun would trust, and refuses what cannot fit. Then it starts Ray, claims and checks the run's
directories on every node, cleans them, drives the ``ExtractionRun`` (while
``ClusterWatch`` watches that the cluster is still there); ``RunEnd``
(``jobs.driver.ending``) records how it ended in ``.summary.json``: exit 0 only
when every shard this run was to write is done (and uploaded, with a sink).
"""

from __future__ import annotations

import logging
import socket
from pathlib import Path
from typing import Any, NamedTuple, Optional

import ray

from extractor.checkpoint import read_config, text_config
from extractor.drafter_config import build_drafter_config
from extractor.types import EngineInfo, EngineSpec
from jobs.cluster.node_disk import LocalDisk, read_claim
from jobs.cluster.nodes import NodeGroup, plan_groups, writers_for
from jobs.cluster.watch import ClusterWatch
from jobs.config import JobConfig
from jobs.driver.context import RunContext
from jobs.driver.ending import RunEnd, disk_full, nothing_to_do
from jobs.driver.progress import RunProgress
from jobs.driver.run import ExtractionRun
from jobs.outdir.budget import DiskBudget
from jobs.planning.capture import check_capture
from jobs.planning.content import RECORDED_SINCE, resumed_device
from jobs.planning.engine import build_engine_spec, planned_metadata
from jobs.planning.inputs import RunInputs, check_resumable, read_inputs
from jobs.planning.own_files import own_files
from jobs.planning.preflight import check_output_dir, check_shards_fit, check_sink, claim_sink
from jobs.planning.shards import Shard, plan_shards, shard_ranges
from jobs.rundir.resume import (
    check_absent_nodes,
    check_done_files,
    claim_directory,
    clean_output_dir,
    refuse_foreign_output,
    relabel_moved_files,
    select_planned,
    select_shards,
)
from jobs.rundir.summary import RunSummary, read_summary, write_drafter_config, write_invalid_rows
from runtime.cluster.session import ray_session, resolve_device
from runtime.cluster.submission import ray_job_submission_id
from runtime.display.stages import StageLine
from runtime.errors import is_disk_full
from runtime.interrupts import signals_deferred
from runtime.lock import OutputLock
from storage.manifest import DONE, LOCAL, MANIFEST_FILE, Manifest, ShardRecord, read_manifest
from storage.token_freq import TOKEN_FREQ_FILE, maybe_write_token_freq

logger = logging.getLogger("jobs.extract")


def run(config: JobConfig) -> dict:
    """Plan, extract and write; returns the run summary (also saved as .summary.json). What it does is shown
    from the start: each stage until the first batch, then the run's progress."""
    stages = StageLine(config.progress.interval_s)
    try:
        return _run(config, stages)
    finally:  # before the command's last lines and any error: the live line is erased
        stages.close()
        logger.info("%s", stages.timeline.line())  # the summary's wall_seconds end with the run; this with Ray too


def _run(config: JobConfig, stages: StageLine) -> dict:
    inputs = _check_before_ray(config, stages)
    try:
        with OutputLock(inputs.output_dir, ray_job_submission_id()) as lock:
            refuse_foreign_output(inputs.output_dir, (inputs.output_dir / MANIFEST_FILE).exists())
            return _run_locked(inputs, lock, stages)
    except OSError as error:  # a full disk under the job's own files (manifest, claims, lock): exit 3, not a fault
        if not is_disk_full(error):
            raise
        raise disk_full(inputs.output_dir, error) from error


def _check_before_ray(config: JobConfig, stages: StageLine) -> RunInputs:
    """The inputs, read and checked, and every check that needs no lock: output.dir, the layers, the sink."""
    stages.show("reading the inputs")
    inputs = read_inputs(config)
    config = inputs.config
    check_output_dir(inputs.output_dir, config.data.path)
    check_resumable(inputs)
    if config.model.engine == "sglang":
        stages.show("checking the layers SGLang captures")
        check_capture(config.model.path, inputs.layer_ids, config.model.dtype)
    check_sink(config.output.sink, config.output.sink_options, inputs.output_dir, config.output.node_dir)
    return inputs


def _run_locked(inputs: RunInputs, lock: OutputLock, stages: StageLine) -> dict:
    """Under output.dir's lock: which shards this run extracts and whether they fit, then Ray and the run."""
    config = inputs.config
    plan = plan_shards(
        inputs.dataset.lengths, config.data.shard_size, config.extract.max_tokens_per_batch,
        config.extract.max_samples_per_batch,
    )
    selection = _select(inputs, plan)
    if selection.nothing_to_do:
        return nothing_to_do(inputs.output_dir, selection.before)
    context = _build_context(inputs, plan, selection, stages)
    write_invalid_rows(inputs.output_dir, inputs.dataset.invalid)
    stages.show("starting Ray")
    with context.end.stops_recorded():  # a signal while Ray starts (the lock is still held then): recorded too
        with ray_session(config.ray.address):
            try:
                # recorded before Ray shuts down (seconds): `ray job stop` sends SIGKILL 3 s after its SIGTERM
                with ClusterWatch(ray.get_runtime_context().gcs_address), context.end.stops_recorded():
                    return _extract(context)
            finally:  # before Ray shuts down, for the same reason
                with signals_deferred(reraise=False):
                    lock.release()
                stages.timeline.enter("stopping Ray")


class _Selection(NamedTuple):
    """What a run under the lock finds before Ray starts: the shards it extracts, what output.dir held."""

    before: Manifest
    """The manifest output.dir holds (closed), or the plan's when it holds none."""
    shards: set[int]
    checked_node: Optional[str]
    reclaimable: int
    """Bytes of the done files checked here that this run may extract again (and so delete first)."""
    nothing_to_do: bool


def _select(inputs: RunInputs, plan: list[Shard]) -> _Selection:
    """The shards this run extracts: those the config selects; with a manifest, after the check of the done
    files output.dir holds on this host. Nothing to do when none is selected, no done file is left unchecked
    and none waits for the sink."""
    config, output_dir = inputs.config, inputs.output_dir
    ranges = shard_ranges(plan)
    manifest = _resumable_manifest(inputs, ranges)
    if manifest is None:
        before = Manifest(output_dir / MANIFEST_FILE, {}, {i: ShardRecord(i, a, b) for i, a, b in ranges})
        return _Selection(before, set(select_planned(config.shards, len(plan))), None, 0, False)
    checked_node = _check_files_here(manifest, output_dir, config.output.resume_check == "checksum")
    selected = {record.index for record in select_shards(manifest, config.shards)}
    unchecked = any(r.location == LOCAL and r.node != checked_node for r in manifest.in_state(DONE))
    if not selected and not unchecked and not _uploads_left(manifest, config.output.sink):
        manifest.close()
        return _Selection(manifest, selected, checked_node, 0, True)
    reclaimable = sum(r.bytes for r in manifest.in_state(DONE) if r.location == LOCAL and r.node == checked_node)
    manifest.close()
    return _Selection(manifest, selected, checked_node, reclaimable, False)


def _build_context(inputs: RunInputs, plan: list[Shard], selection: _Selection, stages: StageLine) -> RunContext:
    """The run's summary, the bound of its own files and its disk budget; refused when a shard cannot fit."""
    config, output_dir = inputs.config, inputs.output_dir
    ranges = shard_ranges(plan)
    metadata = planned_metadata(config, inputs.checkpoint, inputs.layer_ids)
    summary = RunSummary(config, output_dir, {s.index: s.tokens for s in plan}, sorted(selection.shards),
                         inputs.dataset.invalid, stages.timeline)
    own = own_files(inputs, ranges, metadata, summary.room(selection.before))
    summary.own_files = own.total
    budget = DiskBudget(output_dir, config.output.disk_budget_bytes, config.output.min_free_bytes, own=own)
    check_shards_fit([s for s in plan if s.index in selection.shards], budget.where_shards_go(config.output.node_dir),
                     metadata, selection.reclaimable)
    end = RunEnd(summary, selection.before, output_dir, config.output.sink)
    return RunContext(inputs, plan, budget, selection.checked_node, stages, end)


def _extract(context: RunContext) -> dict:
    """The run on Ray: the directories of every node, the actors, the summary."""
    config, output_dir = context.config, context.output_dir
    device = resolve_device(config.model.device, config.model.tp_size)
    spec = build_engine_spec(
        config.model, config.extract, context.inputs.layer_ids, device, int(context.inputs.dataset.lengths.max()),
        config.output.state_dtype,
    )
    groups = plan_groups(
        ray.nodes(), config.model.dp_size, config.model.tp_size, device, config.output.num_writers, output_dir,
        config.output.node_dir,
    )
    manifest = Manifest.open(output_dir, context.inputs.content(device), context.ranges, RECORDED_SINCE)
    context.end.track(manifest)
    try:
        context.stages.show("checking the run's directories")
        final = _extract_shards(context, spec, groups, manifest)
    finally:
        with signals_deferred(reraise=False):
            manifest.close()
    context.stages.timeline.enter("counting tokens")
    _count_tokens(output_dir, config.output.sink_options)
    return final


def _extract_shards(context: RunContext, spec: EngineSpec, groups: list[NodeGroup], manifest: Manifest) -> dict:
    """Prepare every node's directory, run the shards, record how the run ended; returns the final summary."""
    config, output_dir, end = context.config, context.output_dir, context.end
    to_run = _prepare_directories(manifest, groups, output_dir, config, context.checked_node)
    logger.info(
        "%d samples, %d tokens in %d shards; this run extracts %d of them -> %s",
        len(context.inputs.dataset), int(context.inputs.dataset.lengths.sum()), len(context.plan), len(to_run),
        output_dir,
    )
    indices = [record.index for record in to_run]
    reported = _reported_engine(output_dir)  # before this run's summary replaces the last one
    end.start(indices)
    progress = RunProgress(manifest, context.budget, context.shard_tokens, indices, run=str(output_dir),
                           interval_s=config.progress.interval_s, sink=end.summary, stages=context.stages)
    extraction = ExtractionRun(context, spec, writers_for(groups, len(to_run)), to_run, manifest, progress, reported)
    with end.ends_recorded():  # again, with what the wind-down recorded
        with extraction:
            with end.ends_recorded():  # before the wind-down: SIGKILL may follow a stop within seconds
                extraction.run()
        result = extraction.result()
        end.include(result.extracted_again)
        ending = end.judge(indices + [index for index in result.extracted_again if index not in indices])
        write_drafter_config(output_dir, _drafter_config(config, result.engine))
    return end.finish(ending, result)


def _count_tokens(output_dir: Path, sink_options: dict) -> None:
    """speculators' reduced draft vocabulary comes from the trained tokens' counts: counted now, from the
    token columns alone, while every shard is still there (once the run is complete). The run's outcome
    does not hang on it: the shards are whole either way, and the loaders count again without the file."""
    try:
        maybe_write_token_freq(output_dir, sink_options)
    except Exception as error:  # noqa: BLE001 - an extra file; the states are written and recorded
        logger.warning("the token counts (%s) were not written: %s: %s. HiddenStatesDataset.token_freq() and "
                       "jobs.export to=speculators count them from the shards", TOKEN_FREQ_FILE, type(error).__name__,
                       error)


def _reported_engine(output_dir: Path) -> Optional[EngineInfo]:
    """What the model reported to the last run that loaded it (its summary, whose content the manifest's
    check has matched to this run's); None when no summary records it."""
    engine = (read_summary(output_dir) or {}).get("engine")
    try:
        return EngineInfo(**engine) if isinstance(engine, dict) else None
    except TypeError:  # a summary of another version of this code: the run loads the model
        return None


def _check_files_here(manifest: Manifest, output_dir: Path, checksum: bool) -> Optional[str]:
    """Check the done shards' files output.dir holds on this host (its claim names the node they are
    recorded on); returns that node, or None when it cannot be told here (the check then runs once Ray
    has started, on every node)."""
    claim = read_claim(output_dir)
    if not claim or claim.get("run_id") != manifest.run_id or claim.get("host") != socket.gethostname():
        return None
    node = claim["node"]  # this run's own claim (its run_id, this host) always names its node
    check_done_files(LocalDisk(output_dir), manifest, node, True, checksum)
    return node


def _prepare_directories(
    manifest: Manifest, groups: list[NodeGroup], output_dir: Path, config: JobConfig, checked_node: Optional[str],
) -> list[ShardRecord]:
    """Claim every directory of the run, check the done files there, then clean them; the shards to write.

    Every directory, and the sink, is claimed before any is checked or cleaned: a refusal leaves all of them
    untouched. Done files are recorded on the node whose directory holds them before the clean-up; those of a node
    not in this run are refused where its directory is on this host (``check_absent_nodes``).
    """
    claim_sink(config.output.sink, config.output.sink_options, manifest)
    claimed = [claim_directory(group.disk(), manifest, group.name, group.directory == output_dir) for group in groups]
    relabel_moved_files(manifest, claimed)
    check_absent_nodes(manifest, claimed, output_dir, config.output.node_dir)
    for group in groups:
        if not (group.directory == output_dir and group.name == checked_node):
            check_done_files(group.disk(), manifest, group.name, group.directory == output_dir,
                             config.output.resume_check == "checksum")
    to_run = select_shards(manifest, config.shards)
    for group in groups:
        clean_output_dir(group.disk(), manifest, to_run, group.name, group.directory == output_dir)
    return to_run


def _uploads_left(manifest: Manifest, sink: str) -> bool:
    """Done shards still local while a sink is set: a run is needed to upload them."""
    return bool(sink) and any(record.location == LOCAL for record in manifest.in_state(DONE))


def _drafter_config(config: JobConfig, engine: Any) -> dict[str, Any]:
    """A full EAGLE-3 drafter config for SGLang whose aux ids capture what this run stored."""
    source = {key: getattr(engine, key) for key in (
        "model_architecture", "language_model_architecture", "layer_ids", "layers_to_capture", "sglang_version")}
    return build_drafter_config(text_config(read_config(config.model.path)), engine.drafter_layer_ids, engine.dtype, source)


def _resumable_manifest(inputs: RunInputs, plan: list[tuple[int, int, int]]) -> Manifest | None:
    """The existing manifest (its content is checked before Ray starts: ``check_resumable``).

    With ``model.device=auto`` the device is known only once Ray reports the cluster's GPUs;
    the stored device is assumed here and checked after.
    """
    if not (inputs.output_dir / MANIFEST_FILE).exists():
        return None
    device = resumed_device(inputs.config.model.device, read_manifest(inputs.output_dir)["content"])
    return Manifest.open(inputs.output_dir, inputs.content(device), plan, RECORDED_SINCE)
