"""``python -m extractor.capture_probe MODEL < QUESTION``: what would SGLang capture? One JSON line.

The question (JSON on stdin) is either ``{"plan": {"layer_ids": [...], "dtype": ...}}``, what the
job's engine will find for its layers (``plan_capture``), or ``{"drafters": [config, ...]}``, what
SGLang captures with each drafter config (``capture_with_drafters``). The driver, ``jobs.plan`` and
``jobs.check_drafter`` ask before anything loads, so that layers the installed SGLang cannot
capture (deepseek_v2 makes no drafter ids capture [0, ...]) are refused in seconds (exit 2)
instead of after the model has loaded on every node. Targets and drafters are built on the meta
device; SGLang's runtime starts once per process, and its import and warnings stay here: hence a
process of its own (``jobs.planning.capture`` keeps the answers).
"""

from __future__ import annotations

import dataclasses
import json
import sys
from typing import Any, Sequence


def answer(model_path: str, question: dict[str, Any]) -> dict[str, Any]:
    from extractor.drafter_check import capture_with_drafters, plan_capture  # imports SGLang

    if "drafters" in question:
        target, captures = capture_with_drafters(model_path, question["drafters"])
        return {"target": dataclasses.asdict(target), "captures": [dataclasses.asdict(c) for c in captures]}
    asked = question["plan"]
    try:
        plan = plan_capture(model_path, asked["layer_ids"], asked["dtype"])
    except ValueError as error:
        return {"refused": str(error)}
    return {
        "sglang_version": plan.target.sglang_version, "architecture": plan.target.architecture,
        "layer_ids": plan.layer_ids, "layers_to_capture": plan.layers_to_capture,
        "drafter_layer_ids": plan.drafter_layer_ids, "served_drafter": dataclasses.asdict(plan.served_drafter),
    }


def main(argv: Sequence[str]) -> int:
    (model_path,) = argv
    print(json.dumps(answer(model_path, json.loads(sys.stdin.read()))))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
