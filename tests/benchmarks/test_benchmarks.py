"""The benchmark script runs end to end on CPU (smoke test: no timing is asserted)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from benchmarks.extract_wall import engine_alone
from benchmarks.throughput import ROWS, benchmark_layer_ids, headline, print_table, refuse_shape_too_large, run_rows
from extractor.config import SGLangModelConfig
from extractor.layers import check_layer_ids
from testbeds.shapes import DEEPSEEK_V3_REDUCED, LLAMA_8B, SHAPES, weight_bytes
from tests.conftest import REPO_ROOT
from tests.helpers import job_config, python_env


@pytest.mark.extended
def test_throughput_benchmark_smoke(tmp_path):
    """Every row of the benchmark runs and reports; fp8 states are left out here (tests/jobs/test_job.py stores
    them; each row is another job's start-up, which is what the suite pays for)."""
    env = python_env()
    env.pop("RAY_ADDRESS", None)
    result = subprocess.run(
        [sys.executable, "-m", "benchmarks.throughput", "--shape", "tiny", "--device", "cpu", "--samples", "8",
         "--tokens-per-sample", "96", "--max-tokens-per-batch", "256", "--shard-size", "2",
         "--disk-probe-bytes", str(64 << 20), "--consume", "1MB",
         "--work-dir", str(tmp_path / "work"), "--out", str(tmp_path / "results.json")],
        cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=600,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    for row in ("(a) bare SGLang prefill", "(a2) extractor alone", "(b) full job", "(c) disk sequential write",
                "(d) pipeline capacity, synthetic states, disk", "where the extractor's time goes",
                "the writers' CPU seconds per GB"):
        assert row in result.stdout, row
    results = json.loads((tmp_path / "results.json").read_text())
    assert results["tokens"] == 8 * 96
    assert results["bare_prefill_tokens_per_s"] > 0 and results["job_tokens_per_s"] > 0
    assert results["bytes_per_token"] > 4 * 64 * 2  # 3 aux layers + final state, bf16, hidden 64
    rows = results["rows"]
    assert sorted(rows) == ["b", "d"]
    for name, row in rows.items():
        assert row["tokens"] == 8 * 96 and row["extracted_again"] == 0, name  # consumed, never taken for lost
        assert set(row["stage_seconds"]) == {"put", "wait", "fetch", "encode", "write", "hash", "sync", "commit"}
        assert row["writer_cpus"] == ["all cores"]  # a CPU engine: the writers are not pinned
        # the job's extractor was the warm one of (a) and (a2) (the synthetic source's its own); what it did is the
        # job's alone: its forward thread's CPU per stage, the puts, its process's CPU
        assert row["time"]["extractor_tokens"] == 8 * 96 and row["time"]["cpu_hand_on"] > 0, row["time"]
        assert row["time"]["extractor_process_cpu"] > 0
    assert rows["b"]["time"]["forward_thread_cpu"] > 0 and rows["b"]["time"]["cpu_prepare"] > 0
    assert results["a_time"]["cpu_forward"] > 0
    assert results["extractor_starts"] == 2  # the model's for (a), (a2) and (b); the synthetic source's for (d)
    assert results["a2_time"]["extractor_tokens"] == 8 * 96 and results["a2_time"]["cpu_capture"] > 0
    # the synthetic source writes the same layout as the model: same bytes per token
    assert rows["d"]["bytes_per_token"] == pytest.approx(rows["b"]["bytes_per_token"], rel=0.02)
    assert rows["d"]["sglang"] == "none (synthetic states)"


def test_regeneration_gives_sglangs_own_answers_and_is_measured_against_it(tmp_path):
    """``benchmarks.regenerate`` on CPU with SmolLM2 (greedy): jobs.prepare regenerate=true, every first prompt sent
    at once and three shards answered at once, gives for every prompt the very answer (text, tokens) of one
    ``Engine.generate`` over all of them, the path it replaced for one-question conversations; both rates are
    measured in the same run (no rate is asserted). It runs as docs/install.md installs the packages on a GPU node
    (``wheelhouse.sh install --target SITE``, ``PYTHONPATH=SITE``): an interpreter of its own with every package in a
    directory on PYTHONPATH, which the benchmark's ``jobs.prepare`` and Ray's workers must keep."""
    python, env = target_install()
    result = subprocess.run(
        [python, "-m", "benchmarks.regenerate", "--device", "cpu", "--prompts", "12", "--max-new-tokens", "16",
         "--shard-size", "4", "--work-dir", str(tmp_path / "work"), "--out", str(tmp_path / "results.json")],
        cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=900,
    )
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    results = json.loads((tmp_path / "results.json").read_text())
    prepare, own = results["prepare"], results["sglang_offline"]
    assert (prepare["answers"], prepare["shards"], results["same_answers"]) == (12, 3, 12), results
    assert prepare["generated_tokens"] == own["generated_tokens"] > 0
    assert prepare["tokens_per_s"] > 0 and own["tokens_per_s"] > 0 and results["prepare_over_sglang"] > 0
    assert "prepare / SGLang = " in result.stdout and "Paris" in result.stdout
    assert "regenerating 3 of 3 shards" in (tmp_path / "results.prepare.log").read_text()  # jobs.prepare's own log kept
    wall = prepare["wall_seconds"]  # where the command's wall time went, phase by phase, adding up to its total
    assert [phase for phase, _ in wall["phases"]] == ["reading the inputs", "starting Ray", "loading the model",
                                                      "regenerating", "closing the engine", "stopping Ray",
                                                      "tokenizing and publishing"]
    assert sum(seconds for _, seconds in wall["phases"]) == pytest.approx(wall["total"], abs=0.05)
    assert wall["total"] <= prepare["command_seconds"] and "jobs.prepare's wall time" in result.stdout
    assert own["wall_seconds"] > own["seconds"] and results["command_over_sglang_wall"] > 0  # both whole, side by side


def target_install() -> tuple[str, dict[str, str]]:
    """The base interpreter (no project packages of its own) and an environment whose PYTHONPATH is the directory
    holding the packages and nothing else: the layout of ``wheelhouse.sh install --target SITE``."""
    python = str(Path(sys.base_prefix) / "bin" / "python3")
    env = python_env()
    env.pop("PYTHONPATH")
    bare = subprocess.run([python, "-c", "import ray"], capture_output=True, env=env)
    assert bare.returncode != 0, f"{python} imports ray itself: not the layout under test"
    site = subprocess.run([sys.executable, "-c", "import omegaconf; print(omegaconf.__file__)"],
                          capture_output=True, text=True, check=True).stdout.strip()
    return python, dict(env, PYTHONPATH=str(Path(site).parents[1]))


@pytest.mark.extended
def test_extraction_is_measured_against_sglang_alone_on_the_same_tokens(tmp_path):
    """``benchmarks.extract_wall`` on CPU with SmolLM2: the real jobs.extract command over a written dataset, its
    phases from its own summary adding up to its total, then SGLang alone prefilling the very same tokens."""
    env = python_env()
    env.pop("RAY_ADDRESS", None)
    result = subprocess.run(
        [sys.executable, "-m", "benchmarks.extract_wall", "--device", "cpu", "--samples", "6", "--tokens-per-sample",
         "64", "--work-dir", str(tmp_path / "work"), "--out", str(tmp_path / "results.json")],
        cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=900,
    )
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    results = json.loads((tmp_path / "results.json").read_text())
    data = pq.read_table(next((tmp_path / "work").glob("tokens-6x64.parquet")))
    tokens = sum(len(ids) for ids in data.column("input_ids").to_pylist())
    assert results["tokens"] == results["sglang_alone"]["tokens"] == tokens and data.num_rows == 6
    wall = results["extract"]["wall_seconds"]
    assert {"loading the model and starting the writers", "extracting"} <= set(dict(wall["phases"]))
    assert sum(seconds for _, seconds in wall["phases"]) == pytest.approx(wall["total"], abs=0.05)
    assert results["extract"]["command_seconds"] >= wall["total"] and results["command_over_sglang_wall"] > 0
    assert "command / SGLang alone = " in result.stdout
    assert "extracting" in (tmp_path / "results.extract.log").read_text()  # jobs.extract's own output kept


def test_sglang_alone_is_the_engine_the_jobs_serving_command_gives(ray_cluster, llama_fp32, tmp_path):
    """extract_wall's SGLang-alone leg runs what jobs.extract's engine runs: model.serving's values in the model's
    keys (its dtype) and its other settings, not the bare model keys."""
    keys = [f"model.path={llama_fp32}", f"data.path={tmp_path / 'data.parquet'}", f"output.dir={tmp_path / 'out'}",
            "model.device=cpu"]
    served = engine_alone([*keys, "model.serving=--dtype float16 --kv-cache-dtype bfloat16"])
    assert (served.dtype, dict(served.server_args)) == ("float16", {"kv_cache_dtype": "bfloat16"})
    bare = engine_alone(keys)
    assert (bare.dtype, dict(bare.server_args)) == ("bfloat16", {})


@pytest.mark.extended
def test_driver_scale_benchmark_smoke(tmp_path):
    env = python_env()
    env.pop("RAY_ADDRESS", None)
    result = subprocess.run(
        [sys.executable, "-m", "benchmarks.driver_scale", "--rows", "5000", "--shards", "50", "--mean-tokens", "8",
         "--max-samples-per-batch", "32", "--work-dir", str(tmp_path), "--output-dir", str(tmp_path),
         "--out", str(tmp_path / "results.json")],
        cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=600,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    results = json.loads((tmp_path / "results.json").read_text())
    assert results["data"]["rows"] == 5000 and results["open"]["arrays_bytes"] == 5000 * 16
    assert results["plan"]["shards"] == 50 and results["manifest"]["shards"] == 50
    assert results["rows"]["ms_per_batch"] > 0 and results["manifest"]["ms_per_full_rewrite"] > 0
    # The whole job ran in the benchmark's process: every sample and token written, in the planned batches
    schedule = results["schedule"]
    assert (schedule["samples"], schedule["tokens"]) == (5000, results["data"]["tokens"])
    assert (schedule["shards"], schedule["batches"]) == (50, results["plan"]["batches"]) and schedule["batches"] >= 200
    # Both runs' CPU is measured; at this size their difference (the per-batch figure) is noise, and a
    # loaded CI machine once made it negative: its sign is the benchmark's to report, not asserted here.
    assert schedule["driver_cpu_seconds"] > 0 and schedule["one_shard_run_cpu_seconds"] > 0
    assert "driver_ms_per_batch" in schedule and not list(tmp_path.glob("eagle3-driver-scale-*"))
    # the bookkeeping at a tenth of the shards and at all of them: a consuming run's two updates per shard but the
    # last 20, every operation timed, the snapshot's size growing with the shards
    bookkeeping = results["bookkeeping"]
    small, large = bookkeeping["sizes"]["5"], bookkeeping["sizes"]["50"]
    assert (small["updates"], large["updates"]) == (5 + 0, 50 + 30)
    for size in (small, large):
        assert all(size[key] > 0 for key in ("create_ms", "update_ms", "reopen_ms", "rescan_ms", "status_ms")), size
    assert large["manifest_bytes"] > 5 * small["manifest_bytes"] and large["journal_peak_bytes"] > 0
    assert bookkeeping["growth_per_shard"]["manifest_bytes"] > 100


@pytest.mark.parametrize("shape", sorted(SHAPES))
def test_default_layers_are_valid_for_every_shape(shape):
    """A reduced-depth shape must not ask the job for layers it refuses (4 layers: not [2, 2, 1])."""
    config = SHAPES[shape]
    num_layers = config.get("text_config", config)["num_hidden_layers"]
    layer_ids = benchmark_layer_ids(num_layers)
    assert check_layer_ids(layer_ids, num_layers) == layer_ids
    expected = {"llama8b": [2, 16, 29], "deepseek_v3_reduced": [1, 2], "kimi_k25_reduced": [2, 5, 7]}
    assert layer_ids == expected[shape]


SMALL = {"hidden_size": 256, "intermediate_size": 512, "vocab_size": 1000, "num_attention_heads": 4}


@pytest.mark.parametrize("config", [
    {**LLAMA_8B, **SMALL, "num_key_value_heads": 2, "num_hidden_layers": 3},
    {**DEEPSEEK_V3_REDUCED, **SMALL, "num_key_value_heads": 4, "moe_intermediate_size": 64, "n_routed_experts": 8,
     "n_group": 2, "topk_group": 1, "q_lora_rank": 64, "kv_lora_rank": 32, "qk_rope_head_dim": 16,
     "qk_nope_head_dim": 32, "v_head_dim": 32},
], ids=["llama", "deepseek_v3"])
def test_a_shapes_weight_bytes_are_hf_models_own(config):
    """The shapes' families, narrowed: the estimate equals the bf16 bytes of every matrix HF's model holds."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    hf_config = AutoConfig.for_model(config["model_type"], **{k: v for k, v in config.items() if k != "model_type"})
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(hf_config, dtype=torch.bfloat16)
    matrices = [(name, p) for name, p in model.named_parameters() if "norm" not in name
                and not name.endswith("mlp.gate.weight") and "e_score_correction_bias" not in name]
    assert weight_bytes(config) == sum(p.numel() * p.element_size() for _, p in matrices)


def test_a_shape_too_large_for_the_gpu_is_refused_before_loading():
    """kimi_k25_reduced stopped in CUDA out of memory on an H100 (2026-12-05: 83 GB allocated and 5.6 GB more asked)
    and ran on the H200 at mem_fraction_static 0.8 (113 GB): its INT4 estimate lies between."""
    assert 89e9 < weight_bytes(SHAPES["kimi_k25_reduced"]) < 113e9
    h100, h200 = 81559 << 20, 143771 << 20  # nvidia-smi's memory.total, MiB
    with pytest.raises(SystemExit, match=r"--shape kimi_k25_reduced: ~94 GB of weights per GPU at TP=1.*one H200"):
        refuse_shape_too_large("kimi_k25_reduced", SGLangModelConfig(device="cuda"), h100)
    refuse_shape_too_large("kimi_k25_reduced", SGLangModelConfig(device="cuda"), h200)
    refuse_shape_too_large("kimi_k25_reduced", SGLangModelConfig(device="cuda", tp_size=2), h100)
    refuse_shape_too_large("deepseek_v3_reduced", SGLangModelConfig(device="cuda"), h100)
    refuse_shape_too_large("kimi_k25_reduced", SGLangModelConfig(device="cuda"), None)  # no nvidia-smi: SGLang says


def test_every_throughput_row_is_a_job_config_the_job_accepts(tmp_path):
    """A row's keys go to the job as they stand on the device: a misspelt key or value would fail there, after the
    model's load; the piece rows copy in pieces of their size, the whole row at once, the kernel row by a kernel, the
    others in the default's pieces."""
    for name, row in ROWS.items():
        config = job_config(tmp_path / "model", tmp_path / "data.parquet", tmp_path / "out", *row.overrides)
        pieces = int(name.removeprefix("b2-piece")) if "piece" in name else 0 if name == "b2-whole" else 4
        assert config.extract.copy_piece_mb == pieces, name
        assert config.extract.copy_by == ("kernel" if name == "b2-kernel" else "copy_engine"), name
    assert [name for name in ROWS if "piece" in name or "whole" in name] == ["b2-whole", "b2-piece1", "b2-piece16"]


def test_a_row_that_fails_costs_that_row_only(capsys):
    """A row failing on a path new to the device (the kernel copy's first run there) is recorded with its error and
    the rows after it still run, after the warm extractor went; the tables show the others' numbers and name the
    failure. The rows here are those of an H200 run (benchmarks/results), one of them made to fail."""
    recorded = json.loads((REPO_ROOT / "benchmarks" / "results" / "throughput-2026-12-05-h200-deepseek-pieces.json")
                          .read_text())
    ran, closed = [], []

    def measure_row(name: str) -> dict:
        ran.append(name)
        if name == "b2-kernel":
            raise RuntimeError("CUDA error: an illegal memory access was encountered")
        return recorded["rows"]["b2" if name == "b2" else "b2-piece16"]

    rows = run_rows(["b2", "b2-kernel", "b2-piece16"], measure_row, after_failure=lambda: closed.append(1))
    assert ran == ["b2", "b2-kernel", "b2-piece16"] and closed == [1]
    assert rows["b2-kernel"] == {"failed": "RuntimeError: CUDA error: an illegal memory access was encountered"}
    results = {**{key: value for key, value in recorded.items() if key != "rows"}, "rows": rows}
    results.update(headline(results))
    assert results["job_tokens_per_s"] == recorded["rows"]["b2"]["tokens_per_s"]
    print_table(results)
    table = capsys.readouterr().out
    assert "(b2-kernel) as b2, the host copy by a kernel" in table and "FAILED" in table and "illegal memory" in table
    assert "b2-piece16/a = 0.967" in table
    timed = [line.split()[0] for line in table.split("where the extractor's time goes")[1].splitlines()[2:]
             if line.startswith("  ") and not line.startswith("  the writers")]
    assert "b2-piece16" in timed and "b2-kernel" not in timed


@pytest.mark.extended
def test_soak_benchmark_smoke(tmp_path):
    """The soak on CPU at a small size: the job's driver SIGKILLed halfway, the same command resumed on another
    Ray cluster whose node has another name, a budget of a few shards drained by two consumer processes; every
    sample consumed exactly once and the reference shards' states bit-identical (the benchmark exits 1 if not)."""
    env = python_env()
    env.pop("RAY_ADDRESS", None)
    result = subprocess.run(
        [sys.executable, "-m", "benchmarks.soak", "--shape", "tiny", "--device", "cpu", "--tokens-per-sample", "96",
         "--max-tokens-per-batch", "256", "--target-bytes", "8MB", "--shard-size", "4", "--budget", "3MB",
         "--consumers", "2", "--num-cpus", "4", "--memory-sample-s", "1", "--keep-output",
         "--work-dir", str(tmp_path / "work"),
         "--output-root", str(tmp_path), "--out", str(tmp_path / "results.json")],
        cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=1800,  # three model loads, two Ray heads
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    results = json.loads((tmp_path / "results.json").read_text())
    samples = results["samples"]
    assert samples * 96 * results["state_bytes_per_token"] >= 8_000_000 and results["shards"] == -(-samples // 4)
    first, second = results["phases"]
    assert (first["label"], first["killed"], second["label"], second["exit_code"]) == ("soak-a", True, "soak-b", 0)
    assert results["samples_consumed_once"] == samples and results["samples_never_consumed"] == 0
    assert results["samples_consumed_twice_or_more"] == 0
    reference = results["reference_shards"]
    assert reference[0] == 0 and reference[-1] == results["shards"] - 1 and len(reference) == 4
    assert results["reference_samples_compared"] == results["reference_samples"] == 3 * 4 + (samples - 4 * reference[-1])
    assert results["reference_samples_differing"] == 0
    assert results["consumed_tokens"] == samples * 96
    # sampled every second over the run, never above the budget, and the budget was at work (files came and went)
    assert results["budget_samples"] >= 5 and 0 < results["budget_peak_bytes"] <= 3_000_000
    # the last files may be consumed after the job's last rescan: declared, recorded by the next run
    states = results["shard_states"]
    assert states.get("done/consumed", 0) + results["declarations_not_yet_recorded"] == results["shards"], states
    assert states.get("done/local", 0) == results["declarations_not_yet_recorded"]
    # A shard file a writer renamed into place as the driver died is complete but unrecorded: the resume deletes it
    # and writes the shard again (jobs.rundir.resume.clean_output_dir), so that no row is in two files. Whether the
    # SIGKILL lands in that window is timing (a loaded machine widens it): at most one file per writer.
    assert results["shard_files_removed_by_resume"] <= results["summary"]["writers"]
    assert results["manifest_bytes"] > 0 and results["bare_prefill_tokens_per_s"] > 0
    names = {row["name"] for row in results["memory"]}
    assert {"python -m jobs.extract", "python -m benchmarks.soak_consumer", "ray::ExtractorActor"} <= names, names
    assert (tmp_path / results["output_dir"]).exists() and not list((tmp_path / results["output_dir"]).glob("shard-*"))
