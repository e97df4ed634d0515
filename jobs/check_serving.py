"""Check a serving command against a run: ``python -m jobs.check_serving output.dir=RUN -- SERVING FLAGS``
(or ``eagle3-check-serving``; ``model.serving='...'`` instead of ``-- ...`` works too).

Parses the command the SGLang server runs with, as the job does (``extractor.serving``:
the installed SGLang's own parser), and compares every setting that reaches the
target's forward with what the run recorded in its manifest: one ``DIFF`` line per
setting whose value differs (the states the drafter is fed when served would not be
the states it trained on), ``UNSURE`` where the command leaves a choice to SGLang
on the serving GPU, and the settings it does not compare, with why (ports, keys,
logging, scheduling...). When the command names a drafter
(``--speculative-draft-model-path``) that is on this machine, its layer ids are
checked too, as ``jobs.check_drafter`` checks them. ``model.path=DIR`` points at the
target's checkpoint when it has moved since the run (for SGLang's auto dtype).

Exit codes: 0 the server runs the numerics the run was extracted with, 1 some setting
(or the drafter) differs, 2 bad input (no run, a flag SGLang refuses).
"""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path
from typing import Any, Optional, Sequence

from common.config import RunDir
from extractor.checkpoint import read_config, text_config
from extractor.serving import ServingSettings, classify, parse_serving, refuse_unknown_flags, resolved_dtype
from jobs.cli import console_entry, run_command
from jobs.config import parse_command
from jobs.planning.content import recorded_model_path
from runtime.errors import EXIT_NOT_PASSED, EXIT_OK, ConfigError
from storage.manifest import read_manifest

logger = logging.getLogger("jobs.check_serving")

RECORDED_MODEL_KEYS = ("dtype", "tp_size", "attention_backend", "device", "load_format")
"""``model.*`` keys every run records in its content that a serving command also sets."""
CHOSEN_BY_SGLANG = ("attention_backend", "device")
"""Left unset, SGLang picks these for the hardware it runs on: the check cannot know what a server picked."""


@dataclasses.dataclass
class ServedModel:
    serving: Any = None
    """The serving command (as model.serving takes it); or give its flags after `--`."""
    path: str = ""
    """The target's checkpoint directory, when it has moved since the run (its config.json decides SGLang's auto
    dtype). Empty: the model.path the run recorded."""


@dataclasses.dataclass
class CheckServingConfig:
    """The keys ``jobs.check_serving`` reads; the serving command's flags may follow a ``--`` instead."""

    output: RunDir = dataclasses.field(default_factory=RunDir)
    model: ServedModel = dataclasses.field(default_factory=ServedModel)

    def __post_init__(self) -> None:
        self.output.require()


@dataclasses.dataclass(frozen=True)
class Finding:
    kind: str
    """DIFF (changes the states) | UNSURE (SGLang chooses on the serving machine) | NOTE."""
    text: str


def compare(settings: ServingSettings, content: dict[str, Any], checkpoint_config: dict[str, Any]) -> list[Finding]:
    """What differs between the server's settings and a run's recorded ``content`` (its manifest's block)."""
    findings: list[Finding] = []
    for key in RECORDED_MODEL_KEYS:
        recorded = content.get(f"model.{key}")
        flag = settings.flag(key)
        if key == "dtype":
            served: Any = resolved_dtype(settings, checkpoint_config)
            said = f"{served}" + ("" if key in settings.given else " (no --dtype: SGLang's auto for the checkpoint)")
        elif key in CHOSEN_BY_SGLANG and key not in settings.given:
            findings.append(Finding("UNSURE", (
                f"{flag}: the serving command leaves it to SGLang on the serving machine; the run used {recorded}. "
                f"Add {flag} {recorded} to the server's command to be sure")))
            continue
        else:
            served = settings.value(key)
            said = str(served)
        if served != recorded:
            findings.append(Finding("DIFF", f"{flag}: the server runs {said}, the run used {recorded}"))
    recorded_args = content.get("model.serving") or {}
    served_args = settings.applied
    for field in sorted(set(recorded_args) | set(served_args)):
        if classify(field, {**recorded_args, **served_args})[0] != "applied":
            continue  # recorded by a run under rules that applied it; this SGLang's rules leave it out
        served = served_args.get(field, settings.defaults.get(field))
        recorded = recorded_args.get(field, settings.defaults.get(field))
        if served != recorded:
            findings.append(Finding("DIFF", (
                f"{settings.flag(field)}: the server runs {_said(served, field in served_args)}, the run used "
                f"{_said(recorded, field in recorded_args)}")))
    left_out = [settings.flag(field) for field in settings.given
                if classify(field, settings.given)[0] in ("left out", "extractor")]
    if left_out:
        findings.append(Finding("NOTE", f"not compared (they do not change the states, docs/serving.md says why): "
                                        f"{' '.join(left_out)}"))
    return findings


