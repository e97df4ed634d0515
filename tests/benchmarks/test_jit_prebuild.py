"""benchmarks/gpu/jit_prebuild.py: SGLang's tvm-ffi kernels compiled by this machine's nvcc for the H200's
architecture, with no GPU here, under the directory name SGLang looks for, loadable, and added to a JIT cache
tarball that keeps what it held."""

from __future__ import annotations

import importlib.metadata
import io
import os
import struct
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

from benchmarks.gpu.jit_prebuild import (
    CACHE_PREFIX,
    SGLANG_RELEASE,
    add_to_tarball,
    check_architecture,
    cubin_architectures,
    locked_version,
    main,
    nvcc_release,
)
from tests.conftest import REPO_ROOT

CUDA_HOME = Path("/usr/local/cuda")


def _tarball(path: Path, files: dict[str, bytes]) -> None:
    with tarfile.open(path, "w:gz") as out:
        for name, data in files.items():
            member = tarfile.TarInfo(name)
            member.size = len(data)
            out.addfile(member, io.BytesIO(data))


def _read(path: Path) -> dict[str, bytes]:
    with tarfile.open(path, "r:gz") as tar:
        return {member.name: tar.extractfile(member).read() for member in tar if member.isfile()}


def test_the_tarball_keeps_what_it_held_and_each_built_directory_replaces_its_namesake(tmp_path):
    tarball = tmp_path / "jit-cache.tar.gz"
    _tarball(tarball, {
        ".triton/cache/K/kernel.cubin": b"triton",
        f"{CACHE_PREFIX}/kept_kernel/kept_kernel.so": b"kept",
        f"{CACHE_PREFIX}/rebuilt/rebuilt.so": b"stale",
        f"{CACHE_PREFIX}/rebuilt/old-only.txt": b"stale",
        f"{CACHE_PREFIX}/rebuilt_longer/rebuilt_longer.so": b"a name that starts like the rebuilt one",
    })
    built = tmp_path / "built"
    for name, data in {"rebuilt/rebuilt.so": b"fresh", "rebuilt/cuda_0.o": b"object", "rebuilt/cuda.cu": b"src",
                       "new/new.so": b"new", "new/.ninja_log": b"log"}.items():
        (built / name).parent.mkdir(parents=True, exist_ok=True)
        (built / name).write_bytes(data)

    assert add_to_tarball(tarball, built) == ["new", "rebuilt"]

    assert _read(tarball) == {
        ".triton/cache/K/kernel.cubin": b"triton",
        f"{CACHE_PREFIX}/kept_kernel/kept_kernel.so": b"kept",
        f"{CACHE_PREFIX}/rebuilt_longer/rebuilt_longer.so": b"a name that starts like the rebuilt one",
        f"{CACHE_PREFIX}/rebuilt/rebuilt.so": b"fresh",
        f"{CACHE_PREFIX}/rebuilt/cuda.cu": b"src",
        f"{CACHE_PREFIX}/new/new.so": b"new",
    }
    assert not list(tmp_path.glob("*.partial"))


def _fatbin(entries: list[tuple[int, int]]) -> bytes:
    """A fatbin as nvcc lays one out: its header, then per entry (kind, SM) a 64-byte header and a payload."""
    body = b"".join(struct.pack("<HHIQ", kind, 0x101, 64, 8) + bytes(12) + struct.pack("<I", sm) + bytes(32)
                    + b"PAYLOAD!" for kind, sm in entries)
    return struct.pack("<IHHQ", 0xBA55ED50, 1, 16, len(body)) + body


def _library(path: Path, fatbins: list[bytes]) -> Path:
    """A shared library (gcc) whose .nv_fatbin section holds ``fatbins``, as a CUDA library's does."""
    data = b"".join(fatbins)
    source = path.with_suffix(".c")
    source.write_text('__attribute__((section(".nv_fatbin"), used)) const unsigned char fatbin[] = {'
                      + ", ".join(map(str, data)) + "};\nint answer(void) { return 42; }\n")
    subprocess.run(["gcc", "-shared", "-fPIC", "-o", str(path), str(source)], check=True)
    return path


@pytest.mark.skipif(subprocess.run(["sh", "-c", "command -v gcc"], capture_output=True).returncode != 0,
                    reason="no gcc to build a library with")
