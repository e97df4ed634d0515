"""What the driver needs to know about a checkpoint, read from its config.json alone, and where it is:
``model.path`` is a directory, or a Hugging Face hub id found in the local Hugging Face cache."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import re
from pathlib import Path
from typing import Any

WEIGHT_FILES = ("*.safetensors", "*.bin", "*.pt", "*.pth")
IDENTITY_HEAD_BYTES = 1 << 20
"""Read whole from the start of every weight file (a safetensors header, if longer, whole too)."""
IDENTITY_BLOCKS = 32
IDENTITY_BLOCK_BYTES = 64 * 1024
"""Blocks read from the rest of every weight file, evenly spread: 2 MiB per file whatever its size."""
HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")
"""``org/name``: what model.path is when no such directory exists (as SGLang and transformers read it)."""


@dataclasses.dataclass(frozen=True)
class CheckpointInfo:
    architecture: str
    """The class that serves the checkpoint, e.g. KimiK25ForConditionalGeneration."""
    language_model_architecture: str
    """The language model's class: ``text_config.architectures[0]`` in a multimodal checkpoint
    (DeepseekV3ForCausalLM in Kimi-K2.5), else the same as ``architecture``."""
    num_layers: int
    hidden_size: int
    vocab_size: int
    max_position_embeddings: int


def local_checkpoint(model_path: str) -> str:
    """``model_path`` itself when it exists or is no hub id; else the hub id's snapshot in the local Hugging Face
    cache (``HF_HUB_CACHE``; revision ``main``), found offline: nothing is downloaded."""
    if Path(model_path).expanduser().exists() or not HUB_ID.fullmatch(model_path):
        return model_path
    from huggingface_hub import constants, snapshot_download
    from huggingface_hub.errors import HFValidationError, LocalEntryNotFoundError

    try:
        return snapshot_download(model_path, local_files_only=True)
    except (LocalEntryNotFoundError, HFValidationError):
        raise ValueError(
            f"model.path={model_path}: no such directory, and not in the local Hugging Face cache "
            f"({constants.HF_HUB_CACHE}). Download it first (hf download {model_path}), or name the checkpoint's "
            "directory"
        ) from None


def read_config(model_path: str) -> dict[str, Any]:
    return json.loads(read_config_bytes(model_path))


def text_config(config: dict[str, Any]) -> dict[str, Any]:
    """The language model's config: multimodal checkpoints (Kimi-K2.5) nest it under ``text_config``."""
    return config.get("text_config", config)


def checkpoint_identity(model_path: str) -> str:
    """What the checkpoint at ``model_path`` is, not where it is: a digest of its config.json and, per weight file
    (by name), its size, its first MiB (a safetensors header whole: every tensor's name, dtype, shape and offset)
    and 32 blocks of 64 KiB spread over the rest. Weights replaced in place get another identity (new weights
    differ all through a file) for ~2 MiB read per file, not the weights (600 GB); a copy of the same checkpoint
    elsewhere keeps it. ``<digest> (<n> weight files, <bytes> B)``."""
    directory = Path(model_path)
    digest = hashlib.blake2b(read_config_bytes(model_path), digest_size=16)
    files = sorted({path for pattern in WEIGHT_FILES for path in directory.glob(pattern) if path.is_file()})
    total = 0
    for path in files:
        size = path.stat().st_size
        total += size
        digest.update(f"\0{path.name}\0{size}\0".encode())
        with open(path, "rb") as weights:
            head = weights.read(IDENTITY_HEAD_BYTES)
            if path.suffix == ".safetensors" and len(head) >= 8:
                head += weights.read(max(0, 8 + int.from_bytes(head[:8], "little") - len(head)))
            digest.update(head)
            rest = size - len(head)
            for block in range(IDENTITY_BLOCKS if rest > 0 else 0):
                weights.seek(len(head) + max(0, rest - IDENTITY_BLOCK_BYTES) * block // (IDENTITY_BLOCKS - 1))
                digest.update(weights.read(IDENTITY_BLOCK_BYTES))
    return f"blake2b:{digest.hexdigest()} ({len(files)} weight files, {total} B)"


def read_config_bytes(model_path: str) -> bytes:
    config_file = Path(model_path) / "config.json"
    if not config_file.is_file():
        raise ValueError(f"model.path={model_path}: no config.json there; point it at a local HF checkpoint")
    return config_file.read_bytes()


def read_checkpoint_info(model_path: str) -> CheckpointInfo:
    config = read_config(model_path)
    text = text_config(config)
    architecture = (config.get("architectures") or ["unknown"])[0]
    try:
        return CheckpointInfo(
            architecture=architecture,
            language_model_architecture=(text.get("architectures") or [architecture])[0],
            num_layers=int(text["num_hidden_layers"]),
            hidden_size=int(text["hidden_size"]),
            vocab_size=int(text["vocab_size"]),
            max_position_embeddings=int(text.get("max_position_embeddings", 0)) or 1 << 30,
        )
    except KeyError as missing:
        raise ValueError(
            f"{Path(model_path) / 'config.json'}: no {missing} key; is this a decoder-only LM checkpoint?"
        ) from None
