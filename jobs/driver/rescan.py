"""The periodic look at the run's directories: files a consumer deleted, uploads to offer again.

A trainer may consume committed shard files while the run goes on (that is how a
run larger than its disk budget gets written): every ``output.rescan_s`` each
node directory's committed files are counted again, a file that is gone frees
its bytes and is recorded as consumed, and every local file still waiting for
the sink is offered to the upload queue (failed uploads come back this way).
"""

from __future__ import annotations

import logging
import time

from jobs.driver.lanes import Lanes
from jobs.driver.uploads import UploadQueue
from storage import shard_file_name
from storage.manifest import CONSUMED, DONE, LOCAL, Manifest, ShardRecord

logger = logging.getLogger(__name__)


class Rescanner:
    def __init__(self, manifest: Manifest, lanes: Lanes, uploads: UploadQueue, rescan_s: float) -> None:
        self._manifest = manifest
        self._lanes = lanes
        self._uploads = uploads
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
            for shard in lane.budget.rescan((r.index, r.file, r.bytes) for r in records):
                logger.info("shard %d: %s was removed from %s; its bytes are free", shard, shard_file_name(shard),
                            lane.group.directory)
                self._manifest.update(shard, location=CONSUMED)
                self._uploads.gone(shard)
            for record in records:
                current = self._manifest.shards[record.index]
                if current.location == LOCAL:
                    self._uploads.offer(current, self._lanes.home(current))
