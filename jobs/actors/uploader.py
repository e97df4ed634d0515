"""Uploader actor: moves committed shard files to the sink in the background."""

from __future__ import annotations

from typing import Any

import ray

from storage.sink import SinkVerificationError, upload_verified


class SinkUploadError(RuntimeError):
    """An upload failed; carries the original error's text (a client's exception may not pickle)."""


class UploaderActor:
    def __init__(self, sink: str, storage_options: dict[str, Any]) -> None:
        self._sink = sink
        self._options = dict(storage_options)

    def upload(self, local_path: str, nbytes: int, checksum: str) -> str:
        """Upload and verify (size + checksum); returns the sink URL. The driver deletes the local copy."""
        try:
            return upload_verified(local_path, self._sink, nbytes, checksum, self._options)
        except SinkVerificationError:
            raise
        except Exception as error:
            raise SinkUploadError(f"{type(error).__name__}: {error}") from None


def start_uploaders(sink: str, options: dict[str, Any], count: int, placement: dict[str, Any]) -> list[Any]:
    """Uploaders on the node whose files they upload (``placement``)."""
    # No CPU slot: uploads mostly wait on the network, and the disk budget may be waiting
    # on them, so writers holding every CPU slot must never keep them from starting.
    uploader_class = ray.remote(UploaderActor).options(num_cpus=0, **placement)
    return [uploader_class.remote(sink, options) for _ in range(max(1, count))]
