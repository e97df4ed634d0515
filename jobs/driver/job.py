"""One extraction job from its config to its summary: inputs, lock, plan, Ray, the run, the outcome.

``run`` is what ``python -m jobs.extract`` runs: it reads and checks the inputs
(``jobs.planning``), takes output.dir's lock, refuses what cannot fit before Ray
starts, then starts Ray, claims and cleans the run's directories, drives the
``ExtractionRun`` and records how it ended in ``.summary.json``.
"""

from __future__ import annotations

import logging
from typing import Any

from extractor.checkpoint import read_config, text_config
from extractor.drafter_config import build_drafter_config
from jobs.cluster.nodes import plan_groups
from jobs.cluster.session import ray_job_submission_id, ray_session
from jobs.config import JobConfig
from jobs.driver.budget import DiskBudget
from jobs.driver.progress import RunProgress
from jobs.driver.run import ExtractionRun, resolve_device
from jobs.errors import EXIT_BAD_INPUT, EXIT_FAULT, EXIT_OK, EXIT_SHARDS_FAILED, JobFault, JobStopped
from jobs.planning.engine import build_engine_spec
from jobs.planning.inputs import RunInputs, read_inputs
from jobs.planning.preflight import check_shards_fit, planned_metadata
from jobs.planning.shards import plan_shards
from jobs.rundir.lock import OutputLock
from jobs.rundir.resume import claim_directory, clean_output_dir, refuse_foreign_output, select_shards
from jobs.rundir.summary import (
    BAD_INPUT,
    COMPLETE,
    NOTHING_TO_DO,
    SHARDS_FAILED,
    RunSummary,
    manifest_totals,
    write_drafter_config,
    write_invalid_rows,
)
from storage.manifest import DONE, FAILED, LOCAL, MANIFEST_FILE, Manifest, read_manifest

logger = logging.getLogger("jobs.extract")


def run(config: JobConfig) -> dict:
    """Plan, extract and write; returns the run summary (also saved as .summary.json)."""
    inputs = read_inputs(config)
    inputs.output_dir.mkdir(parents=True, exist_ok=True)
    with OutputLock(inputs.output_dir, ray_job_submission_id()):
        refuse_foreign_output(inputs.output_dir, (inputs.output_dir / MANIFEST_FILE).exists())
        return _run_locked(inputs)


def _run_locked(inputs: RunInputs) -> dict:
    config, output_dir, lengths = inputs.config, inputs.output_dir, inputs.dataset.lengths
    budget = DiskBudget(output_dir, config.output.disk_budget_bytes, config.output.free_floor_bytes)
    plan = plan_shards(
        lengths, config.data.shard_size, config.extract.max_tokens_per_batch, config.extract.max_samples_per_batch
    )
    ranges = [(s.index, s.start, s.stop) for s in plan]
    metadata = planned_metadata(config, inputs.checkpoint, inputs.layer_ids)

    manifest = _resumable_manifest(inputs, ranges)
    if manifest is not None:
        selected = {record.index for record in select_shards(manifest, config.shards)}
        if not selected and not _uploads_left(manifest, config.output.sink):
            return {"outcome": NOTHING_TO_DO, "output_dir": str(output_dir), **manifest_totals(manifest)}
        check_shards_fit([s for s in plan if s.index in selected], budget, metadata)
    else:
        check_shards_fit(plan, budget, metadata)
    write_invalid_rows(output_dir, inputs.dataset.invalid)

    with ray_session(config.ray.address):
        device = resolve_device(config.model.device, config.model.tp_size)
        spec = build_engine_spec(
            config.model, config.extract, inputs.layer_ids, device, int(lengths.max()), config.output.state_dtype
        )
        groups = plan_groups(
            config.model.dp_size, config.model.tp_size, device, config.output.num_writers, output_dir,
            config.output.node_dir,
        )
        manifest = Manifest.open(output_dir, inputs.content(device), ranges)
        to_run = select_shards(manifest, config.shards)
        # Every directory is claimed before any is cleaned: a refusal leaves all of them untouched.
        for group in groups:
            claim_directory(group.disk(), manifest, group.name, group.directory == output_dir)
        for group in groups:
            clean_output_dir(group.disk(), manifest, to_run, group.name, group.directory == output_dir)
        logger.info(
            "%d samples, %d tokens in %d shards; this run extracts %d of them -> %s",
            len(inputs.dataset), int(lengths.sum()), len(plan), len(to_run), output_dir,
        )
        shard_tokens = {s.index: s.tokens for s in plan}
        summary = RunSummary(config, output_dir, shard_tokens, [record.index for record in to_run], inputs.dataset.invalid)
        summary.start(manifest)
        progress = RunProgress(
            manifest, budget, shard_tokens, [record.index for record in to_run], run=str(output_dir),
            interval_s=config.progress.interval_s, sink=summary,
        )
        try:
            result = ExtractionRun(
                spec, inputs.dataset, plan, to_run, config.extract, config.output, output_dir, manifest, budget, groups,
                progress,
            ).run()
        except JobStopped as error:
            _record_end(summary, manifest, error.outcome, error.exit_code, str(error))
            raise
        except ValueError as error:  # an input file that changed under the running job: fix it, not a fault
            _record_end(summary, manifest, BAD_INPUT, EXIT_BAD_INPUT, str(error))
            raise
        except BaseException as error:
            _record_end(summary, manifest, JobFault.outcome, EXIT_FAULT, f"{type(error).__name__}: {error}")
            raise
        finally:
            manifest.close()
    write_drafter_config(output_dir, _drafter_config(config, result.engine))
    failed = manifest.in_state(FAILED)
    outcome, code = (SHARDS_FAILED, EXIT_SHARDS_FAILED) if failed else (COMPLETE, EXIT_OK)
    return summary.finish(manifest, outcome, code, "", result)


def _uploads_left(manifest: Manifest, sink: str) -> bool:
    """Done shards still local while a sink is set: a run is needed to upload them."""
    return bool(sink) and any(record.location == LOCAL for record in manifest.in_state(DONE))


def _drafter_config(config: JobConfig, engine: Any) -> dict[str, Any]:
    """A full EAGLE-3 drafter config for SGLang whose aux ids capture what this run stored."""
    source = {key: getattr(engine, key) for key in (
        "model_architecture", "language_model_architecture", "layer_ids", "layers_to_capture", "sglang_version")}
    return build_drafter_config(text_config(read_config(config.model.path)), engine.drafter_layer_ids, engine.dtype, source)


def _record_end(summary: RunSummary, manifest: Manifest, outcome: str, exit_code: int, message: str) -> None:
    """The summary of a run that ended early; failing to write it must not hide why the run ended."""
    try:
        summary.finish(manifest, outcome, exit_code, message)
    except OSError as error:
        logger.warning("could not write %s: %s", summary.path, error)


def _resumable_manifest(inputs: RunInputs, plan: list[tuple[int, int, int]]) -> Manifest | None:
    """The existing manifest, when its content is known to match before Ray starts.

    With ``model.device=auto`` the device (and so the content) is known only once Ray
    reports the cluster's GPUs; the stored device is assumed here and checked after.
    """
    if not (inputs.output_dir / MANIFEST_FILE).exists():
        return None
    requested = inputs.config.model.device
    if requested == "auto":
        requested = str(read_manifest(inputs.output_dir)["content"].get("model.device", "cpu"))
    try:
        return Manifest.open(inputs.output_dir, inputs.content(requested), plan)
    except ValueError:
        if inputs.config.model.device != "auto":
            raise  # the content is fully known: refuse now, before Ray starts
        return None
