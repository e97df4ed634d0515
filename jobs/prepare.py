"""Entry point: ``python -m jobs.prepare [--config FILE] [key=value ...]`` (or ``eagle3-prepare``).

Conversations (ShareGPT or OpenAI messages; JSONL, Parquet, Arrow) -> the tokenized Parquet
``jobs.extract`` reads, rendered with the checkpoint's chat template and an exact assistant-only
loss mask (``conversations``). With ``regenerate=true`` the target answers the prompts again
through SGLang first. With neither ``model.path`` nor ``data.path`` it runs the demo: a tiny chat
model and conversations made locally. Rerunning the same command resumes (or says it is done).

Exit codes (``runtime.errors``): 0 done, 2 bad config or input (the message names the file, row and
reason), 3 disk full (free space, rerun: it resumes), 4 a fault (rerun: it resumes), 5 output.dir in use by
another prepare, 130/143 stopped by a signal (rerun: it resumes).
"""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path
from typing import Any, Sequence

from conversations import output as out_dir
from conversations.config import PrepareConfig
from conversations.pipeline import read_inputs, tokenize_and_publish
from extractor.checkpoint import local_checkpoint
from jobs.cli import DETAILED, console_entry, run_command
from jobs.config import absolute_paths, parse_command
from jobs.planning.preflight import check_output_dir
from runtime.cluster.submission import inside_ray_job, ray_job_submission_id
from runtime.display.stages import StageLine
from runtime.display.timeline import wall_time_line
from runtime.errors import (
    EXIT_BAD_INPUT,
    EXIT_BUDGET_EXHAUSTED,
    EXIT_FAULT,
    EXIT_LOCKED,
    EXIT_OK,
    exit_codes,
    full_disk_stops,
)
from runtime.lock import OutputLock

DESCRIPTION = (
    "Render conversations with the model's chat template into the tokenized Parquet jobs.extract reads "
    "(input_ids, an exact assistant-only loss_mask, conversation_id), optionally with the answers regenerated "
    "by the target through SGLang. " + exit_codes({
        EXIT_OK: "done", EXIT_BAD_INPUT: "bad config or input", EXIT_BUDGET_EXHAUSTED: "disk full (free space, rerun)",
        EXIT_FAULT: "fault (rerun: it resumes)", EXIT_LOCKED: "output.dir in use",
    }, signals="rerun: it resumes")
)


def load_config(argv: Sequence[str]) -> PrepareConfig:
    """Parse ``[--config FILE] [key=value ...]`` into a checked PrepareConfig; raises ConfigError."""
    return parse_command("jobs.prepare", DESCRIPTION, PrepareConfig, argv)[0]


def resolve_paths(config: PrepareConfig, inside_job: bool) -> PrepareConfig:
    """Local paths made absolute once (under ``ray job submit`` relative ones are refused, as by jobs.extract); a hub
    id as model.path is its snapshot in the local Hugging Face cache (downloaded there first with model.download)."""
    model = dataclasses.replace(config.model, path=local_checkpoint(config.model.path, config.model.download))
    config = dataclasses.replace(config, model=model)
    paths = absolute_paths({"model.path": config.model.path, "data.path": config.data.path,
                            "output.dir": config.output.dir, "model.chat_template": config.model.chat_template},
                           inside_job, example="output.dir=/mnt/nvme/data/tokens")
    return dataclasses.replace(
        config,
        model=dataclasses.replace(config.model, path=paths["model.path"], chat_template=paths["model.chat_template"]),
        data=dataclasses.replace(config.data, path=paths["data.path"]),
        output=dataclasses.replace(config.output, dir=paths["output.dir"]),
    )


def prepare(config: PrepareConfig) -> dict[str, Any]:
    """Read and check everything, then write under output.dir's lock; returns the side record. What it does is
    shown from the start: each stage until the first bar (``runtime.display.stages``), then the bar. A full disk is
    ``DiskFull`` (exit 3)."""
    stages = StageLine(config.progress.interval_s)
    stages.show("reading the inputs")
    try:
        with full_disk_stops(config.output.dir or config.demo.dir):
            return _prepare_showing(config, stages)
    finally:  # before the command's last lines and any error: the live line is erased
        stages.close()


def _prepare_showing(config: PrepareConfig, stages: StageLine) -> dict[str, Any]:
    if config.is_demo:
        from conversations.demo import demo_config

        config = demo_config(config)
    config = resolve_paths(config, inside_ray_job())
    if config.output.dir:  # a file, or inside the input: refused before anything is read
        check_output_dir(Path(config.output.dir), config.data.path, create=False)
    inputs = read_inputs(config)
    existing = out_dir.inspect_output(inputs.out, inputs.content(), inputs.regeneration_content())
    if existing.complete:
        return {**existing.record, "nothing_to_do": True}  # type: ignore[dict-item]
    inputs.out.mkdir(parents=True, exist_ok=True)
    with OutputLock(inputs.out, ray_job_submission_id()):
        # Under the lock: another prepare may have finished or started writing here meanwhile.
        existing = out_dir.inspect_output(inputs.out, inputs.content(), inputs.regeneration_content())
        if existing.complete:
            return {**existing.record, "nothing_to_do": True}  # type: ignore[dict-item]
        return tokenize_and_publish(inputs, stages)


def final_message(record: dict[str, Any]) -> str:
    out = Path(record["output_path"])
    counts, tokens = record["counts"], record["tokens"]
    head = "nothing to do: " if record.get("nothing_to_do") else ""
    lines = [
        f"\n{head}{counts['kept']} of {counts['conversations']} conversations in {out} "
        f"({len(record['parts'])} parts): {tokens['total']} tokens, {tokens['masked']} in the loss mask "
        f"({counts['assistant_turns']} assistant turns), lengths {tokens['lengths']}",
    ]
    if counts["skipped"]:
        lines.append(f"{counts['skipped']} rows left out ({counts['skipped_by_kind']}): {out / out_dir.SKIPPED_FILE}")
    if counts["truncated"]:
        lines.append(f"{counts['truncated']} conversations truncated to data.max_length={tokens['max_length']}")
    regeneration = record.get("regeneration_stats")
    if regeneration and not record.get("nothing_to_do"):
        lines.append(f"regenerated {regeneration['answers']} answers ({regeneration['generated_tokens']} tokens, "
                     f"{regeneration['tokens_per_second']} tokens/s, {regeneration['cut_at_max_new_tokens']} cut at "
                     f"generation.max_new_tokens) with SGLang {regeneration['sglang_version']}")
    if not record.get("nothing_to_do"):
        lines.append(f"{record['conversations_per_second']} conversations/s; side record: {out / out_dir.RECORD_FILE}")
        if record.get("wall_seconds"):
            lines.append(wall_time_line(record["wall_seconds"]))
    lines.append(f"next: python -m jobs.extract model.path={record['model_path']} data.path={out} output.dir=STATES_DIR")
    return "\n".join(lines)


def main(argv: Sequence[str]) -> int:
    return run_command(
        _prepare, argv, level=logging.INFO, fmt=DETAILED,
        fault_hint="regenerated shards already published are kept. Rerun the same command to resume",
    )


def _prepare(argv: Sequence[str]) -> int:
    print(final_message(prepare(load_config(argv))))
    return EXIT_OK


cli = console_entry(main)

if __name__ == "__main__":
    cli()
