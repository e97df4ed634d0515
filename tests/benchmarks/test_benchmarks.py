"""The benchmark script runs end to end on CPU (smoke test: no timing is asserted)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks.throughput import benchmark_layer_ids
from extractor.layers import check_layer_ids
from testbeds.shapes import SHAPES
from tests.conftest import REPO_ROOT
from tests.helpers import python_env


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


@pytest.mark.parametrize("shape", sorted(SHAPES))
def test_default_layers_are_valid_for_every_shape(shape):
    """A reduced-depth shape must not ask the job for layers it refuses (4 layers: not [2, 2, 1])."""
    config = SHAPES[shape]
    num_layers = config.get("text_config", config)["num_hidden_layers"]
    layer_ids = benchmark_layer_ids(num_layers)
    assert check_layer_ids(layer_ids, num_layers) == layer_ids
    expected = {"llama8b": [2, 16, 29], "deepseek_v3_reduced": [1, 2], "kimi_k25_reduced": [2, 5, 7]}
    assert layer_ids == expected[shape]
