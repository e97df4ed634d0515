"""Entry point: ``python -m jobs.pipeline model.path=M data.path=chat.jsonl output.dir=DIR to=specforge`` (or ``eagle3-pipeline``).

Conversations to trainer files in one command: ``jobs.prepare`` (render and tokenize; ``regenerate=true``
has the target answer again first), ``jobs.extract`` (the states, in shards) and ``jobs.export`` with
``consume=true`` (each shard turned into the trainer's files, then deleted), run in turn in this process
with each step's own code. At the end ``output.dir/<to>`` holds the only copy of the states, in the
layout the trainer reads. Each step resumes as it does alone: rerun the same command after any stop and
the finished steps say there is nothing to do, the one that was going resumes. With neither
``model.path`` nor ``data.path`` it runs on the prepare demo's tiny chat model and conversations.
Exit codes (``runtime.errors``): those of the step that stopped.
"""

from __future__ import annotations

import dataclasses
import logging
import sys
import time
from pathlib import Path
from typing import Any, Optional, Sequence

from common.config import RunFiles
from conversations.config import (
    ConversationDataConfig,
    GenerationConfig,
    PrepareConfig,
    PrepareDemoConfig,
    PrepareModelConfig,
    PrepareOutputConfig,
    PrepareProgressConfig,
)
from extractor.checkpoint import local_checkpoint, read_checkpoint_info
from extractor.config import ExtractConfig, ModelConfig, SGLangModelConfig
from extractor.layers import check_layer_ids, default_layer_ids
from inputs.config import DataConfig
from jobs.cli import DETAILED, console_entry, run_command
from jobs.config import JobConfig, absolute_paths, parse_command
from jobs.driver.job import run as extract
from jobs.export import export
from jobs.extract import final_message as extract_message
from jobs.outdir.config import OutputConfig
from jobs.planning.preflight import check_output_dir
from jobs.prepare import prepare
from jobs.rundir.summary import DRAFTER_CONFIG_FILE, NOTHING_TO_DO
from runtime.cluster.config import RayConfig
from runtime.cluster.submission import inside_ray_job
from runtime.display.config import ProgressConfig
from runtime.errors import (
    EXIT_BAD_INPUT,
    EXIT_BUDGET_EXHAUSTED,
    EXIT_FAULT,
    EXIT_LOCKED,
    EXIT_NOT_PASSED,
    EXIT_OK,
    exit_codes,
)
from training.export import ExportConfig, check_trainer_packages
from training.final_state import FINAL_STATE, FORMATS, SPECFORGE, served_exports

logger = logging.getLogger("jobs.pipeline")

TOKENS_DIR = "tokens"
STATES_DIR = "states"
STEP_DIRS = (TOKENS_DIR, STATES_DIR, *FORMATS)
"""What output.dir holds: jobs.prepare's parts, the extraction run, the trainer's files (one directory per format)."""
DEMO_OUTPUT = "pipeline-{to}-{conversations}"
"""The demo's output.dir under demo.dir: one per trainer and number of conversations, so that demos run in any order."""


@dataclasses.dataclass
class PipelineModelConfig(PrepareModelConfig):
    """``jobs.pipeline``'s ``model`` section: jobs.prepare's (the SGLang model keys and the chat's); the extraction
    takes the SGLang model keys from it."""

    def __post_init__(self) -> None:
        super().__post_init__()
        self.for_extract()  # the extractor's own checks of the same keys

    def for_prepare(self) -> PrepareModelConfig:
        return PrepareModelConfig(**{field.name: getattr(self, field.name)
                                     for field in dataclasses.fields(PrepareModelConfig)})

    def for_extract(self) -> ModelConfig:
        return ModelConfig(**{field.name: getattr(self, field.name) for field in dataclasses.fields(SGLangModelConfig)})


