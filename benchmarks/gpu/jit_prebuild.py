"""SGLang's tvm-ffi JIT kernels compiled here, for a GPU elsewhere, into the JIT cache tarball a GPU node unpacks.

A fresh GPU machine compiles each of SGLang's tvm-ffi kernels at its first use, on one core, while the engine
waits: `gptq_marlin` (the dense W4A16 Marlin GEMM of the INT4 target) held the H200's first INT4 extraction for
5-8 minutes of device time. Compiling needs nvcc, not a GPU. Run with the node's SGLang release and a CUDA toolkit
of the node's major version, this builds the kernels for the node's architecture under the directory name the
node's SGLang looks for (kernel, source hash, arch, tvm-ffi version; SGLang loads a prebuilt ``.so`` found there
without compiling) and adds them to the tarball ``node.sh install`` unpacks into ``$HOME``:

    ~/.venvs/eagle3-extract-sglang-0.5.17/bin/python -m benchmarks.gpu.jit_prebuild \\
        --arch 9.0 --kernels gptq_marlin_bf16 --into .offline/jit/jit-cache-h200.tar.gz

then ``python -m benchmarks.gpu.stage pack ...`` again (docs/benchmarks.md).
"""

from __future__ import annotations

import argparse
import importlib
import importlib.metadata
import os
import re
import struct
import subprocess
import sys
import tarfile
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Sequence

SGLANG_RELEASE = "0.5.17"
"""The release whose builders ``KERNELS`` names and whose JIT cache layout this writes (0.5.23 keeps its builds
elsewhere, ``~/.cache/sglang/jit``, under other names): the one the GPU node's lock pins."""
GPU_LOCK = Path(__file__).resolve().parents[2] / "requirements" / "gpu-lock.txt"
"""What the node installs: its tvm-ffi release names the directories its SGLang looks in."""
CACHE_PREFIX = ".cache/tvm-ffi"
"""Where tvm-ffi keeps its builds under $HOME (its default ``~/.cache/tvm-ffi``), as in the tarball."""
LEFT_OUT = re.compile(r"(\.o|\.o\.d|\.ninja_deps|\.ninja_log)$")
"""Build by-products a loading node never reads: only the ``.so`` is loaded, the sources kept beside it."""


@dataclass(frozen=True)
class Kernel:
    """How SGLang builds one JIT module: its module-level builder and the builder's arguments (a string names a
    torch dtype)."""

    module: str
    builder: str
    args: tuple = ()

    def build(self) -> None:
        import torch

        maker = getattr(importlib.import_module(self.module), self.builder)
        maker(*(getattr(torch, arg) if isinstance(arg, str) else arg for arg in self.args))


KERNELS = {
    "gptq_marlin_bf16": Kernel("sglang.kernels.ops.quantization.gptq_marlin", "_jit_gptq_marlin_module", ("bfloat16",)),
    "gptq_marlin_repack": Kernel(
        "sglang.kernels.ops.quantization.gptq_marlin_repack", "_jit_gptq_marlin_repack_module"
    ),
    "moe_wna16_marlin_bf16": Kernel(
        "sglang.kernels.ops.moe.moe_wna16_marlin", "_jit_moe_wna16_marlin_module", ("bfloat16", False, False)
    ),
}
"""SGLang 0.5.17's builders of the kernels its compressed-tensors W4A16 paths compile: the dense GEMM, the weights'
repacking at load, the MoE GEMM (Kimi-K2.5's INT4 experts)."""


def locked_version(package: str) -> str:
    """``package``'s version in the node's lock (``requirements/gpu-lock.txt``)."""
    for line in GPU_LOCK.read_text().splitlines():
        name, _, version = line.partition("==")
        if name.strip().lower() == package:
            return version.split(";")[0].split()[0]
    raise SystemExit(f"jit_prebuild: {GPU_LOCK} pins no {package}")


def nvcc_release(cuda_home: Path) -> str:
    """The release of ``cuda_home/bin/nvcc`` ("13.0"), which also decides the libcudart the kernels link."""
    nvcc = cuda_home / "bin" / "nvcc"
    if not nvcc.is_file():
        raise SystemExit(f"jit_prebuild: no nvcc at {nvcc}; give the CUDA toolkit with --cuda-home")
    found = re.search(r"release (\d+\.\d+)", subprocess.run([str(nvcc), "--version"], capture_output=True,
                                                           text=True, check=True).stdout)
    if found is None:
        raise SystemExit(f"jit_prebuild: `{nvcc} --version` names no release")
    return found.group(1)


