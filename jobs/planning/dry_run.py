"""What a run would do, before it does it: the dry run behind ``python -m jobs.plan``.

Takes the job's own config and reads what the job reads before Ray starts (the checkpoint's
config.json and the dataset): no weight loaded, no Ray, nothing written. It refuses what the job
refuses, in the job's order, with the job's message and exit code, and prints what the run would
write against the disk budget and the free space, and the layers SGLang will capture. Each number
comes from the function the job itself uses (``jobs.planning.inputs.read_inputs``, ``plan_shards``,
``DiskBudget.predict``, ``check_shards_fit``; the layers from ``jobs.planning.capture``), so the plan
cannot drift from the run. What it prints, refuses and exits with: docs/operations.md.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any, Optional

from common.checks import format_bytes
from inputs.dataset import EXCEEDS_CONTEXT
from jobs.cluster.nodes import plan_groups, this_host
from jobs.config import JobConfig
from jobs.outdir.budget import DiskBudget
from jobs.planning.capture import ProbeFailed, capture_plan
from jobs.planning.engine import planned_metadata
from jobs.planning.inputs import RunInputs, check_resumable, read_inputs
from jobs.planning.own_files import own_files
from jobs.planning.preflight import check_output_dir, check_shards_fit, check_sink, free_bytes
from jobs.planning.shards import Shard, plan_shards, shard_ranges
from jobs.rundir.resume import refuse_foreign_output, select_planned, select_shards
from jobs.rundir.summary import RunSummary
from runtime.cluster.session import starts_private_cluster, this_host_cpus
from runtime.errors import EXIT_BAD_INPUT, EXIT_BUDGET_EXHAUSTED, EXIT_OK, BudgetExhausted, ConfigError
from runtime.lock import OutputLock
from storage.manifest import DONE, LOCAL, MANIFEST_FILE, Manifest, ShardRecord, read_manifest
from storage.writer import state_bytes_per_token
from training.final_state import served_exports

logger = logging.getLogger("jobs.plan")

INVALID_EXAMPLES = 3
"""Invalid rows the report names (all of them are counted)."""
PLAN_FILES = ("config.json",)
"""What the dry run fetches of a hub id the cache lacks (model.download): the plan reads config.json alone."""


@dataclasses.dataclass(frozen=True)
class Problem:
    exit_code: int
    text: str


@dataclasses.dataclass
class Layers:
    """What the extractor will report, as far as it can be known without loading the model."""

    layer_ids: list[int]
    layers_to_capture: Optional[list[int]]
    drafter_layer_ids: Optional[list[int]]
    source: str
    """Who answered: SGLang's version and how, or why nobody could."""


@dataclasses.dataclass
class DryRun:
    model_path: str
    architecture: str
    language_model_architecture: str
    num_layers: int
    hidden_size: int
    context_length: int
    data_path: str
    samples: int
    tokens: int
    longest_sample: int
    invalid_rows: int
    invalid_over_context: int
    invalid_examples: list[str]
    on_invalid: str
    shard_size: int
    shards: int
    batches: int
    max_tokens_per_batch: int
    max_samples_per_batch: int
    state_dtype: str
    final_state: str
    exports: dict[str, str]
    """Trainer -> how the run will serve its export (``training.final_state.served_exports``)."""
    state_bytes_per_token: int
    """Bytes of states one token adds (fp8 scales included); ids, mask and Parquet come on top."""
    predicted_bytes: int
    """Every shard file this run would write, as the job predicts them for its budget."""
    largest_shard: int
    largest_shard_bytes: int
    done_shards: int
    """Shards an earlier run in output.dir finished (the job resumes: it writes the others)."""
    done_local_bytes: int
    own_files_bytes: int
    """The most the job's own files (manifest, summary, ...) take in output.dir: the budget counts them first."""
    disk_budget: int
    sink: str
    output_dir: str
    free_bytes: int
    min_free_bytes: int
    layers: Layers
    problems: list[Problem]
    serving: list[str] = dataclasses.field(default_factory=list)
    """What model.serving applies, leaves to the model.* keys, gives way to and leaves out (``extractor.serving``)."""

    @property
    def exit_code(self) -> int:
        """What the job would end with: problems are in the order the job meets them (refusals first)."""
        return self.problems[0].exit_code if self.problems else EXIT_OK


