"""Files that appear whole: written under a temp name, fsynced, then renamed over the final name.

A reader (or a process that survives a crash) sees the old file or the new one,
never a part. The directory is fsynced after the rename so that the new name
itself survives a power loss. Every small file the job writes goes through
``replace_atomically``; the shard writer streams its own temp file and uses
``fsync_path`` for the same two syncs.
"""

from __future__ import annotations

import os
from pathlib import Path


def fsync_path(path: Path) -> None:
    """fsync a file or directory by path (Linux flushes the inode whichever descriptor asks)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_synced(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` and fsync it (the caller renames or links it into place)."""
    with open(path, "wb") as file:
        file.write(data)
        file.flush()
        os.fsync(file.fileno())


def replace_atomically(path: Path, data: bytes | str, temp_suffix: str = ".tmp") -> None:
    """``path`` holds ``data`` afterwards, whole; ``temp_suffix`` names the temp file beside it."""
    path = Path(path)
    temp = path.with_name(path.name + temp_suffix)
    write_synced(temp, data.encode() if isinstance(data, str) else data)
    os.replace(temp, path)
    fsync_path(path.parent)
