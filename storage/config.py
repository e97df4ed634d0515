"""The ``output`` section of the job config."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass
class OutputConfig:
    dir: str = ""
    """Where shard files and the run summary go (local NVMe). Empty: <demo.dir>/hidden_states for the demo."""
    num_writers: int = 0
    """CPU writer actors; 0 follows the CPUs Ray has left after the extractor (at most 8)."""
    max_inflight_batches: int = 4
    """Batches between extraction and a finished write; bounds the memory held by states in flight."""
