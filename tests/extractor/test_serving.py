"""The SGLang server's settings as the extractor's input (model.serving): parsed by the installed SGLang's own
parser, sorted into applied / model keys / set by the extractor / the drafter / left out, applied to the real
ModelRunner (the states change as SGLang's own override changes them, twice alike), recorded in the manifest,
refused before Ray when SGLang refuses them, and compared with a run by jobs.check_serving."""

from __future__ import annotations

import importlib.metadata
import json
import shutil
import subprocess
import sys

import pytest
import torch
import yaml

from extractor.config import ModelConfig, serving_command
from extractor.generator import GeneratorSpec, _engine_args
from extractor.serving import (
    DRAFTER,
    EXTRACTOR_FIELDS,
    LEFT_OUT,
    MODEL_FIELDS,
    PLACEMENT,
    classify,
    effective_model,
    parse_serving,
    runner_server_args,
)
from jobs.check_serving import main as check_serving
from jobs.extract import main as extract_main
from jobs.extract import run
from jobs.rundir.summary import DRAFTER_CONFIG_FILE
from storage.manifest import Manifest, read_manifest
from tests.conftest import REPO_ROOT
from tests.helpers import HIDDEN, engine_spec, hf_hidden_states, job_config, python_env, read_all

OVERRIDE = '{"rms_norm_eps": 0.5}'
"""A serving setting that changes the states on CPU: SGLang's own override of the checkpoint's config.json."""
SERVING = [  # as pasted from the server's launch script
    "python", "-m", "sglang.launch_server", "--model-path", "/models/served-elsewhere", "--dtype", "float32",
    "--json-model-override-args", OVERRIDE, "--port", "31000", "--api-key", "not-in-any-log",
    "--chunked-prefill-size", "64", "--log-level", "debug", "--cuda-graph-max-bs-decode", "16",
]


def test_what_is_applied_and_what_is_left_out():
    """Numerics are applied, so is any field no rule names (a later SGLang's); the left-out categories are narrow."""
    for field in ("quantization", "kv_cache_dtype", "moe_runner_backend", "fp8_gemm_runner_backend",
                  "enable_deterministic_inference", "ep_size", "json_model_override_args", "attn_dp_size",
                  "prefill_attention_backend", "disable_custom_all_reduce", "a_flag_of_a_later_sglang"):
        assert classify(field, {}) == ("applied", ""), field
    for field in ("dtype", "tp_size", "attention_backend", "device", "context_length", "load_format"):
        assert classify(field, {})[0] == "model", field
    for field in ("chunked_prefill_size", "mem_fraction_static", "disable_radix_cache", "model_path"):
        assert classify(field, {})[0] == "extractor", field
    for field in ("speculative_algorithm", "speculative_draft_model_path", "speculative_num_steps"):
        assert classify(field, {})[0] == "drafter", field
    for field, category in (("port", "network"), ("api_key", "access"), ("log_level", "observability"),
                            ("chat_template", "text in and out"), ("schedule_policy", "scheduling"),
                            ("cuda_graph_max_bs_decode", "graph capture"), ("lora_paths", "LoRA"),
                            ("dp_size", "placement"), ("watchdog_timeout", "process")):
        kind, why = classify(field, {})
        assert kind == "left out" and why.startswith(category), (field, why)
    assert classify("dp_size", {"enable_dp_attention": True}) == ("applied", "")  # the attention layout
    # what the extractor sets itself is listed with its reason, and docs/serving.md names every category
    spec = engine_spec(REPO_ROOT, [2], server_args={"kv_cache_dtype": "fp8_e4m3", "chunked_prefill_size": 64})
    own = runner_server_args(spec, 1234, capture_only=True)
    assert own["kv_cache_dtype"] == "fp8_e4m3" and own["chunked_prefill_size"] == -1
    assert set(own) - {"kv_cache_dtype"} <= set(EXTRACTOR_FIELDS) | set(MODEL_FIELDS) | {"disable_custom_all_reduce"}
    page = (REPO_ROOT / "docs" / "serving.md").read_text()
    assert [c.name for c in (*LEFT_OUT, PLACEMENT, DRAFTER) if f"| {c.name} |" not in page] == []


