"""What the extractor actors are started with, and what every shard file of the run records about it.

Pure functions of the config: the dry run shows the same spec the job starts.
"""

from __future__ import annotations

from pathlib import Path

from extractor.checkpoint import CheckpointInfo
from extractor.config import ExtractConfig, ModelConfig
from extractor.serving import parse_serving
from extractor.types import EngineInfo, EngineSpec
from jobs.config import JobConfig
from storage import ShardMetadata
from storage.schema import SAME_AS_MODEL, stored_dtype


def build_engine_spec(
    model: ModelConfig, extract: ExtractConfig, layer_ids: list[int], device: str, longest_sample: int,
    state_dtype: str = SAME_AS_MODEL,
) -> EngineSpec:
    """``model`` as ``jobs.planning.inputs.read_inputs`` left it: the serving command's values already in its keys."""
    serving = parse_serving(model.serving)
    return EngineSpec(
        model_path=str(Path(model.path).resolve()),
        dtype=model.dtype,
        device=device,
        tp_size=model.tp_size,
        attention_backend=model.attention_backend or ("torch_native" if device == "cpu" else "flashinfer"),
        layer_ids=tuple(layer_ids),
        last_hidden_state=extract.last_hidden_state,
        state_dtype=state_dtype,
        engine=model.engine,
        synthetic_tokens_per_s=model.synthetic_tokens_per_s,
        max_tokens_per_batch=max(extract.max_tokens_per_batch, longest_sample),
        max_samples_per_batch=extract.max_samples_per_batch,
        copy_piece_bytes=extract.copy_piece_mb << 20,
        copy_by=extract.copy_by,
        context_length=model.context_length,
        mem_fraction_static=model.mem_fraction_static,
        load_format=model.load_format,
        trust_remote_code=model.trust_remote_code,
        server_args=serving.server_args_for(model) if serving else {},
        download=model.download,
    )


def planned_metadata(config: JobConfig, checkpoint: CheckpointInfo, layer_ids: list[int]) -> ShardMetadata:
    """The shard metadata before the model loads, as far as config.json tells it (what SGLang captures, and
    its release, are known once it has loaded: ``shard_metadata``)."""
    planned = EngineInfo(
        sglang_version="",
        model_architecture=checkpoint.architecture,
        language_model_architecture=checkpoint.language_model_architecture,
        num_layers=checkpoint.num_layers,
        hidden_size=checkpoint.hidden_size,
        dtype=config.model.dtype,
        tp_size=config.model.tp_size,
        layer_ids=list(layer_ids),
        layers_to_capture=[],
        drafter_layer_ids=[],
    )
    return shard_metadata(planned, config.model.path, config.output.state_dtype, config.extract.last_hidden_state)


def shard_metadata(engine: EngineInfo, model_path: str, state_dtype: str, last_hidden_state: str) -> ShardMetadata:
    """What every shard file of the run records: the engine's report, where its checkpoint is, and what the run
    stores (``state_dtype``: output.state_dtype; ``last_hidden_state``: extract.last_hidden_state)."""
    return ShardMetadata(
        dtype=engine.dtype,
        state_dtype=stored_dtype(state_dtype, engine.dtype),
        hidden_size=engine.hidden_size,
        layer_ids=list(engine.layer_ids),
        layers_to_capture=engine.layers_to_capture,
        drafter_layer_ids=engine.drafter_layer_ids,
        last_hidden_state=last_hidden_state,
        model_path=model_path,
        model_architecture=engine.model_architecture,
        language_model_architecture=engine.language_model_architecture,
        sglang_version=engine.sglang_version,
        tp_size=engine.tp_size,
    )
