"""The served drafters: the layer ids each claims, ``jobs.check_drafter`` on them, and ``jobs.check_serving`` of
a serving command against a run."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any, Sequence

from benchmarks.acceptance.files import write_json
from benchmarks.acceptance.pipeline import project_env


def served_config(drafter_dir: Path, eagle_config: dict[str, Any]) -> dict[str, Any]:
    """Set the exported drafter's ``eagle_config`` (the layer ids SGLang will capture) to the arm's claim;
    returns the config as written."""
    path = drafter_dir / "config.json"
    config = json.loads(path.read_text())
    config["eagle_config"] = eagle_config
    write_json(config, path)
    return config


def check_drafter_command(drafter_dirs: Sequence[Path], run_dir: Path) -> list[str]:
    """``python -m jobs.check_drafter`` on served drafters against the run their states came from (one command
    for all of them: each start imports SGLang)."""
    return [sys.executable, "-m", "jobs.check_drafter", *map(str, drafter_dirs), f"output.dir={run_dir}"]


def drafter_verdicts(output: str, drafter_dirs: Sequence[Path]) -> list[dict[str, Any]]:
    """Per drafter, PASS or FAIL and SGLang's reading, from ``check_drafter_command``'s output."""
    verdicts = []
    for drafter in drafter_dirs:
        lines = [line for line in output.splitlines() if line.startswith((f"PASS {drafter}:", f"FAIL {drafter}:"))]
        verdicts.append({"passed": bool(lines) and lines[0].startswith("PASS"), "verdict": lines[0] if lines else ""})
    return verdicts


def check_drafters(drafter_dirs: Sequence[Path], run_dir: Path) -> list[dict[str, Any]]:
    """``check_drafter_command`` run here; exit 0 and 1 are verdicts, anything else could not check."""
    result = subprocess.run(check_drafter_command(drafter_dirs, run_dir), capture_output=True, text=True, timeout=600,
                            env=project_env())
    if result.returncode not in (0, 1):
        raise RuntimeError(f"jobs.check_drafter could not check {run_dir} (exit {result.returncode}): "
                           f"{result.stderr.strip()[-2000:]}")
    return drafter_verdicts(result.stdout, drafter_dirs)


def check_serving_command(run_dir: Path, serving: Sequence[str]) -> list[str]:
    """``python -m jobs.check_serving``: does a server running ``serving`` compute the states ``run_dir`` holds?"""
    return [sys.executable, "-m", "jobs.check_serving", f"output.dir={run_dir}", "--", *serving]


CHECK_SERVING_KINDS = ("DIFF", "UNSURE", "NOTE", "PASS", "FAIL")


def serving_verdict(output: str, exit_code: int) -> dict[str, Any]:
    """``check_serving_command``'s verdict: passed (exit 0), and its DIFF / UNSURE / NOTE / PASS / FAIL lines."""
    lines = [line for line in output.splitlines() if line.split(" ", 1)[0] in CHECK_SERVING_KINDS]
    return {"passed": exit_code == 0, "lines": lines,
            "differences": [line.split(":", 1)[0].removeprefix("DIFF ") for line in lines if line.startswith("DIFF ")]}