def test_a_library_without_machine_code_for_the_nodes_architecture_is_not_staged(tmp_path):
    """The SMs are read from the library's .nv_fatbin (two fatbins here, PTX left out); a build for another GPU,
    or PTX alone, is refused, naming the library."""
    (tmp_path / "ampere").mkdir()
    (tmp_path / "hopper").mkdir()
    ampere = _library(tmp_path / "ampere" / "kernel.so", [_fatbin([(1, 90), (2, 80)]), _fatbin([(1, 80)])])
    hopper = _library(tmp_path / "hopper" / "kernel.so", [_fatbin([(2, 80)]), _fatbin([(1, 90), (2, 90)])])
    assert cubin_architectures(ampere) == [80] and cubin_architectures(hopper) == [80, 90]
    check_architecture(tmp_path / "hopper", (9, 0))
    with pytest.raises(SystemExit, match=r"kernel.so holds machine code for SM \[80\], none for the node's 90"):
        check_architecture(tmp_path / "ampere", (9, 0))
    (tmp_path / "ptx").mkdir()
    _library(tmp_path / "ptx" / "kernel.so", [_fatbin([(1, 90)])])
    with pytest.raises(SystemExit, match="SM none"):
        check_architecture(tmp_path / "ptx", (9, 0))
    (tmp_path / "broken").mkdir()
    (tmp_path / "broken" / "kernel.so").write_bytes(ampere.read_bytes()[:200])  # a library cut short
    with pytest.raises(SystemExit, match="kernel.so: its ELF section table is cut short"):
        check_architecture(tmp_path / "broken", (9, 0))


ON_THE_NODES_RELEASE = importlib.metadata.version("sglang") == SGLANG_RELEASE


@pytest.mark.skipif(ON_THE_NODES_RELEASE, reason=f"SGLang {SGLANG_RELEASE} here: the next test builds")
def test_another_sglang_release_is_refused_before_anything_is_built(tmp_path):
    with pytest.raises(SystemExit, match=f"the node runs {SGLANG_RELEASE}"):
        main(["--kernels", "gptq_marlin_repack", "--into", str(tmp_path / "jit-cache.tar.gz")])
    assert list(tmp_path.iterdir()) == []


@pytest.mark.skipif(not ON_THE_NODES_RELEASE, reason=f"builds SGLang {SGLANG_RELEASE}'s cache: scripts/test.sh runs it "
                    "on that release")
@pytest.mark.skipif(not (CUDA_HOME / "bin" / "nvcc").is_file(), reason="no CUDA toolkit at /usr/local/cuda")
def test_a_kernel_built_here_for_hopper_is_loaded_by_sglang_from_the_unpacked_tarball_without_compiling(
        tmp_path, monkeypatch):
    """The weights' repacking kernel (10 s to build) stands for the GEMM the docs stage (4-5 minutes): one builder
    path, one cache layout."""
    monkeypatch.delenv("CUDA_HOME", raising=False)  # the build sets both for itself
    monkeypatch.delenv("TVM_FFI_CACHE_DIR", raising=False)
    tarball = tmp_path / "jit-cache.tar.gz"
    release = nvcc_release(CUDA_HOME)
    assert main(["--arch", "9.0", "--kernels", "gptq_marlin_repack", "--into", str(tarball),
                 "--cuda-home", str(CUDA_HOME), "--cuda", release]) == 0

    files = _read(tarball)
    libraries = [name for name in files if name.endswith(".so")]
    assert len(libraries) == 1 and "gptq_marlin_repack" in libraries[0], sorted(files)
    assert f"__arch_9.0a__tvmffi_{locked_version('apache-tvm-ffi')}/" in libraries[0]  # the H200's, the node's tvm-ffi
    assert not [name for name in files if name.endswith(".o")]
    home = tmp_path / "home"
    with tarfile.open(tarball, "r:gz") as tar:
        tar.extractall(home, filter="data")
    elf = subprocess.run(["readelf", "-d", str(home / libraries[0])], capture_output=True, text=True, check=True)
    assert f"libcudart.so.{release.split('.')[0]}" in elf.stdout
    assert set(cubin_architectures(home / libraries[0])) == {90}  # machine code for the H200, not PTX for its driver

    # As a node's fresh process would: SGLang's own builder, for the H200, with the unpacked cache and no toolkit
    # (a compile would fail at once): it finds the library by the name it computes itself and loads it.
    before = sorted(path.relative_to(home) for path in home.rglob("*"))
    loaded = subprocess.run(
        [sys.executable, "-c", "from sglang.kernels.jit.utils.arch import override_jit_cuda_arch\n"
         "from benchmarks.gpu.jit_prebuild import KERNELS\n"
         "with override_jit_cuda_arch(9, 0):\n    KERNELS['gptq_marlin_repack'].build()\n"],
        env={**os.environ, "TVM_FFI_CACHE_DIR": str(home / CACHE_PREFIX), "CUDA_HOME": str(tmp_path / "no-cuda"),
             "PATH": "/usr/bin:/bin"},
        cwd=REPO_ROOT, capture_output=True, text=True, timeout=300)
    assert loaded.returncode == 0, loaded.stderr[-3000:]
    assert sorted(path.relative_to(home) for path in home.rglob("*")) == before
