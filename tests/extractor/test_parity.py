"""SGLang's captured states equal HF transformers' hidden states (fp32, tiny random models)."""

from __future__ import annotations

import os

import numpy as np
import pytest

from extractor.layers import default_layer_ids
from extractor.sglang_compat import SUPPORTED_SGLANG_VERSIONS
from tests.helpers import ExtractorHandle, assert_matches_hf, engine_spec, extract_once, random_sequences, split_tokens

LENGTHS = (7, 33, 1, 18)
HIDDEN = 64
NUM_LAYERS = 8


@pytest.fixture(params=["llama", "qwen3"])
def model_path(request, llama_fp32, qwen3_fp32):
    return {"llama": llama_fp32, "qwen3": qwen3_fp32}[request.param]


@pytest.mark.parametrize("layer_ids", [pytest.param([0, 1, 2], marks=pytest.mark.extended), default_layer_ids(NUM_LAYERS)],
                         ids=["ids012", "default"])
def test_aux_and_final_states_match_hf(ray_cluster, model_path, layer_ids):
    assert default_layer_ids(NUM_LAYERS) == [2, 4, 5]
    sequences = random_sequences(LENGTHS, seed=1)
    info, captured = extract_once(engine_spec(model_path, layer_ids), sequences)
    # scripts/test.sh names the release each run must use (the main and the overlay environment).
    assert info.sglang_version in SUPPORTED_SGLANG_VERSIONS
    assert info.sglang_version == os.environ.get("EAGLE3_EXPECT_SGLANG", info.sglang_version)
    assert info.layer_ids == layer_ids
    assert info.layers_to_capture == [k + 1 for k in layer_ids]
    assert captured.aux_hidden_states.shape == (sum(LENGTHS), len(layer_ids) * HIDDEN)

    assert_matches_hf(model_path, layer_ids, captured, sequences, HIDDEN, neighbour_gap=1e-2)


def test_pre_norm_final_state_matches_hf(ray_cluster, llama_fp32):
    """extract.last_hidden_state=pre_norm: the residual stream entering the final norm (HF: the
    input of model.norm), captured from SGLang's forward."""
    sequences = random_sequences(LENGTHS, seed=6)
    info, captured = extract_once(engine_spec(llama_fp32, [0, 3, 5], last_hidden_state="pre_norm"), sequences)
    assert info.sglang_version == os.environ.get("EAGLE3_EXPECT_SGLANG", info.sglang_version)
    assert captured.last_hidden_state.shape == (sum(LENGTHS), HIDDEN)
    assert_matches_hf(llama_fp32, [0, 3, 5], captured, sequences, HIDDEN, neighbour_gap=1e-2, final="pre_norm")


def test_packing_does_not_change_states(ray_cluster, llama_fp32):
    """One packed batch gives the states each sample gets alone: bit-identical in bf16 (the dtype runs
    use; float32 differs only by the final norm's rounding, ~1e-6, and costs another extractor start)."""
    sequences = random_sequences((12, 5, 40, 9, 3), seed=2)
    extractor = ExtractorHandle(engine_spec(llama_fp32, [0, 3, 6], dtype="bfloat16"))
    try:
        packed = extractor.extract(sequences)
        alone = [extractor.extract([ids]) for ids in sequences]
    finally:
        extractor.close()
    lengths = [len(ids) for ids in sequences]
    for one, aux, last in zip(alone, split_tokens(packed.aux_hidden_states, lengths),
                              split_tokens(packed.last_hidden_state, lengths)):
        np.testing.assert_array_equal(one.aux_hidden_states, aux)
        np.testing.assert_array_equal(one.last_hidden_state, last)
