"""The ``output`` section of the job config (checks its own keys when built), and byte sizes as people write them."""

from __future__ import annotations

import dataclasses
import re
from typing import Any, Dict

_UNITS = {
    "": 1, "B": 1,
    "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12, "PB": 10**15,
    "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40, "PIB": 2**50,
}


# Element type of the stored states: the model's own (bit-exact with SGLang), or fp8 with a
# float32 scale per token and layer (half the bytes through the host copy, object store and disk).
STATE_DTYPES = ("model", "float8_e4m3fn")


def parse_bytes(value: str | int, key: str) -> int:
    """``"1.3TB"`` -> 1_300_000_000_000 (decimal units; KiB/MiB/GiB/TiB are binary)."""
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([A-Za-z]*)\s*", str(value))
    unit = match.group(2).upper() if match else None
    if not match or unit not in _UNITS:
        raise ValueError(f"{key}={value!r}: write a size like 500GB, 1.3TB, 64GiB or a byte count")
    return int(float(match.group(1)) * _UNITS[unit])


@dataclasses.dataclass
class OutputConfig:
    dir: str = ""
    """Where shard files and the job's own files (.manifest.json, .summary.json, ...) go (local NVMe). Empty: <demo.dir>/hidden_states for the demo."""
    node_dir: str = ""
    """With extractor groups on several nodes: each node's local directory for its shard files, {node} standing
    for the node's name (its eagle3-node label, else its IP), e.g. /mnt/nvme/run1/{node}. Empty: output.dir on every node."""
    disk_budget: str = "1.3TB"
    """Most bytes of shard files kept under output.dir at once (committed + being written), per node; 500GB, 1.3TB or bytes."""
    min_free_bytes: str = "10GB"
    """Free-space floor on output.dir's filesystem: no batch starts that could push free space below it."""
    budget_wait_s: float = 600.0
    """How long the job waits for disk budget when nothing it does can free any, before it stops (non-zero exit)."""
    rescan_s: float = 10.0
    """How often output.dir is re-scanned for shard files deleted by someone else (a trainer consuming them)."""
    sink: str = ""
    """fsspec URL (s3://bucket/prefix, file:///mnt/big): committed shards are uploaded, verified, then deleted locally."""
    sink_options: Dict[str, Any] = dataclasses.field(default_factory=dict)
    """Keyword arguments for the sink's fsspec filesystem (e.g. client_kwargs for an S3 endpoint)."""
    num_writers: int = 0
    """CPU writer actors per node; 0: half the node's CPUs (8 to 32), at most what is left after the extractor."""
    num_uploaders: int = 2
    """CPU actors uploading committed shards to the sink."""
    max_inflight_batches: int = 0
    """Batches between extraction and a finished write; bounds the states held in memory. 0: writers + 2."""
    state_dtype: str = "model"
    """model (bit-exact with SGLang) | float8_e4m3fn: states quantized on the device with one float32 scale
    per token and layer (amax / 448), half the bytes; readers get the model dtype back, dequantized."""


    def __post_init__(self) -> None:
        if self.disk_budget_bytes <= 0:
            raise ValueError(
                f"output.disk_budget={self.disk_budget!r}: must be more than 0 bytes, or no shard could ever be written"
            )
        parse_bytes(self.min_free_bytes, "output.min_free_bytes")  # raises naming the key
        for key in ("budget_wait_s", "rescan_s"):
            value = getattr(self, key)
            if not isinstance(value, (int, float)) or isinstance(value, bool) or value < 0:
                raise ValueError(f"output.{key}={value!r}: must be a number of seconds >= 0")
        if self.rescan_s == 0:
            raise ValueError("output.rescan_s=0: must be more than 0 seconds (the job re-scans output.dir that often)")
        for key, minimum, meaning in (
            ("num_writers", 0, "0 picks the count from the CPUs Ray has left"),
            ("num_uploaders", 1, "at least one uploader carries shards to the sink"),
            ("max_inflight_batches", 0, "0 picks writers + 2"),
        ):
            value = getattr(self, key)
            if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
                raise ValueError(f"output.{key}={value!r}: must be an integer >= {minimum} ({meaning})")
        if self.state_dtype not in STATE_DTYPES:
            raise ValueError(f"output.state_dtype={self.state_dtype!r}: use one of {', '.join(STATE_DTYPES)}")
        if self.sink_options and not self.sink:
            raise ValueError("output.sink_options is set but output.sink is empty: name the sink URL too")

    @property
    def disk_budget_bytes(self) -> int:
        """``disk_budget`` in bytes."""
        return parse_bytes(self.disk_budget, "output.disk_budget")

    @property
    def free_floor_bytes(self) -> int:
        """``min_free_bytes`` in bytes."""
        return parse_bytes(self.min_free_bytes, "output.min_free_bytes")
