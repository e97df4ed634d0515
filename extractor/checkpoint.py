"""What the driver needs to know about a checkpoint, read from its config.json alone, and where it is:
``model.path`` is a directory, or a Hugging Face hub id: its snapshot in the local Hugging Face cache, downloaded
there first with ``model.download``."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import re
import socket
from pathlib import Path
from typing import Any, Optional, Sequence

WEIGHT_FILES = ("*.safetensors", "*.bin", "*.pt", "*.pth")
IDENTITY_HEAD_BYTES = 1 << 20
"""Read whole from the start of every weight file (a safetensors header, if longer, whole too)."""
IDENTITY_BLOCKS = 32
IDENTITY_BLOCK_BYTES = 64 * 1024
"""Blocks read from the rest of every weight file, evenly spread: 2 MiB per file whatever its size."""
HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")
"""``org/name``: what model.path is when no such directory exists (as SGLang and transformers read it)."""

HUB_SNAPSHOT = re.compile(r".*/models--(?P<org>[^/]+?)--(?P<name>[^/]+)/snapshots/(?P<commit>[0-9a-f]{40})")
"""A snapshot in a Hugging Face cache, as huggingface_hub lays it out: the repo's folder, then the commit's."""

logger = logging.getLogger(__name__)


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


def local_checkpoint(model_path: str, download: bool = False, files: Optional[Sequence[str]] = None) -> str:
    """``model_path`` itself when it exists or is no hub id; else the hub id's snapshot (revision ``main``) in the
    local Hugging Face cache (``HF_HUB_CACHE``). With ``download``, unless ``HF_HUB_OFFLINE`` is set, huggingface_hub's
    own ``snapshot_download`` first fetches into that cache what it lacks of the hub's ``main`` (``files``: only
    those, e.g. config.json for a dry run); without, nothing is downloaded. ValueError says what to run."""
    if Path(model_path).expanduser().exists() or not HUB_ID.fullmatch(model_path):
        return model_path
    from huggingface_hub import constants, snapshot_download
    from huggingface_hub.errors import HfHubHTTPError, HFValidationError, LocalEntryNotFoundError

    online = download and not constants.HF_HUB_OFFLINE
    try:
        if not online:
            return snapshot_download(model_path, local_files_only=True)
        logger.info("model.path=%s: fetching what the local cache (%s) lacks from %s", model_path,
                    constants.HF_HUB_CACHE, constants.ENDPOINT)
        return snapshot_download(model_path, allow_patterns=list(files) if files else None)
    except (LocalEntryNotFoundError, HFValidationError, HfHubHTTPError, OSError) as error:
        raise ValueError(_not_here(model_path, download, online, error)) from None


def checkpoint_on_this_node(model_path: str, download: bool) -> str:
    """Where the checkpoint the driver found at ``model_path`` is on the node this runs on (an extractor's or a
    generator's). A hub snapshot the driver downloaded into its cache (``.../models--org--name/snapshots/<commit>``)
    that this node lacks is downloaded here, that commit, into this node's Hugging Face cache (``download``: the
    run's model.download; HF_HUB_OFFLINE respected); any other path is left for the loader to find or refuse."""
    found = HUB_SNAPSHOT.fullmatch(model_path)
    if Path(model_path).is_dir() or found is None:
        return model_path
    from huggingface_hub import constants, snapshot_download

    repo_id, commit = f"{found['org']}/{found['name']}", found["commit"]
    if not download or constants.HF_HUB_OFFLINE:
        raise ValueError(
            f"model.path={model_path}: the driver's snapshot of {repo_id} is not on this node ({socket.gethostname()}) "
            f"and {'model.download=false' if not download else 'HF_HUB_OFFLINE is set'}: download it on every node "
            f"(hf download {repo_id} --revision {commit}) or share one Hugging Face cache (HF_HOME) between them"
        )
    logger.info("%s@%s is not on this node: downloading it into %s", repo_id, commit, constants.HF_HUB_CACHE)
    return snapshot_download(repo_id, revision=commit)


def _not_here(model_path: str, download: bool, online: bool, error: Exception) -> str:
    """Why the hub id ``model_path`` has no complete snapshot here, and the command that makes one."""
    from huggingface_hub import constants
    from huggingface_hub.errors import LocalEntryNotFoundError

    where = f"model.path={model_path}: no such directory, and no complete snapshot of it in the local Hugging Face " \
            f"cache ({constants.HF_HUB_CACHE})"
    if not download:
        return f"{where} (nothing is downloaded here). Download it first (hf download {model_path}), or name the " \
               "checkpoint's directory"
    if not online:
        return f"{where}; HF_HUB_OFFLINE is set, so nothing is downloaded. Download it where the hub is reachable " \
               f"(HF_HUB_OFFLINE=0 hf download {model_path}, into this cache), or name the checkpoint's directory"
    # huggingface_hub wraps a connection error in "not in the cache either": the connection error says why
    cause = error.__cause__ if isinstance(error, LocalEntryNotFoundError) and error.__cause__ else error
    said = " ".join(str(cause).split())[:300]
    return (f"{where}, and the download from {constants.ENDPOINT} failed ({type(cause).__name__}: {said}). Check "
            "the id and the network (HF_ENDPOINT; HF_TOKEN for a gated model), or download it where the hub is "
            f"reachable (hf download {model_path} prints where it put it) and name that directory")


def read_config(model_path: str) -> dict[str, Any]:
    return json.loads(read_config_bytes(model_path))


def text_config(config: dict[str, Any]) -> dict[str, Any]:
    """The language model's config: multimodal checkpoints (Kimi-K2.5) nest it under ``text_config``."""
    return config.get("text_config", config)


def architectures(config: dict[str, Any]) -> list[str]:
    """The model classes config.json names: its own, and its language model's in a multimodal checkpoint."""
    return [*(config.get("architectures") or []), *(text_config(config).get("architectures") or [])]


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