def build(names: Sequence[str], arch: tuple[int, int], cuda_home: Path, cache_dir: Path) -> dict[str, float]:
    """Compile the named kernels for ``arch`` into ``cache_dir`` (one directory each); seconds per kernel."""
    os.environ["CUDA_HOME"] = str(cuda_home)  # tvm-ffi's nvcc, and the libcudart it links (CUDA_HOME/lib64)
    os.environ["TVM_FFI_CACHE_DIR"] = str(cache_dir)  # read by SGLang's load_jit at each build
    from sglang.kernels.jit.utils.arch import override_jit_cuda_arch

    seconds = {}
    with override_jit_cuda_arch(*arch):
        for name in names:
            started = time.monotonic()
            KERNELS[name].build()
            seconds[name] = time.monotonic() - started
    return seconds


def add_to_tarball(tarball: Path, cache_dir: Path) -> list[str]:
    """Write ``tarball`` again with every build directory of ``cache_dir`` under ``.cache/tvm-ffi/``, each replacing
    any of the same name, everything else in it kept; the directories added, by name."""
    added = sorted(path.name for path in cache_dir.iterdir() if path.is_dir())
    replaced = {f"{CACHE_PREFIX}/{name}" for name in added}
    partial = tarball.with_name(tarball.name + ".partial")
    try:
        with tarfile.open(partial, "w:gz") as out:
            if tarball.exists():
                with tarfile.open(tarball, "r:gz") as old:
                    for member in old:
                        if _build_directory(member.name) not in replaced:
                            out.addfile(member, old.extractfile(member) if member.isfile() else None)
            for name in added:
                out.add(cache_dir / name, arcname=f"{CACHE_PREFIX}/{name}", filter=_without_by_products)
        os.replace(partial, tarball)
    finally:
        partial.unlink(missing_ok=True)
    return added


FATBIN_MAGIC = 0xBA55ED50
CUBIN = 2
"""A fatbin entry's kind for machine code (1 is PTX, which a driver would compile at load)."""


def cubin_architectures(library: Path) -> list[int]:
    """The SM versions (90 for 9.0) of the machine code in ``library``'s ``.nv_fatbin`` section, one per cubin; PTX
    entries are left out. Read from the ELF section headers and the fatbin's entry headers (no cuobjdump needed)."""
    data = library.read_bytes()
    if data[:4] != b"\x7fELF" or len(data) < 0x40 or data[4] != 2:
        raise ValueError(f"{library} is not a 64-bit ELF library")
    section_offset, = struct.unpack_from("<Q", data, 0x28)
    entry_size, count, names_index = struct.unpack_from("<HHH", data, 0x3A)
    if not section_offset or not count or names_index >= count:  # no section table (or names beyond it): no fatbin
        return []
    try:
        headers = [struct.unpack_from("<IIQQQQ", data, section_offset + index * entry_size) for index in range(count)]
        names_at = headers[names_index][4]
        for name, _, _, _, offset, size in headers:
            if data[names_at + name : data.index(b"\0", names_at + name)] == b".nv_fatbin":
                return _fatbin_cubins(data[offset : offset + size])
    except (struct.error, ValueError) as error:
        raise ValueError(f"{library}: its ELF section table is cut short or malformed ({error})") from error
    return []


def _fatbin_cubins(fatbin: bytes) -> list[int]:
    """Each cubin's SM in a fatbin section: one or more fatbins, each a header and its entries."""
    found, position = [], 0
    while position + 16 <= len(fatbin):
        magic, _, header_size, body_size = struct.unpack_from("<IHHQ", fatbin, position)
        if magic != FATBIN_MAGIC:
            break
        entry, end = position + header_size, position + header_size + body_size
        while entry < end:
            kind, _, entry_header_size, payload_size = struct.unpack_from("<HHIQ", fatbin, entry)
            if kind == CUBIN:
                found.append(struct.unpack_from("<I", fatbin, entry + 28)[0])
            entry += entry_header_size + payload_size
        position = end
    return found


