"""``python -m extractor.capture_probe MODEL DTYPE ID[,ID...]``: can SGLang capture these layers? One JSON line.

The driver asks before Ray starts, so that layers the installed SGLang cannot
capture (deepseek_v2 makes no drafter ids capture [0, ...]) are refused in
seconds (exit 2) instead of after the model has loaded on every node. The
answer is ``plan_capture``'s (the target built on the meta device); SGLang's
runtime starts once per process, hence a process of its own.
"""

from __future__ import annotations

import json
import sys
from typing import Sequence


def main(argv: Sequence[str]) -> int:
    from extractor.drafter_check import plan_capture  # imports SGLang

    model_path, dtype, ids = argv
    layer_ids = [int(k) for k in ids.split(",")]
    try:
        plan = plan_capture(model_path, layer_ids, dtype)
    except ValueError as error:
        print(json.dumps({"refused": str(error)}))
        return 0
    print(json.dumps({"layers_to_capture": plan.layers_to_capture, "drafter_layer_ids": plan.drafter_layer_ids}))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
