"""The tensor-parallel group's rendezvous store, listening on 127.0.0.1 only.

For SGLang's ``tcp://127.0.0.1:<nccl_port>`` torch's rank 0 starts a TCPStore that listens on every
interface, so anyone who reaches the port could talk to the group's store. Every rank runs on this
node, so the extractor's process hosts the store on loopback and every rank joins it as a client:
torchelastic's agent-store arrangement (``TORCHELASTIC_USE_AGENT_STORE=True``, ``MASTER_ADDR`` and
``MASTER_PORT`` naming the store; torch 2.11 and 2.14 honour it for ``tcp://`` init, 2.14 only when
the URL names that same address, which it does). NCCL's and gloo's own listening sockets are pointed
at ``lo`` unless the environment names an interface. What this was measured to do on an H200:
docs/architecture.md ("Safe by default").
"""

from __future__ import annotations

import os
import socket
from typing import Any

LOOPBACK = "127.0.0.1"
LOOPBACK_INTERFACE = "lo"


class LoopbackStore:
    """A torch TCPStore server on 127.0.0.1:<port>, set up as the store every rank of this node joins.

    Create it in the process that spawns the ranks, before spawning them: they inherit the
    environment that points them at it.
    """

    def __init__(self, world_size: int) -> None:
        import torch.distributed as dist

        listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        listener.bind((LOOPBACK, 0))
        listener.listen()
        self.port: int = listener.getsockname()[1]
        # The store owns the listening socket from here on (it closes it when it goes).
        self._store: Any = dist.TCPStore(
            LOOPBACK, self.port, world_size=world_size, is_master=True, wait_for_workers=False,
            master_listen_fd=listener.detach(),
        )
        os.environ.update(
            MASTER_ADDR=LOOPBACK, MASTER_PORT=str(self.port), TORCHELASTIC_USE_AGENT_STORE=str(True)
        )
        for variable in ("NCCL_SOCKET_IFNAME", "GLOO_SOCKET_IFNAME"):
            os.environ.setdefault(variable, LOOPBACK_INTERFACE)

    def close(self) -> None:
        self._store = None
