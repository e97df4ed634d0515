"""The drafter config a run writes, and `python -m jobs.check_drafter` on the off-by-one cases.

SGLang's rules (asked of SGLang itself, the check encodes none): Llama-family targets always
add 1 to a drafter config's ids; deepseek_v2 adds 1 only when the first id is 1. vLLM reads a
top-level key that SGLang ignores.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from transformers import DeepseekV3Config

from extractor.checkpoint import text_config
from extractor.drafter_config import build_drafter_config, sglang_reads, vllm_style_ids
from inputs.demo import build_synthetic_dataset, build_tiny_model
from jobs.extract import DRAFTER_CONFIG_FILE, run
from runtime.errors import EXIT_BAD_INPUT
from runtime.errors import EXIT_NOT_PASSED as EXIT_MISMATCH
from testbeds.shapes import KIMI_K25
from tests.conftest import REPO_ROOT
from tests.helpers import check_drafter, job_config, python_env, vllm_style, with_ids

IDS = "eagle_aux_hidden_state_layer_ids"


def test_drafter_config_for_kimi_k25_is_complete():
    config = build_drafter_config(KIMI_K25["text_config"], [3, 31, 59], "bfloat16")
    assert config["architectures"] == ["LlamaForCausalLMEagle3"] and config["num_hidden_layers"] == 1
    assert (config["hidden_size"], config["target_hidden_size"], config["vocab_size"]) == (7168, 7168, 163840)
    assert config["draft_vocab_size"] == 163840  # SGLang's LlamaForCausalLMEagle3 cannot be built without it
    assert (config["num_attention_heads"], config["head_dim"], config["intermediate_size"]) == (64, 128, 18432)
    assert config["eagle_config"] == {IDS: [3, 31, 59], "use_aux_hidden_state": True}
    assert IDS not in config  # nothing for vLLM to misread
    # the same text config as transformers saves it: its head_dim is the rope part (64); the drafter's stays 128
    saved = DeepseekV3Config(**KIMI_K25["text_config"]).to_dict()
    assert saved["head_dim"] == saved["qk_rope_head_dim"] == 64
    assert build_drafter_config(saved, [3, 31, 59], "bfloat16")["head_dim"] == 128


@pytest.mark.parametrize("eagle_config, expected", [
    ({IDS: [3, 31, 59]}, (True, [3, 31, 59])),
    ({IDS: [3, 31, 59], "use_aux_hidden_state": False}, (False, [3, 31, 59])),
    ({"use_aux_hidden_state": True}, (True, None)),
    (None, (True, None)),  # no eagle_config: SGLang captures its default layers
])
def test_ids_are_read_as_sglang_reads_them(eagle_config, expected):
    assert sglang_reads(eagle_config) == expected


def test_vllm_style_ids_are_the_top_level_key():
    assert vllm_style_ids({IDS: [3, 5, 6]}) == [3, 5, 6]
    assert vllm_style_ids({"eagle_config": {IDS: [3, 5, 6]}}) is None


@pytest.fixture(scope="module")
def small_data(tmp_path_factory):
    path = tmp_path_factory.mktemp("data") / "data.parquet"
    return build_synthetic_dataset(path, num_samples=2, min_len=8, max_len=24)


def test_llama_family_adds_one_always(finished_run, tmp_path):
    """The drafter config of the session's finished run (layers [2, 4, 5]: layers_to_capture [3, 5, 6]), as written
    and off by one either way."""
    written = json.loads((finished_run / DRAFTER_CONFIG_FILE).read_text())
    assert written["eagle_config"][IDS] == [2, 4, 5] and written["hidden_size"] == 64
    code, verdicts, output = check_drafter(finished_run, {
        "written": written,
        "plus1": with_ids(written, [3, 5, 6]),  # captures [4, 6, 7]
        "minus1": with_ids(written, [1, 3, 4]),  # captures [2, 4, 5]
        "vllm": vllm_style(written, [3, 5, 6]),  # the inputs of layers 3, 5, 6 in vLLM's convention
        "no-draft-vocab": {k: v for k, v in written.items() if k != "draft_vocab_size"},
    }, tmp_path)
    assert code == EXIT_MISMATCH, output
    assert verdicts["written"].startswith("PASS") and "layers_to_capture [3, 5, 6]" in verdicts["written"], output
    assert "would capture layers_to_capture [4, 6, 7]" in verdicts["plus1"], output
    assert "but the run stored layers_to_capture [3, 5, 6]" in verdicts["plus1"], output
    assert "would capture layers_to_capture [2, 4, 5]" in verdicts["minus1"], output
    assert verdicts["vllm"].startswith("FAIL written for vLLM's convention"), output
    assert "draft_vocab_size" in verdicts["no-draft-vocab"] and verdicts["no-draft-vocab"].startswith("FAIL"), output
    for name in ("plus1", "minus1", "vllm"):
        assert f"Fix: set eagle_config.{IDS} to [2, 4, 5]" in verdicts[name], output


@pytest.mark.extended
def test_deepseek_v2_adds_one_only_when_the_first_id_is_1(ray_cluster, small_data, tmp_path):
    model = build_tiny_model(tmp_path / "model", arch="deepseek_v3")
    run(job_config(model, small_data, tmp_path / "run", "extract.layers=[1,3,5]"))  # layers_to_capture [2, 4, 6]
    written = json.loads((tmp_path / "run" / DRAFTER_CONFIG_FILE).read_text())
    assert written["eagle_config"][IDS] == [1, 3, 5]
    code, verdicts, output = check_drafter(tmp_path / "run", {
        "written": written,  # first id 1: SGLang adds 1
        # One more: the first id is no longer 1, SGLang adds nothing, and the same layers come out.
        "plus1": with_ids(written, [2, 4, 6]),
        # One lower, as if SGLang added 1 here as it does for Llama: the first id is 0, nothing is added.
        "minus1": with_ids(written, [0, 2, 4]),
        "plus2": with_ids(written, [3, 5, 7]),  # one more than plus1: no first id 1, taken as they are
        "vllm": vllm_style(written, [2, 4, 6]),  # SGLang ignores the top-level key: its default [2, 4, 5]
    }, tmp_path)
    assert code == EXIT_MISMATCH, output
    assert verdicts["written"].startswith("PASS") and verdicts["plus1"].startswith("PASS"), output
    assert "layers_to_capture [2, 4, 6]" in verdicts["written"], output
    for name, captured in (("minus1", "[0, 2, 4]"), ("plus2", "[3, 5, 7]"), ("vllm", "[2, 4, 5]")):
        assert verdicts[name].startswith("FAIL"), output
        assert f"would capture layers_to_capture {captured}" in verdicts[name], output
        assert "but the run stored layers_to_capture [2, 4, 6]" in verdicts[name], output
        assert f"Fix: set eagle_config.{IDS} to [1, 3, 5]" in verdicts[name], output
    assert "written for vLLM's convention" in verdicts["vllm"], output


def test_bad_input_exits_2(tmp_path):
    result = subprocess.run([sys.executable, "-m", "jobs.check_drafter", str(tmp_path / "missing.json"),
                             f"output.dir={tmp_path}"], cwd=REPO_ROOT, env=python_env(), capture_output=True,
                            text=True, timeout=120)
    assert result.returncode == EXIT_BAD_INPUT
    assert "no shard file and no .summary.json" in result.stderr


def test_the_check_prints_only_its_verdicts_and_asks_sglang_once(monkeypatch, capsys, llama_fp32, tmp_path):
    """SGLang is asked in a child process (its import and warnings stay there) and its answer is cached: the
    command's output is its verdict alone, and the same check again does not ask SGLang again."""
    from jobs.check_drafter import main
    from jobs.planning import capture

    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / ".summary.json").write_text(json.dumps({"model_path": str(llama_fp32), "engine": {
        "hidden_size": 64, "layer_ids": [2, 4, 5], "layers_to_capture": [3, 5, 6], "drafter_layer_ids": [2, 4, 5],
        "sglang_version": "0.5.23"}}))
    drafter = tmp_path / "drafter.json"
    drafter.write_text(json.dumps(build_drafter_config(
        text_config(json.loads((llama_fp32 / "config.json").read_text())), [2, 4, 5], "float32")))
    cache = tmp_path / "cache"
    first = subprocess.run([sys.executable, "-m", "jobs.check_drafter", str(drafter), f"output.dir={run_dir}"],
                           cwd=REPO_ROOT, env=python_env(EAGLE3_CACHE_DIR=str(cache)), capture_output=True, text=True,
                           timeout=600)
    assert first.returncode == 0 and first.stderr == "", first.stderr[-3000:]
    assert first.stdout.startswith(f"PASS {drafter}: SGLang ") and len(first.stdout.splitlines()) <= 2, first.stdout

    def no_probe(*args, **kwargs):
        raise AssertionError("SGLang was asked again")

    monkeypatch.setenv("EAGLE3_CACHE_DIR", str(cache))
    monkeypatch.setattr(capture, "_probe", no_probe)
    assert main([str(drafter), f"output.dir={run_dir}"]) == 0
    assert capsys.readouterr().out == first.stdout
