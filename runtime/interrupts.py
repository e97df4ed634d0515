"""SIGTERM, SIGINT and SIGHUP while a command runs: where they stop it, and the sections they never cut short.

``jobs.cli.run_command`` runs the body under ``signals_stop``: a signal raises ``JobInterrupted``
in the main thread, wherever it is, and the job winds down from there (exit 143 / 130 / 129). SIGHUP
is what a command started from an SSH session gets when the session drops: it ends the run as cleanly
as a Ctrl-C would (summary, lock, every process the run started), not with the default handler's
instant death. Some sections must run whole even so: starting or stopping Ray (a cluster cut short in the middle of
``ray.init`` leaves its processes behind), and the wind-down itself (the summary, the manifest,
output.dir's lock: ``ray job stop`` sends SIGKILL a few seconds after its SIGTERM, and a second
Ctrl-C must not cost the first one's clean-up). Inside ``signals_deferred()`` a signal is remembered instead,
and raised once the section is over, unless the section ends by an exception already on its way
out (the job is stopping anyway). A watcher thread stops the main thread the same way (``stop_main``: the
Ray cluster lost under the job).
"""

from __future__ import annotations

import _thread
import contextlib
import signal
import threading
from typing import Any, Iterator, Optional

from runtime.errors import JobInterrupted, JobStopped

SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
STOP_FROM_THREAD = signal.SIGUSR2
"""The signal ``stop_main`` simulates (``_thread.interrupt_main``: nothing is sent to the process): its handler
raises the error another thread asked the main thread to stop with."""


class _Holding:
    """How many ``signals_deferred()`` sections the main thread is in, the first stop that came meanwhile, the last one
    raised, and the error ``stop_main`` asked for."""

    depth = 0
    pending: Optional[JobStopped] = None
    raised: Optional[JobStopped] = None
    from_thread: Optional[JobStopped] = None


def stop_on_signal(signum: int, frame: Any) -> None:
    """The handler for ``SIGNALS`` (and ``STOP_FROM_THREAD``) while a command runs (``signals_stop``)."""
    stop = _Holding.from_thread if signum == STOP_FROM_THREAD else JobInterrupted(signum)
    if stop is None:
        return
    if _Holding.depth:
        if _Holding.pending is None:
            _Holding.pending = stop
        return
    _Holding.raised = stop
    raise stop


def stop_main(error: JobStopped) -> None:
    """From another thread (a watcher): stop the command as a signal would, with ``error`` raised in the main
    thread wherever it is, a Ray call included (held sections first run whole)."""
    if _Holding.from_thread is None:
        _Holding.from_thread = error
        _thread.interrupt_main(STOP_FROM_THREAD)


@contextlib.contextmanager
def signals_stop() -> Iterator[None]:
    """``SIGNALS`` raise ``JobInterrupted`` in the block (and ``stop_main`` its error); the handlers found before
    are put back after."""
    previous = {signum: signal.signal(signum, stop_on_signal) for signum in (*SIGNALS, STOP_FROM_THREAD)}
    try:
        yield
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
        _Holding.raised = None  # the command is over: what stopped it stops nothing after
        _Holding.from_thread = None


def raise_if_stopped() -> None:
    """Raise again the stop (``JobInterrupted``, or ``stop_main``'s error) that an ``except Exception`` on its way
    took for another error (a shard's failure, say): a loop that calls this each turn stops all the same."""
    if _Holding.raised is not None:
        raise _Holding.raised


@contextlib.contextmanager
def signals_deferred(reraise: bool = True) -> Iterator[None]:
    """Run the block whole: a stop that arrives inside is remembered, then raised after it (with ``reraise``;
    dropped if the block raised, or without ``reraise``). Outside the main thread (where no handler runs) it
    does nothing."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    _Holding.depth += 1
    try:
        yield
    finally:
        _Holding.depth -= 1
        stop = _Holding.pending
        if _Holding.depth == 0:
            _Holding.pending = None
    if reraise and stop is not None and _Holding.depth == 0:  # a nested section leaves it to the outermost
        _Holding.raised = stop
        raise stop
