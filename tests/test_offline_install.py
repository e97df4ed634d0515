"""The offline install for GPU nodes without a registry (docs/install.md): a wheelhouse installed with
--no-index (scripts/wheelhouse.sh install), carried in folders of a size limit and put together again
(benchmarks/gpu/stage.py), sglang-kernel trimmed to what Hopper loads. Local wheels made here stand in
for the registry's; scripts/wheelhouse.sh build, which downloads, is not run here."""

from __future__ import annotations

import base64
import hashlib
import os
import subprocess
import sys
import zipfile
from pathlib import Path

from tests.conftest import REPO_ROOT
from tests.helpers import python_env

KERNEL = "sglang_kernel-0.4.5-cp310-abi3-manylinux2014_x86_64.whl"
TRIMMED = "sglang_kernel-0.4.5-1hopper-cp310-abi3-manylinux2014_x86_64.whl"
MB = 1000 * 1000


def make_wheel(directory: Path, filename: str, files: dict[str, bytes], purelib: bool = True) -> Path:
    """A wheel pip installs: ``files`` plus the dist-info (METADATA, WHEEL, a true RECORD)."""
    name, version, tags = filename[: -len(".whl")].split("-", 2)
    dist_info = f"{name}-{version}.dist-info"
    files = {**files,
             f"{dist_info}/METADATA": f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n".encode(),
             f"{dist_info}/WHEEL": (f"Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: {str(purelib).lower()}\n"
                                    f"Tag: {tags}\n").encode()}
    record = [f"{path},sha256={_digest(data)},{len(data)}" for path, data in files.items()] + [f"{dist_info}/RECORD,,"]
    path = directory / filename
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as wheel:
        for member, data in files.items():
            wheel.writestr(member, data)
        wheel.writestr(f"{dist_info}/RECORD", "\n".join(record) + "\n")
    return path


def _digest(data: bytes) -> str:
    return base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()


def make_wheelhouse(directory: Path) -> Path:
    """What ``scripts/wheelhouse.sh build`` writes, for this python: wheels, locks/, SHA256SUMS, wheelhouse.txt."""
    (directory / "locks").mkdir(parents=True)
    make_wheel(directory, "tinypkg-1.0-py3-none-any.whl", {"tinypkg/__init__.py": b"VALUE = 42\n"})
    make_wheel(directory, KERNEL, {
        "sgl_kernel/__init__.py": b"",
        "sgl_kernel/flash_ops.abi3.so": os.urandom(3 * MB),  # FA3: Hopper serves without it
        "sgl_kernel/sm100/common_ops.abi3.so": os.urandom(1000),
        "sgl_kernel/sm90/common_ops.abi3.so": os.urandom(1000),
        "sgl_kernel/infllm_ops.cpython-310-x86_64-linux-gnu.so": os.urandom(1000),
        "sgl_kernel/infllm_v2/__init__.py": b"",
    }, purelib=False)
    (directory / "locks" / "gpu.txt").write_text("# a lock\nsglang-kernel==0.4.5\n")
    (directory / "locks" / "acceptance.txt").write_text("tinypkg==1.0\n")
    (directory / "wheelhouse.txt").write_text(
        f"python={sys.version_info[0]}.{sys.version_info[1]}\nplatform=manylinux_2_17_x86_64\nlocks=acceptance gpu\n")
    sums = [f"{hashlib.sha256(p.read_bytes()).hexdigest()}  {p.name}" for p in sorted(directory.glob("*.whl"))]
    (directory / "SHA256SUMS").write_text("\n".join(sums) + "\n")
    return directory


def run(*command: str) -> subprocess.CompletedProcess:
    return subprocess.run(command, cwd=REPO_ROOT, env=python_env(), capture_output=True, text=True, timeout=300)


def wheelhouse_sh(*args: str) -> subprocess.CompletedProcess:
    return run("bash", "scripts/wheelhouse.sh", *args, "--python", sys.executable)


def stage(*args: str) -> subprocess.CompletedProcess:
    return run(sys.executable, "-m", "benchmarks.gpu.stage", *args)


