"""One extraction job from its config to its summary: inputs, checks, lock, Ray, the run, the outcome.

``run`` is what ``python -m jobs.extract`` runs. Before Ray starts it reads and
checks the inputs (``jobs.planning``), output.dir (writable, outside the input,
holding no run of other content), the layers (would SGLang capture them), the
sink (a test write), takes output.dir's lock, checks every done shard's file a
rerun would trust, and refuses what cannot fit. Then it starts Ray, claims and checks the run's
directories on every node, cleans them, drives the ``ExtractionRun`` (while
``ClusterWatch`` watches that the cluster is still there) and records
how it ended in ``.summary.json``: exit 0 only when every shard this run was to
write is done (and uploaded, with a sink).
"""

from __future__ import annotations

import logging
import socket
from pathlib import Path
from typing import Any, Optional

import ray

from extractor.checkpoint import read_config, text_config
from extractor.drafter_config import build_drafter_config
from extractor.types import EngineInfo, EngineSpec
from jobs.cluster.node_disk import LocalDisk, read_claim
from jobs.cluster.nodes import NodeGroup, plan_groups, writers_for
from jobs.cluster.session import ray_job_submission_id, ray_session, resolve_device
from jobs.cluster.watch import ClusterWatch
from jobs.config import JobConfig
from jobs.display.stages import StageLine
from jobs.driver.progress import RunProgress
from jobs.driver.run import ExtractionRun
from jobs.errors import (
    EXIT_BAD_INPUT,
    EXIT_FAULT,
    EXIT_NOT_PASSED,
    EXIT_OK,
    EXIT_UPLOADS_FAILED,
    RERUN,
    ClusterLost,
    DiskFull,
    JobFault,
    JobInterrupted,
    JobStopped,
    is_disk_full,
    stop_in,
)
from jobs.interrupts import signals_deferred
from jobs.outdir.budget import DiskBudget
from jobs.planning.capture import check_capture
from jobs.planning.content import RECORDED_SINCE, resumed_device
from jobs.planning.engine import build_engine_spec, planned_metadata
from jobs.planning.inputs import RunInputs, check_resumable, read_inputs
from jobs.planning.own_files import own_files
from jobs.planning.preflight import check_output_dir, check_shards_fit, check_sink
from jobs.planning.shards import Shard, plan_shards
from jobs.rundir.lock import OutputLock
from jobs.rundir.resume import (
    check_done_files,
    claim_directory,
    clean_output_dir,
    refuse_foreign_output,
    relabel_moved_files,
    select_planned,
    select_shards,
)
from jobs.rundir.summary import (
    BAD_INPUT,
    COMPLETE,
    NOTHING_TO_DO,
    SHARDS_FAILED,
    UPLOADS_FAILED,
    RunSummary,
    manifest_totals,
    read_summary,
    write_drafter_config,
    write_invalid_rows,
)
from storage.manifest import DONE, FAILED, LOCAL, MANIFEST_FILE, Manifest, ShardRecord, read_manifest
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


def _run(config: JobConfig, stages: StageLine) -> dict:
    stages.show("reading the inputs")
    inputs = read_inputs(config)
    config = inputs.config
    check_output_dir(inputs.output_dir, config.data.path)
    check_resumable(inputs)
    if config.model.engine == "sglang":
        stages.show("checking the layers SGLang captures")
        check_capture(config.model.path, inputs.layer_ids, config.model.dtype)
    check_sink(config.output.sink, config.output.sink_options, inputs.output_dir, config.output.node_dir)
    try:
        with OutputLock(inputs.output_dir, ray_job_submission_id()) as lock:
            refuse_foreign_output(inputs.output_dir, (inputs.output_dir / MANIFEST_FILE).exists())
            return _run_locked(inputs, lock, stages)
    except OSError as error:  # a full disk under the job's own files (manifest, claims, lock): exit 3, not a fault
        if not is_disk_full(error):
            raise
        raise _disk_full(inputs.output_dir, error) from error


