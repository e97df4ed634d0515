"""Before Ray starts: which layers would the installed SGLang capture? Asked once, then cached.

``extractor.capture_probe`` answers in a child process (the target and drafters
built on the meta device: no weight is read), so that SGLang's import (12-15 s of
one core) and its warnings stay out of the command, which prints only its own
answer. An answer depends only on the SGLang release, the target's config.json,
the question (ids and dtype, or the drafter configs) and the extractor's code, so
it is kept under that key in a small cache (``~/.cache/eagle3-extract/capture``,
or ``$EAGLE3_CACHE_DIR/capture``): the job, its dry run (``jobs.plan``) and
``jobs.check_drafter`` ask the same question once per model, release and ids.
A cached answer is the probe's own, so it refuses exactly what SGLang would.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import logging
import os
import subprocess
import sys
from pathlib import Path
from typing import Any, Optional

from common.pythonpath import checkout_first
from runtime.errors import ConfigError
from storage.atomic import replace_atomically

logger = logging.getLogger(__name__)

PROBE_TIMEOUT_S = 600.0
ROOT = Path(__file__).resolve().parents[2]
EXTRACTOR = ROOT / "extractor"
"""Its code is part of every key: an answer is only as true as the code that asked."""


class ProbeFailed(RuntimeError):
    """SGLang could not be asked here (not installed, or the probe itself failed)."""


def check_capture(model_path: str, layer_ids: list[int], dtype: str) -> None:
    """ConfigError (exit 2) naming extract.layers when SGLang would refuse them. A probe that cannot run here
    is only logged: the extractor makes the same check when it starts."""
    try:
        answer = capture_plan(model_path, layer_ids, dtype)
    except ProbeFailed as error:
        logger.warning("could not ask SGLang about the layers before starting (%s); the extractor checks them "
                       "when it starts", error)
        return
    if "refused" in answer:
        raise ConfigError(f"extract.layers={layer_ids}: {answer['refused']}")


def capture_plan(model_path: str, layer_ids: list[int], dtype: str) -> dict[str, Any]:
    """``extractor.capture_probe``'s answer for the job's layers: ``refused``, or the layers SGLang captures,
    the drafter ids, and what SGLang makes of the drafter config the job writes. Raises ProbeFailed."""
    return _cached(model_path, {"plan": {"layer_ids": list(layer_ids), "dtype": dtype}})


def drafter_captures(model_path: str, drafter_configs: list[dict[str, Any]]) -> dict[str, Any]:
    """What SGLang would capture from the target with each drafter config (``target``, ``captures``).
    Raises ProbeFailed."""
    return _cached(model_path, {"drafters": drafter_configs})


def _cached(model_path: str, question: dict[str, Any]) -> dict[str, Any]:
    try:
        version = importlib.metadata.version("sglang")
    except importlib.metadata.PackageNotFoundError:
        raise ProbeFailed("SGLang is not installed here") from None
    key = hashlib.sha256(json.dumps([version, _code_digest(), question], sort_keys=True).encode())
    key.update((Path(model_path) / "config.json").read_bytes())
    cache = Path(os.environ.get("EAGLE3_CACHE_DIR") or Path.home() / ".cache" / "eagle3-extract") / "capture"
    entry = cache / f"{key.hexdigest()[:32]}.json"
    if entry.exists():
        return json.loads(entry.read_text())
    answer = _probe(model_path, question)
    cache.mkdir(parents=True, exist_ok=True)
    replace_atomically(entry, json.dumps(answer), temp_suffix=f".{os.getpid()}.tmp")
    return answer


def _code_digest() -> str:
    digest = hashlib.sha256()
    for path in sorted(EXTRACTOR.rglob("*.py")):
        digest.update(path.read_bytes())
    return digest.hexdigest()


def _probe(model_path: str, question: dict[str, Any]) -> dict[str, Any]:
    command = [sys.executable, "-m", "extractor.capture_probe", model_path]
    env = {**os.environ, "PYTHONPATH": checkout_first(ROOT)}
    try:
        result = subprocess.run(command, input=json.dumps(question), capture_output=True, text=True,
                                timeout=PROBE_TIMEOUT_S, env=env)
    except (subprocess.TimeoutExpired, OSError) as error:
        raise ProbeFailed(str(error)) from None
    try:
        return json.loads(result.stdout.strip().splitlines()[-1])
    except (ValueError, IndexError):
        said = _last_line(result.stderr) or f"exit {result.returncode}"
        raise ProbeFailed(f"SGLang's probe failed: {said}") from None


def _last_line(text: str) -> Optional[str]:
    lines = [line for line in text.splitlines() if line.strip()]
    return lines[-1].strip() if lines else None
