"""Shared fixtures: one local Ray cluster on loopback for the session, tiny local checkpoints."""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Iterator

# Before ray is imported anywhere: stay on loopback, no auth token, no usage stats.
os.environ.setdefault("RAY_AUTH_MODE", "disabled")
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
os.environ.setdefault("HF_HUB_OFFLINE", "1")  # no model hub here: HF datasets reads local files only
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

import pytest  # noqa: E402

REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO_ROOT))

from jobs.inputs.demo import build_synthetic_dataset, build_tiny_model  # noqa: E402


@contextlib.contextmanager
def ray_temp_dir(prefix: str) -> Iterator[Path]:
    """A Ray cluster's own temp dir, removed after. Short, directly under /tmp: Ray's socket paths live
    under it and may not exceed 107 bytes, which pytest's temp paths (with a worker's folder under
    xdist) leave too little of."""
    path = Path(tempfile.mkdtemp(prefix=prefix, dir="/tmp"))
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


@pytest.fixture(scope="session")
def ray_cluster():
    import ray

    with ray_temp_dir("ray") as temp_dir:
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


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture(scope="module")
def s3_server():
    """moto's S3 server on loopback, with one bucket."""
    port = free_port()
    process = subprocess.Popen(
        [str(Path(sys.executable).parent / "moto_server"), "-H", "127.0.0.1", "-p", str(port)],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )
    options = {
        "key": "test", "secret": "test",
        "client_kwargs": {"endpoint_url": f"http://127.0.0.1:{port}", "region_name": "us-west-2"},
    }
    import s3fs

    deadline = time.monotonic() + 30
    while True:
        try:
            fs = s3fs.S3FileSystem(**options)
            fs.mkdir("eagle3-test")
            break
        except Exception:
            if time.monotonic() > deadline:
                process.kill()
                raise
            time.sleep(0.3)
    yield options
    process.terminate()
    process.wait(timeout=10)
