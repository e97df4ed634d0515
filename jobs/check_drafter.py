"""Check a drafter config against a run: ``python -m jobs.check_drafter DRAFTER_CONFIG [...] output.dir=RUN``
(or ``eagle3-check-drafter``).

Asks the installed SGLang which layers each drafter config would make it capture
from the run's target model (built on the meta device: no weights are read, a
1T-parameter target checks on a CPU box) and fails, naming both lists, when they
are not the layers the run stored. A config written for vLLM's convention (a
top-level ``eagle_aux_hidden_state_layer_ids``, which SGLang ignores) fails too.
``model.path=DIR`` points at the target's checkpoint when it has moved since the
run (config.json is all that is read).

Exit codes: 0 every config captures the stored layers, 1 some config does not,
2 bad input (no run, no such file, not JSON).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
from pathlib import Path
from typing import Any, Optional, Sequence

from common.config import RunDir
from extractor.checkpoint import local_checkpoint
from extractor.drafter_check import DrafterCapture, TargetModel
from extractor.drafter_config import IDS_KEY, vllm_style_ids
from jobs.cli import console_entry, run_command
from jobs.config import CommandParser, build_config, describe, program_name
from jobs.planning.capture import drafter_captures
from jobs.rundir.summary import SUMMARY_FILE
from runtime.errors import EXIT_NOT_PASSED, EXIT_OK
from storage import ShardReader

logger = logging.getLogger("jobs.check_drafter")


@dataclasses.dataclass
class TargetCheckpoint:
    path: str = ""
    """The target's checkpoint directory, when it has moved since the run (only config.json is read). Empty: the
    model_path the run recorded."""


@dataclasses.dataclass
class CheckDrafterConfig:
    """The keys ``jobs.check_drafter`` reads, after the drafter configs (``key=value``; no ``--config`` file)."""

    output: RunDir = dataclasses.field(default_factory=RunDir)
    model: TargetCheckpoint = dataclasses.field(default_factory=TargetCheckpoint)

    def __post_init__(self) -> None:
        self.output.require()


@dataclasses.dataclass(frozen=True)
class StoredLayers:
    """What a run stored, from its shard metadata (or its summary when every shard went to the sink)."""

    model_path: str
    hidden_size: int
    layer_ids: list[int]
    layers_to_capture: list[int]
    drafter_layer_ids: list[int]
    sglang_version: str


@dataclasses.dataclass(frozen=True)
class Verdict:
    ok: bool
    lines: list[str]


def read_stored_layers(output_dir: Path) -> StoredLayers:
    shards = sorted(output_dir.glob("shard-*.parquet"))
    if shards:
        meta = ShardReader(shards[0]).metadata
        return StoredLayers(meta.model_path, meta.hidden_size, meta.layer_ids, meta.layers_to_capture,
                            meta.drafter_layer_ids, meta.sglang_version)
    summary_file = output_dir / SUMMARY_FILE
    if not summary_file.is_file():
        raise ValueError(f"output.dir={output_dir}: no shard file and no {SUMMARY_FILE}; name a run's output dir")
    summary = json.loads(summary_file.read_text())
    engine = summary["engine"]
    return StoredLayers(summary["model_path"], engine["hidden_size"], engine["layer_ids"], engine["layers_to_capture"],
                        engine["drafter_layer_ids"], engine["sglang_version"])


def read_drafter_config(path: Path) -> dict[str, Any]:
    """A drafter's config.json, or the directory holding it."""
    file = path / "config.json" if path.is_dir() else path
    if not file.is_file():
        raise ValueError(f"{path}: no such drafter config (a config.json, or a drafter checkpoint directory)")
    try:
        return json.loads(file.read_text())
    except json.JSONDecodeError as error:
        raise ValueError(f"{file}: not JSON ({error})") from None


