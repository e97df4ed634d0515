"""Which Ray cluster the driver runs on, and joining it.

- Under ``ray job submit``: the cluster that runs the job (Ray tells the driver through
  the environment it starts it with).
- ``ray.address`` or ``RAY_ADDRESS`` set: that cluster, after a short reachability check,
  with an error that names the address and what to check.
- Neither: a private cluster for this run alone, listening on 127.0.0.1 only. It never
  joins a head that happens to run on the machine (``ray start --head``), which Ray's
  plain ``ray.init()`` would try, at whatever address it guesses for this host.
"""

from __future__ import annotations

import contextlib
import ipaddress
import json
import logging
import os
import secrets
import signal
import socket
import sys
import threading
from pathlib import Path
from typing import Any, Iterator

import psutil
import ray

from common.pythonpath import checkout_first
from runtime.cluster.submission import RAY_JOB_ENV, inside_ray_job
from runtime.errors import ClusterLost, ConfigError, stop_in
from runtime.interrupts import SIGNALS, signals_deferred

logger = logging.getLogger(__name__)

REPO_ROOT = Path(__file__).resolve().parents[2]
LOOPBACK = "127.0.0.1"
# Seconds to reach a named cluster's GCS port before giving up with an explanation.
JOIN_TIMEOUT_S = 10.0
# Ray picks its node IP from this switch (named for Windows and macOS, where it is off by
# default): off means 127.0.0.1 for every process the cluster starts.
RAY_CLUSTER_SWITCH = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"
RAY_AUTH_SETTINGS = ("RAY_AUTH_MODE", "RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH")
"""Ray's authentication settings: the mode, a token, a file holding one."""
RAY_WORKER_LOGGER = "ray._private.worker"
"""The logger of ``ray.init`` (Ray 2.60)."""


def starts_private_cluster(address: str) -> bool:
    """Whether a job started now with ``ray.address=address`` runs on a private cluster of this host."""
    return not (inside_ray_job() or address or os.environ.get("RAY_ADDRESS"))


def this_host_cpus() -> int:
    """The CPUs a private cluster started here would have: Ray's own count (cgroup limits included)."""
    from ray._private import utils

    count = getattr(utils, "get_num_cpus", None)  # checked on Ray 2.60
    return int(count()) if count is not None else os.cpu_count() or 1


@contextlib.contextmanager
def ray_session(address: str) -> Iterator[None]:
    """Run the body connected to Ray (see the module docstring for which cluster); disconnect after, and shut
    a private cluster down with every process it started (also when its head was lost: ``ClusterLost``). Starting
    and stopping run whole: a signal meanwhile is held until Ray is up (then raised: the body never runs) or down
    (``runtime.interrupts.signals_deferred``)."""
    if ray.is_initialized():
        yield
        return
    session_over = threading.Event()
    private = starts_private_cluster(address)
    try:
        with signals_deferred():
            _connect_off_main_thread(address, session_over)
        yield
    except BaseException as error:
        if isinstance(stop_in(error), ClusterLost):
            if private:  # its head is gone: what is left of it (raylet, agents, workers) is ended here
                _end_processes_left()
            logger.info("disconnecting from the lost Ray cluster (Ray waits for its GCS a while first)")
        raise
    finally:
        with signals_deferred(reraise=False):  # the run has recorded how it ended; the process ends next
            ray.shutdown()
            _restore_handlers()  # a command may go on after the session (jobs.pipeline's export)
        session_over.set()


def _end_processes_left() -> None:
    """SIGKILL every process this one started (the private cluster's: Ray's own shutdown, without its GCS, leaves
    its agents behind); every descendant first, so that none is orphaned before it is found."""
    processes = psutil.Process().children(recursive=True)
    for process in processes:
        with contextlib.suppress(psutil.Error):
            process.kill()
    psutil.wait_procs(processes, timeout=10)


