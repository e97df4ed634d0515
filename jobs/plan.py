"""``python -m jobs.plan [--config FILE] [--json] [key=value ...]`` (or ``eagle3-plan``): the dry run.

What a run of ``python -m jobs.extract`` with the same config would do, before it does it: no weight
loaded, no Ray, nothing written (``jobs.planning.dry_run`` says what it reads and prints). Exit codes: the
job's own: 0 the run fits, 2 the job would refuse it, 3 it would stop for disk, 5 another job holds output.dir.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Sequence

from common.checks import format_bytes
from jobs.cli import console_entry, run_command
from jobs.config import JobConfig, parse_command
from jobs.planning.dry_run import DryRun, dry_run
from runtime.errors import EXIT_BAD_INPUT, EXIT_BUDGET_EXHAUSTED, EXIT_LOCKED, EXIT_OK, exit_codes

DESCRIPTION = (
    "Dry run: what `python -m jobs.extract` would do with the same config, from config.json and the dataset "
    "alone. " + exit_codes({
        EXIT_OK: "it fits", EXIT_BAD_INPUT: "the job would refuse it",
        EXIT_BUDGET_EXHAUSTED: "it would stop for disk budget or space", EXIT_LOCKED: "another job holds output.dir",
    }, signals=None)
)


def format_report(report: DryRun) -> str:
    layers = report.layers
    final = "" if report.final_state == "none" else f" + final state ({report.final_state})"
    captured = (
        f"SGLang layers_to_capture {layers.layers_to_capture}, drafter eagle_aux_hidden_state_layer_ids "
        f"{layers.drafter_layer_ids}" if layers.layers_to_capture is not None else "layers_to_capture unknown"
    )
    invalid = (
        f"{report.invalid_rows:,} rows ({report.invalid_over_context:,} longer than the context length); "
        f"data.on_invalid={report.on_invalid}: " + ("they will be left out" if report.on_invalid == "skip" else
                                                     "they stop the job") if report.invalid_rows else "none"
    )
    resumed = (
        f"; {report.done_shards} shards already done in output.dir ({format_bytes(report.done_local_bytes)} "
        "there): the job writes the rest" if report.done_shards else ""
    )
    lines = [
        "dry run: config.json and the dataset only; no weights, no Ray, nothing written",
        f"model    {report.model_path}: {report.architecture} (language model {report.language_model_architecture}), "
        f"{report.num_layers} layers, hidden {report.hidden_size}, context length {report.context_length:,}",
        *(f"serving  {line}" for line in report.serving),
        f"data     {report.data_path}: {report.samples:,} samples, {report.tokens:,} tokens "
        f"(mean {report.tokens / max(1, report.samples):,.0f}, longest {report.longest_sample:,})",
        f"invalid  {invalid}",
        *(f"         {example}" for example in report.invalid_examples),
        f"plan     {report.shards:,} shards of {report.shard_size:,} samples, {report.batches:,} batches (at most "
        f"{report.max_tokens_per_batch:,} tokens and {report.max_samples_per_batch:,} samples each){resumed}",
        f"layers   {layers.layer_ids} -> {captured} ({layers.source})",
        f"states   {report.state_dtype}, {len(layers.layer_ids)} layers{final} x hidden {report.hidden_size}: "
        f"{report.state_bytes_per_token:,} B/token",
        *(f"{'exports' if i == 0 else '':<8} {trainer}: {how}" for i, (trainer, how) in enumerate(report.exports.items())),
        f"disk     {format_bytes(report.predicted_bytes)} predicted for the {report.shards - report.done_shards:,} "
        f"shards to write (largest: shard {report.largest_shard}, {format_bytes(report.largest_shard_bytes)}), "
        f"{(report.own_files_bytes + report.done_local_bytes + report.predicted_bytes) / report.disk_budget:.0%} of "
        f"output.disk_budget {format_bytes(report.disk_budget)} with the job's own files (up to "
        f"{format_bytes(report.own_files_bytes)}); "
        + (f"sink {report.sink}" if report.sink else "no sink"),
        f"         {report.output_dir}: {format_bytes(report.free_bytes)} free on its filesystem, "
        f"output.min_free {format_bytes(report.min_free_bytes)}",
    ]
    if not report.problems:
        lines.append("fits     yes: nothing above stops the run")
    lines += [f"WILL NOT FIT (exit {problem.exit_code}): {problem.text}" for problem in report.problems]
    return "\n".join(lines)


def main(argv: Sequence[str]) -> int:
    return run_command(_plan, argv)


def _plan(argv: Sequence[str]) -> int:
    config, args = parse_command("jobs.plan", DESCRIPTION, JobConfig, argv, {"--json": "print the plan as one JSON object"})
    report = dry_run(config)
    if args.json:
        print(json.dumps({**dataclasses.asdict(report), "exit_code": report.exit_code}))
    else:
        print(format_report(report))
    return report.exit_code


cli = console_entry(main)


if __name__ == "__main__":
    cli()
