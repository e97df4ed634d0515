"""Kimi-K2.5 as it ships: a DeepSeek-V3 inside KimiK25ForConditionalGeneration, through SGLang's kimi_k25.py.

One tiny DeepSeek-V3 is saved twice, bare (the session's, tests/helpers.py) and in Kimi-K2.5's published layout
(same tensors under ``language_model.``, a random MoonViT and projector). Every stored state of the wrapped
model must equal the bare model's bit for bit, at TP=1 (the session's bf16 run of the bare model, which
tests/extractor/test_deepseek.py checks as a job) and TP=2.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import ray
import torch
from safetensors.torch import load_file

from extractor.drafter_config import build_drafter_config
from extractor.sglang_compat import SUPPORTED_SGLANG_VERSIONS
from jobs.extract import DRAFTER_CONFIG_FILE, run
from runtime.errors import EXIT_NOT_PASSED
from storage import ShardReader
from storage.manifest import read_manifest
from storage.writer import state_bytes_per_token
from testbeds.shapes import KIMI_K25, kimi_k25_reduced
from tests.conftest import REPO_ROOT
from tests.helpers import (
    DEEPSEEK_RUN_SAMPLES,
    DEEPSEEK_RUN_SETTINGS,
    check_drafter,
    deepseek_bf16_run,
    deepseek_v3_checkpoint,
    engine_spec,
    job_config,
    python_env,
    random_sequences,
    read_all,
    session_ray_address,
    vllm_style,
    with_ids,
)

KIMI = "KimiK25ForConditionalGeneration"
DEEPSEEK = "DeepseekV3ForCausalLM"
SAMPLES = DEEPSEEK_RUN_SAMPLES
JOB_SETTINGS = DEEPSEEK_RUN_SETTINGS


@pytest.fixture(scope="module")
def kimi_demo(ray_cluster, tmp_path_factory):
    """The README's demo command on the Kimi-K2.5 layout: a fresh driver process, on this test process's Ray
    cluster (the demo's own private cluster is tests/jobs/test_entry.py's subject; another one costs seconds of CPU)."""
    demo = tmp_path_factory.mktemp("kimi-demo")
    result = subprocess.run(
        [sys.executable, "-m", "jobs.extract", "demo.arch=kimi_k25", f"demo.dir={demo}",
         f"demo.num_samples={SAMPLES}", "model.device=cpu", "output.min_free=1GB", "output.num_writers=1",
         *JOB_SETTINGS, f"ray.address={session_ray_address()}"],
        cwd=REPO_ROOT, env=python_env(), capture_output=True, text=True, timeout=600,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert f"{SAMPLES} samples" in result.stdout
    (model,) = demo.glob("model-kimi_k25-*")
    (data,) = demo.glob("data-*.parquet")
    return model, data, demo / f"hidden_states-kimi_k25-{SAMPLES}-seed0"


@pytest.fixture(scope="module")
def bare_deepseek(tmp_path_factory, kimi_demo):
    """The demo's language model saved on its own (same builder, same seed): the session's tiny DeepSeek-V3."""
    bare = deepseek_v3_checkpoint(tmp_path_factory)
    wrapped = load_file(kimi_demo[0] / "model.safetensors")
    tensors = load_file(bare / "model.safetensors")
    assert all(torch.equal(tensor, wrapped[f"language_model.{name}"]) for name, tensor in tensors.items())
    assert {name.split(".")[0] for name in wrapped} == {"language_model", "vision_tower", "mm_projector"}
    return bare


def assert_bit_identical(wrapped_dir, bare_dir):
    wrapped, bare = read_all(wrapped_dir), read_all(bare_dir)
    assert sorted(wrapped) == sorted(bare) == list(range(SAMPLES))
    for sample_id, sample in wrapped.items():
        reference = bare[sample_id]
        assert sample.aux_hidden_states.dtype == torch.bfloat16
        assert torch.equal(sample.input_ids, reference.input_ids)
        assert torch.equal(sample.aux_hidden_states.view(torch.int16), reference.aux_hidden_states.view(torch.int16))
        assert torch.equal(sample.last_hidden_state.view(torch.int16), reference.last_hidden_state.view(torch.int16))
    wrapped_meta = ShardReader(next(wrapped_dir.glob("shard-*.parquet"))).metadata
    bare_meta = ShardReader(next(bare_dir.glob("shard-*.parquet"))).metadata
    assert (wrapped_meta.model_architecture, wrapped_meta.language_model_architecture) == (KIMI, DEEPSEEK)
    assert (bare_meta.model_architecture, bare_meta.language_model_architecture) == (DEEPSEEK, DEEPSEEK)
    for meta in (wrapped_meta, bare_meta):
        assert (meta.layer_ids, meta.layers_to_capture, meta.drafter_layer_ids) == ([2, 4, 5], [3, 5, 6], [3, 5, 6])
        # scripts/test.sh names the release each run must use (the main and the overlay environment).
        assert meta.sglang_version in SUPPORTED_SGLANG_VERSIONS
        assert meta.sglang_version == os.environ.get("EAGLE3_EXPECT_SGLANG", meta.sglang_version)
    wrapped_drafter = json.loads((wrapped_dir / DRAFTER_CONFIG_FILE).read_text())
    bare_drafter = json.loads((bare_dir / DRAFTER_CONFIG_FILE).read_text())
    assert wrapped_drafter["eagle_config"] == bare_drafter["eagle_config"]
    source = wrapped_drafter["eagle3_extract"]
    assert (source["model_architecture"], source["language_model_architecture"]) == (KIMI, DEEPSEEK)
    assert source["layers_to_capture"] == [3, 5, 6]


@pytest.mark.parametrize("tp_size", [1, pytest.param(2, marks=pytest.mark.extended)])
def test_kimi_layout_stores_the_bare_models_states_bit_for_bit(ray_cluster, kimi_demo, bare_deepseek, tp_size,
                                                               tmp_path, tmp_path_factory):
    kimi, data, demo_output = kimi_demo
    if tp_size == 1:
        wrapped_dir = demo_output  # the subprocess run
        bare_dir = deepseek_bf16_run(tmp_path_factory)
        bare, wrapped = read_manifest(bare_dir)["content"], read_manifest(wrapped_dir)["content"]
        assert Path(bare["model.path"]).resolve() == bare_deepseek.resolve()
        assert bare["data.fingerprint"] == wrapped["data.fingerprint"]  # the rows the demo built
    else:
        wrapped_dir, bare_dir = tmp_path / "kimi", tmp_path / "bare"
        summary = run(job_config(kimi, data, wrapped_dir, *JOB_SETTINGS, f"model.tp_size={tp_size}"))
        assert summary["engine"]["model_architecture"] == KIMI and summary["engine"]["tp_size"] == tp_size
        run(job_config(bare_deepseek, data, bare_dir, *JOB_SETTINGS, f"model.tp_size={tp_size}"))
    assert_bit_identical(wrapped_dir, bare_dir)


def test_dry_run_plans_what_the_run_wrote(kimi_demo, tmp_path):
    """``python -m jobs.plan`` with the demo's settings: SGLang's layers through the wrapper (built on the meta
    device), samples, tokens, shards and bytes as the demo's run wrote them."""
    kimi, data, run_dir = kimi_demo
    result = subprocess.run(
        [sys.executable, "-m", "jobs.plan", f"model.path={kimi}", f"data.path={data}", f"output.dir={tmp_path}",
         "model.device=cpu", "output.min_free=1GB", *JOB_SETTINGS, "--json"],
        cwd=REPO_ROOT, env=python_env(), capture_output=True, text=True, timeout=300,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    plan = json.loads(result.stdout.strip().splitlines()[-1])
    shards = read_manifest(run_dir)["shards"]
    meta = ShardReader(next(run_dir.glob("shard-*.parquet"))).metadata
    assert (plan["architecture"], plan["language_model_architecture"]) == (KIMI, DEEPSEEK)
    assert plan["layers"]["layer_ids"] == meta.layer_ids
    assert plan["layers"]["layers_to_capture"] == meta.layers_to_capture == [3, 5, 6]
    assert plan["layers"]["drafter_layer_ids"] == meta.drafter_layer_ids == [3, 5, 6]
    assert f"SGLang {meta.sglang_version}, {KIMI}" in plan["layers"]["source"]
    assert (plan["samples"], plan["shards"]) == (sum(s["rows"] for s in shards), len(shards)) == (SAMPLES, 2)
    assert plan["tokens"] == sum(s["tokens"] for s in shards)
    assert plan["state_bytes_per_token"] == state_bytes_per_token(meta) == 4 * 64 * 2  # 3 layers + final, bf16
    written = sum(s["bytes"] for s in shards)
    assert plan["tokens"] * plan["state_bytes_per_token"] < written <= plan["predicted_bytes"]
    assert plan["problems"] == []


@ray.remote(num_cpus=1, max_calls=1)  # one SGLang runtime per process: the worker exits afterwards
def modules_run_by_capture_and_bare_prefill(spec, sequences):
    """Module classes whose forward ran, per phase, and what the decoder stack returned."""
    from extractor.tensor_parallel import TensorParallelEngine

    engine = TensorParallelEngine(spec)
    ran: dict[str, list[str]] = {}
    phase = "capture"

    def record(module, args, output):
        kind = "tuple" if isinstance(output, tuple) else "tensor"
        ran.setdefault(phase, []).append(f"{type(module).__module__}.{type(module).__name__}:{kind}")

    hook = torch.nn.modules.module.register_module_forward_hook(record)
    try:
        with engine.capture(sequences) as batch:
            first = batch.aux_hidden_states.copy()
        phase = "bare"
        engine.bare_prefill(sequences)
        phase = "again"
        with engine.capture(sequences) as batch:
            again = batch.aux_hidden_states.copy()
    finally:
        hook.remove()
        engine.close()
    return {name: sorted(set(classes)) for name, classes in ran.items()}, np.array_equal(first, again)


def test_text_only_batches_never_run_the_vision_tower(ray_cluster, kimi_demo):
    spec = engine_spec(kimi_demo[0], [2, 4, 5], dtype="bfloat16")
    ran, restored = ray.get(modules_run_by_capture_and_bare_prefill.remote(spec, random_sequences((9, 30), seed=6)))
    vision_modules = ("sglang.srt.models.kimi_vl_moonvit.", "sglang.srt.layers.attention.vision.")
    for phase in ("capture", "bare", "again"):
        assert any(".DeepseekV2DecoderLayer:" in name for name in ran[phase]), ran[phase]  # the hook sees layers
        vision = [name for name in ran[phase] if name.startswith(vision_modules)
                  or (name.startswith("sglang.srt.models.kimi_k25.") and f".{KIMI}:" not in name)]
        assert vision == [], f"{phase}: the vision tower ran on text-only input: {vision}"
    # Capture is switched off through the wrapper for the baseline (the decoder returns no aux
    # states) and back on afterwards, with the same states as before.
    decoder = "sglang.srt.models.deepseek_v2.DeepseekV2Model"
    assert f"{decoder}:tuple" in ran["capture"] and f"{decoder}:tensor" not in ran["capture"]
    assert f"{decoder}:tensor" in ran["bare"] and f"{decoder}:tuple" not in ran["bare"]
    assert restored


def test_check_drafter_through_the_wrapper(kimi_demo, tmp_path):
    """deepseek_v2 with a first id that is not 1: SGLang adds nothing, so ids off by one either way fail."""
    _, _, run_dir = kimi_demo
    written = json.loads((run_dir / DRAFTER_CONFIG_FILE).read_text())
    assert written["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [3, 5, 6]
    code, verdicts, output = check_drafter(run_dir, {
        "written": written,
        "plus1": with_ids(written, [4, 6, 7]),
        "minus1": with_ids(written, [2, 4, 5]),  # SGLang's default for this depth, and SpecForge's convention
        "vllm": vllm_style(written, [3, 5, 6]),
    }, tmp_path)
    assert code == EXIT_NOT_PASSED, output
    assert verdicts["written"].startswith("PASS") and KIMI in verdicts["written"], output
    assert "would capture layers_to_capture [4, 6, 7]" in verdicts["plus1"], output
    assert "would capture layers_to_capture [2, 4, 5]" in verdicts["minus1"], output
    assert "which SGLang ignores" in verdicts["vllm"], output
    assert f"would capture layers_to_capture [2, 4, 5] from {KIMI} with drafter ids none" in verdicts["vllm"], output


@ray.remote(num_cpus=1, max_calls=1)
def check_published_kimi_k25(model_dir, drafter_config):
    import resource

    from extractor.drafter_check import capture_with_drafters

    target, (capture,) = capture_with_drafters(str(model_dir), [drafter_config])
    return target, capture, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def test_drafter_check_on_the_published_1t_kimi_k25_needs_no_weights(ray_cluster, tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(KIMI_K25))  # config.json alone: ~1T parameters
    drafter = build_drafter_config(KIMI_K25["text_config"], [3, 31, 59], "bfloat16")
    target, capture, peak_rss = ray.get(check_published_kimi_k25.remote(tmp_path, drafter))
    assert (target.architecture, target.language_model_architecture) == (KIMI, DEEPSEEK)
    assert (target.num_layers, target.hidden_size) == (61, 7168)
    assert target.default_layers_to_capture == [2, 30, 58]  # what SGLang captures for a config without ids
    assert capture.error is None and capture.drafter_architecture == "LlamaForCausalLMEagle3"
    assert capture.layers_to_capture == [3, 31, 59]  # the outputs of layers [2, 30, 58]
    assert peak_rss < 4 << 30, peak_rss  # the bf16/INT4 weights alone would be ~600 GB


@ray.remote(num_cpus=1, max_calls=1)
def quantization_methods(model_dir):
    """The quantization method SGLang attaches to each kind of module, building the model on the meta device."""
    import re as regex

    from extractor.cpu_shims import install_cpu_shims

    install_cpu_shims()
    from extractor.sglang_compat import MetaModels, import_sglang

    methods = {}
    for name, module in MetaModels(import_sglang(), str(model_dir)).target.named_modules():
        method = getattr(module, "quant_method", None)
        if method is not None:
            scheme = getattr(module, "scheme", None)  # 0.5.23 wraps the compressed-tensors MoE scheme
            kind = regex.sub(r"\.\d+\.", ".N.", name)
            methods.setdefault(kind, type(scheme or method).__name__)
    return methods


def test_kimi_k25_reduced_shape_gets_sglangs_int4_moe_path(ray_cluster, tmp_path):
    """The benchmark shape parses, and SGLang routes its routed experts (only those) to the
    compressed-tensors WNA16 MoE scheme, whose kernels (Marlin repack and GEMM) need CUDA."""
    (tmp_path / "config.json").write_text(json.dumps(kimi_k25_reduced()))
    methods = ray.get(quantization_methods.remote(tmp_path))
    experts = {kind: method for kind, method in methods.items() if kind.endswith("mlp.experts")}
    assert len(experts) == 1, experts
    # Logged by SGLang (0.5.17 and 0.5.23) as "Using CompressedTensorsWNA16MarlinMoEMethod".
    assert set(experts.values()) == {"CompressedTensorsWNA16MoE"}, experts
    others = {method for kind, method in methods.items() if not kind.endswith("mlp.experts")}
    assert others <= {"UnquantizedLinearMethod", "UnquantizedEmbeddingMethod"}, others
    for bf16 in ("self_attn.o_proj", "mlp.shared_experts.down_proj", "layers.N.mlp.down_proj", "lm_head"):
        assert any(kind.endswith(bf16) for kind in methods), bf16