def _said(value: Any, given: bool) -> str:
    return f"{value}" if given else f"SGLang's default ({value})"


def check(output_dir: Path, serving: Any, model_path: Optional[str] = None) -> tuple[bool, list[str]]:
    """(whether the server matches the run, the report's lines)."""
    content = read_manifest(output_dir)["content"]
    refuse_unknown_flags(serving)  # a misspelt flag in seconds, before SGLang's import
    from extractor.cpu_shims import install_cpu_shims

    install_cpu_shims()  # before the first SGLang import: the drafter check builds models on the meta device
    settings = parse_serving(serving)
    if settings is None:
        raise ConfigError("name the serving command: its flags after `--`, or model.serving='...'")
    target = model_path or recorded_model_path(content)
    if not (Path(target) / "config.json").is_file():
        raise ValueError(f"the run's target {target} has no config.json here; pass model.path=DIR")
    findings = compare(settings, content, text_config(read_config(target)))
    lines = [f"{finding.kind} {finding.text}" for finding in findings]
    ok = not any(finding.kind == "DIFF" for finding in findings)
    drafter_ok, drafter_lines = _check_drafter(settings, output_dir, model_path)
    lines += drafter_lines
    extracted_with = _stored_sglang_version(output_dir)
    if extracted_with not in (None, settings.sglang_version):
        lines.append(f"NOTE the run was extracted with SGLang {extracted_with}, this check parsed the command with "
                     f"SGLang {settings.sglang_version}: the server's release decides what its flags mean")
    if ok and drafter_ok:
        lines.append(f"PASS the server runs the numerics {output_dir} was extracted with "
                     f"(SGLang {settings.sglang_version} parsed the command)")
    elif not ok:
        lines.append(f"FAIL {sum(f.kind == 'DIFF' for f in findings)} settings differ: the states the served "
                     "drafter is fed are not the states it trains on. Extract again with model.serving set to this "
                     "command (in a new output.dir), or serve with the run's settings")
    return ok and drafter_ok, lines


def _stored_sglang_version(output_dir: Path) -> Optional[str]:
    from jobs.check_drafter import read_stored_layers

    try:
        return read_stored_layers(output_dir).sglang_version
    except (ValueError, KeyError):
        return None  # no shard file and no summary left to say


def _check_drafter(settings: ServingSettings, output_dir: Path, model_path: Optional[str]) -> tuple[bool, list[str]]:
    """The drafter the command serves, checked as ``jobs.check_drafter`` checks it, when it is on this machine."""
    drafter = settings.given.get("speculative_draft_model_path")
    if not drafter:
        return True, []
    if not (Path(drafter) / "config.json").is_file():
        return True, [f"NOTE the drafter {drafter} is not on this machine: check it where it is with "
                      f"`python -m jobs.check_drafter {drafter} output.dir={output_dir}`"]
    from jobs.check_drafter import check as check_drafter

    verdict = check_drafter([Path(drafter)], output_dir, model_path)[0]
    return verdict.ok, verdict.lines


def parse_args(argv: Sequence[str]) -> tuple[Path, Any, Optional[str]]:
    argv = list(argv)
    flags = argv[argv.index("--") + 1:] if "--" in argv else []
    keys = argv[:argv.index("--")] if "--" in argv else argv
    config, _ = parse_command("jobs.check_serving", __doc__, CheckServingConfig, keys)
    if flags and config.model.serving:
        raise ConfigError("give the serving command once: after `--` or as model.serving, not both")
    return Path(config.output.dir), flags or config.model.serving, config.model.path or None


def main(argv: Sequence[str]) -> int:
    return run_command(_check_serving, argv)


def _check_serving(argv: Sequence[str]) -> int:
    output_dir, serving, model_path = parse_args(argv)
    ok, lines = check(output_dir, serving, model_path)
    for line in lines:
        print(line)
    return EXIT_OK if ok else EXIT_NOT_PASSED


cli = console_entry(main)


if __name__ == "__main__":
    cli()