def _run_locked(inputs: RunInputs, lock: OutputLock, stages: StageLine) -> dict:
    config, output_dir = inputs.config, inputs.output_dir
    plan = plan_shards(
        inputs.dataset.lengths, config.data.shard_size, config.extract.max_tokens_per_batch,
        config.extract.max_samples_per_batch,
    )
    ranges = [(s.index, s.start, s.stop) for s in plan]
    metadata = planned_metadata(config, inputs.checkpoint, inputs.layer_ids)
    manifest = _resumable_manifest(inputs, ranges)
    checked_node: Optional[str] = None
    if manifest is not None:
        checked_node = _check_files_here(manifest, output_dir, config.output.resume_check == "checksum")
        selected = {record.index for record in select_shards(manifest, config.shards)}
        unchecked = any(r.location == LOCAL and r.node != checked_node for r in manifest.in_state(DONE))
        if not selected and not unchecked and not _uploads_left(manifest, config.output.sink):
            manifest.close()
            return {"outcome": NOTHING_TO_DO, "output_dir": str(output_dir), **manifest_totals(manifest)}
        reclaimable = sum(r.bytes for r in manifest.in_state(DONE) if r.location == LOCAL and r.node == checked_node)
        manifest.close()
    else:
        selected = set(select_planned(config.shards, len(plan)))
        reclaimable = 0
    shard_tokens = {s.index: s.tokens for s in plan}
    summary = RunSummary(config, output_dir, shard_tokens, sorted(selected), inputs.dataset.invalid)
    before = manifest or Manifest(output_dir / MANIFEST_FILE, {}, {i: ShardRecord(i, a, b) for i, a, b in ranges})
    own = own_files(inputs, ranges, metadata, summary.room(before))
    summary.own_files = own.total
    budget = DiskBudget(output_dir, config.output.disk_budget_bytes, config.output.min_free_bytes, own=own)
    check_shards_fit([s for s in plan if s.index in selected], budget.where_shards_go(config.output.node_dir), metadata,
                     reclaimable)
    write_invalid_rows(output_dir, inputs.dataset.invalid)
    stages.show("starting Ray")
    try:
        with ray_session(config.ray.address):
            try:
                with ClusterWatch(ray.get_runtime_context().gcs_address):
                    return _extract(inputs, plan, ranges, budget, checked_node, summary, before, stages)
            finally:  # before Ray shuts down (seconds): `ray job stop` sends SIGKILL 3 s after its SIGTERM
                with signals_deferred(reraise=False):
                    lock.release()
    except BaseException as error:  # a signal while Ray started (the lock is still held then): recorded too
        _record_early_stop(summary, before, error)
        raise


def _extract(
    inputs: RunInputs, plan: list[Shard], ranges: list[tuple[int, int, int]], budget: DiskBudget,
    checked_node: Optional[str], summary: RunSummary, before: Manifest, stages: StageLine,
) -> dict:
    """The run on Ray: the directories of every node, the actors, the summary. ``before`` is what output.dir
    held before (a stop before this run's own manifest is open is recorded against it)."""
    config, output_dir = inputs.config, inputs.output_dir
    manifest = before
    try:
        device = resolve_device(config.model.device, config.model.tp_size)
        spec = build_engine_spec(
            config.model, config.extract, inputs.layer_ids, device, int(inputs.dataset.lengths.max()),
            config.output.state_dtype,
        )
        groups = plan_groups(
            ray.nodes(), config.model.dp_size, config.model.tp_size, device, config.output.num_writers, output_dir,
            config.output.node_dir,
        )
        manifest = Manifest.open(output_dir, inputs.content(device), ranges, RECORDED_SINCE)
        try:
            stages.show("checking the run's directories")
            final = _extract_shards(inputs, plan, spec, groups, manifest, budget, checked_node, summary, stages)
        finally:
            with signals_deferred(reraise=False):
                manifest.close()
    except BaseException as error:
        _record_early_stop(summary, manifest, error)
        raise
    _count_tokens(output_dir, config.output.sink_options)
    return final


