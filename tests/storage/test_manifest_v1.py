"""A run written by the release before (manifest version 1: checksums named ``sha256``, plain hex), made by that
release's own code from this repository's history, read by every command of this one; the first run that opens it
writes it as version 2 and keeps the version-1 files beside it."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from inputs.demo import build_synthetic_dataset, build_tiny_model
from storage.manifest import MANIFEST_FILE, MANIFEST_VERSION, V1_BACKUP_SUFFIX, read_manifest
from tests.conftest import REPO_ROOT
from tests.helpers import python_env, session_ray_address

NUM_SAMPLES = 12
SHARD_SIZE = 4


def release_before(destination: Path) -> Path:
    """The source tree of the last commit whose manifest was version 1 (the parent of the one that made it 2)."""
    found = subprocess.run(["git", "-C", str(REPO_ROOT), "log", "-S", "MANIFEST_VERSION = 2", "--format=%H", "--",
                            "storage/manifest.py"], capture_output=True, text=True)
    commits = found.stdout.split()
    if found.returncode != 0 or not commits:
        pytest.skip(f"no git history here to take the release before from: {found.stderr.strip()[:200]}")
    destination.mkdir()
    archive = subprocess.run(["git", "-C", str(REPO_ROOT), "archive", f"{commits[-1]}^"], capture_output=True,
                             check=True)
    subprocess.run(["tar", "-x", "-C", str(destination)], input=archive.stdout, check=True)
    return destination


def command(source: Path, module: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", module, *args], cwd=source,
                          env=dict(python_env(), PYTHONPATH=str(source)), capture_output=True, text=True, timeout=600)


@pytest.fixture(scope="module")
def v1_run(ray_cluster, tmp_path_factory) -> dict[str, Path]:
    """The run, made by the release before's jobs.extract on this session's Ray cluster (a cluster of its own
    costs a start that times out on a loaded machine)."""
    root = tmp_path_factory.mktemp("v1")
    old = release_before(root / "release-before")
    model = build_tiny_model(root / "model", arch="llama", dtype="bfloat16")
    data = build_synthetic_dataset(root / "data.parquet", num_samples=NUM_SAMPLES, min_len=16, max_len=48, seed=3)
    out = root / "out"
    args = [f"model.path={model}", f"data.path={data}", f"output.dir={out}", "model.engine=synthetic",
            "model.device=cpu", f"data.shard_size={SHARD_SIZE}", "output.num_writers=1",
            f"ray.address={session_ray_address()}"]
    written = command(old, "jobs.extract", *args, "output.min_free_bytes=0")  # that release's name of the key
    assert written.returncode == 0, written.stderr[-3000:]
    stored = json.loads((out / MANIFEST_FILE).read_text())
    assert stored["version"] == 1 and all(len(r["sha256"]) == 64 and "checksum" not in r for r in stored["shards"])
    return {"out": out, "args": [*args, "output.min_free=0"]}


def test_every_command_reads_a_version_1_run_and_the_job_migrates_it(v1_run, tmp_path):
    out, args = v1_run["out"], v1_run["args"]
    before = (out / MANIFEST_FILE).read_bytes()
    records = read_manifest(out)["shards"]
    assert all(r["checksum"].startswith("sha256:") and len(r["checksum"]) == 7 + 64 for r in records)

    status = command(REPO_ROOT, "jobs.status", f"output.dir={out}")
    assert status.returncode == 0, status.stdout + status.stderr[-3000:]
    verified = command(REPO_ROOT, "jobs.verify", f"output.dir={out}", "--deep")
    assert verified.returncode == 0, verified.stdout + verified.stderr[-3000:]
    assert f"OK: {NUM_SAMPLES // SHARD_SIZE} files of {NUM_SAMPLES // SHARD_SIZE} shards: {NUM_SAMPLES} samples" \
        in verified.stdout
    read = subprocess.run([sys.executable, "-c", "import sys; from training.dataset import HiddenStatesDataset; "
                           "print(len(HiddenStatesDataset(sys.argv[1])))", str(out)], cwd=REPO_ROOT, env=python_env(),
                          capture_output=True, text=True, timeout=300)
    assert read.returncode == 0 and read.stdout.split()[-1] == str(NUM_SAMPLES), read.stderr[-3000:]
    exported = command(REPO_ROOT, "jobs.export", f"output.dir={out}", "to=speculators", f"dest={tmp_path / 'dest'}")
    assert exported.returncode == 0, exported.stderr[-3000:]
    assert len(list((tmp_path / "dest").rglob("*.safetensors"))) == NUM_SAMPLES
    assert (out / MANIFEST_FILE).read_bytes() == before, "a reading command wrote the manifest"

    rerun = command(REPO_ROOT, "jobs.extract", *args, "shards=[1]")
    assert rerun.returncode == 0, rerun.stderr[-3000:]
    assert "manifest version 1" in rerun.stderr and MANIFEST_FILE + V1_BACKUP_SUFFIX in rerun.stderr
    stored = json.loads((out / MANIFEST_FILE).read_text())
    assert stored["version"] == MANIFEST_VERSION and all("sha256" not in r for r in stored["shards"])
    assert (out / (MANIFEST_FILE + V1_BACKUP_SUFFIX)).read_bytes() == before
    verified = command(REPO_ROOT, "jobs.verify", f"output.dir={out}", "--deep")
    assert verified.returncode == 0, verified.stdout + verified.stderr[-3000:]
