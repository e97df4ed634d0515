"""runtime.interrupts with real signals sent to this process: where a signal stops a command, the sections it never
cuts short, and a stop that an ``except Exception`` swallowed."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time

import pytest

from runtime.errors import ClusterLost, JobInterrupted
from runtime.interrupts import raise_if_stopped, signals_deferred, signals_stop, stop_main
from tests.conftest import REPO_ROOT
from tests.helpers import python_env


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


def test_a_watcher_thread_stops_the_main_thread_with_its_error_after_a_held_section():
    """``stop_main`` from another thread (the cluster watch): its error is raised in the main thread, where it
    waits, once a held section there is over; a loop that swallowed it raises it again."""
    lost = ClusterLost("the cluster is gone")
    steps = []
    with pytest.raises(ClusterLost) as stopped, signals_stop():
        with signals_deferred():
            watcher = threading.Thread(target=stop_main, args=(lost,))
            watcher.start()
            watcher.join()
            time.sleep(0.05)  # bytecodes run: the stop waits for the section
            steps.append("the section ran whole")
        steps.append("not reached")
    assert stopped.value is lost and steps == ["the section ran whole"]

    with signals_stop():
        try:
            threading.Thread(target=stop_main, args=(lost,)).start()
            time.sleep(5)  # interrupted well before
            raise AssertionError("not stopped")
        except ClusterLost:
            pass  # what a shard's error handler would do with it
        with pytest.raises(ClusterLost):
            raise_if_stopped()


def test_a_sigterm_after_a_ray_session_still_stops_the_command_where_it_is():
    """Ray's shutdown leaves SIGTERM's default action behind (the process ends at once, no wind-down, although Python
    still names the command's handler): a command that goes on after its Ray session (jobs.pipeline's export) must
    still stop where it is, exit 143. In a process of its own: it starts and ends a private cluster."""
    script = (
        "import os, signal, time\n"
        "from runtime.cluster.session import ray_session\n"
        "from runtime.errors import JobInterrupted\n"
        "from runtime.interrupts import signals_stop\n"
        "try:\n"
        "    with signals_stop():\n"
        "        with ray_session(''):\n"
        "            pass\n"
        "        os.kill(os.getpid(), signal.SIGTERM)\n"
        "        time.sleep(30)\n"
        "except JobInterrupted as stop:\n"
        "    print('stopped with', stop.exit_code)\n"
    )
    result = subprocess.run([sys.executable, "-c", script], cwd=REPO_ROOT, env=python_env(), capture_output=True,
                            text=True, timeout=300)
    assert (result.returncode, result.stdout.strip()) == (0, "stopped with 143"), result.stderr[-3000:]