def resolve_device(requested: str, tp_size: int) -> str:
    """``model.device`` made concrete for this cluster: ``auto`` is cuda where it has ``tp_size`` GPUs."""
    gpus = int(ray.cluster_resources().get("GPU", 0))
    if requested == "auto":
        return "cuda" if gpus >= tp_size else "cpu"
    if requested == "cuda" and gpus < tp_size:
        raise ValueError(f"model.device=cuda with model.tp_size={tp_size}, but the Ray cluster has {gpus} GPUs")
    return requested


def _worker_env() -> dict[str, Any]:
    # Workers import this repository's packages from its root (or from site-packages once installed).
    return {"env_vars": {"PYTHONPATH": checkout_first(REPO_ROOT)}}


def _joined_runtime_env(job: dict[str, Any]) -> dict[str, Any]:
    """What the workers of a cluster this driver joins run with, on top of the job's own runtime env ``job``.

    Their Python is the driver's, which holds this project (``jobs.environment`` checked it), unless the job's
    runtime env names one: a joined cluster's raylets start workers with the Python that started Ray, which
    may lack it. Under ``ray job submit --working-dir`` the workers import from it; otherwise from here.
    """
    extra: dict[str, Any] = {} if "py_executable" in job else {"py_executable": sys.executable}
    if not (job.get("working_dir") or "PYTHONPATH" in (job.get("env_vars") or {})):
        extra.update(_worker_env())
    return extra


