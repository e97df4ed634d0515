"""An exclusive lock on output.dir, held by one job for its whole run.

The kernel lock is the truth: ``fcntl.flock`` on ``output.dir/.job.lock``, kept open
for the run and released by the kernel when the process ends, however it ends
(``kill -9`` included). The same file holds a JSON record of the owner (host, boot,
pid and its start time, Ray job id, start time, command) for the message a second job
gets and for ``jobs.status``; the owner removes it when it releases the lock (a refused or
finished run leaves no lock file). The record is only ever written into a file of the lock's own: one
created new at that name, or one found there with no other name (a hard link planted there would send
the record into the file it shares: its name is removed instead).

A record left by an owner that died is stale: the next job takes the lock over
and logs whose it was. The owner is the process with the recorded pid that started at the recorded clock tick since
boot (``/proc/PID/stat``), in the recorded boot (``boot_id``): neither moves when the wall clock is set, so a clock
step never calls a live owner dead, and a later process with that pid (this boot or another) is never taken for it.
A record whose owner still runs on this host although the kernel lock is free (the lock file was deleted and
recreated under it), or whose owner runs on another host (this host cannot check), is not taken over.

flock is reliable on local filesystems, the job's NVMe. On NFS it depends on the
server and mount options (``nolock`` makes it host-local), so two hosts sharing an
NFS output.dir may both get it.
"""

from __future__ import annotations

import dataclasses
import datetime
import errno
import fcntl
import json
import logging
import os
import shlex
import socket
import stat
import time
from pathlib import Path
from typing import Optional

import psutil

from runtime.errors import OutputLocked

logger = logging.getLogger(__name__)

LOCK_FILE = ".job.lock"
# Overrides whose values the lock's record leaves out (keys, secrets, endpoints of the sink).
SECRET_KEYS = ("output.sink_options",)
# How long a refused job waits for the owner's record to appear (it is written right after flock).
RECORD_WAIT_S = 2.0


@dataclasses.dataclass(frozen=True)
class LockOwner:
    host: str
    boot_id: str
    """The host's boot the owner ran in (``/proc/sys/kernel/random/boot_id``)."""
    pid: int
    pid_start_ticks: int
    """When the owner process started, in clock ticks since boot: tells it apart from a later process with its pid."""
    ray_job: str
    """Submission id under ``ray job submit``, else ""."""
    started: str
    """When the job took the lock (ISO 8601, UTC)."""
    command: str

    @classmethod
    def this_process(cls, ray_job: str) -> "LockOwner":
        process = psutil.Process()
        return cls(
            host=socket.gethostname(),
            boot_id=boot_id(),
            pid=process.pid,
            pid_start_ticks=start_ticks(process.pid),
            ray_job=ray_job,
            started=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            command=shlex.join(_redacted(process.cmdline())),
        )

    def describe(self) -> str:
        job = f", Ray job {self.ray_job}" if self.ray_job else ""
        return f"pid {self.pid} on {self.host}{job}, since {self.started}: {self.command}"

    def is_alive(self) -> Optional[bool]:
        """Whether the owner process still runs; None when it runs on another host (cannot tell)."""
        if self.host != socket.gethostname():
            return None
        if self.boot_id != boot_id():  # the host booted since: every process of that boot is gone
            return False
        return start_ticks(self.pid) == self.pid_start_ticks


def boot_id() -> str:
    """This boot of the host: a new random id at every boot."""
    return Path("/proc/sys/kernel/random/boot_id").read_text().strip()


def start_ticks(pid: int) -> Optional[int]:
    """When process ``pid`` started, in clock ticks since boot (``/proc/PID/stat``'s field 22), None when no process
    has that pid. Exact and fixed for the process's life: psutil's ``create_time`` adds the boot's wall-clock time,
    which moves whenever the clock is set."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_bytes()
    except (FileNotFoundError, ProcessLookupError):
        return None
    # Fields from the 3rd on follow the command name's closing parenthesis (the name may hold spaces and parentheses).
    return int(stat.rsplit(b")", 1)[1].split()[19])


def _redacted(argv: list[str]) -> list[str]:
    """The command line as recorded and shown to other users: sink options may hold credentials."""
    return [f"{arg.split('=', 1)[0]}=<hidden>" if arg.startswith(SECRET_KEYS) and "=" in arg else arg for arg in argv]


def read_owner(output_dir: Path) -> Optional[LockOwner]:
    """The recorded owner of ``output_dir``'s lock, or None when nobody holds it (or never did)."""
    try:
        text = (Path(output_dir) / LOCK_FILE).read_text()
    except FileNotFoundError:
        return None
    return _parse(text)


def _parse(text: str) -> Optional[LockOwner]:
    try:
        return LockOwner(**json.loads(text)) if text.strip() else None
    except (ValueError, TypeError):
        return None  # being written, or not ours: treated as no record


