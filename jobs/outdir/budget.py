"""Disk budget for everything the job keeps under output.dir: reservations, commits, and the policies that gate a shard.

The job's own files (manifest, summary, lock, ...) take at most a bound fixed before Ray starts
(``jobs.rundir.bookkeeping``): the budget counts it as used from the start, and shard files get the rest.
Before a shard's first batch goes to the extractor the driver reserves the
bytes the whole shard file will take on disk (with the consumption record a consumer may leave beside it, in whole
blocks). Own files + committed files + reservations never exceed the budget; a commit turns the shard's
reservation into the file's real size, a failure releases it, an upload to the sink or a deletion by someone else
frees the file's bytes. Each policy answers one question, and any "no"
holds the shard back.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any, Iterable, Protocol

from common.checks import format_bytes
from jobs.cluster.node_disk import LocalDisk
from jobs.rundir.bookkeeping import OwnFiles, on_disk
from storage.consumed import RECORD_BYTES, record_name

# Token ids (4 B), loss mask (1 B) and Parquet page headers, per token, until a committed
# file shows the real figure.
INITIAL_OVERHEAD_PER_TOKEN = 16
# Footer with the schema and metadata, once per shard file.
FILE_OVERHEAD_BYTES = 64 * 1024
# Row-group and column-chunk metadata and page headers a batch adds (a batch is >= 1 row group).
BATCH_OVERHEAD_BYTES = 16 * 1024


class AdmissionPolicy(Protocol):
    def admits(self, budget: "DiskBudget", nbytes: int) -> bool: ...

    def describe(self, budget: "DiskBudget") -> str: ...


@dataclasses.dataclass
class BudgetPolicy:
    """The job's own files + committed local files + reservations stay within ``output.disk_budget``."""

    limit: int

    def admits(self, budget: "DiskBudget", nbytes: int) -> bool:
        return budget.used + nbytes <= self.limit

    def describe(self, budget: "DiskBudget") -> str:
        return (f"used {format_bytes(budget.used)} of output.disk_budget {format_bytes(self.limit)} (the job's own "
                f"files up to {format_bytes(budget.own_files)} of it)")


@dataclasses.dataclass
class FreeSpacePolicy:
    """The filesystem keeps at least ``output.min_free`` free once reserved bytes land."""

    floor: int

    def admits(self, budget: "DiskBudget", nbytes: int) -> bool:
        return budget.free_after_reservations() - nbytes >= self.floor

    def describe(self, budget: "DiskBudget") -> str:
        return (f"{format_bytes(budget.disk.free_and_unwritten({})[0])} free on disk, output.min_free "
                f"{format_bytes(self.floor)}")


