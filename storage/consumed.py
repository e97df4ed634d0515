"""Consuming a run's shard files: declared first, then deleted; a file gone without a declaration is damage.

A trainer may take committed shard files out of a run's directory while the run goes on (how a run
larger than its disk budget gets written) or after it: ``consume_shard(path, into)`` durably writes
a small record beside the file (``.shard-00007.parquet.consumed``: the file's size and checksum, and
``into``), then deletes the file. A record vouches only for the file it names (``mismatch``). Only the
job writes the manifest: its rescan (or a rerun's start-up) finds the file gone and the record there,
records the shard as consumed into ``into`` and removes the record. A done shard's file gone without
a record was lost, not consumed: it is extracted again. docs/operations.md has the user's side.
"""

from __future__ import annotations

import datetime
import json
import os
import socket
from pathlib import Path
from typing import Any, Iterable, Optional

import storage.checksum as checksum
from storage.atomic import fsync_path, replace_atomically
from storage.writer import shard_of_file

CONSUMED_SUFFIX = ".consumed"
RECORD_GLOB = ".shard-*.parquet" + CONSUMED_SUFFIX
RECORD_BYTES_MAX = 64 * 1024
"""A record is a few hundred bytes; anything larger at its name is not one."""
INTO_BYTES = 1024
"""The most bytes ``into`` takes in JSON."""
RECORD_BYTES = 2048
"""The most bytes a record ``consume_shard`` writes takes: ``into`` and the file's name, size, checksum, host
(<= 255 characters), pid and time."""
def record_name(file_name: str) -> str:
    """The consumption record of the shard file ``file_name`` (beside it, hidden)."""
    return f".{file_name}{CONSUMED_SUFFIX}"


def file_of_record(name: str) -> Optional[str]:
    """The shard file a record's name declares consumed, or None when ``name`` is not a record's."""
    if not (name.startswith(".") and name.endswith(CONSUMED_SUFFIX)):
        return None
    file_name = name[1 : -len(CONSUMED_SUFFIX)]
    return file_name if shard_of_file(file_name) is not None else None


def consume_shard(path: str | os.PathLike, into: str) -> None:
    """Declare the committed shard file ``path`` consumed, then delete it (both durable when this returns).

    ``into`` says where its samples went or who took them (``"trainer run 17 on gpu-node-3"``): the run's
    manifest records it as the shard's ``consumed_into``. Call it only once the samples are safe wherever they
    went: the job never writes them again. A file already gone after an earlier call is fine (nothing happens);
    a file gone without one raises FileNotFoundError.
    """
    path = Path(path)
    if shard_of_file(path.name) is None:
        raise ValueError(f"{path}: not a shard file of a run (shard-NNNNN.parquet)")
    if not into or not into.strip():
        raise ValueError("into: say where the shard's samples went (or who took them); the manifest records it")
    if len(json.dumps(into)) > INTO_BYTES:
        raise ValueError(f"into: {len(json.dumps(into))} bytes in JSON; say where the shard's samples went in at most "
                         f"{INTO_BYTES} (the run's disk budget counts a record of at most {RECORD_BYTES} bytes)")
    record = path.with_name(record_name(path.name))
    try:
        size = os.stat(path, follow_symlinks=False).st_size
    except FileNotFoundError:
        if read_record(record) is not None:
            return  # declared and deleted by an earlier call
        raise
    replace_atomically(record, json.dumps({
        "file": path.name, "bytes": size, "checksum": checksum.of_file(path, checksum.DEFAULT_ALGORITHM), "into": into, "host": socket.gethostname(), "pid": os.getpid(),
        "at": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    }) + "\n", temp_suffix=".tmp")
    path.unlink()
    fsync_path(path.parent)


def read_record(path: Path) -> Optional[dict[str, Any]]:
    """A consumption record, or None when there is none at ``path`` (or what is there is not one: a link, a
    directory, something else)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:  # missing, a link (ELOOP), ...
        return None
    try:
        data = os.read(fd, RECORD_BYTES_MAX + 1)
    except OSError:  # a directory
        return None
    finally:
        os.close(fd)
    try:
        record = json.loads(data)
    except ValueError:
        return None
    if not isinstance(record, dict) or record.get("file") != path.name[1 : -len(CONSUMED_SUFFIX)] \
            or not isinstance(record.get("into"), str) or not record["into"]:
        return None
    return record


def mismatch(declaration: dict[str, Any], size: int, file_checksum: str) -> str:
    """Why ``declaration`` does not vouch for the file a run recorded (``size`` bytes, checksum ``file_checksum``),
    or "" when it does. A declaration is trusted only for the file its consumer took: one left from another file of
    that name, or written by hand, must not turn a lost file into a consumed one (its samples would be in nobody's
    hands)."""
    if declaration.get("bytes") != size:
        return f"it declares a file of {declaration.get('bytes')} bytes, the run recorded {size}"
    declared = declaration.get("checksum")
    try:
        algorithm = checksum.algorithm_of(declared if isinstance(declared, str) else "")
    except ValueError:
        return "it names no checksum (storage.consumed.consume_shard writes one)"
    # A run written with another algorithm (output.checksum) is compared by size alone.
    if file_checksum and checksum.algorithm_of(file_checksum) == algorithm and declared != file_checksum:
        return "its checksum is not the one the run recorded"
    return ""


def read_records(directory: Path, file_names: Iterable[str]) -> dict[str, dict[str, Any]]:
    """File name -> its consumption record, for those of ``file_names`` declared consumed in ``directory``."""
    found = {}
    for name in file_names:
        record = read_record(Path(directory) / record_name(name))
        if record is not None:
            found[name] = record
    return found