class OutputLock:
    """``with OutputLock(output_dir, ray_job):`` holds ``output_dir`` for this process or raises OutputLocked."""

    def __init__(self, output_dir: Path, ray_job: str = "") -> None:
        self.path = Path(output_dir) / LOCK_FILE
        self.owner = LockOwner.this_process(ray_job)
        self._fd: Optional[int] = None

    def __enter__(self) -> "OutputLock":
        self.acquire()
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()

    def acquire(self) -> None:
        fd = self._lock_file()
        try:
            self._take_over(_parse(_read_all(fd)))
            _write_all(fd, json.dumps(dataclasses.asdict(self.owner), indent=1) + "\n")
        except BaseException:
            os.close(fd)  # releases the kernel lock
            raise
        self._fd = fd

    def _lock_file(self) -> int:
        """The lock file, open and flock'ed. A releasing owner removes the file while it still holds the
        lock: a lock won on a file that is no longer the one at the path is worth nothing, so try again."""
        while True:
            fd = self._open_lock_file()
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(fd)
                raise OutputLocked(self._held_message(self._wait_for_record())) from None
            try:
                if os.stat(self.path).st_ino == os.fstat(fd).st_ino and not self._shared(fd):
                    return fd
            except FileNotFoundError:
                pass
            os.close(fd)

    def _shared(self, fd: int) -> bool:
        """Whether the file at the lock's name is not a plain file of its own: one with other names too (a hard
        link planted there would have the record written into a file outside output.dir), or no regular file.
        Every lock file is created new under this name alone, and nobody holds this one (its flock is ours):
        the name is removed, the file it shares untouched, and the lock is taken on a new file."""
        found = os.fstat(fd)
        if found.st_nlink <= 1 and stat.S_ISREG(found.st_mode):
            return False
        logger.warning("%s is not a lock file of its own (a hard link to a file with other names, or not a regular "
                       "file): its name removed (the file is untouched)", self.path)
        self.path.unlink(missing_ok=True)
        return True

    def _open_lock_file(self) -> int:
        """The lock file, created new (``O_EXCL``: never through a link of any kind) or, when one is there already,
        opened without following a link: a symbolic link at its name is never a lock file (a job's lock is a
        plain file), so it is removed (the link, not what it points to)."""
        while True:
            try:
                return os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
            except FileExistsError:
                pass
            try:
                return os.open(self.path, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)
            except FileNotFoundError:
                continue  # its owner released it meanwhile: create it
            except OSError as error:
                if error.errno != errno.ELOOP:
                    raise
            logger.warning("%s is a symbolic link, not a lock file: removed (what it points to is untouched)",
                           self.path)
            self.path.unlink(missing_ok=True)

    def release(self) -> None:
        """Remove the lock file (a refused or finished run leaves nothing), then let the kernel lock go."""
        if self._fd is None:
            return
        fd, self._fd = self._fd, None
        try:
            self.path.unlink(missing_ok=True)
        finally:
            os.close(fd)

    def check_free(self) -> None:
        """Raise the OutputLocked that ``acquire`` would raise now, taking no lock and writing nothing (the
        dry run): a recorded owner that still runs, or one on another host."""
        previous = read_owner(self.path.parent)
        alive = previous.is_alive() if previous is not None else False
        if alive:
            raise OutputLocked(self._held_message(previous))
        if alive is None:  # on another host: refused as acquire refuses it
            self._take_over(previous)

    def _take_over(self, previous: Optional[LockOwner]) -> None:
        """The kernel lock is ours; decide what the record of a previous owner means."""
        if previous is None:
            return
        alive = previous.is_alive()
        if alive is None:
            raise OutputLocked(
                f"output.dir={self.path.parent} is recorded as held by {previous.describe()}. That is another "
                "host, which this one cannot check, and flock across hosts (NFS) is unreliable. If that job "
                f"no longer runs, delete {self.path} and rerun; otherwise choose another output.dir"
            )
        if alive:
            raise OutputLocked(
                f"output.dir={self.path.parent} is in use by {previous.describe()}, which still runs although "
                f"its lock on {self.path.name} is gone (was the file deleted?). Stop that process first "
                f"(kill {previous.pid}), then rerun"
            )
        logger.warning(
            "taking over the lock on %s from %s: that process is gone (killed?); shards it left unfinished are "
            "extracted again", self.path.parent, previous.describe(),
        )

    def _wait_for_record(self) -> Optional[LockOwner]:
        deadline = time.monotonic() + RECORD_WAIT_S
        while True:
            owner = read_owner(self.path.parent)
            if owner is not None or time.monotonic() > deadline:
                return owner
            time.sleep(0.1)

    def _held_message(self, owner: Optional[LockOwner]) -> str:
        holder = owner.describe() if owner else "a process that has not recorded itself yet"
        stop = ""
        if owner is not None:
            stop = f"`ray job stop {owner.ray_job}`" if owner.ray_job else f"`kill {owner.pid}` on {owner.host}"
            stop = f", stop it ({stop}; a rerun resumes)"
        return (
            f"output.dir={self.path.parent} is in use by another job: {holder}. Wait for it to finish "
            f"(python -m jobs.status output.dir={self.path.parent}){stop}, or choose another output.dir"
        )


def _read_all(fd: int) -> str:
    return os.pread(fd, 1 << 20, 0).decode(errors="replace")


def _write_all(fd: int, text: str) -> None:
    data = text.encode()
    os.ftruncate(fd, 0)
    os.pwrite(fd, data, 0)
    os.fsync(fd)
