"""SIGTERM and SIGINT while a command runs: where they stop it, and the sections they never cut short.

``jobs.cli.run_command`` installs ``stop_on_signal`` for the body: a signal raises ``JobInterrupted``
in the main thread, wherever it is, and the job winds down from there (exit 143 / 130). Some
sections must run whole even so: starting or stopping Ray (a cluster cut short in the middle of
``ray.init`` leaves its processes behind), and the wind-down itself (the summary, the manifest,
output.dir's lock: ``ray job stop`` sends SIGKILL a few seconds after its SIGTERM, and a second
Ctrl-C must not cost the first one's clean-up). Inside ``held()`` a signal is remembered instead,
and raised once the section is over, unless the section ends by an exception already on its way
out (the job is stopping anyway).
"""

from __future__ import annotations

import contextlib
import threading
from typing import Any, Iterator, Optional

from jobs.errors import JobInterrupted


class _Holding:
    """How many ``held()`` sections the main thread is in, and the first signal that came meanwhile."""

    depth = 0
    signum: Optional[int] = None


def stop_on_signal(signum: int, frame: Any) -> None:
    """The handler ``run_command`` installs for SIGTERM and SIGINT."""
    if _Holding.depth:
        if _Holding.signum is None:
            _Holding.signum = signum
        return
    raise JobInterrupted(signum)


@contextlib.contextmanager
def held(reraise: bool = True) -> Iterator[None]:
    """Run the block whole: a signal that arrives inside is remembered, then raised as ``JobInterrupted``
    after it (with ``reraise``; dropped if the block raised, or without ``reraise``). Outside the main
    thread (where no handler runs) it does nothing."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    _Holding.depth += 1
    try:
        yield
    finally:
        _Holding.depth -= 1
        signum = _Holding.signum
        if _Holding.depth == 0:
            _Holding.signum = None
    if reraise and signum is not None and _Holding.depth == 0:  # a nested section leaves it to the outermost
        raise JobInterrupted(signum)
