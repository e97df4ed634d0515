"""A directory on any fsspec filesystem that files appear in whole or not at all.

A file is written under a hidden temp name beside its final one (``.<name>.tmp``),
fsynced when local, then renamed: a reader never sees a partial file under a final
name, so "the file exists" means "the file is complete" and a rerun can skip it. A local
temp file is created new without following a link, and the rename replaces a link at
the final name instead of writing through it; a directory below the root that is a link
is refused (``storage.atomic``): nothing is written outside ``dest``. On
object stores whose objects appear only once their upload completes (S3, GCS, Azure),
the file is uploaded to its final name directly: a rename there is a copy.
"""

from __future__ import annotations

import json
import os
import threading
from pathlib import Path
from typing import Any, BinaryIO, Callable, Iterable, Mapping

import fsspec
from fsspec.implementations.local import LocalFileSystem

from storage import checksum
from storage.atomic import fsync_path, open_new

TEMP_PREFIX = "."
TEMP_SUFFIX = ".tmp"
ATOMIC_UPLOAD_PROTOCOLS = frozenset({"s3", "s3a", "gs", "gcs", "abfs", "abfss", "az"})
"""Object stores where an object becomes visible only when its upload is complete."""

class Destination:
    def __init__(self, url: str, storage_options: Mapping[str, Any] | None = None) -> None:
        self.url = url
        self.fs, self.root = fsspec.core.url_to_fs(url, **dict(storage_options or {}))
        self.root = self.root.rstrip("/") or "/"
        self.local = isinstance(self.fs, LocalFileSystem)
        protocols = self.fs.protocol if isinstance(self.fs.protocol, (tuple, list)) else (self.fs.protocol,)
        self._direct = bool(ATOMIC_UPLOAD_PROTOCOLS.intersection(protocols))
        self._made: set[str] = set()
        self._lock = threading.Lock()

    def path(self, relpath: str) -> str:
        return f"{self.root}/{relpath}"

    def write(self, relpath: str, produce: Callable[[BinaryIO], None]) -> int:
        """Create ``relpath`` with what ``produce(file)`` writes; returns its bytes. Whole or absent."""
        target = self.path(relpath)
        self._makedirs(posix_parent(target))
        if self._direct:
            file = self.fs.open(target, "wb")
            try:
                produce(file)
                size = file.tell()
            except BaseException:
                # Leaving a `with` block would upload what was written: throw it away instead (s3fs aborts its
                # multipart upload), and mark the file closed so that nothing flushes it later.
                file.discard()
                file.closed = True
                raise
            file.close()
            return size
        temp = f"{posix_parent(target)}/{TEMP_PREFIX}{posix_name(target)}{TEMP_SUFFIX}"
        try:
            if self.local:
                with open_new(temp) as file:  # never through a link planted at the temp name
                    produce(file)
                    size = file.tell()
                    file.flush()
                    os.fsync(file.fileno())
                os.replace(temp, target)
            else:
                with self.fs.open(temp, "wb") as file:
                    produce(file)
                    size = file.tell()
                self.fs.mv(temp, target)
        except BaseException:
            self._remove_quietly(temp)
            raise
        return size

    def write_bytes(self, relpath: str, data: bytes) -> int:
        return self.write(relpath, lambda file: file.write(data))

    def files(self, under: str = "") -> set[str]:
        """Relative paths of every file below ``under`` (all of the destination when empty)."""
        base = self.path(under).rstrip("/") if under else self.root
        if not self.fs.exists(base):
            return set()
        prefix = self.root.rstrip("/") + "/"
        return {path[len(prefix):] for path in self.fs.find(base) if path.startswith(prefix)}

    def file_sizes(self, under: str = "") -> dict[str, int]:
        """Relative path -> size of every file below ``under`` (all of the destination when empty)."""
        base = self.path(under).rstrip("/") if under else self.root
        if not self.fs.exists(base):
            return {}
        prefix = self.root.rstrip("/") + "/"
        found = self.fs.find(base, detail=True)
        return {path[len(prefix):]: int(info["size"]) for path, info in found.items() if path.startswith(prefix)}

    def digest(self, relpath: str, algorithm: str) -> tuple[int, str]:
        """Size and checksum (``storage.checksum``, of ``algorithm``) of ``relpath`` as the storage holds it. A local
        file's pages are first dropped from the page cache (it was fsynced, so they are clean): the bytes then come
        from the disk, not from memory."""
        if self.local:
            with open(self.path(relpath), "rb", buffering=0) as file:
                os.posix_fadvise(file.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
                return checksum.of_stream(file, algorithm)
        with self.fs.open(self.path(relpath), "rb", block_size=checksum.READ_CHUNK_BYTES) as file:
            return checksum.of_stream(file, algorithm)

    def read_bytes(self, relpath: str) -> bytes:
        with self.fs.open(self.path(relpath), "rb") as file:
            return file.read()

    def sync_directories(self, relpaths: Iterable[str]) -> None:
        """Make the names of files written here durable (local: fsync their directories up to the root), so that
        a crash cannot lose a file whose source is deleted next. Object stores: an upload that returned is durable."""
        if not self.local:
            return
        directories = {self.root}
        for relpath in relpaths:
            parts = relpath.split("/")[:-1]
            directories.update(self.path("/".join(parts[:depth])) for depth in range(1, len(parts) + 1))
        for directory in sorted(directories, key=len, reverse=True):
            fsync_path(Path(directory))

    def remove(self, relpath: str) -> None:
        """Delete a file or directory the caller wrote here (its own bookkeeping), if it is there."""
        if self.fs.exists(self.path(relpath)):
            self.fs.rm(self.path(relpath), recursive=True)

    def remove_temps(self, under: str = "") -> int:
        """Delete temp files a stopped run left below ``under``; returns how many."""
        temps = [path for path in self.files(under) if is_temp(path)]
        for relpath in temps:
            self._remove_quietly(self.path(relpath))
        return len(temps)

    def read_json(self, relpath: str) -> dict[str, Any] | None:
        path = self.path(relpath)
        if not self.fs.exists(path):
            return None
        with self.fs.open(path, "rb") as file:
            return json.loads(file.read())

    def write_json(self, relpath: str, payload: Mapping[str, Any]) -> None:
        data = (json.dumps(payload, indent=2) + "\n").encode()
        self.write_bytes(relpath, data)

    def _makedirs(self, directory: str) -> None:
        with self._lock:
            if directory in self._made:
                return
        self.fs.makedirs(directory, exist_ok=True)
        if self.local:
            self._refuse_links(directory)
        with self._lock:
            self._made.add(directory)

    def _refuse_links(self, directory: str) -> None:
        """A local directory below the root that is a symbolic link would take the files written "into" it
        elsewhere: refused (ValueError), naming it."""
        root = Path(self.root)
        path = Path(directory)
        while path != root and root in path.parents:
            if path.is_symlink():
                raise ValueError(
                    f"{path} is a symbolic link (to {os.readlink(path)}): files written into it would land outside "
                    f"{self.url}. This export never makes links; remove it, then rerun"
                )
            path = path.parent

    def _remove_quietly(self, path: str) -> None:
        try:
            self.fs.rm(path)
        except (FileNotFoundError, OSError):
            pass


def posix_parent(path: str) -> str:
    return path.rsplit("/", 1)[0] if "/" in path else ""


def posix_name(path: str) -> str:
    return path.rsplit("/", 1)[-1]


def is_temp(relpath: str) -> bool:
    name = posix_name(relpath)
    return name.startswith(TEMP_PREFIX) and name.endswith(TEMP_SUFFIX)
