"""What the extractor actors are started with, and what every shard file of the run records about it.

Pure functions of the config: the dry run shows the same spec the job starts.
"""

from __future__ import annotations

from pathlib import Path

from extractor.config import ExtractConfig, ModelConfig
from extractor.serving import parse_serving
from extractor.types import EngineInfo, EngineSpec
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
        context_length=model.context_length,
        mem_fraction_static=model.mem_fraction_static,
        load_format=model.load_format,
        trust_remote_code=model.trust_remote_code,
        server_args=serving.server_args_for(model) if serving else {},
    )


def shard_metadata(engine: EngineInfo, spec: EngineSpec) -> ShardMetadata:
    return ShardMetadata(
        dtype=engine.dtype,
        state_dtype=stored_dtype(spec.state_dtype, engine.dtype),
        hidden_size=engine.hidden_size,
        layer_ids=engine.layer_ids,
        layers_to_capture=engine.layers_to_capture,
        drafter_layer_ids=engine.drafter_layer_ids,
        last_hidden_state=spec.last_hidden_state,
        model_path=spec.model_path,
        model_architecture=engine.model_architecture,
        language_model_architecture=engine.language_model_architecture,
        sglang_version=engine.sglang_version,
        tp_size=engine.tp_size,
    )