def judge(name: str, config: dict[str, Any], capture: Any, target: Any, stored: StoredLayers) -> Verdict:
    """Compare what SGLang would capture with this drafter config against what the run stored."""
    fix = f"set eagle_config.{IDS_KEY} to {stored.drafter_layer_ids}"
    problems: list[str] = []
    if capture.error:
        problems.append(f"SGLang {target.sglang_version} cannot load this drafter config: {capture.error}")
    else:
        vllm_ids = vllm_style_ids(config)
        if vllm_ids is not None and capture.drafter_layer_ids is None:
            problems.append(
                f"written for vLLM's convention: a top-level {IDS_KEY} {vllm_ids} (vLLM uses them as they are), "
                "which SGLang ignores"
            )
        if not capture.use_aux_hidden_state:
            problems.append("eagle_config.use_aux_hidden_state is false: SGLang would feed the drafter no aux states")
        elif capture.layers_to_capture != stored.layers_to_capture:
            ids = capture.drafter_layer_ids if capture.drafter_layer_ids is not None else "none (its default)"
            problems.append(
                f"SGLang {target.sglang_version} would capture layers_to_capture {capture.layers_to_capture} from "
                f"{target.architecture} with drafter ids {ids}, but the run stored "
                f"layers_to_capture {stored.layers_to_capture} (outputs of decoder layers {stored.layer_ids})"
            )
        width = config.get("target_hidden_size") or config.get("hidden_size")
        if width != stored.hidden_size:
            problems.append(f"target_hidden_size {width} but the run stored hidden size {stored.hidden_size}")
    if problems:
        return Verdict(False, [f"FAIL {name}: " + "; ".join(problems) + f". Fix: {fix}"])
    lines = [
        f"PASS {name}: SGLang {target.sglang_version} reads ids {capture.drafter_layer_ids} and captures "
        f"layers_to_capture {capture.layers_to_capture} from {target.architecture}: the outputs of decoder "
        f"layers {stored.layer_ids} this run stored"
    ]
    if vllm_style_ids(config) not in (None, capture.drafter_layer_ids):
        lines.append(f"NOTE {name}: a vLLM server would read the top-level {IDS_KEY} {vllm_style_ids(config)} instead")
    if stored.sglang_version != target.sglang_version:
        lines.append(f"NOTE the run was extracted with SGLang {stored.sglang_version}, this check asked "
                     f"{target.sglang_version}")
    return Verdict(True, lines)


def check(drafter_paths: Sequence[Path], output_dir: Path, model_path: Optional[str] = None) -> list[Verdict]:
    stored = read_stored_layers(output_dir)
    configs = [read_drafter_config(path) for path in drafter_paths]
    target_path = local_checkpoint(model_path) if model_path else stored.model_path
    if not (Path(target_path) / "config.json").is_file():
        raise ValueError(f"the run's target {target_path} has no config.json here; pass model.path=DIR")
    answer = drafter_captures(target_path, configs)
    target, captures = TargetModel(**answer["target"]), [DrafterCapture(**c) for c in answer["captures"]]
    return [judge(str(path), config, capture, target, stored)
            for path, config, capture in zip(drafter_paths, configs, captures)]


def parse_args(argv: Sequence[str]) -> tuple[list[Path], Path, Optional[str]]:
    parser = CommandParser(prog=program_name("jobs.check_drafter"), description=__doc__,
                           formatter_class=argparse.RawDescriptionHelpFormatter,
                           epilog="keys (key=value, defaults shown):\n" + describe(CheckDrafterConfig))
    parser.add_argument("items", nargs="+", metavar="DRAFTER_CONFIG|key=value",
                        help="drafter config.json files or directories, then output.dir=RUN [model.path=DIR]")
    items = parser.parse_args(list(argv)).items
    config = build_config(CheckDrafterConfig, None, [item for item in items if "=" in item], prog=parser.prog)
    paths = [Path(item) for item in items if "=" not in item]
    if not paths:
        parser.error("name at least one drafter config")
    return paths, Path(config.output.dir), config.model.path or None


def main(argv: Sequence[str]) -> int:
    return run_command(_check_drafter, argv)


def _check_drafter(argv: Sequence[str]) -> int:
    paths, output_dir, model_path = parse_args(argv)
    verdicts = check(paths, output_dir, model_path)
    for verdict in verdicts:
        for line in verdict.lines:
            print(line)
    return EXIT_OK if all(v.ok for v in verdicts) else EXIT_NOT_PASSED


cli = console_entry(main)


if __name__ == "__main__":
    cli()
