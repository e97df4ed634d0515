"""The ``progress`` section: how often the driver reports where a run stands."""

from __future__ import annotations

import dataclasses

from common.checks import check_seconds


@dataclasses.dataclass
class ProgressConfig:
    interval_s: float = 10.0
    """How often the driver rewrites the progress in .summary.json (what jobs.status shows) and, when its log is
    not a terminal (e.g. under `ray job submit`, a pipe), logs one progress line (shards, samples, tokens, tok/s,
    ETA, disk against the budget), or, before the first batch, the stage it is in (also at each new stage). On a
    terminal that line is redrawn in place every second (or this often if shorter). Ray metrics are re-set every
    few seconds regardless."""

    def __post_init__(self) -> None:
        check_seconds("progress.interval_s", self.interval_s, positive=True)
