"""Uploader actor: moves committed shard files to the sink in the background."""

from __future__ import annotations

from typing import Any

from storage.sink import SinkVerificationError, upload_verified


class SinkUploadError(RuntimeError):
    """An upload failed; carries the original error's text (a client's exception may not pickle)."""


class UploaderActor:
    def __init__(self, sink: str, storage_options: dict[str, Any]) -> None:
        self._sink = sink
        self._options = dict(storage_options)

    def upload(self, local_path: str, nbytes: int, sha256: str) -> str:
        """Upload and verify (size + sha256); returns the sink URL. The driver deletes the local copy."""
        try:
            return upload_verified(local_path, self._sink, nbytes, sha256, self._options)
        except SinkVerificationError:
            raise
        except Exception as error:
            raise SinkUploadError(f"{type(error).__name__}: {error}") from None
