"""The acceptance benchmark's 4-bit target (benchmarks/acceptance/quantize_int4.py) on SmolLM2-135M-Instruct: its
packed Linears decompress, through compressed_tensors' own decompressor, to round-to-nearest INT4 values computed
here; the others are stored as those values; transformers loads it on CPU and answers mostly as the bf16 model
does; SGLang's compressed-tensors config parser reads it as W4A16 Marlin where Marlin takes the shape and
unquantized elsewhere. SGLang serving it (Marlin) runs on the H200 only: on CPU SGLang refuses the scheme."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from benchmarks.acceptance.quantize_int4 import GROUP_SIZE, ignore_list, main, marlin_takes
from testbeds.smollm2 import WEIGHTS_FILE, checkpoint_dir
from tests.helpers import made_once, shared_dir

PROMPTS = ("What is the capital of France?", "Name three primary colors.", "Write a haiku about the sea.",
           "How many legs does a spider have?", "Give me a synonym for happy.", "What is 12 times 12?",
           "Explain what a noun is in one sentence.", "Which planet is closest to the sun?")
NEW_TOKENS = 24
MIN_AGREEMENT = 0.6
"""The least share of next tokens (teacher-forced on the bf16 model's greedy answers) the INT4 model must predict
as the bf16 model does; measured 0.70, 106 of 151 (this test prints it)."""


@pytest.fixture(scope="module", autouse=True)
def one_torch_thread():
    """This file's torch work (quantizing, decompressing, two models' forwards) on one thread: on the 2-core
    machine, beside the suite's other worker and its actors, two OpenMP threads wait on each other, spinning."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def int4(tmp_path_factory, one_torch_thread) -> Path:
    out = shared_dir(tmp_path_factory) / "smollm2-int4"
    with made_once(out) as needed:
        if needed:
            assert main([str(checkpoint_dir()), str(out)]) == 0
    return out


