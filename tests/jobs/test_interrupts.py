"""jobs.interrupts with real signals sent to this process: where a signal stops a command, the sections it never
cuts short, and a stop that an ``except Exception`` swallowed."""

from __future__ import annotations

import os
import signal

import pytest

from jobs.errors import JobInterrupted
from jobs.interrupts import signals_deferred, raise_if_stopped, signals_stop


def send(signum: int) -> None:
    os.kill(os.getpid(), signum)  # delivered to the main thread before the next bytecode


def test_a_signal_stops_the_command_where_it_is_and_the_handlers_go_back_after():
    before = signal.getsignal(signal.SIGTERM)
    with pytest.raises(JobInterrupted) as stopped, signals_stop():
        send(signal.SIGTERM)
        raise AssertionError("not reached")
    assert stopped.value.exit_code == 143
    assert signal.getsignal(signal.SIGTERM) is before
    raise_if_stopped()  # the command is over: nothing is left pending


def test_a_held_section_runs_whole_and_the_signal_follows_it():
    steps = []
    with pytest.raises(JobInterrupted) as stopped, signals_stop():
        with signals_deferred():
            send(signal.SIGINT)
            steps.append("after the signal")
            with signals_deferred():  # nested: the outermost section raises it
                send(signal.SIGTERM)
                steps.append("nested")
            steps.append("end of the section")
        steps.append("not reached")
    assert steps == ["after the signal", "nested", "end of the section"]
    assert stopped.value.exit_code == 130  # the first signal


def test_a_held_signal_is_dropped_when_the_job_is_stopping_anyway():
    with signals_stop():
        with signals_deferred(reraise=False):
            send(signal.SIGTERM)
        with pytest.raises(ValueError):  # the section's own end wins
            with signals_deferred():
                send(signal.SIGTERM)
                raise ValueError("the error the job stops with")
        raise_if_stopped()  # neither signal was raised


def test_a_stop_swallowed_as_another_error_is_raised_again():
    with signals_stop():
        try:
            send(signal.SIGTERM)
        except Exception:  # noqa: BLE001 - what a shard's error handler would do with it
            pass
        with pytest.raises(JobInterrupted):
            raise_if_stopped()
