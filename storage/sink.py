"""Copies committed shard files to a sink (any fsspec URL) and proves the copy is whole.

Verification reads the remote object back and compares size and checksum with
what the writer recorded while writing: it works the same for every fsspec
backend (S3 ETags are not content hashes for multipart uploads), at the
price of reading each shard once more over the network.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
import uuid
from pathlib import Path
from typing import Any

import fsspec
from fsspec.implementations.local import LocalFileSystem

import storage.checksum as checksum
from storage.atomic import open_new, remove_quietly

READ_CHUNK_BYTES = 8 * 1024 * 1024


class SinkVerificationError(RuntimeError):
    pass


def sink_url_for(sink: str, file_name: str) -> str:
    return sink.rstrip("/") + "/" + file_name


def upload_verified(
    local_path: str, sink: str, expected_bytes: int, expected_checksum: str, storage_options: dict[str, Any]
) -> str:
    """Upload ``local_path`` under ``sink``; returns the remote URL once size and checksum (``storage.checksum``,
    made with the algorithm ``expected_checksum`` names) match."""
    url = sink_url_for(sink, Path(local_path).name)
    fs, remote = fsspec.core.url_to_fs(url, **storage_options)
    fs.makedirs(fs._parent(remote), exist_ok=True)
    if isinstance(fs, LocalFileSystem):  # a directory (file://): whole or absent, never written through a link
        _copy_into_place(local_path, Path(remote))
    else:
        fs.put_file(local_path, remote)
    size = fs.info(remote)["size"]
    if size != expected_bytes:
        raise SinkVerificationError(f"{url}: {size} bytes in the sink, {expected_bytes} written locally")
    found = checksum.of_remote(fs, remote, checksum.algorithm_of(expected_checksum))
    if found != expected_checksum:
        raise SinkVerificationError(f"{url}: checksum {found} in the sink, {expected_checksum} written locally")
    return url


def _copy_into_place(source: str, target: Path) -> None:
    """Copy ``source`` to ``target`` through a new temp file beside it (``storage.atomic``), fsynced, then renamed."""
    temp = target.with_name(f".{target.name}.upload.tmp")
    try:
        with open(source, "rb") as reader, open_new(temp) as writer:
            shutil.copyfileobj(reader, writer, READ_CHUNK_BYTES)
            writer.flush()
            os.fsync(writer.fileno())
        os.replace(temp, target)
    except BaseException:
        remove_quietly(temp)
        raise


def probe(sink: str, storage_options: dict[str, Any]) -> None:
    """Write a small object under ``sink``, read it back and delete it; raises what failed. (A filesystem
    that cannot delete at all, such as plain HTTP, keeps the small object: uploads never delete either.)"""
    url = sink_url_for(sink, f".eagle3-probe-{uuid.uuid4().hex}")
    payload = b"eagle3-extract sink probe\n"
    fs, remote = fsspec.core.url_to_fs(url, **storage_options)
    fs.makedirs(fs._parent(remote), exist_ok=True)
    with tempfile.NamedTemporaryFile() as local:  # put_file: the call every upload makes
        local.write(payload)
        local.flush()
        fs.put_file(local.name, remote)
    try:
        if fs.cat_file(remote) != payload:
            raise SinkVerificationError(f"{url}: what was read back is not what was written")
    finally:
        with contextlib.suppress(NotImplementedError):
            fs.rm_file(remote)