def dry_run(config: JobConfig) -> DryRun:
    """Everything the report says; raises what the job would raise before it extracts anything (a ValueError,
    ConfigError for config, exit 2; OutputLocked, exit 5), in the job's order."""
    if config.is_demo:
        raise ConfigError("the dry run plans a real run: set model.path and data.path (the demo needs no plan)")
    # Every invalid row is counted; data.on_invalid=fail is judged below, as the job would judge it.
    on_invalid = config.data.on_invalid
    inputs = read_inputs(dataclasses.replace(config, data=dataclasses.replace(config.data, on_invalid="skip")),
                         fetch=PLAN_FILES)
    config, checkpoint, dataset = inputs.config, inputs.checkpoint, inputs.dataset
    check_output_dir(inputs.output_dir, config.data.path, create=False)
    check_resumable(inputs)
    layers = _layers(inputs)
    check_sink(config.output.sink, config.output.sink_options, inputs.output_dir, config.output.node_dir)
    OutputLock(inputs.output_dir).check_free()
    manifest = _stored_manifest(inputs)
    plan = plan_shards(
        dataset.lengths, config.data.shard_size, config.extract.max_tokens_per_batch,
        config.extract.max_samples_per_batch,
    )
    if manifest is not None:
        selected = {record.index for record in select_shards(manifest, config.shards)}
        done = {
            r.index: r.bytes if r.location == LOCAL else 0 for r in manifest.in_state(DONE) if r.index not in selected
        }
    else:
        selected, done = set(select_planned(config.shards, len(plan))), {}
    metadata = planned_metadata(config, checkpoint, inputs.layer_ids)
    bytes_per_token = state_bytes_per_token(metadata)
    ranges = shard_ranges(plan)
    before = manifest or Manifest(inputs.output_dir / MANIFEST_FILE, {}, {r[0]: ShardRecord(*r) for r in ranges})
    summary = RunSummary(config, inputs.output_dir, {s.index: s.tokens for s in plan}, sorted(selected),
                         dataset.invalid)
    own = own_files(inputs, ranges, metadata, summary.room(before))
    budget = DiskBudget(inputs.output_dir, config.output.disk_budget_bytes, config.output.min_free_bytes, own=own)
    to_write = [shard for shard in plan if shard.index in selected]
    sizes = {shard.index: budget.predict(shard.tokens, bytes_per_token, len(shard.batches)) for shard in to_write}
    largest = max(sizes, key=sizes.__getitem__, default=0)
    invalid = dataset.invalid
    report = DryRun(
        model_path=config.model.path, architecture=checkpoint.architecture,
        language_model_architecture=checkpoint.language_model_architecture, num_layers=checkpoint.num_layers,
        hidden_size=checkpoint.hidden_size,
        context_length=config.model.context_length or checkpoint.max_position_embeddings,
        data_path=config.data.path, samples=len(dataset), tokens=int(dataset.lengths.sum()),
        longest_sample=int(dataset.lengths.max()), invalid_rows=len(invalid),
        invalid_over_context=sum(EXCEEDS_CONTEXT in row.reason for row in invalid),
        invalid_examples=[f"{row.file} row {row.file_row} (sample id {row.sample_id}): {row.reason}"
                          for row in invalid[:INVALID_EXAMPLES]],
        on_invalid=on_invalid, shard_size=config.data.shard_size, shards=len(plan),
        batches=sum(len(shard.batches) for shard in plan), max_tokens_per_batch=config.extract.max_tokens_per_batch,
        max_samples_per_batch=config.extract.max_samples_per_batch, state_dtype=metadata.state_dtype,
        final_state=metadata.last_hidden_state,
        exports=served_exports(metadata.last_hidden_state, checkpoint.language_model_architecture, config.model.path),
        state_bytes_per_token=bytes_per_token,
        predicted_bytes=sum(sizes.values()), largest_shard=largest, largest_shard_bytes=sizes.get(largest, 0),
        done_shards=len(done), done_local_bytes=sum(done.values()), own_files_bytes=own.total,
        disk_budget=budget.limit,
        sink=config.output.sink, output_dir=str(inputs.output_dir), free_bytes=free_bytes(inputs.output_dir),
        min_free_bytes=config.output.min_free_bytes, layers=layers, problems=[],
        serving=inputs.serving.describe() if inputs.serving else [],
    )
    report.problems = _problems(report, to_write, budget.where_shards_go(config.output.node_dir), metadata,
                                _cluster_refusal(inputs))
    return report


def _stored_manifest(inputs: RunInputs) -> Optional[Manifest]:
    """output.dir's manifest as the job would resume it (read into memory: nothing is written; its content was
    checked by ``check_resumable``), or None for a new run; shard files without a manifest are refused as the job
    refuses them."""
    path = inputs.output_dir / MANIFEST_FILE
    refuse_foreign_output(inputs.output_dir, path.exists())
    if not path.exists():
        return None
    stored = read_manifest(inputs.output_dir)
    records = {record["index"]: ShardRecord(**record) for record in stored["shards"]}
    return Manifest(path, stored["content"], records, stored["sequence"], stored.get("run_id", ""))