def _extract_shards(
    inputs: RunInputs, plan: list[Shard], spec: EngineSpec, groups: list[NodeGroup], manifest: Manifest,
    budget: DiskBudget, checked_node: Optional[str], summary: RunSummary, stages: StageLine,
) -> dict:
    """Prepare every node's directory, run the shards, record how the run ended; returns the final summary."""
    config, output_dir = inputs.config, inputs.output_dir
    to_run = _prepare_directories(manifest, groups, output_dir, config, checked_node)
    logger.info(
        "%d samples, %d tokens in %d shards; this run extracts %d of them -> %s",
        len(inputs.dataset), int(inputs.dataset.lengths.sum()), len(plan), len(to_run), output_dir,
    )
    shard_tokens = {s.index: s.tokens for s in plan}
    indices = [record.index for record in to_run]
    summary.select(indices)
    reported = _reported_engine(output_dir)  # before this run's summary replaces the last one
    summary.start(manifest)
    progress = RunProgress(manifest, budget, shard_tokens, indices, run=str(output_dir),
                           interval_s=config.progress.interval_s, sink=summary, stages=stages)
    extraction = ExtractionRun(spec, inputs.dataset, plan, to_run, config.extract, config.output, output_dir,
                               manifest, budget, writers_for(groups, len(to_run)), progress, reported)
    try:
        with extraction:
            try:
                extraction.run()
            except BaseException as error:  # recorded before the wind-down: SIGKILL may follow a stop within seconds
                _record_end(summary, manifest, *_ending(error, output_dir))
                raise
        result = extraction.result()
        summary.include(result.extracted_again)
        ran = indices + [index for index in result.extracted_again if index not in indices]
        outcome, code, message = _outcome(manifest, ran, config.output.sink)
        write_drafter_config(output_dir, _drafter_config(config, result.engine))
    except BaseException as error:  # again, with what the wind-down recorded
        _record_end(summary, manifest, *_ending(error, output_dir))
        stop = _as_stop(error, output_dir)
        if stop is not error:  # a signal seen through a Ray call, or a full disk: their own exit codes
            raise stop from None
        raise
    return summary.finish(manifest, outcome, code, message, result)


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

    Every directory is claimed before any is checked or cleaned: a refusal leaves all of them untouched. Done
    files recorded on a node label no node goes by now are recorded where they are before the clean-up.
    """
    claimed = [claim_directory(group.disk(), manifest, group.name, group.directory == output_dir) for group in groups]
    relabel_moved_files(manifest, claimed)
    for group in groups:
        if not (group.directory == output_dir and group.name == checked_node):
            check_done_files(group.disk(), manifest, group.name, group.directory == output_dir,
                             config.output.resume_check == "checksum")
    to_run = select_shards(manifest, config.shards)
    for group in groups:
        clean_output_dir(group.disk(), manifest, to_run, group.name, group.directory == output_dir)
    return to_run


def _ending(error: BaseException, output_dir: Path) -> tuple[str, int, str]:
    """How a run that raised ``error`` ended: outcome, exit code, message."""
    error = _as_stop(error, output_dir)
    if isinstance(error, JobStopped):
        return error.outcome, error.exit_code, str(error)
    if isinstance(error, ValueError):  # an input file that changed under the running job: fix it, not a fault
        return BAD_INPUT, EXIT_BAD_INPUT, str(error)
    return JobFault.outcome, EXIT_FAULT, f"{type(error).__name__}: {error}"


def _as_stop(error: BaseException, output_dir: Path) -> BaseException:
    """The stop ``error`` stands for: the ``JobInterrupted`` behind it, ``DiskFull`` for a full disk, else itself."""
    stop = stop_in(error)
    if stop is error and is_disk_full(error):
        return _disk_full(output_dir, error)
    return stop


def _disk_full(output_dir: Path, error: BaseException) -> DiskFull:
    return DiskFull(
        f"the disk under output.dir={output_dir} is full ({type(error).__name__}: {error}). What is done stays done: "
        "the manifest keeps every change it recorded and no temp file is left. Free space there (or set output.sink, "
        "or lower output.disk_budget below the space the disk has), then rerun the same command: it resumes"
    )


def _outcome(manifest: Manifest, to_run: list[int], sink: str) -> tuple[str, int, str]:
    """Exit 0 only when every shard this run was to write is done (and, with a sink, uploaded)."""
    records = [manifest.shards[index] for index in to_run]
    unsettled = [r.index for r in records if r.state not in (DONE, FAILED)]
    if unsettled:  # the driver's loop ended with shards neither written nor failed: never call that complete
        raise JobFault(f"shards {_listed(unsettled)} were to be written by this run but are neither done nor "
                       f"failed. {RERUN}")
    failed = [r.index for r in records if r.state == FAILED]
    if failed:
        return SHARDS_FAILED, EXIT_NOT_PASSED, (
            f"{len(failed)} of {len(records)} shards failed and wrote no file ({_listed(failed)}); rerun them with "
            "the same command plus shards=failed")
    local = [r.index for r in manifest.in_state(DONE) if sink and r.location == LOCAL]
    if local:
        return UPLOADS_FAILED, EXIT_UPLOADS_FAILED, (
            f"{len(local)} shards are written but not in {sink}: {_listed(local)} (kept locally; the last error of "
            "each is in the manifest). Fix the sink, then rerun the same command: it uploads them")
    return COMPLETE, EXIT_OK, ""


def _listed(shards: list[int], limit: int = 20) -> str:
    more = f" and {len(shards) - limit} more" if len(shards) > limit else ""
    return ", ".join(str(index) for index in shards[:limit]) + more


def _uploads_left(manifest: Manifest, sink: str) -> bool:
    """Done shards still local while a sink is set: a run is needed to upload them."""
    return bool(sink) and any(record.location == LOCAL for record in manifest.in_state(DONE))


def _drafter_config(config: JobConfig, engine: Any) -> dict[str, Any]:
    """A full EAGLE-3 drafter config for SGLang whose aux ids capture what this run stored."""
    source = {key: getattr(engine, key) for key in (
        "model_architecture", "language_model_architecture", "layer_ids", "layers_to_capture", "sglang_version")}
    return build_drafter_config(text_config(read_config(config.model.path)), engine.drafter_layer_ids, engine.dtype, source)


def _record_end(summary: RunSummary, manifest: Manifest, outcome: str, exit_code: int, message: str) -> None:
    """The summary of a run that ended early, written whole (a second signal waits); failing to write it
    must not hide why the run ended."""
    try:
        with signals_deferred(reraise=False):
            summary.finish(manifest, outcome, exit_code, message)
    except OSError as error:
        logger.error("could not write %s (outcome %s, exit code %d): %s", summary.path, outcome, exit_code, error)


def _record_early_stop(summary: RunSummary, manifest: Manifest, error: BaseException) -> None:
    """A signal (or the cluster lost) before the run's summary started (Ray starting, the looks at every node's
    directory) ends it as interrupted (or cluster_lost) all the same, recorded against what output.dir holds; a
    refusal leaves it as it was."""
    stop = stop_in(error)
    if not summary.ended and isinstance(stop, (JobInterrupted, ClusterLost)):
        _record_end(summary, manifest, stop.outcome, stop.exit_code, str(stop))


def _resumable_manifest(inputs: RunInputs, plan: list[tuple[int, int, int]]) -> Manifest | None:
    """The existing manifest (its content is checked before Ray starts: ``check_resumable``).

    With ``model.device=auto`` the device is known only once Ray reports the cluster's GPUs;
    the stored device is assumed here and checked after.
    """
    if not (inputs.output_dir / MANIFEST_FILE).exists():
        return None
    device = resumed_device(inputs.config.model.device, read_manifest(inputs.output_dir)["content"])
    return Manifest.open(inputs.output_dir, inputs.content(device), plan, RECORDED_SINCE)