def test_the_shapes_model_serving_takes():
    assert serving_command(" ".join(SERVING[:7])) == ("--model-path", "/models/served-elsewhere", "--dtype", "float32")
    assert serving_command(["sglang", "serve", "--tp-size", 8]) == ("--tp-size", "8")
    assert serving_command({"quantization": "fp8"}) is None and serving_command(None) == () == serving_command("")
    for bad in ([["--tp"]], [True], "--x 'unclosed"):
        with pytest.raises(ValueError, match="model.serving="):
            ModelConfig(serving=bad)


def test_sglang_parses_the_command_and_refuses_what_it_refuses(llama_fp32):
    settings = parse_serving(SERVING)
    assert settings.sglang_version in ("0.5.17", "0.5.23")
    assert settings.applied == {"json_model_override_args": OVERRIDE}
    assert settings.of_kind("model") == {"dtype": "float32"}
    assert set(settings.of_kind("extractor")) == {"model_path", "chunked_prefill_size"}
    assert set(settings.of_kind("left out")) == {"port", "api_key", "log_level", "cuda_graph_max_bs_decode"}
    log = "\n".join(settings.describe())
    assert "applied: --json-model-override-args" in log and "not-in-any-log" not in log
    assert "left out (network: " in log and "--port" in log
    # the mapping of ServerArgs fields is read by the same parser
    fields = parse_serving({"dtype": "float32", "json_model_override_args": json.loads(OVERRIDE),
                            "enable_deterministic_inference": True})
    assert fields.applied == {"json_model_override_args": OVERRIDE, "enable_deterministic_inference": True}

    refused = {
        "--kv-cache-dtype fp8_e4m3 --bogus-flag 1": "unrecognized arguments: --bogus-flag 1",
        "--quantization nope": "argument --quantization: invalid choice: 'nope'",
        "--tp-size two": "argument --tp-size/--tensor-parallel-size: invalid int value: 'two'",
        "--help": "unrecognized arguments: --help",
        "--kv-cache-dtype": "argument --kv-cache-dtype: expected one argument",
    }
    for command, message in refused.items():
        with pytest.raises(ValueError, match=rf"model.serving: SGLang {settings.sglang_version} refuses the "
                                             rf"serving command: {message}"):
            parse_serving(command)
    with pytest.raises(ValueError, match="quantisation is not a ServerArgs field .*; did you mean quantization"):
        parse_serving({"quantisation": "fp8"})
    with pytest.raises(ValueError, match="--enable-deterministic-inference takes no value"):
        parse_serving({"enable_deterministic_inference": "yes"})

    # precedence: the serving command decides the model.* keys; a conflicting explicit one is refused
    config = json.loads((llama_fp32 / "config.json").read_text())
    model = effective_model(ModelConfig(), parse_serving("--dtype half --tp-size 2"), config)
    assert (model.dtype, model.tp_size) == ("float16", 2)
    with pytest.raises(ValueError, match=r"model.tp_size=4, but the serving command \(model.serving\) runs "
                                         r"--tp-size 2: .* drop model.tp_size or make the two agree"):
        effective_model(ModelConfig(tp_size=4), parse_serving("--tp-size 2"), config)
    # no --dtype: the dtype SGLang's auto picks for this float32 checkpoint (float16), as the server computes
    assert effective_model(ModelConfig(), parse_serving("--port 1"), config).dtype == "float16"
    with pytest.raises(ValueError, match=r"model.dtype='float32', but .* runs float16 \(no --dtype: SGLang's auto"):
        effective_model(ModelConfig(dtype="float32"), parse_serving("--port 1"), config)
    # jobs.prepare's engine: the applied settings under its own, and the model fields it has no key for
    spec = GeneratorSpec(model_path="m", dtype="float32", device="cpu", seed=3,
                         server_args={"json_model_override_args": OVERRIDE, "random_seed": 9})
    assert _engine_args(spec)["json_model_override_args"] == OVERRIDE and _engine_args(spec)["random_seed"] == 3


