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

from jobs.actors import start_uploaders
from jobs.work import PendingWork, Upload
from storage.manifest import LOCAL, ShardRecord


class UploadQueue:
    def __init__(self, sink: str, options: dict[str, Any], uploaders: int, output_dir: Path, max_attempts: int) -> None:
        self.sink = sink
        self._uploaders = start_uploaders(sink, options, uploaders) if sink else []
        self._output_dir = output_dir
        self._max_attempts = max_attempts
        self._next = 0
        self._uploading: set[int] = set()
        self._failures: dict[int, int] = {}
        self.retries: set[int] = set()
        """Shards whose upload failed and has tries left: the run is not over before they are offered again."""

    def uploading(self, shard: int) -> bool:
        return shard in self._uploading

    def offer(self, record: ShardRecord, work: PendingWork) -> None:
        """Start uploading a committed local file, unless it is on its way or out of tries."""
        if (
            not self._uploaders or record.location != LOCAL or record.index in self._uploading
            or self._failures.get(record.index, 0) >= self._max_attempts
        ):
            return
        uploader = self._uploaders[self._next % len(self._uploaders)]
        self._next += 1
        self._uploading.add(record.index)
        self.retries.discard(record.index)
        path = str(self._output_dir / record.file)
        work.add(uploader.upload.remote(path, record.bytes, record.sha256), Upload(record.index))

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
        for uploader in self._uploaders:
            ray.kill(uploader)
