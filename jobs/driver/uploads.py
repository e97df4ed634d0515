"""The upload queue: committed shard files on their way to the sink, from the offer to the local copy's deletion.

An upload is verified remotely (size and checksum) before the queue records the
shard as in the sink and deletes the local copy (record first: a crash in
between leaves a local copy the next run removes). One that fails or does not
verify leaves the file local, its error in the manifest, and is offered again
once its pause is over: ``output.rescan_s`` after the first failure, four times
longer after each next one, at most ``RETRY_MAX_S`` (10 s, 40 s, 160 s, ... by
default: six tries span 45 minutes, so that a sink down for half an hour strands
nothing), up to ``output.upload_attempts`` times per run; after that the shard
stays local and the run ends with exit 7 naming it (a rerun tries again).
"""

from __future__ import annotations

import logging
import time
from typing import Any

from jobs.driver.lanes import Lane, Lanes
from jobs.driver.work import PendingWork, Upload, error_text
from storage import shard_file_name
from storage.manifest import LOCAL, SINK, Manifest, ShardRecord

logger = logging.getLogger(__name__)

RETRY_GROWTH = 4
"""Each failed upload's pause before the next try is this many times the one before."""
RETRY_MAX_S = 1800.0
"""The longest pause between two tries of one shard's upload."""


class UploadQueue:
    def __init__(
        self, sink: str, uploaders: dict[str, list[Any]], max_attempts: int, lanes: Lanes, manifest: Manifest,
        work: PendingWork, retry_s: float,
    ) -> None:
        """``uploaders``: each node's uploader actors (its files are on its local disk); none without a sink.
        ``retry_s``: the pause after a shard's first failed upload."""
        self.sink = sink
        self._uploaders = uploaders
        self._max_attempts = max_attempts
        self._lanes = lanes
        self._manifest = manifest
        self._work = work
        self._next = 0
        self._uploading: set[int] = set()
        self._failures: dict[int, int] = {}
        self._retry_s = retry_s
        self._retry_at: dict[int, float] = {}
        """Shards whose upload failed with tries left, not offered again yet: when they may be (monotonic s)."""

    @property
    def retries(self) -> bool:
        """Uploads failed with tries left: the run is not over before they are offered again."""
        return bool(self._retry_at)

    def uploading(self, shard: int) -> bool:
        return shard in self._uploading

    def offer(self, record: ShardRecord, lane: Lane) -> None:
        """Start uploading a committed local file on ``lane``'s node, unless it is on its way or out of tries."""
        uploaders = self._uploaders.get(lane.group.name)
        if (
            not uploaders or record.location != LOCAL or record.index in self._uploading
            or self._failures.get(record.index, 0) >= self._max_attempts
            or time.monotonic() < self._retry_at.get(record.index, 0.0)
        ):
            return
        uploader = uploaders[self._next % len(uploaders)]
        self._next += 1
        self._uploading.add(record.index)
        self._retry_at.pop(record.index, None)
        path = lane.group.directory / record.file
        self._work.add(uploader.upload.remote(str(path), record.bytes, record.checksum), Upload(record.index))

    def settle(self, shard: int, ref: Any) -> None:
        """The upload ended: the shard is in the sink and its local copy deleted, or its error recorded."""
        self._uploading.discard(shard)
        try:
            url = self._work.result(ref)
        except Exception as error:
            message = f"upload to {self.sink} failed, the file stays local: {error_text(error)}"
            self._failures[shard] = self._failures.get(shard, 0) + 1
            left = self._max_attempts - self._failures[shard]
            pause = min(RETRY_MAX_S, self._retry_s * RETRY_GROWTH ** (self._failures[shard] - 1))
            if left:
                self._retry_at[shard] = time.monotonic() + pause
            self._manifest.update(shard, error=message)
            logger.error("shard %d: %s (%s)", shard, message, f"{left} more tries in this run, the next in {pause:.1f} s"
                         if left else "no tries left in this run (output.upload_attempts): a rerun tries again")
            return
        record = self._manifest.update(shard, location=SINK, sink_url=url, error="")
        lane = self._lanes.home(record)
        if lane is not None:
            lane.budget.delete_file(shard, shard_file_name(shard))

    def gone(self, shard: int) -> None:
        """The local file is gone (a consumer deleted it, or it was lost): nothing left to upload; a file written
        again is offered at once."""
        self._retry_at.pop(shard, None)
