"""SIGTERM and SIGINT while a command runs: where they stop it, and the sections they never cut short.

``jobs.cli.run_command`` runs the body under ``signals_stop``: a signal raises ``JobInterrupted``
in the main thread, wherever it is, and the job winds down from there (exit 143 / 130). Some
sections must run whole even so: starting or stopping Ray (a cluster cut short in the middle of
``ray.init`` leaves its processes behind), and the wind-down itself (the summary, the manifest,
output.dir's lock: ``ray job stop`` sends SIGKILL a few seconds after its SIGTERM, and a second
Ctrl-C must not cost the first one's clean-up). Inside ``signals_deferred()`` a signal is remembered
instead, and raised once the section is over, unless the section ends by an exception already on its
way out (the job is stopping anyway).
"""

from __future__ import annotations

import contextlib
import signal
import threading
from typing import Any, Iterator, Optional

from jobs.errors import JobInterrupted


SIGNALS = (signal.SIGTERM, signal.SIGINT)


class _Holding:
    """How many ``signals_deferred()`` sections the main thread is in, the first signal that came meanwhile, and the
    last one raised."""

    depth = 0
    signum: Optional[int] = None
    raised: Optional[int] = None


def stop_on_signal(signum: int, frame: Any) -> None:
    """The handler for SIGTERM and SIGINT while a command runs (``signals_stop``)."""
    if _Holding.depth:
        if _Holding.signum is None:
            _Holding.signum = signum
        return
    _Holding.raised = signum
    raise JobInterrupted(signum)


@contextlib.contextmanager
def signals_stop() -> Iterator[None]:
    """SIGTERM and SIGINT raise ``JobInterrupted`` in the block; the handlers found before are put back after."""
    previous = {signum: signal.signal(signum, stop_on_signal) for signum in SIGNALS}
    try:
        yield
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
        _Holding.raised = None  # the command is over: what stopped it stops nothing after


def raise_if_stopped() -> None:
    """Raise again the ``JobInterrupted`` of a signal that an ``except Exception`` on its way took for another
    error (a shard's failure, say): a loop that calls this each turn stops all the same."""
    if _Holding.raised is not None:
        raise JobInterrupted(_Holding.raised)


@contextlib.contextmanager
def signals_deferred(reraise: bool = True) -> Iterator[None]:
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
        _Holding.raised = signum
        raise JobInterrupted(signum)
