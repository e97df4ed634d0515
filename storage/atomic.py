"""Files that appear whole, and only where the caller says: new, never through a link, then renamed.

Every file the job, its exports and ``jobs.prepare`` write is created new under a temp name beside
its final one, written, fsynced, renamed over the final name, and the directory fsynced: a reader (or
a process that survives a crash) sees the old file or the new one, never a part, even after a power
loss. No write follows a symbolic link (``create_new``; the rename replaces a link at the final name
without following it), so a link planted where the job writes cannot send its bytes anywhere else.
A write that fails (a full disk) removes its temp file; ``reserve_space`` sets blocks aside for a
file that must be written even then, and ``swap_in`` rewrites such a file through them again and again.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import os
from pathlib import Path
from typing import IO, Any

AT_FDCWD = -100
RENAME_EXCHANGE = 2
_renameat2 = getattr(ctypes.CDLL(None, use_errno=True), "renameat2", None)
"""Linux's renameat2 (glibc 2.28+), which swaps two names in one step; None where the C library lacks it."""
CREATE_FLAGS = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
"""A new regular file, never through a symbolic link (O_EXCL alone already refuses one at the name)."""
FILE_MODE = 0o644


def fsync_path(path: Path) -> None:
    """fsync a file or directory by path (Linux flushes the inode whichever descriptor asks)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def create_new(path: Path | str) -> int:
    """A descriptor open for writing on a new, empty regular file at ``path``, a name of the caller's own (a temp
    name): whatever has that name (a file a stopped run left, a link someone planted) is removed first, never
    followed; a directory there raises."""
    try:
        return os.open(path, CREATE_FLAGS, FILE_MODE)
    except FileExistsError:
        os.unlink(path)  # a link is removed itself, not what it points to
        return os.open(path, CREATE_FLAGS, FILE_MODE)


def open_new(path: Path | str, mode: str = "wb", **kwargs: Any) -> IO[Any]:
    """``create_new(path)`` as a Python file object (``mode`` "wb" or "w")."""
    fd = create_new(path)
    try:
        return os.fdopen(fd, mode, **kwargs)
    except BaseException:
        os.close(fd)
        raise


def fd_path(fd: int) -> str:
    """A name that opens the very file ``fd`` is open on (Linux ``/proc/self/fd``): for a library that opens files
    by name only (pyarrow's native file) and must write the file this process created, whatever the directory holds
    under its name meanwhile."""
    return f"/proc/self/fd/{fd}"


def remove_quietly(path: Path | str) -> None:
    """Remove a temp file of the caller's on the way out of a failed write (a full disk, say); a failure to remove
    it must not hide the error that got here."""
    with contextlib.suppress(OSError):
        os.unlink(path)


def _write_all(fd: int, data: bytes | memoryview) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]


def write_synced(path: Path | str, data: bytes) -> None:
    """Create ``path`` new (``create_new``) holding ``data``, fsynced (the caller renames or links it into place);
    a write that fails removes it."""
    fd = create_new(path)
    try:
        _write_all(fd, data)
        os.fsync(fd)
    except BaseException:
        remove_quietly(path)
        raise
    finally:
        os.close(fd)


def replace_atomically(
    path: Path | str, data: bytes | str, temp_suffix: str = ".tmp", reserve: Path | None = None,
) -> None:
    """``path`` holds ``data`` afterwards, whole; ``temp_suffix`` names the temp file beside it. With ``reserve``
    (``reserve_space``'s file, if it is still there) the data goes into its blocks, which then become ``path``."""
    path = Path(path)
    data = data.encode() if isinstance(data, str) else data
    temp = _write_reserved(reserve, data) if reserve is not None else None
    if temp is None:
        temp = path.with_name(path.name + temp_suffix)
        write_synced(temp, data)
    try:
        os.replace(temp, path)
    except BaseException:
        remove_quietly(temp)
        raise
    fsync_path(path.parent)


def _write_at(fd: int, data: bytes) -> None:
    """``data`` from the start of the file, over the blocks it has."""
    view, offset = memoryview(data), 0
    while offset < len(view):
        offset += os.pwrite(fd, view[offset:], offset)


def _write_reserved(reserve: Path, data: bytes) -> Path | None:
    """``data`` written over the reserved file's blocks, fsynced; None when there is no reserve (used already)."""
    try:
        fd = os.open(reserve, os.O_WRONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:  # gone (used), or a link planted in its place (ELOOP): not ours to write
        return None
    try:
        _write_at(fd, data)
        os.ftruncate(fd, len(data))
        os.fsync(fd)
    except BaseException:
        remove_quietly(reserve)
        raise
    finally:
        os.close(fd)
    return reserve


def swap_in(reserve: Path, path: Path, data: bytes, final: bool) -> bool:
    """``data`` written over the blocks of ``reserve`` (``reserve_space``'s file), fsynced, then swapped with ``path``
    in one step (``renameat2`` with ``RENAME_EXCHANGE``): ``path`` holds ``data`` whole, and ``reserve`` what ``path``
    held, whose blocks stay set aside for the next swap, so that no swap ever needs a block the disk may not have.
    ``final``: the last write, whose file is cut to ``data`` and whose reserve is removed. False, with nothing
    changed, where there is no reserve (gone, or a link planted there) or the filesystem cannot swap two names."""
    if not path.exists() or _renameat2 is None:
        return False
    try:
        fd = os.open(reserve, os.O_WRONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return False
    try:
        _write_at(fd, data)
        if final:
            os.ftruncate(fd, len(data))
        os.fsync(fd)
    finally:
        os.close(fd)
    if _renameat2(AT_FDCWD, os.fsencode(reserve), AT_FDCWD, os.fsencode(path), RENAME_EXCHANGE) != 0:
        error = ctypes.get_errno()
        if error in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP):  # the filesystem does not swap names
            return False
        raise OSError(error, os.strerror(error), str(path))
    if final:
        os.unlink(reserve)
    fsync_path(path.parent)
    return True


def reserve_space(path: Path, nbytes: int) -> None:
    """Allocate ``nbytes`` on disk under ``path`` (a hidden name of the caller's), for a later
    ``replace_atomically(..., reserve=path)`` that must succeed on a full disk. Quietly nothing where the disk has
    no room for it now (the later write then takes its chances)."""
    fd = create_new(path)
    try:
        os.posix_fallocate(fd, 0, nbytes)
        os.fsync(fd)
    except OSError:
        remove_quietly(path)
    finally:
        os.close(fd)
