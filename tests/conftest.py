"""Shared fixtures: one local Ray cluster on loopback for the session, tiny local checkpoints."""

from __future__ import annotations

import contextlib
import hashlib
import os
import re
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
# No workers started ahead of need in the clusters the tests start (their session clusters and the private ones of
# the commands they run: the variable reaches the raylet). Ray prestarts one per logical CPU when the first driver
# connects; those no actor or task takes sit idle, each having imported Ray, polling until the cluster stops.
# Without it a worker starts when an actor or task asks for one.
os.environ.setdefault("RAY_prestart_worker_first_driver", "0")
os.environ.setdefault("HF_HUB_OFFLINE", "1")  # no model hub here: HF datasets reads local files only
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

import pytest  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from inputs.demo import build_synthetic_dataset, build_tiny_model  # noqa: E402
from tests.paths import REPO_ROOT  # noqa: E402


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


LONGEST_FILES = (
    "tests/jobs/test_entry.py",
    "tests/jobs/test_outcomes.py",
    "tests/jobs/test_faults.py",
    "tests/conversations/test_prepare.py",
    "tests/test_readme.py",
    "tests/jobs/test_multinode.py",
    "tests/jobs/test_job.py",
    "tests/benchmarks/test_benchmarks.py",
    "tests/jobs/test_lost_session.py",
    "tests/jobs/test_pipeline.py",
    "tests/jobs/test_budget_resume.py",
    "tests/jobs/test_integrity.py",
    "tests/extractor/test_kimi.py",
    "tests/jobs/test_progress.py",
    "tests/training/test_training_data.py",
    "tests/extractor/test_real_weights.py",
    "tests/jobs/test_nonfinite.py",
    "tests/extractor/test_deepseek.py",
    "tests/extractor/test_serving.py",
    "tests/jobs/test_start_faults.py",
    "tests/benchmarks/test_quantize_int4.py",
)
"""The test files that take longest (a CI run's ``--durations``), longest first."""


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The longest files first, the rest as collected: scripts/test.sh's workers (``--dist loadfile
    --no-loadscope-reorder``) take files in this order, so the short ones come last and both workers end
    together, not one idle while the other runs a long file it took late."""
    rank = {path: position for position, path in enumerate(LONGEST_FILES)}
    items.sort(key=lambda item: rank.get(item.nodeid.split("::")[0], len(LONGEST_FILES)))


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


@pytest.fixture(scope="session")
def finished_run(ray_cluster, llama_fp32, demo_dataset, tmp_path_factory) -> Path:
    """The output.dir of a complete run of ``llama_fp32`` over ``demo_dataset`` in five shards
    (``tests.helpers.FINISHED_RUN``), made once per test process (each xdist worker: its own cluster and model):
    the tests that only read a finished run read it; those that rerun, damage or refuse a run start from a copy
    of it (``tests.helpers.copy_of``). Nothing changes it."""
    from jobs.driver.job import run
    from tests.helpers import FINISHED_RUN, job_config

    out = tmp_path_factory.mktemp("finished-run") / "out"
    summary = run(job_config(llama_fp32, demo_dataset, out, *FINISHED_RUN))
    assert (summary["outcome"], summary["shards_done"]) == ("complete", 5), summary
    return out


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


# -- checkouts and the shared virtualenv (scripts/setup.sh) ------------------------------------------------

def shared_site() -> Path:
    """site-packages of the shared virtualenv with the locked packages (the tests run in it, or in a checkout's
    .venv over it)."""
    import omegaconf

    return Path(omegaconf.__file__).parents[1]


@pytest.fixture
def private_shared_venv(tmp_path) -> Path:
    """A virtualenv at a path of its own with the shared one's packages (their files hard-linked: whatever a
    setup.sh might write there lands in this copy only), stamped as holding this checkout's lock: scripts/setup.sh
    finds it installed and goes on to the checkout's own virtualenv."""
    shared = shared_site().parents[2]
    lock = hashlib.sha256((REPO_ROOT / "requirements" / "cpu-lock.txt").read_bytes()).hexdigest()[:16]
    venv = tmp_path / "shared"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    site = site_of(venv)
    shutil.rmtree(site)
    subprocess.run(["cp", "-al", str(shared_site().resolve()), str(site)], check=True)
    for command in (shared / "bin").iterdir():
        if not (venv / "bin" / command.name).exists():
            (venv / "bin" / command.name).symlink_to(command)
    (venv / f".installed-{lock}").touch()
    return venv


def site_of(venv: Path) -> Path:
    code = "import sysconfig; print(sysconfig.get_paths()['purelib'])"
    return Path(subprocess.run([str(venv / "bin" / "python"), "-c", code], capture_output=True, text=True,
                               check=True).stdout.strip())


def clone_checkout(destination: Path) -> Path:
    """A copy of this checkout's files (tracked and untracked, not ignored), as a second clone would hold them."""
    files = subprocess.run(["git", "ls-files", "-co", "--exclude-standard"], cwd=REPO_ROOT, capture_output=True,
                           text=True, check=True).stdout.split()
    for name in files:
        if (REPO_ROOT / name).is_file():
            (destination / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(REPO_ROOT / name, destination / name)
    return destination


def readme_commands() -> list[str]:
    """Every command of README.md's bash blocks as a user pastes it: continued lines joined, comments dropped."""
    text = (REPO_ROOT / "README.md").read_text()
    commands = []
    for block in re.findall(r"^```bash\n(.*?)^```", text, re.DOTALL | re.MULTILINE):
        for line in re.sub(r"\\\n", " ", block).splitlines():
            command = " ".join(re.sub(r"(^|\s)#.*$", "", line).split())
            if command:
                commands.append(command)
    return commands
