"""The served drafters: the layer ids each claims, and ``jobs.check_drafter`` on them."""

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


def check_drafters(drafter_dirs: Sequence[Path], run_dir: Path) -> list[dict[str, Any]]:
    """``python -m jobs.check_drafter`` on served drafters against the run their states came from (one
    command for all of them: each start imports SGLang); per drafter, PASS or FAIL and SGLang's reading."""
    result = subprocess.run([sys.executable, "-m", "jobs.check_drafter", *map(str, drafter_dirs),
                             f"output.dir={run_dir}"], capture_output=True, text=True, timeout=600, env=project_env())
    if result.returncode not in (0, 1):
        raise RuntimeError(f"jobs.check_drafter could not check {run_dir} (exit {result.returncode}): "
                           f"{result.stderr.strip()[-2000:]}")
    verdicts = []
    for drafter in drafter_dirs:
        lines = [line for line in result.stdout.splitlines() if line.startswith((f"PASS {drafter}:", f"FAIL {drafter}:"))]
        verdicts.append({"passed": bool(lines) and lines[0].startswith("PASS"), "verdict": lines[0] if lines else ""})
    return verdicts
