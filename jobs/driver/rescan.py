"""The periodic look at the run's directories: files consumed or lost, uploads to offer again.

A trainer may consume committed shard files while the run goes on (that is how a
run larger than its disk budget gets written), declaring each one first
(``storage.consumed.consume_shard``). Every ``output.rescan_s`` each node
directory's committed files are counted again: a file that is gone frees its
bytes; declared consumed, it is recorded as consumed into what the declaration
names (and the declaration removed); gone without one, it was lost, and the shard
is extracted again. Every local file still waiting for the sink is offered to the
upload queue (failed uploads come back this way).
"""

from __future__ import annotations

import logging
import time

from jobs.driver.lanes import Lane, Lanes
from jobs.driver.scheduler import Scheduler
from jobs.driver.uploads import UploadQueue
from storage.consumed import mismatch, record_name
from storage.manifest import CONSUMED, DONE, LOCAL, Manifest, ShardRecord

logger = logging.getLogger(__name__)


class Rescanner:
    def __init__(
        self, manifest: Manifest, lanes: Lanes, uploads: UploadQueue, scheduler: Scheduler, rescan_s: float,
    ) -> None:
        self._manifest = manifest
        self._lanes = lanes
        self._uploads = uploads
        self._scheduler = scheduler
        self.rescan_s = rescan_s
        self._last = float("-inf")

    def rescan_if_due(self) -> None:
        if time.monotonic() - self._last >= self.rescan_s:
            self.rescan()

    def rescan(self) -> None:
        self._last = time.monotonic()
        by_budget: dict[int, list[ShardRecord]] = {}
        for record in self._manifest.in_state(DONE):
            if record.location == LOCAL and not self._uploads.uploading(record.index):
                lane = self._lanes.home(record)
                if lane is not None:
                    by_budget.setdefault(id(lane.budget), []).append(record)
        for lane in self._lanes.by_budget():
            records = by_budget.get(id(lane.budget), [])
            gone = lane.budget.rescan((r.index, r.file, r.bytes) for r in records)
            if gone:
                self._settle_gone(lane, [self._manifest.shards[shard] for shard in gone])
            for record in records:
                current = self._manifest.shards[record.index]
                if current.state == DONE and current.location == LOCAL:
                    self._uploads.offer(current, self._lanes.home(current))

    def _settle_gone(self, lane: Lane, records: list[ShardRecord]) -> None:
        """Done shards whose files are gone from the lane's directory: consumed if declared, else lost."""
        declared = lane.budget.read_declarations(record.file for record in records)
        for record in records:
            self._uploads.gone(record.index)
            where = lane.budget.output_dir / record.file
            declaration = declared.get(record.file)
            why = mismatch(declaration, record.bytes, record.checksum) if declaration is not None else ""
            if why:
                logger.warning("shard %d: the declaration %s does not vouch for the file the run recorded (%s): "
                               "dropped", record.index, where.with_name(record_name(record.file)), why)
                declaration = None
            if declaration is None:
                reason = (f"{where} is gone and no consumer declared it consumed (storage.consumed.consume_shard): "
                          "lost, not consumed; the shard is extracted again")
                logger.warning("shard %d: %s", record.index, reason)
                self._scheduler.extract_again(record.index, reason)
                continue
            logger.info("shard %d: %s was consumed into %s; its bytes are free", record.index, where,
                        declaration["into"])
            self._manifest.update(record.index, location=CONSUMED, consumed_into=declaration["into"])
        lane.budget.delete_declarations(declared)
