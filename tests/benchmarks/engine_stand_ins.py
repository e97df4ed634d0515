"""Serving engines' timelines without a GPU, for the acceptance benchmark's start order (importable by a spawned
process: nothing heavy here)."""

from __future__ import annotations

import json
import time
from typing import Any


def engine_taking_its_memory_after_a_second(spec: Any, ready: Any) -> None:
    started = time.time()
    time.sleep(1.0)  # SGLang's load and KV-pool allocation
    ready.set()
    holds = time.time()
    time.sleep(0.5)  # serving
    spec.out.write_text(json.dumps({"started": started, "holds": holds, "ended": time.time(), "prompts": []}))


def engine_failing_to_start(spec: Any, ready: Any) -> None:
    raise SystemExit(3)
