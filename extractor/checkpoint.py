"""What the driver needs to know about a checkpoint, read from its config.json alone, and where it is:
``model.path`` is a directory, or a Hugging Face hub id found in the local Hugging Face cache."""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path
from typing import Any

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
    config_file = Path(model_path) / "config.json"
    if not config_file.is_file():
        raise ValueError(f"model.path={model_path}: no config.json there; point it at a local HF checkpoint")
    return json.loads(config_file.read_text())


def text_config(config: dict[str, Any]) -> dict[str, Any]:
    """The language model's config: multimodal checkpoints (Kimi-K2.5) nest it under ``text_config``."""
    return config.get("text_config", config)


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
