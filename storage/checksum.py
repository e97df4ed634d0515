"""Checksums of every file the job writes and later checks: shard files, exported files, the exports' lists.

A checksum is kept as ``<algorithm>:<hex digest>`` (``xxh3_128:6a0f...``): whoever checks a file
reads the algorithm from the value it checks against, so files written with either algorithm are
checked right whatever the checking job is set to. ``xxh3_128`` (xxhash's 128-bit XXH3) is the
default: it hashes ~29 GB/s on one core against sha256's ~2 GB/s (with SHA-NI), and sha256 cost a
writer as much CPU as encoding and writing the Parquet itself; it finds every accidental change
(a flipped bit, a torn or swapped file), which is what these checksums are for. ``sha256``
(``output.checksum=sha256``) when the values must compare with ``sha256sum``'s.
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import IO, Any, Protocol, get_args

import fsspec
import xxhash

from storage.schema import DEFAULT_CHECKSUM as DEFAULT_ALGORITHM
from storage.schema import ChecksumAlgorithm

ALGORITHMS: tuple[str, ...] = get_args(ChecksumAlgorithm)
READ_CHUNK_BYTES = 8 * 1024 * 1024
SEPARATOR = ":"


class _Digest(Protocol):
    def update(self, data: Any) -> None: ...

    def hexdigest(self) -> str: ...


class Hasher:
    """A checksum being computed over bytes fed in order; ``value`` is ``<algorithm>:<hex>``.

    Both algorithms release the GIL while they hash a large buffer: a thread hashing runs beside
    the others."""

    def __init__(self, algorithm: str = DEFAULT_ALGORITHM) -> None:
        check_algorithm(algorithm)
        self.algorithm = algorithm
        self._digest: _Digest
        self._digest = hashlib.sha256() if algorithm == "sha256" else xxhash.xxh3_128()

    def update(self, data: Any) -> None:
        self._digest.update(data)

    @property
    def value(self) -> str:
        return f"{self.algorithm}{SEPARATOR}{self._digest.hexdigest()}"


def check_algorithm(algorithm: str) -> str:
    if algorithm not in ALGORITHMS:
        raise ValueError(f"checksum algorithm {algorithm!r}: use one of {', '.join(ALGORITHMS)}")
    return algorithm


def algorithm_of(value: str) -> str:
    """The algorithm a checksum value was made with; ValueError for a value this version cannot check."""
    algorithm, separator, digest = value.partition(SEPARATOR)
    if not separator or not digest or algorithm not in ALGORITHMS:
        raise ValueError(f"checksum {value!r} is not <algorithm>:<hex> with an algorithm of {', '.join(ALGORITHMS)}")
    return algorithm


def of_bytes(data: Any, algorithm: str = DEFAULT_ALGORITHM) -> str:
    hasher = Hasher(algorithm)
    hasher.update(data)
    return hasher.value


def of_stream(file: IO[bytes], algorithm: str) -> tuple[int, str]:
    """Size and checksum of what ``file`` holds from its position to its end."""
    hasher = Hasher(algorithm)
    size = 0
    while chunk := file.read(READ_CHUNK_BYTES):
        hasher.update(chunk)
        size += len(chunk)
    return size, hasher.value


def of_file(path: str | Path, algorithm: str) -> str:
    """Checksum of a local file."""
    with open(path, "rb", buffering=0) as file:
        return of_stream(file, algorithm)[1]


def of_remote(fs: fsspec.AbstractFileSystem, path: str, algorithm: str) -> str:
    """Checksum of a file as ``fs`` holds it (read back whole: object stores' ETags are no content hashes)."""
    with fs.open(path, "rb", block_size=READ_CHUNK_BYTES) as file:
        return of_stream(file, algorithm)[1]
