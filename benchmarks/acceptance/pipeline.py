"""The pipeline's state: the work directory's layout, and steps recorded under DIR/steps (skipped when
recorded, so a rerun goes on where the last call stopped)."""

from __future__ import annotations

import argparse
import json
import logging
import os
import subprocess
import time
from pathlib import Path
from typing import Any, Callable, Optional

from benchmarks.acceptance.arms import DRAFT_CONFIG_RUN
from benchmarks.acceptance.files import write_json
from benchmarks.acceptance.trainer import Recipe

logger = logging.getLogger("benchmarks.acceptance")

EXIT_MORE_TO_DO = 75
"""--deadline-s stopped before a step: rerun the same command to go on."""


class OutOfTime(Exception):
    """--deadline-s passed before a step could start."""


class Pipeline:
    """One work directory: where each step's output goes, and the records of the steps done."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.work = Path(args.work).expanduser().absolute()
        self.started = time.monotonic()
        self.recipe = Recipe(epochs=args.epochs, batch_size=args.batch_size, learning_rate=args.learning_rate,
                             seed=args.seed, max_steps=args.max_steps)
        (self.work / "steps").mkdir(parents=True, exist_ok=True)

    @property
    def model(self) -> Path:
        return self.work / "model"

    @property
    def train_conversations(self) -> Path:
        return self.work / "prompts" / "train.jsonl"

    @property
    def eval_prompts(self) -> Path:
        return self.work / "prompts" / "eval.jsonl"

    @property
    def data(self) -> Path:
        return self.work / "data"

    def run_dir(self, arm: str) -> Path:
        return self.work / "runs" / arm

    def features(self, arm: str) -> Path:
        return self.work / "features" / arm

    def drafter(self, arm: str) -> Path:
        return self.work / "drafters" / arm

    def draft_config(self, arm: str) -> Path:
        return self.run_dir(DRAFT_CONFIG_RUN[arm]) / ".drafter_config.json"

    def record(self, name: str) -> Optional[dict[str, Any]]:
        path = self.work / "steps" / f"{name}.json"
        return json.loads(path.read_text()) if path.is_file() else None

    def step(self, name: str, action: Callable[[], dict[str, Any]]) -> dict[str, Any]:
        """Run ``action`` unless its record exists; its result (and wall time) become the record."""
        if (done := self.record(name)) is not None:
            return done
        if self.args.deadline_s and time.monotonic() - self.started > self.args.deadline_s:
            raise OutOfTime(name)
        logger.info("step %s", name)
        started = time.perf_counter()
        return self.save(name, action(), time.perf_counter() - started)

    def save(self, name: str, result: dict[str, Any], seconds: float) -> dict[str, Any]:
        """Record a finished step (also those run side by side, whose records are written as each ends)."""
        result = {**result, "seconds": round(seconds, 1)}
        write_json(result, self.work / "steps" / f"{name}.json")
        logger.info("step %s done in %.0f s", name, seconds)
        return result

    def command(self, command: list[str], log_name: str, env: Optional[dict[str, str]] = None) -> str:
        """Run a project command or a peer's tool; its output goes to DIR/logs; a failure names the log."""
        log = self.work / "logs" / f"{log_name}.log"
        log.parent.mkdir(parents=True, exist_ok=True)
        with open(log, "w") as handle:
            result = subprocess.run(command, stdout=handle, stderr=subprocess.STDOUT, text=True,
                                    env=env or project_env())
        if result.returncode != 0:
            raise RuntimeError(f"`{' '.join(command)}` exited {result.returncode}; its output: {log}\n"
                               + log.read_text()[-3000:])
        return log.read_text()


def project_env() -> dict[str, str]:
    """Project commands import from the checkout, whatever the current directory."""
    root = str(Path(__file__).resolve().parents[2])
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
    return env
