"""Copies committed shard files to a sink (any fsspec URL) and proves the copy is whole.

Verification reads the remote object back and compares size and checksum with
what the writer recorded while writing: it works the same for every fsspec
backend (S3 ETags are not content hashes for multipart uploads), at the
price of reading each shard once more over the network.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile
import uuid
from pathlib import Path, PurePosixPath
from typing import Any, Collection

import fsspec
from fsspec.implementations.local import LocalFileSystem

import storage.checksum as checksum
from storage.atomic import fsync_path, open_new, remove_quietly
from storage.claim import CLAIM_FILE, link_new_claim
from storage.writer import SHARD_GLOB

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
        fsync_path(target.parent)  # the rename itself survives a crash: the local copy is deleted next
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
    _put_bytes(fs, remote, payload)
    try:
        if fs.cat_file(remote) != payload:
            raise SinkVerificationError(f"{url}: what was read back is not what was written")
    finally:
        with contextlib.suppress(NotImplementedError):
            fs.rm_file(remote)


def _put_bytes(fs: fsspec.AbstractFileSystem, remote: str, data: bytes) -> None:
    """``data`` written to ``remote`` by put_file, the call every upload makes (plain HTTP: a POST; pipe_file would
    PUT, which such a sink may refuse)."""
    with tempfile.NamedTemporaryFile() as local:
        local.write(data)
        local.flush()
        fs.put_file(local.name, remote)


def claim_refusal(sink: str, storage_options: dict[str, Any], run_id: str, own_files: Collection[str]) -> str:
    """Why ``sink`` is not the run ``run_id``'s to upload into ('' when it is, or is free to claim): another run's
    claim (a run's sink, or a node directory of another run), or no claim but shard files ``own_files`` (the files
    this run recorded uploaded there) do not name. Uploads replace a file of the same name and then delete the local
    copy: two runs sharing a sink would each replace the other's only copy."""
    fs, root = fsspec.core.url_to_fs(sink, **storage_options)
    try:
        holder = json.loads(fs.cat_file(f"{root.rstrip('/')}/{CLAIM_FILE}"))
    except FileNotFoundError:
        holder = None
    except ValueError:
        holder = {"output_dir": f"(unreadable {sink_url_for(sink, CLAIM_FILE)})"}
    if holder is not None:
        if holder.get("run_id") == run_id:
            return ""
        return f"belongs to the run whose output.dir is {holder.get('output_dir')} on {holder.get('host', '?')}"
    try:
        found = {PurePosixPath(path).name for path in fs.glob(f"{root.rstrip('/')}/{SHARD_GLOB}")}
    except NotImplementedError:  # a filesystem that cannot list (plain HTTP): the claim alone tells
        found = set()
    strangers = sorted(found - set(own_files))
    if strangers:
        return f"holds {len(strangers)} shard files (e.g. {strangers[0]}) that this run did not upload"
    return ""


def claim(sink: str, storage_options: dict[str, Any], owner: dict[str, str], own_files: Collection[str]) -> str:
    """Make ``sink`` the run ``owner`` names (``run_id``, ``output_dir``, ``host``) its own before its first upload;
    '' once it is, else why not (``claim_refusal``). A directory is claimed as a node's directory is (exactly one of
    two runs claiming at once wins); an object store keeps the last of two claims written at the same moment."""
    refusal = claim_refusal(sink, storage_options, owner["run_id"], own_files)
    if refusal:
        return refusal
    fs, root = fsspec.core.url_to_fs(sink, **storage_options)
    fs.makedirs(root, exist_ok=True)
    if isinstance(fs, LocalFileSystem):
        link_new_claim(Path(root), owner)
    elif not fs.exists(f"{root.rstrip('/')}/{CLAIM_FILE}"):
        _put_bytes(fs, f"{root.rstrip('/')}/{CLAIM_FILE}", json.dumps(owner).encode())
    return claim_refusal(sink, storage_options, owner["run_id"], own_files)  # read back: whose it is now
