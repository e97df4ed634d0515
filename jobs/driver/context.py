"""What one run fixed under output.dir's lock before Ray started, which every step after it reads."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Optional

from jobs.config import JobConfig
from jobs.driver.ending import RunEnd
from jobs.outdir.budget import DiskBudget
from jobs.planning.inputs import RunInputs
from jobs.planning.shards import Shard, shard_ranges
from runtime.display.stages import StageLine


@dataclasses.dataclass(frozen=True)
class RunContext:
    """One run's inputs, its shard plan, its disk budget and its end, handed down from the lock to the loop."""

    inputs: RunInputs
    plan: list[Shard]
    """Every shard of the dataset (index, samples, tokens, batches), whichever this run extracts."""
    budget: DiskBudget
    checked_node: Optional[str]
    """The node whose done files were checked before Ray started (on this host), else None."""
    stages: StageLine
    end: RunEnd

    @property
    def config(self) -> JobConfig:
        return self.inputs.config

    @property
    def output_dir(self) -> Path:
        return self.inputs.output_dir

    @property
    def ranges(self) -> list[tuple[int, int, int]]:
        """(index, start, stop) of every shard: what the manifest records of the plan."""
        return shard_ranges(self.plan)

    @property
    def shard_tokens(self) -> dict[int, int]:
        return {shard.index: shard.tokens for shard in self.plan}