@dataclasses.dataclass
class PipelineOutputConfig:
    dir: str = ""
    """Where everything goes: tokens/ (jobs.prepare's parts), states/ (the extraction run: its manifest, and each
    shard until it is exported) and <to>/ (the trainer's files: SpecForge's --hidden-states-path, speculators'
    data path). Empty in the demo: demo.dir/pipeline-<to>-<demo.num_conversations>."""
    shard_size: int = 200
    """Samples per shard of states (jobs.extract's data.shard_size): what extraction resumes by and the export
    consumes by; the disk holds the export and at most about one shard more."""
    part_size: int = 5000
    """Conversations per tokenized part (jobs.prepare's output.shard_size); also what regeneration resumes by."""

    def __post_init__(self) -> None:
        for key in ("shard_size", "part_size"):
            value = getattr(self, key)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"output.{key}={value!r}: must be an integer >= 1")


@dataclasses.dataclass
class PipelineExportConfig:
    fp8: Optional[bool] = None
    """speculators: true writes its fp8 variant (float8_e4m3fn, one float32 scale per token), false the model dtype.
    Unset: the model dtype."""
    exact: bool = False
    """Refuse, before anything runs, unless the files will hold the states exactly as SGLang computes them (SpecForge
    then needs extract.last_hidden_state=post_norm)."""
    threads: int = 4
    """Files written at once (jobs.export's threads)."""


@dataclasses.dataclass
class PipelineConfig:
    model: PipelineModelConfig = dataclasses.field(default_factory=PipelineModelConfig)
    data: ConversationDataConfig = dataclasses.field(default_factory=ConversationDataConfig)
    output: PipelineOutputConfig = dataclasses.field(default_factory=PipelineOutputConfig)
    to: str = ""
    """specforge | speculators (any case): the trainer whose files the command ends with, in output.dir/<to>."""
    regenerate: bool = False
    """The target answers every prompt again through SGLang first (generation.*), as jobs.prepare's regenerate."""
    generation: GenerationConfig = dataclasses.field(default_factory=GenerationConfig)
    workers: int = 0
    """Processes that tokenize at once (jobs.prepare's workers); 0: one per CPU."""
    extract: ExtractConfig = dataclasses.field(default_factory=ExtractConfig)
    export: PipelineExportConfig = dataclasses.field(default_factory=PipelineExportConfig)
    ray: RayConfig = dataclasses.field(default_factory=RayConfig)
    progress: ProgressConfig = dataclasses.field(default_factory=ProgressConfig)
    demo: PrepareDemoConfig = dataclasses.field(default_factory=PrepareDemoConfig)

    def __post_init__(self) -> None:
        self.to = self.to.lower() if isinstance(self.to, str) else self.to
        if self.to not in FORMATS:
            raise ValueError(f"to={self.to!r}: name the trainer, to={' or to='.join(FORMATS)}")
        if bool(self.model.path) != bool(self.data.path):
            raise ValueError("set both model.path (the target checkpoint, or its hub id) and data.path (the "
                             "conversations), or neither for the demo")
        if not self.is_demo and not self.output.dir:
            raise ValueError("output.dir is empty: name the directory the tokens, states and trainer files go to")
        try:  # jobs.export's own checks of the export.* keys (fp8 with SpecForge, fp8 with exact), paths stood in
            self.step_export(run="/", dest="/")
        except ValueError as error:
            raise ValueError(f"export.{error}") from None  # its messages start with the key: fp8=true: ...

    @property
    def is_demo(self) -> bool:
        return not self.model.path and not self.data.path

    @property
    def out(self) -> Path:
        return Path(self.output.dir)

    def step_prepare(self) -> PrepareConfig:
        """``jobs.prepare``'s config: its keys as given, into output.dir/tokens."""
        return PrepareConfig(
            model=self.model.for_prepare(), data=self.data,
            output=PrepareOutputConfig(dir=str(self.out / TOKENS_DIR), shard_size=self.output.part_size),
            workers=self.workers, regenerate=self.regenerate, generation=self.generation, ray=self.ray,
            progress=PrepareProgressConfig(interval_s=self.progress.interval_s), demo=self.demo,
        )

    def step_extract(self) -> JobConfig:
        """``jobs.extract``'s config: the same checkpoint and engine settings, over output.dir/tokens into
        output.dir/states."""
        return JobConfig(
            model=self.model.for_extract(),
            data=DataConfig(path=str(self.out / TOKENS_DIR), shard_size=self.output.shard_size),
            extract=self.extract, output=OutputConfig(dir=str(self.out / STATES_DIR)), ray=self.ray,
            progress=self.progress,
        )

    def step_export(self, run: str = "", dest: str = "") -> ExportConfig:
        """``jobs.export``'s config: output.dir/states into output.dir/<to>, consuming each shard once exported."""
        return ExportConfig(
            output=RunFiles(dir=run or str(self.out / STATES_DIR)), to=self.to, dest=dest or str(self.out / self.to),
            consume=True, fp8=self.export.fp8, exact=self.export.exact, threads=self.export.threads,
            progress_interval_s=self.progress.interval_s,
        )