def round_to_nearest(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric INT4 per group of 32 input columns: scale max|w| / 7.5 (in bf16), q = round(w / scale) in
    [-8, 7]; returns q * scale in bf16 and the scales."""
    groups = weight.reshape(weight.shape[0], -1, GROUP_SIZE)
    scale = groups.abs().amax(dim=-1, keepdim=True) / 7.5
    q = torch.clamp(torch.round(groups.float() / scale.float()), -8, 7)
    return (q * scale.float()).to(weight.dtype).reshape(weight.shape), scale.squeeze(-1)


def test_packed_linears_decompress_to_round_to_nearest_and_the_others_are_stored_as_it(int4):
    from compressed_tensors.compressors.pack_quantized.base import PackedQuantizationCompressor
    from compressed_tensors.quantization import QuantizationScheme

    source = load_file(str(checkpoint_dir() / WEIGHTS_FILE))
    stored = load_file(str(int4 / WEIGHTS_FILE))
    quantization = json.loads((int4 / "config.json").read_text())["quantization_config"]
    scheme = QuantizationScheme.model_validate(quantization["config_groups"]["group_0"])
    assert (quantization["quant_method"], quantization["format"]) == ("compressed-tensors", "pack-quantized")
    assert (scheme.weights.num_bits, scheme.weights.group_size, scheme.weights.strategy, scheme.weights.symmetric,
            scheme.input_activations) == (4, 32, "group", True, None)
    linears = [name.removesuffix(".weight") for name in source if name.endswith("_proj.weight")]
    assert len(linears) == 30 * 7
    packed = [module for module in linears if f"{module}.weight_packed" in stored]
    # Marlin takes down_proj (1536 -> 576) only; q/k/v/o and gate/up read 576 columns, not a multiple of 128
    assert packed == [module for module in linears if module.endswith("down_proj")]
    assert all(marlin_takes(*source[f"{module}.weight"].shape) == (module in packed) for module in linears)
    dequantized = [module for module in linears if module not in packed]
    assert quantization["ignore"] == ignore_list(dequantized)
    assert set(quantization["ignore"]) - set(dequantized) == {"lm_head"} | {
        f"model.layers.{n}.{fused}" for n in range(30) for fused in ("self_attn.qkv_proj", "mlp.gate_up_proj")}
    for module in linears:
        expected, scale = round_to_nearest(source[f"{module}.weight"])
        if module in packed:
            parts = {key.rsplit(".", 1)[1]: value for key, value in stored.items() if key.startswith(f"{module}.")}
            assert set(parts) == {"weight_packed", "weight_scale", "weight_shape"}
            assert parts["weight_packed"].dtype == torch.int32 and parts["weight_packed"].shape == (576, 1536 // 8)
            assert torch.equal(parts["weight_scale"], scale) and parts["weight_scale"].dtype == torch.bfloat16
            got = PackedQuantizationCompressor.decompress(parts, scheme)["weight"]
        else:
            got = stored[f"{module}.weight"]
        assert got.dtype == torch.bfloat16 and torch.equal(got, expected), module
    others = [name for name in source if not name.endswith("_proj.weight")]
    assert all(torch.equal(stored[name], source[name]) for name in others)
    assert set(stored) == set(others) | {f"{m}.weight" for m in dequantized} | {
        f"{m}.{key}" for m in packed for key in ("weight_packed", "weight_scale", "weight_shape")}
    assert json.loads((int4 / "model.safetensors.index.json").read_text())["weight_map"].keys() == stored.keys()


def test_transformers_loads_it_on_cpu_and_it_answers_mostly_as_the_bf16_model(int4):
    import transformers
    from transformers import CompressedTensorsConfig

    # computed in float32 (bf16 matmuls are many times slower on this CPU): the stored bf16 weights as they are,
    # the packed ones as q * scale unrounded (rounded to bf16, the values the decompressor gives in bf16)
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(int4))
    bf16 = transformers.AutoModelForCausalLM.from_pretrained(str(checkpoint_dir()), dtype=torch.float32).eval()
    quantized = transformers.AutoModelForCausalLM.from_pretrained(
        str(int4), dtype=torch.float32, quantization_config=CompressedTensorsConfig(run_compressed=False)).eval()
    source = load_file(str(checkpoint_dir() / WEIGHTS_FILE))
    for module in ("model.layers.7.mlp.down_proj", "model.layers.7.self_attn.q_proj"):
        weight = quantized.get_submodule(module).weight
        assert torch.equal(weight.to(torch.bfloat16), round_to_nearest(source[f"{module}.weight"])[0]), module
    agree = total = 0
    answers = []
    with torch.no_grad():
        for prompt in PROMPTS:
            ids = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                                return_tensors="pt", return_dict=True)["input_ids"]
            greedy = bf16.generate(ids, max_new_tokens=NEW_TOKENS, do_sample=False)
            answered = slice(ids.shape[1] - 1, greedy.shape[1] - 1)  # the positions predicting the answer
            ours = bf16(greedy).logits[0, answered].argmax(-1)
            theirs = quantized(greedy).logits[0, answered].argmax(-1)
            agree += int((ours == theirs).sum())
            total += ours.numel()
            answer = quantized.generate(ids, max_new_tokens=NEW_TOKENS, do_sample=False)[0, ids.shape[1]:]
            answers.append(tokenizer.decode(answer, skip_special_tokens=True))
    print(f"INT4 vs bf16: {agree}/{total} = {agree / total:.3f} of next tokens agree; answers: {answers}")
    assert agree / total >= MIN_AGREEMENT
    assert "Paris" in answers[0]


def test_sglang_reads_its_config_as_marlin_w4a16_where_marlin_takes_the_shape(int4):
    """SGLang's own compressed-tensors config parser and Marlin shape check, on the names and shapes SGLang's
    Llama builds (fused qkv_proj and gate_up_proj); no kernel runs (Marlin is CUDA only)."""
    from sglang.srt.layers.quantization.compressed_tensors.compressed_tensors import CompressedTensorsConfig
    from sglang.srt.layers.quantization.compressed_tensors.schemes import CompressedTensorsWNA16
    from sglang.srt.layers.quantization.marlin_utils import check_marlin_supports_shape

    config = CompressedTensorsConfig.from_config(json.loads((int4 / "config.json").read_text())["quantization_config"])
    hidden, intermediate, kv = 576, 1536, 3 * 64
    shapes = {"self_attn.qkv_proj": (hidden + 2 * kv, hidden), "self_attn.o_proj": (hidden, hidden),
              "mlp.gate_up_proj": (2 * intermediate, hidden), "mlp.down_proj": (hidden, intermediate)}
    linear = torch.nn.Linear(1, 1)
    for layer in (0, 29):
        for name, (out_features, in_features) in shapes.items():
            scheme = config.get_scheme_dict(linear, f"model.layers.{layer}.{name}")
            takes, why = check_marlin_supports_shape(out_features, in_features, in_features, GROUP_SIZE)
            assert takes == (name == "mlp.down_proj") == (scheme is not None), (name, why)
            if scheme is not None:
                wna16 = config._get_scheme_from_parts(scheme["weights"], scheme["input_activations"],
                                                      scheme["format"])
                assert isinstance(wna16, CompressedTensorsWNA16)
                assert (wna16.group_size, wna16.symmetric, str(wna16.quant_type)) == (32, True, "uint4b8")
