"""The job config: dataclass defaults < YAML file (``--config``) < ``key=value`` overrides.

Each section sits beside the code it configures (``extractor.config``,
``inputs.config``, ``jobs.outdir.config``, ``runtime.display.config``, ``runtime.cluster.config``) and checks
its own keys in ``__post_init__`` (with ``common.checks``):
OmegaConf's structured merge checks every value's type and refuses unknown
keys, then building the dataclasses runs every section's checks. Whatever is
wrong comes out as one ``ConfigError`` line (exit code 2) before anything
starts. ``--help`` prints the tree, with the docstring under each field as its
help text.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import difflib
import inspect
import os
import re
import sys
import textwrap
import typing
from pathlib import Path
from typing import Any, Mapping, Sequence, TypeVar

import yaml
from omegaconf import OmegaConf
from omegaconf.errors import ConfigKeyError, OmegaConfBaseException, ValidationError

from common.checks import is_int
from extractor.config import ExtractConfig, ModelConfig
from inputs.config import DataConfig, DemoConfig
from jobs.outdir.config import OutputConfig
from runtime.cluster.config import RayConfig
from runtime.display.config import ProgressConfig
from runtime.errors import (
    EXIT_BAD_INPUT,
    EXIT_BUDGET_EXHAUSTED,
    EXIT_FAULT,
    EXIT_LOCKED,
    EXIT_NOT_PASSED,
    EXIT_OK,
    EXIT_UPLOADS_FAILED,
    ConfigError,
    exit_codes,
)

T = TypeVar("T")

_OVERRIDE = re.compile(r"[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*=.*", re.DOTALL)
SELECT_PENDING = "pending"
SELECT_FAILED = "failed"


def check_selection(selection: Any) -> None:
    """``shards``: pending, failed, or a non-empty list of shard indices."""
    if selection in (SELECT_PENDING, SELECT_FAILED):
        return
    if isinstance(selection, list) and selection and all(
        is_int(i) and i >= 0 for i in selection
    ):
        return
    raise ValueError(
        f"shards={selection!r}: use `pending` (every shard not done yet: resume), "
        "`failed` (rerun failed shards only) or a list of shard indices like [3,17]"
    )


@dataclasses.dataclass
class JobConfig:
    model: ModelConfig = dataclasses.field(default_factory=ModelConfig)
    data: DataConfig = dataclasses.field(default_factory=DataConfig)
    extract: ExtractConfig = dataclasses.field(default_factory=ExtractConfig)
    output: OutputConfig = dataclasses.field(default_factory=OutputConfig)
    ray: RayConfig = dataclasses.field(default_factory=RayConfig)
    progress: ProgressConfig = dataclasses.field(default_factory=ProgressConfig)
    demo: DemoConfig = dataclasses.field(default_factory=DemoConfig)
    shards: Any = "pending"
    """Which shards to run: pending (resume: every shard not done), failed, or a list like [3,17]."""

    def __post_init__(self) -> None:
        if bool(self.model.path) != bool(self.data.path):
            raise ValueError(
                "set both model.path and data.path for a real run (did you forget --config?), or neither "
                "for the embedded demo"
            )
        check_selection(self.shards)

    @property
    def is_demo(self) -> bool:
        return not self.model.path and not self.data.path


class CommandParser(argparse.ArgumentParser):
    """An argument parser whose mistakes are ``ConfigError``s (exit 2, one line), not argparse's exit."""

    def error(self, message: str) -> None:  # type: ignore[override]
        raise ConfigError(f"{message} ({self.prog} --help lists the options and keys)")


def program_name(module: str) -> str:
    """How the user started this command: a console script (``eagle3-extract``) or ``python -m jobs.extract``."""
    script = Path(sys.argv[0]).name if sys.argv else ""
    return script if script.startswith("eagle3-") else f"python -m {module}"