DESCRIPTION = (
    "Conversations to a trainer's files in one command: jobs.prepare, jobs.extract and jobs.export consume=true in "
    "turn, one copy of the states on disk at the end (output.dir/<to>); rerun the same command to resume. " + exit_codes({
        EXIT_OK: "done", EXIT_NOT_PASSED: "shards failed (extraction)", EXIT_BAD_INPUT: "bad config or input",
        EXIT_BUDGET_EXHAUSTED: "disk full", EXIT_FAULT: "fault (rerun: it resumes)",
        EXIT_LOCKED: "a directory under output.dir in use",
    }, signals="rerun: it resumes")
)


def load_config(argv: Sequence[str]) -> PipelineConfig:
    """Parse ``[--config FILE] [key=value ...]`` into a checked PipelineConfig; raises ConfigError."""
    return parse_command("jobs.pipeline", DESCRIPTION, PipelineConfig, argv)[0]


def resolve(config: PipelineConfig) -> PipelineConfig:
    """The demo's model and conversations made (once), local paths absolute, a hub id its local snapshot."""
    if config.is_demo:
        from conversations.demo import demo_config

        made = demo_config(config.step_prepare())
        config = dataclasses.replace(
            config, model=dataclasses.replace(config.model, path=made.model.path), data=made.data,
            output=dataclasses.replace(config.output, dir=config.output.dir or str(
                Path(config.demo.dir) / DEMO_OUTPUT.format(to=config.to, conversations=config.demo.num_conversations))),
        )
    model = dataclasses.replace(config.model, path=local_checkpoint(config.model.path, config.model.download))
    paths = absolute_paths({"model.path": model.path, "data.path": config.data.path, "output.dir": config.output.dir},
                           inside_ray_job(), example="output.dir=/mnt/nvme/eagle3/run1")
    return dataclasses.replace(
        config, model=dataclasses.replace(model, path=paths["model.path"]),
        data=dataclasses.replace(config.data, path=paths["data.path"]),
        output=dataclasses.replace(config.output, dir=paths["output.dir"]),
    )


def check_before_running(config: PipelineConfig) -> None:
    """What would stop a later step, refused before the first one starts: the trainer's final state and packages,
    the layers, an output.dir that is a file, inside data.path or holding anything but this command's directories."""
    check_trainer_packages(config.to)
    check_output_dir(config.out, config.data.path, create=False)
    checkpoint = read_checkpoint_info(config.model.path)
    check_layer_ids(config.extract.layers or default_layer_ids(checkpoint.num_layers), checkpoint.num_layers)
    final_state = config.extract.last_hidden_state
    served = served_exports(final_state, checkpoint.language_model_architecture, config.model.path)[config.to]
    if served.startswith("no:"):
        raise ValueError(f"to={config.to} with extract.last_hidden_state={final_state}: {served.removeprefix('no: ')}")
    if config.export.exact and final_state != FINAL_STATE[config.to]:
        raise ValueError(f"export.exact=true: {config.to}'s files hold the {FINAL_STATE[config.to]} "
                         f"final state, which extract.last_hidden_state={final_state} does not store as SGLang computes "
                         f"it; extract with extract.last_hidden_state={FINAL_STATE[config.to]}, or drop "
                         "export.exact")
    if config.out.is_dir():
        foreign = sorted(entry.name for entry in config.out.iterdir() if entry.name not in STEP_DIRS)
        if foreign:
            raise ValueError(
                f"output.dir={config.out} holds {', '.join(foreign[:3])}{', ...' if len(foreign) > 3 else ''}, which "
                f"this command did not write (it writes only {', '.join(STEP_DIRS)} there); choose an empty or new "
                "output.dir"
            )