class DiskBudget:
    """Bytes under one directory: the job's own files, committed shard files and reservations (the wait for room is
    ``jobs.driver.disk_wait``)."""

    def __init__(
        self, output_dir: Path, limit: int, min_free_bytes: int, disk: LocalDisk | None = None,
        own: OwnFiles = OwnFiles(),
    ) -> None:
        """``own``: the most the job's own files take in output.dir (``jobs.rundir.bookkeeping``)."""
        self.output_dir = output_dir
        self.own = own
        self.own_files = own.total
        self.disk = disk or LocalDisk(output_dir)
        """Where the files are: looks at free space and files run on their node."""
        self.limit = limit
        self.min_free_bytes = min_free_bytes
        self.budget_policy = BudgetPolicy(limit)
        self.free_space_policy = FreeSpacePolicy(min_free_bytes)
        self.policies: tuple[AdmissionPolicy, ...] = (self.budget_policy, self.free_space_policy)
        """The admission policies in force: any "no" holds the next shard back."""
        self._committed: dict[int, int] = {}
        self._reserved: dict[int, int] = {}
        self._committed_total = 0
        self._reserved_total = 0
        self.overhead_per_token = INITIAL_OVERHEAD_PER_TOKEN
        self.peak = 0
        self.overshoot = 0
        self.changes = 0
        """Counts every change of the accounting: an admission refused at one count is refused until it moves."""
        self._free_seen: int | None = None
        """free_after_reservations() as last looked at."""

    def for_disk(self, disk: LocalDisk) -> "DiskBudget":
        """The same limits for a node's directory (each node has its own budget)."""
        own = self.own if disk.directory == self.output_dir else self.own.on_other_node()
        return DiskBudget(disk.directory, self.limit, self.min_free_bytes, disk, own)

    def where_shards_go(self, node_dir: str) -> "DiskBudget":
        """The budget every shard must fit: this one, or with ``output.node_dir`` a node directory's, which holds
        only its claim of the job's own files."""
        return DiskBudget(self.output_dir, self.limit, self.min_free_bytes, self.disk, self.own.on_other_node()) \
            if node_dir else self

    @property
    def used(self) -> int:
        return self.own_files + self._committed_total + self._reserved_total

    @property
    def shard_limit(self) -> int:
        """What the budget leaves for shard files."""
        return self.limit - self.own_files

    def predict(self, tokens: int, state_bytes_per_token: int, batches: int) -> int:
        """Bytes a shard holding ``tokens`` tokens written in ``batches`` batches takes under output.dir."""
        fixed = FILE_OVERHEAD_BYTES + batches * BATCH_OVERHEAD_BYTES
        return self.taken(tokens * (state_bytes_per_token + self.overhead_per_token) + fixed)

    @staticmethod
    def taken(file_bytes: int) -> int:
        """What a shard file of ``file_bytes`` takes under output.dir: its blocks, and those of the consumption
        record a consumer may write beside it (gone together with the file's bytes: ``rescan``)."""
        return on_disk(file_bytes) + on_disk(RECORD_BYTES)

    def blocking_policy(self, nbytes: int) -> AdmissionPolicy | None:
        return next((policy for policy in self.policies if not policy.admits(self, nbytes)), None)

    def describe_use(self) -> str:
        """How much of the budget is used, in words."""
        return self.budget_policy.describe(self)

    def describe_block(self, nbytes: int) -> str:
        """What holds a shard of ``nbytes`` bytes back, in words (the budget's use if nothing does)."""
        return (self.blocking_policy(nbytes) or self.budget_policy).describe(self)

    def reserve(self, shard: int, nbytes: int) -> None:
        self._set(self._reserved, shard, self._reserved.get(shard, 0) + nbytes)
        self.peak = max(self.peak, self.used)

    def commit(self, shard: int, file_bytes: int, tokens: int, state_bytes_per_token: int) -> None:
        """The shard's file is published: its real size replaces its reservation."""
        self._set(self._reserved, shard, None)
        self._set(self._committed, shard, self.taken(file_bytes))
        self.overshoot = max(self.overshoot, self.used - self.limit)
        # Whatever the file holds beyond its states, spread per token: future predictions cover it.
        measured = -(-(file_bytes - tokens * state_bytes_per_token) // max(1, tokens))
        self.overhead_per_token = max(self.overhead_per_token, measured)
        self.peak = max(self.peak, self.used)

    def release(self, shard: int) -> None:
        self._set(self._reserved, shard, None)

    def forget(self, shard: int) -> None:
        """The shard's local file is gone (uploaded to the sink or consumed)."""
        self._set(self._committed, shard, None)

    def delete_file(self, shard: int, file_name: str) -> None:
        """Delete the shard's local file (its copy in the sink is verified): its bytes are free."""
        self.disk.remove([file_name])
        self.forget(shard)

    def read_declarations(self, file_names: Iterable[str]) -> dict[str, dict[str, Any]]:
        """Read the consumption records (``storage.consumed``) beside these files: name -> declaration, for those
        their consumer declared consumed."""
        return self.disk.read_declarations(file_names)

    def delete_declarations(self, file_names: Iterable[str]) -> None:
        """Delete these files' consumption records: the manifest records the files as consumed, the declarations
        have served."""
        self.disk.remove(record_name(name) for name in file_names)

    def rescan(self, local_files: Iterable[tuple[int, str, int]]) -> list[int]:
        """Count the committed files ``(shard, file name, bytes)`` that are still under output.dir;
        returns the shards whose file is gone (a consumer deleted it): their bytes are free."""
        gone = []
        local_files = list(local_files)
        existing = self.disk.existing(name for _, name, _ in local_files)
        for shard, name, nbytes in local_files:
            if name in existing:
                self._set(self._committed, shard, self.taken(nbytes))
            else:
                gone.append(shard)
                self.forget(shard)
        self.changes += 1  # free space on disk may have moved too
        return gone

    def free_after_reservations(self) -> int:
        """Free bytes on the disk once every reserved byte not yet written lands (temp files hold the rest)."""
        free, unwritten = self.disk.free_and_unwritten(self._reserved)
        self._free_seen = free - unwritten
        return self._free_seen

    def room(self) -> int:
        """The bytes of shard files this directory can hold: the budget, or less where the disk, as last looked at
        (once, if never), holds less above output.min_free."""
        free = self._free_seen if self._free_seen is not None else self.free_after_reservations()
        return min(self.limit, self.used + max(0, free - self.min_free_bytes))

    def _set(self, table: dict[int, int], shard: int, nbytes: int | None) -> None:
        """The one place the tables change: their totals follow in O(1)."""
        delta = (nbytes or 0) - table.pop(shard, 0)
        if nbytes is not None:
            table[shard] = nbytes
        if table is self._committed:
            self._committed_total += delta
        else:
            self._reserved_total += delta
        self.changes += 1
