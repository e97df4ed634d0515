"""The prepare demo: a tiny chat model (random weights, the demo's chat tokenizer, ``inputs.demo_chat``) and
conversations to render with it."""

from __future__ import annotations

import dataclasses
import json
import logging
from pathlib import Path

from conversations.config import PrepareConfig
from inputs.demo import build_tiny_model
from inputs.demo_chat import CHATML, TEMPLATES, build_chat_tokenizer, demo_conversations

logger = logging.getLogger(__name__)


def build_chat_model(directory: str | Path, family: str = CHATML, seed: int = 0) -> Path:
    """The demo's tiny random Llama with a chat tokenizer of its vocabulary; its config names the tokenizer's
    bos and eos (SGLang stops at config.json's eos too)."""
    directory = Path(directory)
    build_tiny_model(directory, arch="llama", seed=seed)
    build_chat_tokenizer(directory, family)
    spec = TEMPLATES[family]
    vocab = json.loads((directory / "tokenizer.json").read_text())["model"]["vocab"]
    config_path = directory / "config.json"
    config = json.loads(config_path.read_text())
    config.update(bos_token_id=vocab[spec.bos], eos_token_id=vocab[spec.eos])
    config_path.write_text(json.dumps(config, indent=2) + "\n")
    return directory


def write_conversations(path: str | Path, count: int, seed: int = 0) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(row) + "\n" for row in demo_conversations(count, seed)))
    return path


def demo_config(config: PrepareConfig) -> PrepareConfig:
    """The demo's model, conversations and output under demo.dir, built once and reused."""
    directory = Path(config.demo.dir).expanduser().absolute()
    model = directory / f"model-llama-{CHATML}"
    data = directory / f"conversations-{config.demo.num_conversations}.jsonl"
    if not (model / "tokenizer.json").exists():
        logger.info("demo: building a tiny random Llama with a %s chat tokenizer in %s", CHATML, model)
        build_chat_model(model, CHATML)
    if not data.exists():
        write_conversations(data, config.demo.num_conversations)
    return dataclasses.replace(
        config,
        model=dataclasses.replace(config.model, path=str(model)),
        data=dataclasses.replace(config.data, path=str(data)),
        output=dataclasses.replace(config.output, dir=config.output.dir or str(directory / "tokens")),
    )
