"""DeepSeek-V3 / Kimi-K2.5 architecture (MLA + MoE) through SGLang's deepseek_v2 on CPU."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from inputs.demo import build_tiny_model
from jobs.extract import DRAFTER_CONFIG_FILE, run
from jobs.rundir.summary import read_summary
from storage import ShardReader
from tests.helpers import (
    DEEPSEEK_RUN_SAMPLES,
    ExtractorHandle,
    assert_matches_hf,
    deepseek_bf16_run,
    deepseek_v3_checkpoint,
    engine_spec,
    extract_once,
    job_config,
    random_sequences,
    read_all,
    split_tokens,
)

HIDDEN = 64
LENGTHS = (9, 1, 23, 5)


@pytest.fixture(scope="module")
def deepseek_q_lora(tmp_path_factory) -> Path:
    """The session's tiny DeepSeek-V3 (q LoRA rank 32), which tests/extractor/test_kimi.py wraps too."""
    return deepseek_v3_checkpoint(tmp_path_factory)


@pytest.fixture(scope="module")
def deepseek_fp32(tmp_path_factory, deepseek_q_lora) -> dict[str, Path]:
    """The tiny DeepSeek-V3 with and without a q LoRA (MLA's two query paths)."""
    no_q_lora = build_tiny_model(tmp_path_factory.mktemp("deepseek-no_q_lora") / "model", arch="deepseek_v3",
                                 q_lora_rank=None)
    return {"q_lora": deepseek_q_lora, "no_q_lora": no_q_lora}


# deepseek_v2.set_eagle3_layers_to_capture adds +1 only when the first id is 1: the three
# cases (the two below and the pre-norm test's, first id 1) take different drafter ids to
# capture the same kind of layers (each query path meets at least one case; every case is one
# extractor start, which is what the suite pays for).
@pytest.mark.parametrize(
    "variant, layer_ids, drafter_ids",
    [("q_lora", [2, 4, 5], [3, 5, 6]), ("no_q_lora", [2, 3, 5], [3, 4, 6])],
    ids=["q_lora-default", "no_q_lora-first2"],
)
def test_deepseek_matches_hf(ray_cluster, deepseek_fp32, variant, layer_ids, drafter_ids):
    model = deepseek_fp32[variant]
    sequences = random_sequences(LENGTHS, seed=3)
    info, captured = extract_once(engine_spec(model, layer_ids), sequences)
    assert info.model_architecture == "DeepseekV3ForCausalLM"
    assert info.layers_to_capture == [k + 1 for k in layer_ids]
    assert info.drafter_layer_ids == drafter_ids
    assert_matches_hf(model, layer_ids, captured, sequences, HIDDEN, neighbour_gap=1e-3)


def test_deepseek_pre_norm_final_state_matches_hf(ray_cluster, deepseek_q_lora):
    sequences = random_sequences(LENGTHS, seed=8)
    spec = engine_spec(deepseek_q_lora, [1, 3, 5], last_hidden_state="pre_norm")
    info, captured = extract_once(spec, sequences)
    assert info.model_architecture == "DeepseekV3ForCausalLM"
    assert info.layers_to_capture == [2, 4, 6]
    assert info.drafter_layer_ids == [1, 3, 5]  # first id 1: deepseek_v2 adds +1 itself
    assert_matches_hf(deepseek_q_lora, [1, 3, 5], captured, sequences, HIDDEN, neighbour_gap=1e-3, final="pre_norm")


@pytest.mark.extended
def test_deepseek_bf16_is_deterministic_across_runs_and_packings(ray_cluster, deepseek_q_lora):
    """In bf16 SGLang routes with bf16 router logits (HF upcasts), so near-ties pick other
    experts than HF: compare SGLang with SGLang, bit for bit."""
    sequences = random_sequences((17, 4, 30, 2, 11), seed=4)
    extractor = ExtractorHandle(engine_spec(deepseek_q_lora, [1, 3, 5], dtype="bfloat16"))
    try:
        first = extractor.extract(sequences)
        second = extractor.extract(sequences)
        alone = [extractor.extract([ids]) for ids in sequences]
    finally:
        extractor.close()
    assert first.aux_hidden_states.dtype == np.int16  # bf16 bits
    assert np.array_equal(first.aux_hidden_states, second.aux_hidden_states)
    assert np.array_equal(first.last_hidden_state, second.last_hidden_state)
    lengths = [len(ids) for ids in sequences]
    for one, aux in zip(alone, split_tokens(first.aux_hidden_states, lengths)):
        assert np.array_equal(one.aux_hidden_states, aux)


def test_deepseek_job_end_to_end(ray_cluster, tmp_path_factory):
    """The job in bf16 (the session's run, which tests/extractor/test_kimi.py compares the Kimi-K2.5 layout with)."""
    out = deepseek_bf16_run(tmp_path_factory)
    summary = read_summary(out)
    assert summary["shards_failed"] == {}
    samples = read_all(out)
    assert sorted(samples) == list(range(summary["samples"])) and summary["samples"] == DEEPSEEK_RUN_SAMPLES
    metadata = ShardReader(next(out.glob("shard-*.parquet"))).metadata
    assert metadata.model_architecture == "DeepseekV3ForCausalLM"
    assert (metadata.layer_ids, metadata.layers_to_capture, metadata.drafter_layer_ids) == ([2, 4, 5], [3, 5, 6], [3, 5, 6])
    drafter = json.loads((out / DRAFTER_CONFIG_FILE).read_text())
    assert drafter["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [3, 5, 6]
    for sample in samples.values():
        assert sample.aux_hidden_states.shape == (len(sample.input_ids), 3 * HIDDEN)


def test_61_layers_resolve_the_missions_ids(ray_cluster, tmp_path_factory):
    """Kimi-K2.5's depth at toy width: [2, 30, 58] -> layers_to_capture [3, 31, 59] on this SGLang."""
    model = build_tiny_model(tmp_path_factory.mktemp("deepseek61") / "model", arch="deepseek_v3", num_layers=61)
    sequences = random_sequences((6, 3), seed=5)
    info, captured = extract_once(engine_spec(model, [2, 30, 58]), sequences)
    assert info.num_layers == 61
    assert info.layers_to_capture == [3, 31, 59]
    assert info.drafter_layer_ids == [3, 31, 59]
    assert_matches_hf(model, [2, 30, 58], captured, sequences, HIDDEN, neighbour_gap=1e-3)


def test_last_layer_is_rejected_before_loading(ray_cluster, deepseek_q_lora, demo_dataset, tmp_path):
    with pytest.raises(ValueError, match=r"\[7\] cannot be captured from a 8-layer model"):
        run(job_config(deepseek_q_lora, demo_dataset, tmp_path / "out", "extract.layers=[2,4,7]"))