def check_architecture(cache_dir: Path, arch: tuple[int, int]) -> None:
    """Every library built under ``cache_dir`` holds machine code for ``arch``: one without it would fail on the
    node at its first launch, after the engine had loaded (or be compiled there from PTX, if it carried any)."""
    wanted = arch[0] * 10 + arch[1]
    for library in sorted(cache_dir.rglob("*.so")):
        try:
            found = cubin_architectures(library)
        except ValueError as error:
            raise SystemExit(f"jit_prebuild: {error}: not staged") from error
        if wanted not in found:
            raise SystemExit(f"jit_prebuild: {library.name} holds machine code for SM {found or 'none'}, none for the "
                             f"node's {wanted} ({arch[0]}.{arch[1]}): not staged")


def _build_directory(name: str) -> str:
    """``.cache/tvm-ffi/DIR`` of a member inside a build directory (or the member's own name)."""
    return "/".join(name.rstrip("/").split("/")[:3])


def _without_by_products(member: tarfile.TarInfo) -> Optional[tarfile.TarInfo]:
    return None if LEFT_OUT.search(member.name) else member


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--arch", default="9.0", help="the node GPU's compute capability (9.0: H100, H200)")
    parser.add_argument("--kernels", nargs="+", choices=sorted(KERNELS), default=["gptq_marlin_bf16"])
    parser.add_argument("--into", type=Path, required=True,
                        help="the JIT cache tarball to add them to (made if missing)")
    parser.add_argument("--cuda-home", type=Path, default=Path(os.environ.get("CUDA_HOME", "/usr/local/cuda")))
    parser.add_argument("--cuda", default="13.0", help="the node's CUDA release (its torch's: cu130 is 13.0)")
    args = parser.parse_args(argv)
    if locked_version("sglang") != SGLANG_RELEASE:
        raise SystemExit(f"jit_prebuild: {GPU_LOCK} pins SGLang {locked_version('sglang')}; the kernels' builders "
                         f"here are {SGLANG_RELEASE}'s: check them against that release's first")
    installed = importlib.metadata.version("sglang")
    if installed != SGLANG_RELEASE:
        raise SystemExit(f"jit_prebuild: this Python has SGLang {installed}; the node runs {SGLANG_RELEASE}, whose "
                         f"JIT cache this builds: run it with that release's Python "
                         f"(~/.venvs/eagle3-extract-sglang-{SGLANG_RELEASE}/bin/python, `bash scripts/setup.sh "
                         f"sglang-{SGLANG_RELEASE}`)")
    tvm_ffi, node_tvm_ffi = importlib.metadata.version("apache-tvm-ffi"), locked_version("apache-tvm-ffi")
    if tvm_ffi != node_tvm_ffi:
        raise SystemExit(f"jit_prebuild: this Python has tvm-ffi {tvm_ffi}, the node {node_tvm_ffi} ({GPU_LOCK}): the "
                         "node's SGLang would look for the kernels under another directory and compile them again")
    major, _, minor = args.arch.partition(".")
    release = nvcc_release(args.cuda_home)
    if release.split(".")[0] != args.cuda.split(".")[0]:
        raise SystemExit(f"jit_prebuild: nvcc {release} at {args.cuda_home} links libcudart of another major "
                         f"release than the node's {args.cuda}; give a CUDA {args.cuda} toolkit with --cuda-home")
    with tempfile.TemporaryDirectory(prefix="jit-prebuild-") as cache_dir:
        seconds = build(args.kernels, (int(major), int(minor or 0)), args.cuda_home, Path(cache_dir))
        if not any(Path(cache_dir).iterdir()):
            raise SystemExit(f"jit_prebuild: SGLang built nothing under {cache_dir}: its JIT cache is elsewhere")
        check_architecture(Path(cache_dir), (int(major), int(minor or 0)))
        added = add_to_tarball(args.into, Path(cache_dir))
    for name, took in seconds.items():
        print(f"jit_prebuild: {name} built in {took:.0f} s (nvcc {release}, sm {args.arch})")
    for name in added:
        print(f"jit_prebuild: {args.into} now holds {CACHE_PREFIX}/{name}")
    print(f"jit_prebuild: {args.into}: {args.into.stat().st_size / 1e6:.1f} MB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
