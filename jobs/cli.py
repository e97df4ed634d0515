"""One way every command runs: logging, signals, and how each kind of error becomes an exit code.

Each command (``jobs.prepare``, ``jobs.extract``, ``jobs.pipeline``, ``jobs.plan``, ``jobs.status``,
``jobs.verify``, ``jobs.export``, ``jobs.check_drafter``, ``jobs.check_serving``) writes a ``body(argv) -> exit code`` and
hands it to ``run_command``:

- SIGTERM, SIGINT and SIGHUP raise ``JobInterrupted`` while the body runs (exit 143 / 130 / 129), except
  inside the sections ``runtime.interrupts.signals_deferred`` runs whole; the handlers found before are put
  back after, however the body ends.
- A ``ValueError`` (``ConfigError`` included) is a refusal: ``error: <message>`` on
  stderr, one line, exit 2. The message names the key, file or row and the fix.
- A ``JobStopped`` (budget, fault, lock, interrupt) ends with its own code and message.
- An ``OSError`` of a full disk (ENOSPC) is exit 3, as ``DiskFull``: free space, rerun.
- Anything else is a fault: the traceback is logged, then one line with what to do next, exit 4.
"""

from __future__ import annotations

import logging
import sys
from typing import Callable, Sequence

from runtime.errors import EXIT_BAD_INPUT, EXIT_BUDGET_EXHAUSTED, EXIT_FAULT, JobStopped, is_disk_full, stop_in
from runtime.interrupts import signals_deferred, signals_stop

logger = logging.getLogger("jobs.cli")

DETAILED = "%(asctime)s %(levelname)s %(name)s: %(message)s"
"""Log lines of the commands that run for long (extract, export): with the time."""
BRIEF = "%(levelname)s %(name)s: %(message)s"


def run_command(
    body: Callable[[Sequence[str]], int], argv: Sequence[str], level: int = logging.WARNING, fmt: str = BRIEF,
    fault_hint: str = "",
) -> int:
    """``body(argv)``'s exit code, or the code of what it raised (see the module docstring).

    ``fault_hint`` ends the line printed after an unexpected error (e.g. "rerun the same command: it resumes").
    """
    logging.basicConfig(level=level, format=fmt)
    with signals_stop():
        try:
            return body(argv)
        except BaseException as raised:  # noqa: BLE001 - every way out gets its exit code here
            # the command is ending: a further signal must not cut its last line short
            with signals_deferred(reraise=False):
                return _exit_code(raised, fault_hint)


def _exit_code(raised: BaseException, fault_hint: str) -> int:
    error = stop_in(raised)
    if isinstance(error, JobStopped):
        print(f"error: {error}", file=sys.stderr)
        return error.exit_code
    if isinstance(error, ValueError):
        print(f"error: {error}", file=sys.stderr)
        return EXIT_BAD_INPUT
    hint = f"; {fault_hint}" if fault_hint else ""
    if is_disk_full(error):
        print(f"error: the disk is full ({type(error).__name__}: {error}): free space on it"
              f"{hint or ', then rerun the same command'}", file=sys.stderr)
        return EXIT_BUDGET_EXHAUSTED
    if not isinstance(error, Exception):  # SystemExit, KeyboardInterrupt with the handlers gone
        raise raised
    logger.error("the command failed", exc_info=error)
    print(f"error: the command failed ({type(error).__name__}: {error}){hint}", file=sys.stderr)
    return EXIT_FAULT


def console_entry(main: Callable[[Sequence[str]], int]) -> Callable[[], None]:
    """The console script (``eagle3-*``) for a command's ``main(argv) -> exit code``."""

    def entry() -> None:
        sys.exit(main(sys.argv[1:]))

    entry.__doc__ = f"Console entry point: ``{main.__module__}.main`` with the process's arguments."
    return entry
