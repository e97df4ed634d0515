"""The job config: dataclass defaults < YAML file (``--config``) < ``key=value`` overrides.

Each package owns its section (``extractor.config``, ``storage.config``);
this module composes them and prints the tree for ``--help``, with the
docstring under each field as its help text.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import inspect
import textwrap
from typing import Any, Dict, Sequence

from omegaconf import OmegaConf

from extractor.config import ExtractConfig, ModelConfig, validate_extract_config, validate_model_config
from jobs.dataset import ON_INVALID
from jobs.resume import check_selection
from storage.config import OutputConfig, parse_bytes


@dataclasses.dataclass
class DataConfig:
    path: str = ""
    """Tokenized dataset with input_ids (and optional loss_mask): a .parquet, .jsonl or .arrow file, a directory
    or glob of them, an HF datasets save_to_disk directory, or an fsspec URL (s3://...). Empty: demo data."""
    shard_size: int = 200
    """Samples per shard; one Parquet file per shard."""
    on_invalid: str = "fail"
    """A row that fails the input checks: fail (stop before anything runs, naming file, row and reason) or skip
    (leave it out, listed in summary.json and _invalid_rows.jsonl; the other rows keep their sample ids)."""
    storage_options: Dict[str, Any] = dataclasses.field(default_factory=dict)
    """Keyword arguments for data.path's fsspec filesystem (e.g. client_kwargs for an S3 endpoint)."""

    def __post_init__(self) -> None:
        if self.on_invalid not in ON_INVALID:
            raise ValueError(f"data.on_invalid={self.on_invalid!r}: use {' or '.join(ON_INVALID)}")


@dataclasses.dataclass
class RayConfig:
    address: str = ""
    """Ray cluster to join; empty joins the one `ray job submit` runs under, or starts a local one."""


@dataclasses.dataclass
class DemoConfig:
    dir: str = "eagle3-demo"
    """Where the demo writes its tiny model, dataset and output."""
    arch: str = "llama"
    """Architecture of the tiny random-weight model: llama | qwen3 | deepseek_v3 | kimi_k25 (a DeepSeek-V3 in Kimi-K2.5's wrapper)."""
    num_samples: int = 48
    """Synthetic samples the demo makes (lengths vary from 16 to 256 tokens)."""
    seed: int = 0


@dataclasses.dataclass
class JobConfig:
    model: ModelConfig = dataclasses.field(default_factory=ModelConfig)
    data: DataConfig = dataclasses.field(default_factory=DataConfig)
    extract: ExtractConfig = dataclasses.field(default_factory=ExtractConfig)
    output: OutputConfig = dataclasses.field(default_factory=OutputConfig)
    ray: RayConfig = dataclasses.field(default_factory=RayConfig)
    demo: DemoConfig = dataclasses.field(default_factory=DemoConfig)
    shards: Any = "pending"
    """Which shards to run: pending (resume: every shard not done), failed, or a list like [3,17]."""

    @property
    def is_demo(self) -> bool:
        return not self.model.path and not self.data.path


def load_config(argv: Sequence[str]) -> JobConfig:
    """Parse ``[--config FILE] [key=value ...]`` into a checked JobConfig."""
    parser = argparse.ArgumentParser(
        prog="python -m jobs.extract",
        description="Extract EAGLE-3 hidden states with SGLang into Parquet shards.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="keys (key=value overrides, defaults shown):\n" + describe(JobConfig),
    )
    parser.add_argument("--config", help="YAML file with any of the keys below")
    parser.add_argument("overrides", nargs="*", metavar="key=value")
    args = parser.parse_args(list(argv))
    merged = OmegaConf.structured(JobConfig)
    if args.config:
        merged = OmegaConf.merge(merged, OmegaConf.load(args.config))
    bad = [item for item in args.overrides if "=" not in item]
    if bad:
        parser.error(f"overrides must look like key=value, got {bad}")
    merged = OmegaConf.merge(merged, OmegaConf.from_dotlist(list(args.overrides)))
    config: JobConfig = OmegaConf.to_object(merged)
    if bool(config.model.path) != bool(config.data.path):
        raise ValueError(
            "set both model.path and data.path for a real run, or neither for the embedded demo"
        )
    check_selection(config.shards)
    parse_bytes(config.output.disk_budget, "output.disk_budget")
    parse_bytes(config.output.min_free_bytes, "output.min_free_bytes")
    validate_model_config(config.model)
    validate_extract_config(config.extract)
    return config


def to_yaml(config: JobConfig) -> str:
    return OmegaConf.to_yaml(OmegaConf.structured(config))


def _field_docs(cls: type) -> dict[str, str]:
    """Docstrings written under dataclass fields (the convention used in this repo)."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    body = tree.body[0].body  # type: ignore[attr-defined]
    docs: dict[str, str] = {}
    for node, following in zip(body, body[1:]):
        if (
            isinstance(node, ast.AnnAssign)
            and isinstance(node.target, ast.Name)
            and isinstance(following, ast.Expr)
            and isinstance(following.value, ast.Constant)
            and isinstance(following.value.value, str)
        ):
            docs[node.target.id] = " ".join(following.value.value.split())
    return docs


def describe(cls: type, prefix: str = "") -> str:
    """One line per key: ``section.key = default  # doc``."""
    lines: list[str] = []
    docs = _field_docs(cls)
    for field in dataclasses.fields(cls):
        key = f"{prefix}{field.name}"
        if dataclasses.is_dataclass(field.type) or (
            field.default_factory is not dataclasses.MISSING and dataclasses.is_dataclass(field.default_factory)
        ):
            lines.append(describe(field.default_factory, prefix=key + "."))  # type: ignore[arg-type]
            continue
        default: Any = field.default if field.default is not dataclasses.MISSING else None
        doc = docs.get(field.name, "")
        lines.append(f"  {key} = {default!r}" + (f"  # {doc}" if doc else ""))
    return "\n".join(lines)