def build_parser(prog: str, description: str, schema: type) -> argparse.ArgumentParser:
    """``[--config FILE] [key=value ...]`` with every key of ``schema`` and its help in the epilog."""
    parser = CommandParser(
        prog=prog,
        description=description,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="keys (key=value overrides, defaults shown):\n" + describe(schema),
    )
    parser.add_argument("--config", help="YAML file with any of the keys below")
    parser.add_argument("overrides", nargs="*", metavar="key=value")
    return parser


def parse_command(
    module: str, description: str, schema: type[T], argv: Sequence[str], flags: dict[str, str] | None = None,
) -> tuple[T, argparse.Namespace]:
    """A command's ``[--config FILE] [--flag ...] [key=value ...]``: its checked config and its flags
    (``flags``: name -> help of each on/off flag). Raises ConfigError."""
    parser = build_parser(program_name(module), description, schema)
    for flag, help in (flags or {}).items():
        parser.add_argument(flag, action="store_true", help=help)
    args = parser.parse_args(list(argv))
    return build_config(schema, args.config, args.overrides, prog=parser.prog), args


def load_config(argv: Sequence[str]) -> JobConfig:
    """Parse ``[--config FILE] [key=value ...]`` into a checked JobConfig; raises ConfigError."""
    return parse_command(
        "jobs.extract",
        "Extract EAGLE-3 hidden states with SGLang into Parquet shards. " + exit_codes({
            EXIT_OK: "done", EXIT_NOT_PASSED: "shards failed", EXIT_BAD_INPUT: "bad config or input",
            EXIT_BUDGET_EXHAUSTED: "disk budget exhausted", EXIT_FAULT: "fault", EXIT_LOCKED: "output.dir in use",
            EXIT_UPLOADS_FAILED: "shards written but not all uploaded to output.sink",
        }, signals="docs/reference.md: exit codes"),
        JobConfig, argv,
    )[0]


def build_config(schema: type[T], config_file: str | None, overrides: Sequence[str], prog: str) -> T:
    """Defaults of ``schema`` < ``config_file`` < ``overrides``, type-checked, each section checked."""
    merged = OmegaConf.structured(schema)
    try:
        if config_file:
            merged = OmegaConf.merge(merged, _read_config_file(config_file))
        merged = OmegaConf.merge(merged, _parse_overrides([_list_syntax(item, schema) for item in overrides]))
        return OmegaConf.to_object(merged)  # type: ignore[return-value]
    except ConfigError:
        raise
    except OmegaConfBaseException as error:
        raise ConfigError(_explain(error, schema, prog, [item.split("=", 1)[0] for item in overrides])) from None
    except ValueError as error:  # a section's own check
        raise ConfigError(str(error)) from None


def _read_config_file(path: str) -> Any:
    file = Path(path)
    if not file.is_file():
        raise ConfigError(f"--config {path}: no such file")
    try:
        loaded = yaml.safe_load(file.read_text())
    except yaml.YAMLError as error:
        raise ConfigError(f"--config {path}: not valid YAML ({' '.join(str(error).split())})") from None
    if loaded is None:
        return {}
    if not isinstance(loaded, dict):
        raise ConfigError(
            f"--config {path}: must hold a mapping of sections (model:, data:, ...), not {type(loaded).__name__}"
        )
    return OmegaConf.create(loaded)


def _parse_overrides(overrides: Sequence[str]) -> Any:
    bad = [item for item in overrides if not _OVERRIDE.fullmatch(item)]
    if bad:
        raise ConfigError(f"overrides must look like section.key=value (e.g. model.tp_size=8), got {bad[0]!r}")
    for item in overrides:
        try:
            OmegaConf.from_dotlist([item])
        except (OmegaConfBaseException, yaml.YAMLError) as error:
            raise ConfigError(f"cannot parse {item!r} as key=YAML value: {_first_line(error)}") from None
    return OmegaConf.from_dotlist(list(overrides))