def _cluster_refusal(inputs: RunInputs) -> Optional[str]:
    """What the job refuses once Ray is up, before any actor starts, where that is known here: the groups of
    a private cluster on this host (a CPU run; a cluster's GPUs and other nodes are known only to Ray)."""
    config = inputs.config
    if config.model.device != "cpu" or not starts_private_cluster(config.ray.address):
        return None
    try:
        plan_groups([this_host(this_host_cpus())], config.model.dp_size, config.model.tp_size, "cpu",
                    config.output.num_writers, inputs.output_dir, config.output.node_dir)
    except ValueError as error:
        return str(error)
    return None


def _layers(inputs: RunInputs) -> Layers:
    """The ids the extractor will find: from SGLang's model class on the meta device, or the synthetic source's rule."""
    from extractor.layers import llama_convention, resolve_drafter_layer_ids

    config = inputs.config
    if config.model.engine == "synthetic":
        drafter_ids, captured = resolve_drafter_layer_ids(llama_convention, inputs.layer_ids)
        return Layers(inputs.layer_ids, captured, drafter_ids, "the synthetic states source (no model)")
    try:
        plan = capture_plan(config.model.path, inputs.layer_ids, config.model.dtype)
    except ProbeFailed as error:
        return Layers(inputs.layer_ids, None, None, f"not checked: {error}")
    if "refused" in plan:
        raise ConfigError(f"extract.layers={inputs.layer_ids}: {plan['refused']}")
    served = plan["served_drafter"]
    if served["error"] or served["layers_to_capture"] != plan["layers_to_capture"]:
        finding = served["error"] or f"it captures {served['layers_to_capture']}"
        raise ValueError(
            f"SGLang {plan['sglang_version']} would not read back the drafter config the job writes "
            f"(ids {plan['drafter_layer_ids']}): {finding}; "
            "check the installed SGLang against docs/install.md, 'Supported versions'"
        )
    return Layers(
        plan["layer_ids"], plan["layers_to_capture"], plan["drafter_layer_ids"],
        f"SGLang {plan['sglang_version']}, {plan['architecture']} built on the meta device; "
        "a drafter config with these ids captures the same layers",
    )


def _problems(
    report: DryRun, to_write: list[Shard], budget: DiskBudget, metadata: Any, cluster_refusal: Optional[str],
) -> list[Problem]:
    """What will not fit or will not run, one line each, with the exit code the job would end with, in the
    order the job meets them: before Ray, once Ray is up, while it runs."""
    problems = []
    if report.invalid_rows and report.on_invalid == "fail":
        over = f", {report.invalid_over_context} of them longer than the context length" if report.invalid_over_context else ""
        problems.append(Problem(EXIT_BAD_INPUT, (
            f"{report.invalid_rows} invalid rows{over} and data.on_invalid=fail: the job stops before it extracts "
            f"anything, at {report.invalid_examples[0]}. Fix the rows, or set data.on_invalid=skip to leave them out"
        )))
    try:
        check_shards_fit(to_write, budget, metadata, report.done_local_bytes)
    except ConfigError as error:
        problems.append(Problem(EXIT_BAD_INPUT, str(error)))
    except BudgetExhausted as error:
        problems.append(Problem(EXIT_BUDGET_EXHAUSTED, str(error)))
    if cluster_refusal:
        problems.append(Problem(EXIT_BAD_INPUT, cluster_refusal))
    needed = report.own_files_bytes + report.done_local_bytes + report.predicted_bytes
    if not report.sink and needed > report.disk_budget:
        problems.append(Problem(EXIT_BUDGET_EXHAUSTED, (
            f"the run needs about {format_bytes(needed)} on local disk (its own files included) but output.disk_budget is "
            f"{format_bytes(report.disk_budget)} and output.sink is empty: once the budget is full the job waits "
            "output.budget_wait_s for something to delete shard files, then stops (exit 3). Raise "
            "output.disk_budget, set output.sink, or consume shards while it runs"
        )))
    # The most the job adds to the disk at once: the whole rest of the run, up to the budget.
    adds = min(report.own_files_bytes + report.predicted_bytes, max(0, report.disk_budget - report.done_local_bytes))
    usable = report.free_bytes - report.min_free_bytes
    if adds > usable:
        problems.append(Problem(EXIT_BUDGET_EXHAUSTED, (
            f"output.dir's filesystem has {format_bytes(report.free_bytes)} free; above output.min_free="
            f"{format_bytes(report.min_free_bytes)} the job can write {format_bytes(max(0, usable))}, not the "
            f"{format_bytes(adds)} it would hold at once. Free space there, lower output.disk_budget (with a sink "
            "or a consumer), or choose another output.dir"
        )))
    return problems
