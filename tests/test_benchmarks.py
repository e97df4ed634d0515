"""The benchmark script runs end to end on CPU (smoke test: no timing is asserted)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from benchmarks.throughput import benchmark_layer_ids
from extractor.layers import check_layer_ids
from testbeds.shapes import SHAPES
from tests.conftest import REPO_ROOT
from tests.helpers import python_env


@pytest.mark.extended
def test_throughput_benchmark_smoke(tmp_path):
    """Every row of the benchmark runs and reports; fp8 states are left out here (tests/test_job.py stores
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
                "writer pool", "(d) pipeline capacity, synthetic states, disk", "writers' CPU s per GB"):
        assert row in result.stdout, row
    results = json.loads((tmp_path / "results.json").read_text())
    assert results["tokens"] == 8 * 96
    assert results["bare_prefill_tokens_per_s"] > 0 and results["job_tokens_per_s"] > 0
    assert results["bytes_per_token"] > 4 * 64 * 2  # 3 aux layers + final state, bf16, hidden 64
    rows = results["rows"]
    assert sorted(rows) == ["b", "d"]
    for name, row in rows.items():
        assert row["tokens"] == 8 * 96, name
        assert set(row["stage_seconds"]) == {"put", "wait", "fetch", "encode", "write", "hash", "sync", "commit"}
    # the synthetic source writes the same layout as the model: same bytes per token
    assert rows["d"]["bytes_per_token"] == pytest.approx(rows["b"]["bytes_per_token"], rel=0.02)
    assert rows["d"]["sglang"] == "none (synthetic states)"


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