def run_pipeline(config: PipelineConfig) -> tuple[int, str]:
    """Prepare, extract, export in turn; returns the exit code and the summary of the whole (or of the step that
    stopped it). A step that raises ends the command with that step's exit code (``jobs.cli``)."""
    config = resolve(config)
    check_before_running(config)
    started = time.perf_counter()
    logger.info("1/3 prepare: %s -> %s", config.data.path, config.out / TOKENS_DIR)
    record = prepare(config.step_prepare())
    logger.info("2/3 extract: -> %s", config.out / STATES_DIR)
    summary = extract(config.step_extract())
    code = summary.get("exit_code") or EXIT_OK
    if code != EXIT_OK:
        return code, _stopped_in_extract(summary)
    logger.info("3/3 export: -> %s (to=%s, consume=true)", config.out / config.to, config.to)
    report = export(config.step_export())
    return EXIT_OK, final_message(config, record, summary, report, time.perf_counter() - started)


def _stopped_in_extract(summary: dict[str, Any]) -> str:
    lines = [extract_message(summary)]
    lines += [f"shard {shard} FAILED: {error}" for shard, error in summary.get("shards_failed", {}).items()]
    lines.append(f"error: {summary.get('message')}; the states done are kept and nothing was exported yet. Rerun the "
                 "same command: it resumes")
    return "\n".join(lines)


def final_message(config: PipelineConfig, record: dict[str, Any], summary: dict[str, Any], report: dict[str, Any],
                  seconds: float) -> str:
    """One summary of the whole: what each step did (or that it had nothing to do), then where the files are."""
    counts, tokens = record["counts"], record["tokens"]
    again = "nothing to do: " if record.get("nothing_to_do") else ""
    lines = [f"\nprepare: {again}{counts['kept']} of {counts['conversations']} conversations -> {tokens['total']} "
             f"tokens, {tokens['masked']} in the loss mask, in {record['output_path']}"]
    if counts["skipped"]:
        lines.append(f"  {counts['skipped']} rows left out: {record['output_path']}/_skipped_rows.jsonl")
    if summary["outcome"] == NOTHING_TO_DO:
        lines.append(f"extract: nothing to do: all {summary['shards_done']} shards done ({summary['samples']} samples)")
    else:
        this_run = summary["this_run"]
        lines.append(f"extract: {summary['shards_done']} of {summary['plan']['shards']} shards, {summary['samples']} "
                     f"samples, {summary['tokens']} tokens; this run {this_run['tokens']} tokens in "
                     f"{this_run['seconds']:.1f} s ({summary['tokens_per_second']:.0f} tokens/s), layers "
                     f"{summary['engine']['layer_ids']}")
    if report["already_complete"]:
        lines.append(f"export: nothing to do: the {report['format']} export is complete ({report['samples']} samples)")
    else:
        lines.append(f"export: {report['samples']} samples, {report['format']} ({report['states']} states, final state "
                     f"{report['final_state']}): {report['written']} files written, {report['skipped']} already there, "
                     f"{report['bytes'] / 1e6:.1f} MB; {report['consumed']} shards consumed")
    states = config.out / STATES_DIR
    lines.append(
        f"done in {seconds:.1f} s: {report['dest']} holds the {report['samples']} samples for {config.to}, the only "
        f"copy of the states (the run's manifest in {states} records each shard consumed into it)\n"
        f"{_train_hint(config.to, report['dest'])}; drafter config: {states / DRAFTER_CONFIG_FILE}"
    )
    return "\n".join(lines)


def _train_hint(trainer: str, dest: str) -> str:
    if trainer == SPECFORGE:
        return f"train: SpecForge's --hidden-states-path {dest}"
    return f"train: speculators' data path {dest}, --token-freq-path {dest}/token_freq.pt"


def main(argv: Sequence[str]) -> int:
    return run_command(
        _pipeline, argv, level=logging.INFO, fmt=DETAILED,
        fault_hint="what each step finished is kept. Rerun the same command to resume",
    )


def _pipeline(argv: Sequence[str]) -> int:
    code, message = run_pipeline(load_config(argv))
    print(message, file=sys.stdout if code == EXIT_OK else sys.stderr)
    return code


cli = console_entry(main)

if __name__ == "__main__":
    cli()
