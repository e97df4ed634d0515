"""Noticing that the Ray cluster is gone while the job runs on it.

When the head's GCS stops (``ray stop`` on the head, a crash, a reboot), nothing tells the driver: its Ray calls
wait, and after ``gcs_rpc_server_reconnect_timeout_s`` (60 s) Ray ends the driver's process from inside (exit 1,
no Python code run), leaving the summary saying ``running`` and the lock's record behind. ``ClusterWatch`` connects
to the GCS's port every ``CHECK_S``; once it has refused (or timed out) for ``LOST_AFTER_S`` it stops the main
thread with ``ClusterLost`` (``runtime.interrupts.stop_main``), which winds the run down without asking Ray anything
more: the summary, the manifest and the lock are written and released well before Ray's own end comes.
"""

from __future__ import annotations

import socket
import threading
import time
from typing import Optional

from runtime.errors import RERUN, ClusterLost
from runtime.interrupts import stop_main

CHECK_S = 1.0
LOST_AFTER_S = 10.0
"""Long enough for a GCS with fault tolerance (an external Redis) to come back, short enough that the wind-down
ends well before Ray's own 60 s."""
CONNECT_TIMEOUT_S = 2.0


class ClusterWatch:
    """``with ClusterWatch(gcs_address):`` watches the GCS at ``host:port`` from a thread of its own."""

    def __init__(self, gcs_address: str) -> None:
        self.address = gcs_address
        host, _, port = gcs_address.rpartition(":")
        self._target = (host.strip("[]"), int(port))
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="cluster-watch", daemon=True)
        self.lost: Optional[ClusterLost] = None

    def __enter__(self) -> "ClusterWatch":
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def _answers(self) -> bool:
        try:
            with socket.create_connection(self._target, timeout=CONNECT_TIMEOUT_S):
                return True
        except OSError:
            return False

    def _watch(self) -> None:
        silent_since: Optional[float] = None
        while not self._stop.wait(CHECK_S):
            if self._answers():
                silent_since = None
                continue
            now = time.monotonic()
            silent_since = silent_since if silent_since is not None else now
            if now - silent_since >= LOST_AFTER_S:
                self.lost = ClusterLost(
                    f"the Ray cluster is gone: its GCS at {self.address} has not answered for {LOST_AFTER_S:.0f} s "
                    "(the head was stopped, `ray stop`, or crashed). The run stopped without it; the manifest keeps "
                    f"every shard it recorded. Start the cluster again (or unset ray.address for a private one): "
                    f"{RERUN}"
                )
                stop_main(self.lost)
                return
