"""``python -m jobs.reference``: rewrites ``docs/reference.md`` from the code: every command's keys and the exit codes.

The keys of each command come from the config dataclasses it parses (``COMMANDS``):
their defaults and the docstring under each field (``jobs.config.key_docs``), the
same text its ``--help`` prints. The exit codes come from ``runtime.errors``: the table
in its docstring, each code matched to the ``EXIT_*`` constants that carry it (a
code without a constant, or a constant missing from the table, is an error here).
``tests/test_docs.py`` fails when the page differs from what this renders.
``--check`` exits 1 instead of writing when it would change the page.
"""

from __future__ import annotations

import dataclasses
import importlib
import json
import re
import signal
import sys
from pathlib import Path
from typing import Any, Sequence

from conversations.config import PrepareConfig
from jobs.check_drafter import CheckDrafterConfig
from jobs.check_serving import CheckServingConfig
from jobs.config import JobConfig, key_docs
from jobs.pipeline import PipelineConfig
from jobs.status import StatusConfig
from jobs.verify import VerifyConfig
from runtime import errors
from training.export import ExportConfig

PAGE = Path(__file__).resolve().parents[1] / "docs" / "reference.md"
REGENERATE = "python -m jobs.reference"


@dataclasses.dataclass(frozen=True)
class Command:
    modules: tuple[str, ...]
    """The commands (``python -m MODULE``) that read exactly these keys."""
    schema: type
    """The config dataclass tree they parse."""


COMMANDS = (
    Command(("jobs.prepare",), PrepareConfig),
    Command(("jobs.pipeline",), PipelineConfig),
    Command(("jobs.extract", "jobs.plan"), JobConfig),
    Command(("jobs.status",), StatusConfig),
    Command(("jobs.verify",), VerifyConfig),
    Command(("jobs.export",), ExportConfig),
    Command(("jobs.check_drafter",), CheckDrafterConfig),
    Command(("jobs.check_serving",), CheckServingConfig),
)

SIGNAL_CODES = {errors.EXIT_SIGNAL_BASE + signum: f"EXIT_SIGNAL_BASE + {signal.Signals(signum).name}"
                for signum in (signal.SIGHUP, signal.SIGINT, signal.SIGTERM)}


def markdown(text: str) -> str:
    """reST literals (````x````) as Markdown's (```x```)."""
    return text.replace("``", "`")


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def _default(value: Any) -> str:
    """A default as it would be written in a ``key=value`` override (YAML)."""
    if isinstance(value, str):
        return f"`{value}`" if value else "`''`"
    return f"`{json.dumps(value)}`"


def _usage(module: str) -> str:
    """The first line of the command module's docstring: how it is typed and what it does."""
    doc = importlib.import_module(module).__doc__ or ""
    return markdown(" ".join(doc.strip().split("\n\n")[0].split()))


def render_keys(command: Command) -> list[str]:
    title = ", ".join(f"`{module}`" for module in command.modules)
    lines = [f"## {title}", ""]
    lines += [f"- {_usage(module)}" for module in command.modules]
    lines += ["", "| key | default | meaning |", "|---|---|---|"]
    lines += [f"| `{item.key}` | {_cell(_default(item.default))} | {_cell(markdown(item.doc))} |"
              for item in key_docs(command.schema)]
    return lines + [""]


def exit_codes() -> list[tuple[str, str, str, str]]:
    """``(code, constants, outcome, what to do)`` per row of ``runtime.errors``' table, checked against its
    constants."""
    constants: dict[int, list[str]] = {}
    for name in dir(errors):
        if name.startswith("EXIT_") and name != "EXIT_SIGNAL_BASE":
            constants.setdefault(getattr(errors, name), []).append(name)
    rows = []
    for line in (errors.__doc__ or "").splitlines():
        cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
        if len(cells) != 3 or not re.fullmatch(r"\d+(, \d+)*", cells[0]):
            continue
        names = []
        for code in map(int, cells[0].split(", ")):
            found = constants.pop(code, None) or ([SIGNAL_CODES[code]] if code in SIGNAL_CODES else None)
            if found is None:
                raise ValueError(f"runtime.errors' table lists exit code {code}, which no EXIT_* constant carries")
            names += found
        rows.append((cells[0], ", ".join(f"`{name}`" for name in names), markdown(cells[1]), markdown(cells[2])))
    if constants:
        missing = ", ".join(f"{name} = {code}" for code, names in sorted(constants.items()) for name in names)
        raise ValueError(f"runtime.errors' docstring table has no row for {missing}")
    return rows


def render_exit_codes() -> list[str]:
    lines = ["## Exit codes", "", markdown(" ".join((errors.__doc__ or "").strip().splitlines()[0].split())), "",
             "| code | constant | outcome | what to do |", "|---|---|---|---|"]
    lines += [f"| {code} | {names} | {outcome} | {action} |" for code, names, outcome, action in exit_codes()]
    return lines + [""]


def render() -> str:
    lines = [
        "# Reference: every key of every command, and the exit codes",
        "",
        f"<!-- Generated from the code by `{REGENERATE}`; do not edit by hand. -->",
        "",
        f"Generated by `{REGENERATE}` from the config dataclasses each command parses (the docstring under each "
        "field; `--help` prints the same) and from `runtime/errors.py`; `tests/test_docs.py` keeps this page in "
        "step. Keys are set as `key=value` on the command line or in the YAML file given with `--config` (every "
        "command but `jobs.check_drafter`, which takes its drafter configs and `key=value` alone): "
        "dataclass defaults < the file < the command line. How the keys work together: "
        "[operations](operations.md).",
        "",
    ]
    for command in COMMANDS:
        lines += render_keys(command)
    lines += render_exit_codes()
    return "\n".join(lines).rstrip("\n") + "\n"


USAGE = f"usage: python -m jobs.reference [--check]\n  rewrites {PAGE.name} from the code; --check: exit 1 if it would change"


def main(argv: Sequence[str]) -> int:
    if argv and argv[0] in ("-h", "--help"):
        print(USAGE)
        return 0
    if any(arg != "--check" for arg in argv):
        print(f"{USAGE}\nerror: unknown arguments {' '.join(a for a in argv if a != '--check')}", file=sys.stderr)
        return 2
    text = render()
    if "--check" in argv:
        current = PAGE.read_text() if PAGE.is_file() else ""
        if current != text:
            print(f"{PAGE} is not what the code says; rewrite it with {REGENERATE}", file=sys.stderr)
            return 1
        return 0
    PAGE.parent.mkdir(exist_ok=True)
    PAGE.write_text(text)
    print(f"wrote {PAGE}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