def _list_syntax(item: str, schema: type) -> str:
    """A list-typed key given as ``extract.layers=2,15,27`` (or one value, ``extract.layers=5``) means the list:
    written as the YAML list OmegaConf reads, ``[2,15,27]``."""
    key, _, value = item.partition("=")
    if not value.strip() or value.lstrip().startswith("[") or value.strip() in ("null", "~"):
        return item
    return f"{key}=[{value}]" if _is_list_key(schema, key) else item


def _is_list_key(schema: type, key: str) -> bool:
    section, *rest = key.split(".", 1)
    fields = {field.name: field for field in dataclasses.fields(schema)} if dataclasses.is_dataclass(schema) else {}
    if section not in fields:
        return False
    if rest:
        inner = _section_type(fields[section])
        return inner is not None and _is_list_key(inner, rest[0])
    kind = typing.get_type_hints(schema).get(section)
    return any(typing.get_origin(option) is list for option in (kind, *typing.get_args(kind)))


def _explain(error: OmegaConfBaseException, schema: type, prog: str, given: Sequence[str]) -> str:
    refusal = _choice_refusal(error)
    if refusal is not None:
        return refusal
    key = str(getattr(error, "full_key", None) or getattr(error, "key", None) or "")
    if isinstance(error, ConfigKeyError) or "not in" in _first_line(error):
        # OmegaConf names the first unknown part; the user wrote the whole dotted key
        key = next((name for name in given if name == key or name.startswith(key + ".")), key)
        close = difflib.get_close_matches(str(key), config_keys(schema), n=1, cutoff=0.6)
        hint = f"; did you mean {close[0]}?" if close else ""
        return f"unknown key {key}{hint} ({prog} --help lists every key)"
    return f"{key}: {_first_line(error)}" if key else _first_line(error)


@dataclasses.dataclass
class _Text:
    value: str = ""


def _choice_refusal(error: OmegaConfBaseException) -> str | None:
    """A value OmegaConf refused for a key typed with a ``Literal`` alias, in the words of the key's section.

    OmegaConf checks the Literal in the merge, before any section is built; the key's one message is its section's
    own check (``check_choice``, with what the choice means), from the command line, a file or Python alike. So the
    value is taken as a ``str`` key takes it (``true`` -> 'True'; a list or null refused as such a key refuses it)
    and the section is built with it. None: not such a refusal."""
    section, key = getattr(error, "object_type", None), getattr(error, "key", None)
    if not (isinstance(error, ValidationError) and isinstance(section, type) and dataclasses.is_dataclass(section)
            and isinstance(key, str)
            and typing.get_origin(typing.get_type_hints(section).get(key)) is typing.Literal):
        return None
    try:
        text = OmegaConf.merge(OmegaConf.structured(_Text), {"value": getattr(error, "value", None)})
        section(**{key: text.value})
    except OmegaConfBaseException as refused:
        return f"{getattr(error, 'full_key', key)}: {_first_line(refused)}"
    except ValueError as refused:
        return str(refused)
    return None


def _first_line(error: BaseException) -> str:
    text = getattr(error, "msg", None) or str(error)
    return str(text).strip().splitlines()[0] if str(text).strip() else type(error).__name__


def config_keys(schema: type, prefix: str = "") -> list[str]:
    """Every dotted key of a config dataclass tree."""
    keys: list[str] = []
    for field in dataclasses.fields(schema):
        section = _section_type(field)
        keys += config_keys(section, f"{prefix}{field.name}.") if section else [f"{prefix}{field.name}"]
    return keys


def _section_type(field: dataclasses.Field) -> type | None:
    factory = field.default_factory
    if factory is not dataclasses.MISSING and dataclasses.is_dataclass(factory):
        return factory  # type: ignore[return-value]
    return None


# -- paths -------------------------------------------------------------------------------------

def _is_url(path: str) -> bool:
    return "://" in path


