"""Before Ray starts: would the installed SGLang capture the requested layers at all?

``extractor.capture_probe`` answers in a child process (the target on the meta
device: no weight is read). The answer depends only on SGLang's version, the
model's config.json, the ids and the dtype, so it is kept in a small cache
(``~/.cache/eagle3-extract/capture``, or ``$EAGLE3_CACHE_DIR/capture``): a rerun
or a second run on the same model asks nothing. A probe that cannot run here
(no SGLang on the driver's host, say) is only logged: the extractor makes the
same check when it starts.
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
from typing import Optional

from jobs.config import ConfigError
from storage.atomic import replace_atomically

logger = logging.getLogger(__name__)

PROBE_TIMEOUT_S = 600.0


def check_capture(model_path: str, layer_ids: list[int], dtype: str) -> None:
    """ConfigError (exit 2) naming extract.layers when SGLang would refuse them."""
    answer = _cached_answer(model_path, layer_ids, dtype)
    if answer is not None and "refused" in answer:
        raise ConfigError(f"extract.layers={layer_ids}: {answer['refused']}")


def _cached_answer(model_path: str, layer_ids: list[int], dtype: str) -> Optional[dict]:
    try:
        version = importlib.metadata.version("sglang")
    except importlib.metadata.PackageNotFoundError:
        logger.warning("SGLang is not installed here: the extractor checks the layers when it starts")
        return None
    config = (Path(model_path) / "config.json").read_bytes()
    key = hashlib.sha256(json.dumps([version, dtype, layer_ids]).encode() + config).hexdigest()[:32]
    cache = Path(os.environ.get("EAGLE3_CACHE_DIR") or Path.home() / ".cache" / "eagle3-extract") / "capture"
    entry = cache / f"{key}.json"
    if entry.exists():
        return json.loads(entry.read_text())
    answer = _probe(model_path, layer_ids, dtype)
    if answer is not None:
        cache.mkdir(parents=True, exist_ok=True)
        replace_atomically(entry, json.dumps(answer), temp_suffix=f".{os.getpid()}.tmp")
    return answer


def _probe(model_path: str, layer_ids: list[int], dtype: str) -> Optional[dict]:
    command = [sys.executable, "-m", "extractor.capture_probe", model_path, dtype, ",".join(map(str, layer_ids))]
    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(root), os.environ.get("PYTHONPATH")]))}
    try:
        result = subprocess.run(command, capture_output=True, text=True, timeout=PROBE_TIMEOUT_S, env=env)
        return json.loads(result.stdout.strip().splitlines()[-1])
    except (subprocess.TimeoutExpired, ValueError, IndexError, OSError) as error:
        logger.warning("could not ask SGLang about the layers before starting (%s); the extractor checks them "
                       "when it starts", error)
        return None