def test_check_serving_refuses_a_misspelt_flag_without_importing_sglang(llama_fp32, tmp_path):
    """Once SGLang's parser has been built here (its flags kept), `jobs.check_serving` refuses a flag it lacks as
    SGLang does, with the flag it likely meant, before importing SGLang: here an `sglang` package that cannot be
    imported stands in front of the real one."""
    env = python_env(EAGLE3_CACHE_DIR=str(tmp_path / "cache"))
    run = tmp_path / "run"
    run.mkdir()
    Manifest.open(run, {"model.path": str(llama_fp32)}, [(0, 0, 4)])
    command = [sys.executable, "-m", "jobs.check_serving", f"output.dir={run}", "--", "--dtype", "float32",
               "--kv-cache-dtpye", "fp8_e4m3"]
    built = subprocess.run(command, cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert built.returncode == 2 and "unrecognized arguments: --kv-cache-dtpye fp8_e4m3" in built.stderr, built.stderr
    blocker = tmp_path / "blocker" / "sglang"
    blocker.mkdir(parents=True)
    (blocker / "__init__.py").write_text("raise ImportError('SGLang was imported')\n")
    blocked = {**env, "PYTHONPATH": f"{blocker.parent}:{env['PYTHONPATH']}"}
    fast = subprocess.run(command, cwd=REPO_ROOT, env=blocked, capture_output=True, text=True, timeout=600)
    assert fast.returncode == 2 and fast.stdout == "", fast.stderr
    assert fast.stderr.splitlines()[-1] == (f"error: model.serving: SGLang {importlib.metadata.version('sglang')} refuses the "
                                   "serving command: unrecognized arguments: --kv-cache-dtpye fp8_e4m3 (did you mean "
                                   "--kv-cache-dtype?)"), fast.stderr


def test_a_refused_command_stops_the_job_before_ray(llama_fp32, demo_dataset, tmp_path, capsys):
    """exit 2 and one `error:` line naming the flag; argparse's usage text and SystemExit never come out."""
    out = tmp_path / "out"
    code = extract_main([f"model.path={llama_fp32}", f"data.path={demo_dataset}", f"output.dir={out}",
                         "model.device=cpu", "model.serving=--quantization fp8 --kv-cache-dtpye fp8_e4m3"])
    err = capsys.readouterr().err
    assert code == 2, err
    assert err.strip().splitlines()[-1].startswith("error: model.serving: SGLang ") and "usage:" not in err
    assert "unrecognized arguments: --kv-cache-dtpye fp8_e4m3" in err
    assert not out.exists()


def _with_serving(tmp_path, name: str, serving) -> list[str]:
    """``--config FILE`` holding model.serving, as a user's YAML would."""
    conf = tmp_path / f"{name}.yaml"
    conf.write_text(yaml.safe_dump({"model": {"serving": serving}}))
    return ["--config", str(conf)]


@pytest.fixture(scope="module")
def served(ray_cluster, llama_fp32, demo_dataset, tmp_path_factory):
    """A run extracted with SERVING."""
    tmp_path = tmp_path_factory.mktemp("served")
    run(job_config(llama_fp32, demo_dataset, tmp_path / "run", "output.num_writers=1",
                   *_with_serving(tmp_path, "list", SERVING)))
    return tmp_path / "run"


def test_serving_settings_reach_the_states_and_the_manifest(served, llama_fp32, demo_dataset, tmp_path, capsys):
    # the same settings as ServerArgs fields, in another output.dir
    again = tmp_path / "again"
    fields = {"dtype": "float32", "json_model_override_args": json.loads(OVERRIDE), "port": 31001}
    run(job_config(llama_fp32, demo_dataset, again, "output.num_writers=1", *_with_serving(tmp_path, "fields", fields)))

    content = read_manifest(served)["content"]
    assert content["model.serving"] == {"json_model_override_args": OVERRIDE}
    assert content["model.dtype"] == "float32"
    assert read_manifest(again)["content"] == content  # port and api key are not content

    samples, repeated = read_all(served), read_all(again)
    hf = _hf_model(llama_fp32, rms_norm_eps=0.5)
    default_hf = _hf_model(llama_fp32)
    for sample_id in (0, 7, 19):
        sample = samples[sample_id]
        # bit for bit the same when the same settings are applied twice
        assert torch.equal(sample.aux_hidden_states, repeated[sample_id].aux_hidden_states)
        assert torch.equal(sample.last_hidden_state, repeated[sample_id].last_hidden_state)
        # the states of the model the override describes (HF with rms_norm_eps 0.5), not of the checkpoint's
        ids = sample.input_ids.numpy()
        mine, default = hf_hidden_states(hf, ids), hf_hidden_states(default_hf, ids)
        for j, k in enumerate([2, 4, 5]):
            got = sample.aux_hidden_states[:, j * HIDDEN:(j + 1) * HIDDEN]
            assert (got - mine[k + 1]).abs().max() < 1e-5
            assert (got - default[k + 1]).abs().max() > 1e-3

    # a rerun with other serving numerics is refused like any content change, before Ray
    with pytest.raises(ValueError, match=r"model.serving: was \{'json_model_override_args': .*\}, now None"):
        run(job_config(llama_fp32, demo_dataset, served, "model.dtype=float32"))

    # the check: the same command passes (left-out flags named, not compared), another one fails on each difference
    assert check_serving([f"output.dir={served}", "--", *SERVING[3:], "--port", "9"]) == 0
    text = capsys.readouterr().out
    assert "PASS the server runs the numerics" in text and "NOTE not compared" in text and "--api-key" in text
    other = ["--dtype", "bfloat16", "--tp-size", "2", "--json-model-override-args", '{"rms_norm_eps": 0.25}',
             "--quantization", "fp8", "--load-format", "dummy"]
    assert check_serving([f"output.dir={served}", "--", *other]) == 1
    diffs = sorted(line.split(":")[0] for line in capsys.readouterr().out.splitlines() if line.startswith("DIFF"))
    assert diffs == ["DIFF --dtype", "DIFF --json-model-override-args", "DIFF --load-format", "DIFF --quantization",
                     "DIFF --tp-size"]


def test_check_serving_checks_the_served_drafter_too(served, tmp_path):
    """The real command on a serving command with an EAGLE-3 drafter: the one differing setting named, the
    drafter's layer ids checked as jobs.check_drafter checks them (its config is the one the run wrote)."""
    drafter = tmp_path / "drafter"
    drafter.mkdir()
    shutil.copy(served / DRAFTER_CONFIG_FILE, drafter / "config.json")
    command = ["sglang", "serve", "--speculative-algorithm", "EAGLE3", "--speculative-draft-model-path", str(drafter),
               "--dtype", "float32", "--attention-backend", "torch_native"]
    result = subprocess.run([sys.executable, "-m", "jobs.check_serving", f"output.dir={served}", "--", *command],
                            cwd=REPO_ROOT, env=python_env(), capture_output=True, text=True, timeout=600)
    lines = result.stdout.splitlines()
    assert result.returncode == 1, result.stdout + result.stderr[-3000:]
    assert [line for line in lines if line.startswith("DIFF")] == [
        f"DIFF --json-model-override-args: the server runs SGLang's default ({{}}), the run used {OVERRIDE}"]
    assert any(line.startswith(f"PASS {drafter}: SGLang") for line in lines), result.stdout


def _hf_model(model_path, **overrides):
    import transformers

    config = transformers.AutoConfig.from_pretrained(model_path, **overrides)
    return transformers.AutoModelForCausalLM.from_pretrained(model_path, config=config, dtype=torch.float32).eval()