def absolute_paths(paths: Mapping[str, str], inside_ray_job: bool,
                   example: str = "output.dir=/mnt/nvme/eagle3/run1") -> dict[str, str]:
    """Each local path of ``paths`` (key -> value) made absolute (``~`` expanded, ``..`` folded); empty values and
    URLs stay as they are.

    Under ``ray job submit`` the driver's working directory is Ray's unpacked copy of
    ``--working-dir`` (``/tmp/ray/session_*/runtime_resources/working_dir_files/_ray_pkg_<hash>``),
    which changes whenever a file in it changes: a relative path there would put the
    output somewhere new on every submit, so it is refused; the message shows ``example``.
    """
    relative = [f"{key}={value}" for key, value in paths.items() if value and not _is_url(value)
                and not Path(value).expanduser().is_absolute()]
    if relative and inside_ray_job:
        raise ConfigError(
            f"{', '.join(relative)}: relative paths under `ray job submit` resolve inside Ray's copy of "
            f"the working dir ({os.getcwd()}), which changes on every submit; pass absolute paths "
            f"(e.g. {example})"
        )
    return {key: value if not value or _is_url(value) else os.path.abspath(Path(value).expanduser())
            for key, value in paths.items()}


def resolve_paths(config: JobConfig, inside_ray_job: bool) -> JobConfig:
    """Every local path made absolute, once, here on the driver (see ``absolute_paths``)."""
    keys = {"model.path": config.model.path, "data.path": config.data.path, "output.dir": config.output.dir,
            "output.node_dir": config.output.node_dir, "output.sink": config.output.sink}
    if config.is_demo:
        keys["demo.dir"] = config.demo.dir
    paths = absolute_paths(keys, inside_ray_job)
    return dataclasses.replace(
        config,
        model=dataclasses.replace(config.model, path=paths["model.path"]),
        data=dataclasses.replace(config.data, path=paths["data.path"]),
        output=dataclasses.replace(config.output, dir=paths["output.dir"], node_dir=paths["output.node_dir"],
                                   sink=paths["output.sink"]),
        demo=dataclasses.replace(config.demo, dir=paths["demo.dir"]) if config.is_demo else config.demo,
    )


# -- help --------------------------------------------------------------------------------------

def to_yaml(config: Any) -> str:
    return OmegaConf.to_yaml(OmegaConf.structured(config))


def _field_docs(cls: type) -> dict[str, str]:
    """Docstrings written under dataclass fields (the convention used in this repo), a section's own and those of
    the sections it extends (``extractor.config.SGLangModelConfig``)."""
    docs: dict[str, str] = {}
    for klass in reversed(cls.__mro__):
        if dataclasses.is_dataclass(klass):
            docs.update(_own_field_docs(klass))
    return docs


def _own_field_docs(cls: type) -> dict[str, str]:
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


@dataclasses.dataclass(frozen=True)
class KeyDoc:
    """One key of a config tree: its dotted name, its default and the docstring under its field."""

    key: str
    default: Any
    doc: str


def key_docs(cls: type, prefix: str = "") -> list[KeyDoc]:
    """Every key of a config dataclass tree, in field order, with its default and docstring."""
    found: list[KeyDoc] = []
    docs = _field_docs(cls)
    for field in dataclasses.fields(cls):
        key = f"{prefix}{field.name}"
        section = _section_type(field)
        if section is not None:
            found += key_docs(section, prefix=key + ".")
            continue
        if field.default is not dataclasses.MISSING:
            default: Any = field.default
        elif field.default_factory is not dataclasses.MISSING:
            default = field.default_factory()
        else:
            default = None
        found.append(KeyDoc(key, default, docs.get(field.name, "")))
    return found


def describe(cls: type, prefix: str = "") -> str:
    """One line per key: ``section.key = default  # doc``."""
    return "\n".join(
        f"  {item.key} = {item.default!r}" + (f"  # {item.doc}" if item.doc else "") for item in key_docs(cls, prefix)
    )
