"""What a run reads and checks before it touches output.dir: paths, demo, checkpoint, layers, dataset.

The job and its dry run (``jobs.plan``) both start here, so that the plan shows
exactly what the job would do. Nothing here starts Ray or loads a weight.
"""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path
from typing import Any, Optional, Sequence

from extractor.checkpoint import (
    CheckpointInfo,
    checkpoint_identity,
    local_checkpoint,
    read_checkpoint_info,
)
from extractor.layers import HF_PARITY_CHECKED, check_layer_ids, default_layer_ids
from extractor.serving import ServingSettings, with_serving
from inputs.dataset import TokenizedDataset, open_tokenized_dataset
from jobs.cluster.node_disk import read_claim
from jobs.config import JobConfig, resolve_paths
from jobs.planning.content import CHECKPOINT, RECORDED_SINCE, resumed_device, run_content
from jobs.planning.engine import build_engine_spec
from jobs.planning.preflight import demo_config, refuse_pickled_weights
from runtime.cluster.submission import inside_ray_job
from runtime.errors import ConfigError
from storage.manifest import MANIFEST_FILE, content_differences, read_manifest

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class RunInputs:
    """What the run reads and checks before it touches output.dir."""

    config: JobConfig
    checkpoint: CheckpointInfo
    layer_ids: list[int]
    dataset: TokenizedDataset
    fingerprint: str
    output_dir: Path
    serving: Optional[ServingSettings] = None
    """``model.serving`` as the installed SGLang parsed it (its values are already in ``config.model``)."""
    checkpoint_id: str = ""
    """What the checkpoint at model.path is (``extractor.checkpoint.checkpoint_identity``)."""

    def content(self, device: str) -> dict[str, Any]:
        spec = build_engine_spec(
            self.config.model, self.config.extract, self.layer_ids, device, 0, self.config.output.state_dtype
        )
        return run_content(self.config, dataclasses.asdict(spec), self.fingerprint, self.checkpoint_id)


def read_inputs(config: JobConfig, fetch: Optional[Sequence[str]] = None) -> RunInputs:
    """Paths, demo, checkpoint, layers and dataset, all checked: nothing is written but a hub id's download into the
    Hugging Face cache (model.download; ``fetch``: only those files of it)."""
    model = dataclasses.replace(config.model, path=local_checkpoint(config.model.path, config.model.download, fetch))
    config = dataclasses.replace(config, model=model)
    config = resolve_paths(config, inside_ray_job())
    if config.is_demo:
        config = demo_config(config)
    if not config.output.dir:
        raise ConfigError("output.dir is empty: name a directory on local disk for the shard files")
    checkpoint = read_checkpoint_info(config.model.path)
    model, serving = with_serving(config.model)
    if serving is not None:
        config = dataclasses.replace(config, model=model)
        for line in serving.describe():
            logger.info("%s", line)
    refuse_pickled_weights(config.model)
    if config.model.engine == "sglang" and checkpoint.language_model_architecture not in HF_PARITY_CHECKED:
        logger.warning(
            "%s: the states SGLang captures for this model class have not been compared with HF's hidden_states "
            "(checked: %s). They are what SGLang's EAGLE-3 serving feeds a drafter; before exporting them for "
            "another engine (to=speculators), compare a few samples with HF's output_hidden_states[k+1]",
            checkpoint.language_model_architecture, ", ".join(sorted(HF_PARITY_CHECKED)))
    layers = config.extract.layers or default_layer_ids(checkpoint.num_layers)
    layer_ids = check_layer_ids(layers, checkpoint.num_layers)
    max_length = config.model.context_length or checkpoint.max_position_embeddings
    dataset = open_tokenized_dataset(
        config.data.path, checkpoint.vocab_size, max_length, config.data.on_invalid, config.data.storage_options
    )
    return RunInputs(config, checkpoint, layer_ids, dataset, dataset.fingerprint, Path(config.output.dir), serving,
                     checkpoint_identity(config.model.path))


def check_resumable(inputs: RunInputs) -> None:
    """A run already in output.dir must have this run's content, or a resume would mix two runs' states, and
    output.dir must not be another run's node directory (its claim): refused here, before Ray starts (the
    claims of other nodes' directories are read once Ray is up). With ``model.device=auto`` the device is
    known only once Ray reports the cluster's GPUs: the stored one is assumed here."""
    exists = (inputs.output_dir / MANIFEST_FILE).exists()
    claim = read_claim(inputs.output_dir)
    if claim and claim.get("run_id") != (read_manifest(inputs.output_dir).get("run_id") if exists else None):
        raise ConfigError(
            f"output.dir={inputs.output_dir} belongs to the run whose output.dir is {claim.get('output_dir')} on "
            f"{claim.get('host', '?')}; nothing there was touched. Give this run a directory of its own, or rerun "
            "that run's own command"
        )
    if not exists:
        return
    stored = read_manifest(inputs.output_dir)["content"]
    content = inputs.content(resumed_device(inputs.config.model.device, stored))
    if CHECKPOINT in stored and stored[CHECKPOINT] != content[CHECKPOINT]:
        raise ConfigError(
            f"model.path={inputs.config.model.path}: the checkpoint there is not the one the run in "
            f"output.dir={inputs.output_dir} was extracted with (its config.json or weight files changed: recorded "
            f"{stored[CHECKPOINT]}, now {content[CHECKPOINT]}); resuming would mix two models' states in one run. "
            "Point model.path at the checkpoint the run was extracted with, or write to a new output.dir"
        )
    differing = content_differences(stored, content, RECORDED_SINCE)
    if differing:
        raise ConfigError(
            f"output.dir={inputs.output_dir} holds a run with different content ({differing}). Resume with the "
            "same settings, or write to a new output.dir"
        )