def test_a_wheelhouse_travels_in_small_folders_and_installs_without_an_index(tmp_path):
    wheelhouse = make_wheelhouse(tmp_path / "wheelhouse")
    model = tmp_path / "model.gguf"
    model.write_bytes(os.urandom(5 * MB))  # larger than a folder: travels in parts

    packed = stage("pack", str(tmp_path / "stage"), str(wheelhouse), str(model), "--limit-mb", "2", "--hopper-kernel")
    assert packed.returncode == 0, packed.stderr
    folders = sorted((tmp_path / "stage").iterdir())
    assert len(folders) >= 3 and all(sum(f.stat().st_size for f in folder.iterdir()) <= 2 * MB for folder in folders)
    assert packed.stdout.count("python3 -m benchmarks.gpu.stage receive") == len(folders)

    dest = tmp_path / "node"
    for folder in reversed(folders[1:]):  # any order
        received = stage("receive", str(folder), str(dest))
        assert received.returncode == 0 and "still to receive" in received.stdout, received.stdout + received.stderr
        assert not (dest / "model.gguf").exists()
    received = stage("receive", str(folders[0]), str(dest))
    assert received.returncode == 0 and "complete" in received.stdout, received.stdout + received.stderr
    assert sorted(path.name for path in dest.iterdir()) == ["model.gguf", "wheelhouse"]  # the parts are gone
    assert (dest / "model.gguf").read_bytes() == model.read_bytes()

    # sglang-kernel arrived trimmed, under its build tag, with a true RECORD; SHA256SUMS names it
    arrived = dest / "wheelhouse"
    assert not (arrived / KERNEL).exists() and (arrived / TRIMMED).is_file()
    assert TRIMMED in (arrived / "SHA256SUMS").read_text() and KERNEL not in (arrived / "SHA256SUMS").read_text()
    with zipfile.ZipFile(arrived / TRIMMED) as trimmed:
        names = set(trimmed.namelist())
        record = trimmed.read("sglang_kernel-0.4.5.dist-info/RECORD").decode().splitlines()
        for line in record:
            path, digest, size = line.rsplit(",", 2)
            assert path in names and (not digest or digest == f"sha256={_digest(trimmed.read(path))}"), line
        assert len(record) == len(names)
        assert b"Build: 1hopper" in trimmed.read("sglang_kernel-0.4.5.dist-info/WHEEL")

    site = tmp_path / "site"
    installed = wheelhouse_sh("install", str(arrived), "--target", str(site))
    assert installed.returncode == 0, installed.stderr
    kernel = site / "sgl_kernel"
    assert (kernel / "sm90" / "common_ops.abi3.so").is_file() and (kernel / "infllm_v2").is_dir()
    assert not any((kernel / name).exists() for name in ("flash_ops.abi3.so", "sm100",
                                                         "infllm_ops.cpython-310-x86_64-linux-gnu.so"))
    imported = subprocess.run([sys.executable, "-c", "import tinypkg; print(tinypkg.VALUE)"], capture_output=True,
                              text=True, env=dict(python_env(), PYTHONPATH=str(site)))
    assert imported.stdout.strip() == "42", imported.stderr

    kept = wheelhouse_sh("install", str(arrived), "--target", str(site), "--lock", "acceptance", "--keep-installed")
    assert kept.returncode == 0 and "keeping the installed tinypkg" in kept.stderr and "nothing to install" in kept.stderr


def test_install_refuses_a_damaged_wheelhouse_or_another_python(tmp_path):
    wheelhouse = make_wheelhouse(tmp_path / "wheelhouse")
    wheel = wheelhouse / "tinypkg-1.0-py3-none-any.whl"
    wheel.write_bytes(wheel.read_bytes()[:-10])
    damaged = wheelhouse_sh("install", str(wheelhouse), "--target", str(tmp_path / "site"))
    assert damaged.returncode == 2 and "does not match SHA256SUMS" in damaged.stderr, damaged.stderr

    other = make_wheelhouse(tmp_path / "other")
    (other / "wheelhouse.txt").write_text("python=3.99\nplatform=manylinux_2_17_x86_64\nlocks=gpu\n")
    refused = wheelhouse_sh("install", str(other), "--target", str(tmp_path / "site"))
    assert refused.returncode == 2 and "built for python 3.99" in refused.stderr, refused.stderr
    assert not (tmp_path / "site").exists() or not any((tmp_path / "site").iterdir())

    unknown = wheelhouse_sh("install", str(make_wheelhouse(tmp_path / "third")), "--target", str(tmp_path / "site"),
                            "--lock", "nope")
    assert unknown.returncode == 2 and "has no lock 'nope'" in unknown.stderr
