"""Entry point: ``python -m jobs.extract [--config FILE] [key=value ...]`` (or ``eagle3-extract``).

With neither ``model.path`` nor ``data.path`` it runs the embedded demo: a
tiny random Llama and a synthetic dataset, made locally. Submit to a cluster
with ``ray job submit --working-dir . -- python -m jobs.extract ...`` and
absolute paths. Rerunning the same command resumes; ``shards=failed`` or
``shards=[3,17]`` reruns only those shards. Exit codes: ``jobs.errors``.
"""

from __future__ import annotations

import dataclasses
import logging
import signal
import sys
from pathlib import Path
from typing import Any, Sequence

from extractor.checkpoint import CheckpointInfo, read_checkpoint_info, read_config, text_config
from extractor.drafter_config import build_drafter_config
from extractor.layers import check_layer_ids, default_layer_ids
from jobs.budget import DiskBudget
from jobs.cluster import inside_ray_job, ray_job_submission_id, ray_session
from jobs.config import ConfigError, JobConfig, load_config, resolve_paths
from jobs.dataset import TokenizedDataset, open_tokenized_dataset
from jobs.errors import EXIT_BAD_INPUT, EXIT_FAULT, EXIT_OK, EXIT_SHARDS_FAILED, JobFault, JobInterrupted, JobStopped
from jobs.lock import OutputLock
from jobs.nodes import plan_groups
from jobs.pipeline import ExtractionRun, build_engine_spec, resolve_device
from jobs.plan import plan_shards
from jobs.preflight import check_shards_fit, demo_config, planned_metadata, refuse_pickled_weights
from jobs.progress import RunProgress
from jobs.resume import claim_directory, clean_output_dir, refuse_foreign_output, select_shards
from jobs.summary import (
    BAD_INPUT, COMPLETE, DRAFTER_CONFIG_FILE, NOTHING_TO_DO, SHARDS_FAILED, RunSummary, manifest_totals,
    write_drafter_config, write_invalid_rows,
)
from storage.manifest import DONE, FAILED, LOCAL, MANIFEST_FILE, Manifest, read_manifest

logger = logging.getLogger("jobs.extract")

def run_content(config: JobConfig, spec_fields: dict[str, Any], data_fingerprint: str) -> dict[str, Any]:
    """Everything that changes what the shard files contain: a resume must match it exactly."""
    return {
        "model.path": spec_fields["model_path"],
        "model.dtype": spec_fields["dtype"],
        "model.tp_size": spec_fields["tp_size"],
        "model.device": spec_fields["device"],
        "model.attention_backend": spec_fields["attention_backend"],
        "model.load_format": spec_fields["load_format"],
        "extract.layers": list(spec_fields["layer_ids"]),
        "extract.last_hidden_state": spec_fields["last_hidden_state"],
        "output.state_dtype": spec_fields["state_dtype"],
        "model.engine": spec_fields["engine"],
        "data.fingerprint": data_fingerprint,
        "data.shard_size": config.data.shard_size,
    }


@dataclasses.dataclass(frozen=True)
class RunInputs:
    """What the run reads and checks before it touches output.dir."""

    config: JobConfig
    checkpoint: CheckpointInfo
    layer_ids: list[int]
    dataset: TokenizedDataset
    fingerprint: str
    output_dir: Path

    def content(self, device: str) -> dict[str, Any]:
        spec = build_engine_spec(
            self.config.model, self.config.extract, self.layer_ids, device, 0, self.config.output.state_dtype
        )
        return run_content(self.config, dataclasses.asdict(spec), self.fingerprint)


def run(config: JobConfig) -> dict:
    """Plan, extract and write; returns the run summary (also saved as .summary.json)."""
    inputs = read_inputs(config)
    inputs.output_dir.mkdir(parents=True, exist_ok=True)
    with OutputLock(inputs.output_dir, ray_job_submission_id()):
        refuse_foreign_output(inputs.output_dir, (inputs.output_dir / MANIFEST_FILE).exists())
        return _run_locked(inputs)


def read_inputs(config: JobConfig) -> RunInputs:
    """Paths, demo, checkpoint, layers and dataset, all checked: nothing is written yet."""
    config = resolve_paths(config, inside_ray_job())
    if config.is_demo:
        config = demo_config(config)
    if not config.output.dir:
        raise ConfigError("output.dir is empty: name a directory on local disk for the shard files")
    checkpoint = read_checkpoint_info(config.model.path)
    refuse_pickled_weights(config.model)
    layers = config.extract.layers or default_layer_ids(checkpoint.num_layers)
    layer_ids = check_layer_ids(layers, checkpoint.num_layers)
    max_length = config.model.context_length or checkpoint.max_position_embeddings
    dataset = open_tokenized_dataset(
        config.data.path, checkpoint.vocab_size, max_length, config.data.on_invalid, config.data.storage_options
    )
    return RunInputs(config, checkpoint, layer_ids, dataset, dataset.fingerprint, Path(config.output.dir))


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


def _raise_on_signal(signum: int, frame: Any) -> None:
    raise JobInterrupted(signum)


def main(argv: Sequence[str]) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, _raise_on_signal)
    output_dir = ""
    try:
        config = load_config(argv)
        output_dir = config.output.dir
        summary = run(config)
    except ValueError as error:  # config or input: refused before any work
        logger.error("%s", error)
        return EXIT_BAD_INPUT
    except JobStopped as error:
        logger.error("%s", error)
        return error.exit_code
    except Exception as error:  # a fault: what is done stays done
        logger.exception("the job failed: %s", error)
        where = f" output.dir={output_dir}" if output_dir else ""
        logger.error(
            "the job failed (%s); done shards are kept. Rerun the same command to resume "
            "(python -m jobs.status%s shows where it stands)", type(error).__name__, where,
        )
        return EXIT_FAULT
    print(final_message(summary))
    if summary.get("shards_failed"):
        for shard, error in summary["shards_failed"].items():
            print(f"shard {shard} FAILED: {error}", file=sys.stderr)
        print(
            f"{len(summary['shards_failed'])} shards failed and wrote no file; rerun them with the same "
            "command plus shards=failed", file=sys.stderr,
        )
        return EXIT_SHARDS_FAILED
    return EXIT_OK


def final_message(summary: dict) -> str:
    out = summary["output_dir"]
    if summary["outcome"] == NOTHING_TO_DO:
        return (
            f"\nnothing to do: all {summary['shards_done']} shards in {out} are done ({summary['samples']} "
            f"samples, {summary['tokens']} tokens); Ray was not started. Rerun chosen shards with "
            f"shards=[...]; check the files with python -m jobs.verify output.dir={out}"
        )
    engine, this_run = summary["engine"], summary["this_run"]
    return (
        f"\n{summary['shards_done']} shards done in {out}: {summary['samples']} samples, "
        f"{summary['tokens']} tokens, {summary['bytes'] / 1e6:.1f} MB; this run extracted "
        f"{this_run['tokens']} tokens in {this_run['seconds']:.1f} s ({summary['tokens_per_second']:.0f} tokens/s)\n"
        f"layers {engine['layer_ids']} (SGLang {engine['sglang_version']} layers_to_capture "
        f"{engine['layers_to_capture']}); drafter config: {Path(out) / DRAFTER_CONFIG_FILE} "
        f"eagle_aux_hidden_state_layer_ids={engine['drafter_layer_ids']}"
    )


def cli() -> None:
    """Console entry point ``eagle3-extract``."""
    sys.exit(main(sys.argv[1:]))


if __name__ == "__main__":
    cli()