class _NotMainThread(logging.Filter):
    """Ray's warning that it set no SIGTERM handler outside the main thread: that is the point."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "SIGTERM handler is not set" not in record.getMessage()


def _connect_off_main_thread(address: str, session_over: threading.Event) -> None:
    """``ray.init`` in a thread of its own, which lives until ``session_over``; the main thread waits for it.

    On the main thread ``ray.init`` replaces the SIGTERM handler with its own ``sys.exit`` (checked on
    Ray 2.60), which would end the driver in the middle of starting a cluster and leave the processes
    started so far (the raylet's agents) behind; off it, Ray leaves the handler alone. The thread must
    outlive the session: Ray has the kernel end the processes it starts when their parent *thread* ends
    (``PR_SET_PDEATHSIG``). SIGHUP is blocked in that thread: what it starts is not ended by a dropped SSH
    session; the driver (whose main thread takes SIGHUP) stops it.
    """
    outcome: dict[str, BaseException] = {}
    connected = threading.Event()

    def connect() -> None:
        # The processes a private cluster starts (GCS, raylet, agents, workers) are children of this thread and
        # inherit its signal mask: with SIGHUP blocked, a dropped SSH session (SIGHUP to the whole process group)
        # does not kill the cluster under the driver, which winds the run down on it as it does on SIGTERM.
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGHUP})
        try:
            _connect(address)
        except BaseException as error:  # noqa: BLE001 - raised again on the main thread
            outcome["error"] = error
        finally:
            connected.set()
        session_over.wait()

    quiet = _NotMainThread()
    ray_logger = logging.getLogger(RAY_WORKER_LOGGER)
    ray_logger.addFilter(quiet)
    try:
        threading.Thread(target=connect, name="ray-session", daemon=True).start()
        while not connected.wait(0.1):
            pass
    finally:
        ray_logger.removeFilter(quiet)
    _restore_handlers()
    if "error" in outcome:
        raise outcome["error"]


def _restore_handlers() -> None:
    """Ray's core worker puts its own C-level handler in front of SIGTERM when it connects (it logs a stack, then
    calls the one before it), and its shutdown leaves the default one there (SIGTERM then ends the process at once,
    although Python still names the command's handler): the command's handlers go back in front."""
    for signum in SIGNALS:
        signal.signal(signum, signal.getsignal(signum))


def _connect(address: str) -> None:
    if inside_ray_job():
        job = json.loads(os.environ.get(RAY_JOB_ENV, "{}")).get("runtime_env") or {}
        ray.init(address=os.environ.get("RAY_ADDRESS") or "auto", runtime_env=_joined_runtime_env(job))
    elif address or os.environ.get("RAY_ADDRESS"):
        _join(address or os.environ["RAY_ADDRESS"], "ray.address" if address else "RAY_ADDRESS")
    else:
        _start_private_cluster()


def _start_private_cluster() -> None:
    _use_loopback()
    _use_run_token()
    context = ray.init(address="local", runtime_env=_worker_env())
    # Its dashboard takes 8265, or the next free port where another cluster holds that one: the one it took.
    dashboard = f", its dashboard on http://{context.dashboard_url}" if context.dashboard_url else ""
    logger.info("started a private Ray cluster on %s for this run (no ray.address or RAY_ADDRESS given)%s",
                LOOPBACK, dashboard)


def _join(address: str, source: str) -> None:
    if address.startswith(("http://", "https://")):
        raise ConfigError(
            f"{source}={address} is a dashboard URL, which `ray job` commands use; the driver joins a "
            "cluster at its GCS address (host:6379). Submit the job with `ray job submit --address "
            f"{address} -- python -m jobs.extract ...`, or unset {source} to run on a private local cluster"
        )
    host, port = _host_port(address)
    if host is not None:
        _check_reachable(address, source, host, port)
        if _is_loopback(host):
            _use_loopback()  # a head on loopback registered its node as 127.0.0.1: this driver must too
    try:
        ray.init(address=address, runtime_env=_joined_runtime_env({}))
    except (ConnectionError, RuntimeError, TimeoutError) as error:
        raise ConfigError(
            f"could not join the Ray cluster at {source}={address}: {' '.join(str(error).split())[:300]}. "
            f"Check `ray status --address {address}` on that machine, or unset {source} to run on a "
            "private local cluster"
        ) from None


def _host_port(address: str) -> tuple[str | None, int]:
    """(host, port) of a ``host:port`` GCS address; (None, 0) for ``auto`` and ``ray://`` client URLs."""
    if address == "auto" or "://" in address:
        return None, 0
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit():
        raise ConfigError(f"ray address {address!r}: write it as HOST:PORT (the head's GCS port, 6379 by default)")
    return host.strip("[]"), int(port)


def _check_reachable(address: str, source: str, host: str, port: int) -> None:
    try:
        with socket.create_connection((host, port), timeout=JOIN_TIMEOUT_S):
            pass
    except OSError as error:
        raise ConfigError(
            f"no Ray cluster answers at {source}={address} ({error}). Check that its head runs "
            f"(`ray status --address {address}`), that {port} is its GCS port (6379 by default; the "
            "dashboard's 8265 is for `ray job` commands) and that this machine can reach it; or unset "
            f"{source} to run on a private local cluster"
        ) from None


def _is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


def _use_run_token() -> None:
    """Token authentication for the private cluster with a token of this run's own, which its processes inherit.

    Left to itself, Ray 2.60 turns token authentication on for a new local cluster and writes a token into
    ~/.ray/auth_token, which every Ray started on the machine later picks up. A mode or token the user set
    is theirs. Ray read the mode when it was imported: its config is read again (checked on Ray 2.60).
    """
    if any(name in os.environ for name in RAY_AUTH_SETTINGS):
        return
    from ray._raylet import AuthenticationTokenLoader, Config

    os.environ[RAY_AUTH_SETTINGS[0]] = "token"
    os.environ[RAY_AUTH_SETTINGS[1]] = secrets.token_hex(32)
    Config.initialize("")
    AuthenticationTokenLoader.instance().reset_cache()


def _use_loopback() -> None:
    """Make Ray pick 127.0.0.1 as this node's address, here and in every process it starts.

    The environment variable reaches the processes ``ray.init`` starts (GCS, raylet,
    agents, workers); ``ray_constants.ENABLE_RAY_CLUSTER`` is the same switch as this
    process read it when it imported Ray (checked on Ray 2.60).
    """
    from ray._private import ray_constants

    if not hasattr(ray_constants, "ENABLE_RAY_CLUSTER"):
        raise RuntimeError(
            f"Ray {ray.__version__} has no ray_constants.ENABLE_RAY_CLUSTER; the private cluster could not "
            "be kept on 127.0.0.1. Set ray.address to a cluster you started, or use Ray 2.60"
        )
    os.environ[RAY_CLUSTER_SWITCH] = "0"
    ray_constants.ENABLE_RAY_CLUSTER = False
