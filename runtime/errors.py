"""How a command ends: one exit code per outcome (what 1 means depends on the command); messages say what to do next.

| code | outcome | what the user does |
|---|---|---|
| 0 | every shard this run was to write is done, and with ``output.sink`` uploaded (or already was: nothing to do) | nothing |
| 1 | the command's work or check did not pass: ``jobs.extract``: some shards failed (their errors are in the manifest); ``jobs.check_drafter``: a drafter config would not capture the run's layers; ``jobs.check_serving``: a serving setting differs from the run's | ``jobs.extract``: rerun with ``shards=failed``; ``jobs.check_drafter``: fix the drafter config; ``jobs.check_serving``: extract again with the serving settings, or serve with the run's |
| 2 | bad config or input, refused before any work (or an input file changed under the running job) | fix what the message names |
| 3 | the disk budget is full and nothing can free it, or the disk is (ENOSPC), or a shard could never fit above ``output.min_free`` | free space or raise the budget, rerun |
| 4 | a fault the job could not absorb (actors or a node lost; the whole Ray cluster lost: outcome ``cluster_lost``), or shards left neither done nor failed (named) | rerun the same command (once the cluster runs again): it resumes |
| 5 | another job holds output.dir | wait for it, or choose another output.dir |
| 6 | ``jobs.verify`` found problems (one line each: file, what is wrong, what to do) | do what the lines say |
| 7 | every shard is written, but some could not be uploaded to ``output.sink`` (kept locally, listed) | fix the sink, rerun: it uploads them |
| 129, 130, 143 | stopped by SIGHUP (the SSH session it was started from dropped), SIGINT (Ctrl-C) or SIGTERM (``ray job stop``, ``kill``) | rerun the same command: it resumes |
"""

from __future__ import annotations

import contextlib
import errno
import signal
from typing import Iterator

EXIT_OK = 0
EXIT_NOT_PASSED = 1
"""The command's work or check did not pass; what that means per command is in the table above."""
EXIT_BAD_INPUT = 2
EXIT_BUDGET_EXHAUSTED = 3
EXIT_FAULT = 4
EXIT_LOCKED = 5
EXIT_VERIFY_FAILED = 6
EXIT_UPLOADS_FAILED = 7
RERUN = "Done shards are kept; rerun the same command to resume"
"""How a message about a stop the run cannot absorb ends."""
# 128 + the signal number, as shells report a process a signal ended.
EXIT_SIGNAL_BASE = 128


def exit_codes(meanings: dict[int, str], signals: str | None = "") -> str:
    """A command's ``--help`` sentence on its exit codes: what each of its codes (the constants above) means
    for it, then the signals' codes; ``signals``: what to do after one (``"rerun: it resumes"``), None for a
    command whose signals' codes go without saying."""
    said = ", ".join(f"{code} {meaning}" for code, meaning in sorted(meanings.items()))
    if signals is None:
        return f"Exit codes: {said}."
    codes = "/".join(str(EXIT_SIGNAL_BASE + signum) for signum in (signal.SIGHUP, signal.SIGINT, signal.SIGTERM))
    return f"Exit codes: {said}, {codes} stopped by a signal{f' ({signals})' if signals else ''}."


class ConfigError(ValueError):
    """A user mistake in the config: one line that names the key and the fix (exit code 2, as every
    ``ValueError`` a command refuses with)."""


class JobStopped(RuntimeError):
    """The job ended early but cleanly: what is done is recorded, a rerun resumes."""

    exit_code = EXIT_FAULT
    outcome = "stopped"
    """How ``.summary.json`` names this end."""


class BudgetExhausted(JobStopped):
    """The disk budget is full and nothing in flight can free it."""

    exit_code = EXIT_BUDGET_EXHAUSTED
    outcome = "budget_exhausted"


class DiskFull(BudgetExhausted):
    """A write met ENOSPC: the disk under output.dir is full (something else filled it, or the budget is
    larger than the disk)."""

    outcome = "disk_full"


class JobFault(JobStopped):
    """Actors died more often than the job restarts them; done shards are kept, a rerun resumes."""

    exit_code = EXIT_FAULT
    outcome = "fault"


class ClusterLost(JobFault):
    """The Ray cluster went away under the job (its GCS stopped answering: ``ray stop`` on the head, a crash, a
    reboot): nothing more can run on it; what is done is recorded, a rerun on a cluster that runs resumes."""

    outcome = "cluster_lost"


class OutputLocked(JobStopped):
    """Another job holds output.dir."""

    exit_code = EXIT_LOCKED
    outcome = "locked"


class JobInterrupted(JobStopped):
    """A signal asked the job to stop (``ray job stop`` sends SIGTERM, Ctrl-C SIGINT, a dropped SSH session SIGHUP)."""

    outcome = "interrupted"

    def __init__(self, signum: int) -> None:
        self.signum = signum
        self.exit_code = EXIT_SIGNAL_BASE + signum
        super().__init__(
            f"stopped by {signal.Signals(signum).name}; done shards are kept and temp files removed. "
            "Rerun the same command to resume"
        )


def is_disk_full(error: BaseException) -> bool:
    """An OSError of a full disk (or quota). pyarrow reports ENOSPC as an OSError whose errno is not always set; its
    message names it."""
    return isinstance(error, OSError) and (
        error.errno in (errno.ENOSPC, errno.EDQUOT) or "No space left on device" in str(error)
    )


def disk_full_stop(where: str, error: BaseException, kept: str = "", free: str = "Free space there") -> DiskFull:
    """The stop a full disk stands for (exit 3, not a fault): ``where`` it is, what a rerun keeps (``kept``, said
    after the error) and what to free (``free``)."""
    return DiskFull(f"the disk under {where} is full ({type(error).__name__}: {error}){kept}. {free}, then rerun the "
                    "same command: it resumes")


@contextlib.contextmanager
def full_disk_stops(where: str, kept: str = "") -> Iterator[None]:
    """Inside: an OSError of a full disk (``is_disk_full``) ends the command as ``disk_full_stop`` (exit 3) naming
    ``where``; any other error goes on as it is."""
    try:
        yield
    except OSError as error:
        if not is_disk_full(error):
            raise
        raise disk_full_stop(where, error, kept) from error


def stop_in(error: BaseException) -> BaseException:
    """The stop behind ``error``: the ``JobInterrupted`` of a signal, or the ``ClusterLost`` a watcher raised in the
    main thread (``runtime.interrupts.stop_main``), if one caused it, else ``error``.

    Both are raised by a handler wherever the main thread is; inside a Ray call (waiting on a
    model load, say) CPython reports that as ``SystemError: ... returned a result with an
    exception set``, with the handler's exception as its cause.
    """
    seen: set[int] = set()
    current: BaseException | None = error
    while current is not None and id(current) not in seen:
        if isinstance(current, (JobInterrupted, ClusterLost)):
            return current
        seen.add(id(current))
        current = current.__cause__ or current.__context__
    return error
