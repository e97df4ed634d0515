"""Disk budget for shard files under output.dir: reservations, commits, and the policies that gate a shard.

Before a shard's first batch goes to the extractor the driver reserves the
bytes the whole shard file will take on disk. Committed files + reservations never exceed the
budget; a commit turns the shard's reservation into the file's real size, a
failure releases it, an upload to the sink or a deletion by someone else
frees the file's bytes. Each policy answers one question, and any "no"
holds the shard back.
"""

from __future__ import annotations

import dataclasses
import shutil
from pathlib import Path
from typing import Protocol

from storage.writer import shard_file_name, temp_file_name

# Token ids (4 B), loss mask (1 B) and Parquet page headers, per token, until a committed
# file shows the real figure.
INITIAL_OVERHEAD_PER_TOKEN = 16
# Footer with the schema and metadata, once per shard file.
FILE_OVERHEAD_BYTES = 64 * 1024
# Row-group and column-chunk metadata and page headers a batch adds (a batch is >= 1 row group).
BATCH_OVERHEAD_BYTES = 16 * 1024


def format_bytes(count: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if abs(count) < 1000 or unit == "TB":
            return f"{count:.1f} {unit}" if unit != "B" else f"{int(count)} B"
        count /= 1000
    raise AssertionError("unreachable")


class AdmissionPolicy(Protocol):
    def admits(self, budget: "DiskBudget", nbytes: int) -> bool: ...

    def describe(self, budget: "DiskBudget") -> str: ...


@dataclasses.dataclass
class BudgetPolicy:
    """Committed local files + reservations stay within ``output.disk_budget``."""

    limit: int

    def admits(self, budget: "DiskBudget", nbytes: int) -> bool:
        return budget.used + nbytes <= self.limit

    def describe(self, budget: "DiskBudget") -> str:
        return f"used {format_bytes(budget.used)} of {format_bytes(self.limit)}"


@dataclasses.dataclass
class FreeSpacePolicy:
    """The filesystem keeps at least ``output.min_free_bytes`` free once reserved bytes land."""

    floor: int

    def admits(self, budget: "DiskBudget", nbytes: int) -> bool:
        return budget.free_bytes() - budget.unwritten_reserved() - nbytes >= self.floor

    def describe(self, budget: "DiskBudget") -> str:
        return f"{format_bytes(budget.free_bytes())} free on disk, floor {format_bytes(self.floor)}"


class DiskBudget:
    def __init__(self, output_dir: Path, limit: int, min_free_bytes: int) -> None:
        self.output_dir = output_dir
        self.limit = limit
        self.policies: list[AdmissionPolicy] = [BudgetPolicy(limit), FreeSpacePolicy(min_free_bytes)]
        self.committed: dict[int, int] = {}
        self.reserved: dict[int, int] = {}
        self.overhead_per_token = INITIAL_OVERHEAD_PER_TOKEN
        self.peak = 0
        self.overshoot = 0

    @property
    def used(self) -> int:
        return sum(self.committed.values()) + sum(self.reserved.values())

    def predict(self, tokens: int, state_bytes_per_token: int, batches: int) -> int:
        """Bytes of a shard file holding ``tokens`` tokens written in ``batches`` batches."""
        fixed = FILE_OVERHEAD_BYTES + batches * BATCH_OVERHEAD_BYTES
        return tokens * (state_bytes_per_token + self.overhead_per_token) + fixed

    def blocking_policy(self, nbytes: int) -> AdmissionPolicy | None:
        return next((policy for policy in self.policies if not policy.admits(self, nbytes)), None)

    def reserve(self, shard: int, nbytes: int) -> None:
        self.reserved[shard] = self.reserved.get(shard, 0) + nbytes
        self.peak = max(self.peak, self.used)

    def commit(self, shard: int, file_bytes: int, tokens: int, state_bytes_per_token: int) -> None:
        """The shard's file is published: its real size replaces its reservation."""
        self.reserved.pop(shard, None)
        self.committed[shard] = file_bytes
        self.overshoot = max(self.overshoot, self.used - self.limit)
        # Whatever the file holds beyond its states, spread per token: future predictions cover it.
        measured = -(-(file_bytes - tokens * state_bytes_per_token) // max(1, tokens))
        self.overhead_per_token = max(self.overhead_per_token, measured)
        self.peak = max(self.peak, self.used)

    def release(self, shard: int) -> None:
        self.reserved.pop(shard, None)

    def forget(self, shard: int) -> None:
        """The shard's local file is gone (uploaded to the sink or consumed)."""
        self.committed.pop(shard, None)

    def free_bytes(self) -> int:
        return shutil.disk_usage(self.output_dir).free

    def unwritten_reserved(self) -> int:
        """Reserved bytes not yet on disk: each open shard's temp file already holds part of its reservation.

        One stat per open shard, not a listing of output.dir (10,000 files at the end of a large
        run, listed for every shard opened).
        """
        return sum(max(0, nbytes - self._temp_bytes(shard)) for shard, nbytes in self.reserved.items())

    def _temp_bytes(self, shard: int) -> int:
        try:
            return (self.output_dir / temp_file_name(shard_file_name(shard))).stat().st_size
        except FileNotFoundError:  # not created yet, or renamed into place a moment ago by its writer
            return 0
