"""Shared fixtures: one local Ray cluster on loopback for the session, tiny local checkpoints."""

from __future__ import annotations

import os
import sys
from pathlib import Path

# Before ray is imported anywhere: stay on loopback, no auth token, no usage stats.
os.environ.setdefault("RAY_AUTH_MODE", "disabled")
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
os.environ.setdefault("HF_HUB_OFFLINE", "1")  # no model hub here: HF datasets reads local files only
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

import pytest  # noqa: E402

REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO_ROOT))

from jobs.demo import build_synthetic_dataset, build_tiny_model  # noqa: E402


@pytest.fixture(scope="session")
def ray_cluster(tmp_path_factory):
    import ray

    temp_dir = tmp_path_factory.mktemp("ray")
    ray.init(
        _node_ip_address="127.0.0.1",
        _temp_dir=str(temp_dir),
        include_dashboard=False,
        num_cpus=3,  # extractor + writers; the machine has 2 cores, Ray's CPUs are logical
        runtime_env={"env_vars": {"PYTHONPATH": str(REPO_ROOT)}},
    )
    yield
    ray.shutdown()


@pytest.fixture(scope="session")
def llama_fp32(tmp_path_factory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("llama") / "model", arch="llama", dtype="float32")


@pytest.fixture(scope="session")
def qwen3_fp32(tmp_path_factory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("qwen3") / "model", arch="qwen3", dtype="float32")


@pytest.fixture(scope="session")
def demo_dataset(tmp_path_factory) -> Path:
    return build_synthetic_dataset(tmp_path_factory.mktemp("data") / "data.parquet", num_samples=20, max_len=96)
