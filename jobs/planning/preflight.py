"""What the driver decides before Ray starts and before the model loads.

The demo's paths (and never into a directory that holds something else), the
checkpoint's weight files (no pickled weights unless trusted), whether every shard
this run would write fits the disk budget (from config.json and the dataset's
lengths alone), and whether there is anything to do at all.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Iterable

from extractor.checkpoint import CheckpointInfo
from extractor.config import ModelConfig
from jobs.config import ConfigError, JobConfig
from jobs.driver.budget import DiskBudget, format_bytes
from jobs.inputs.demo import prepare_demo
from jobs.planning.shards import Shard
from jobs.rundir.lock import LOCK_FILE
from storage import ShardMetadata
from storage.manifest import MANIFEST_FILE, read_manifest
from storage.writer import state_bytes_per_token

DEMO_OUTPUT = "hidden_states"
DEMO_SHARD_SIZE = 16
# Weight files torch.load unpickles: loading them can run code stored in them.
PICKLED_WEIGHTS = ("*.bin", "*.pt", "*.pth")


def demo_config(config: JobConfig) -> JobConfig:
    """The demo's model, data and output paths filled in (model and data built once, then reused).

    The demo resumes like any run: nothing is deleted. A user-named ``output.dir`` that
    holds anything but a demo's output is refused: with model.path and data.path both
    empty, the likelier story is a forgotten ``--config``.
    """
    demo_dir = Path(config.demo.dir)
    output_dir = Path(config.output.dir) if config.output.dir else demo_dir / DEMO_OUTPUT
    if config.output.dir:
        _refuse_foreign_demo_output(output_dir, demo_dir)
    model_dir, data_path = prepare_demo(demo_dir, config.demo.arch, config.demo.num_samples, config.demo.seed)
    return dataclasses.replace(
        config,
        model=dataclasses.replace(config.model, path=str(model_dir)),
        data=dataclasses.replace(
            config.data, path=str(data_path), shard_size=min(config.data.shard_size, DEMO_SHARD_SIZE)
        ),
        output=dataclasses.replace(config.output, dir=str(output_dir)),
    )


def _refuse_foreign_demo_output(output_dir: Path, demo_dir: Path) -> None:
    if not output_dir.is_dir():
        return
    entries = sorted(path.name for path in output_dir.iterdir() if path.name != LOCK_FILE)
    if not entries:
        return
    if MANIFEST_FILE in entries:
        model_path = Path(str(read_manifest(output_dir)["content"].get("model.path", "")))
        if model_path.resolve().is_relative_to(demo_dir.resolve()):
            return  # an earlier demo run: resume it
    raise ConfigError(
        f"model.path and data.path are empty, so this would run the demo, but output.dir={output_dir} holds "
        f"{len(entries)} entries that are not a demo's output (e.g. {', '.join(entries[:3])}). Did you forget "
        "--config? Set model.path and data.path for a real run, or give the demo an empty or new output.dir"
    )


def refuse_pickled_weights(model: ModelConfig) -> None:
    """Without ``model.trust_remote_code`` a checkpoint must ship safetensors: .bin/.pt files are
    pickles, and some SGLang releases fall back to a full (code-running) unpickle for them."""
    if model.trust_remote_code or model.load_format not in ("auto", "pt"):
        return
    directory = Path(model.path)
    if model.load_format == "auto" and any(directory.glob("*.safetensors")):
        return  # SGLang prefers safetensors and never opens the pickles
    pickled = sorted(path.name for pattern in PICKLED_WEIGHTS for path in directory.glob(pattern))
    if pickled:
        raise ConfigError(
            f"model.path={directory} has only pickled weights ({', '.join(pickled[:3])}), and loading a pickle "
            "can run code stored in it. Convert the checkpoint to safetensors, or set "
            "model.trust_remote_code=true if you trust where it came from"
        )


def planned_metadata(config: JobConfig, checkpoint: CheckpointInfo, layer_ids: list[int]) -> ShardMetadata:
    """The shard metadata as far as config.json tells it (what SGLang captures is known after loading)."""
    return ShardMetadata(
        dtype=config.model.dtype,
        state_dtype=config.model.dtype if config.output.state_dtype == "model" else config.output.state_dtype,
        hidden_size=checkpoint.hidden_size,
        layer_ids=list(layer_ids),
        layers_to_capture=[],
        drafter_layer_ids=[],
        last_hidden_state=config.extract.last_hidden_state,
        model_path=config.model.path,
        model_architecture=checkpoint.architecture,
        sglang_version="",
        tp_size=config.model.tp_size,
    )


def check_shards_fit(shards: Iterable[Shard], budget: DiskBudget, metadata: ShardMetadata) -> None:
    """Every planned shard must fit the disk budget whole, or it could never be written."""
    bytes_per_token = state_bytes_per_token(metadata)
    for shard in shards:
        need = budget.predict(shard.tokens, bytes_per_token, len(shard.batches))
        if need > budget.limit:
            raise ConfigError(
                f"shard {shard.index} needs about {format_bytes(need)} but output.disk_budget is "
                f"{format_bytes(budget.limit)}: a shard must fit the budget whole. Lower data.shard_size or "
                "raise output.disk_budget"
            )