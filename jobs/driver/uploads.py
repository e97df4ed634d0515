"""The upload queue: committed shard files on their way to the sink, and the tries each has left.

An upload is verified remotely (size and sha256) before the driver deletes the
local copy; one that fails or does not verify leaves the file local, its error
in the manifest, and is offered again at the next rescan, up to
``extract.max_attempts`` times per run. A rerun tries again.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import ray

from jobs.actors.handles import start_uploaders
from jobs.driver.work import PendingWork, Upload
from storage.manifest import LOCAL, ShardRecord


class UploadQueue:
    def __init__(
        self, sink: str, options: dict[str, Any], uploaders: int, max_attempts: int, nodes: dict[str, dict[str, Any]],
    ) -> None:
        """``nodes``: each node's name and the actor options that place an actor there; its files
        are uploaded by uploaders on it (the files are on its local disk)."""
        self.sink = sink
        self._uploaders = {
            name: start_uploaders(sink, options, uploaders, placement) for name, placement in nodes.items()
        } if sink else {}
        self._max_attempts = max_attempts
        self._next = 0
        self._uploading: set[int] = set()
        self._failures: dict[int, int] = {}
        self.retries: set[int] = set()
        """Shards whose upload failed and has tries left: the run is not over before they are offered again."""

    def uploading(self, shard: int) -> bool:
        return shard in self._uploading

    def offer(self, record: ShardRecord, node: str, path: Path, work: PendingWork) -> None:
        """Start uploading a committed local file (at ``path`` on ``node``), unless it is on its way or
        out of tries."""
        uploaders = self._uploaders.get(node)
        if (
            not uploaders or record.location != LOCAL or record.index in self._uploading
            or self._failures.get(record.index, 0) >= self._max_attempts
        ):
            return
        uploader = uploaders[self._next % len(uploaders)]
        self._next += 1
        self._uploading.add(record.index)
        self.retries.discard(record.index)
        work.add(uploader.upload.remote(str(path), record.bytes, record.sha256), Upload(record.index))

    def failed(self, shard: int) -> int:
        """The upload did not verify; returns the tries the shard has left in this run."""
        self._uploading.discard(shard)
        self._failures[shard] = self._failures.get(shard, 0) + 1
        left = self._max_attempts - self._failures[shard]
        if left:
            self.retries.add(shard)
        return left

    def succeeded(self, shard: int) -> None:
        self._uploading.discard(shard)

    def gone(self, shard: int) -> None:
        """The local file is gone (a consumer deleted it): nothing left to upload."""
        self.retries.discard(shard)

    def stop(self) -> None:
        for uploaders in self._uploaders.values():
            for uploader in uploaders:
                ray.kill(uploader)
