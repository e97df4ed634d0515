"""The tensor-parallel group's rendezvous store, listening on 127.0.0.1 only.

SGLang initialises torch.distributed with ``tcp://127.0.0.1:<nccl_port>``; for that
URL torch's rank 0 starts a TCPStore that listens on every interface whatever host
the URL names, so anyone who reaches the port could talk to the group's store.
Every rank of the group runs on this node (the extractor spawns them), so the
extractor's process hosts the store itself on a socket bound to loopback, and every
rank joins it as a client. That is torchelastic's agent-store arrangement:
``TORCHELASTIC_USE_AGENT_STORE=True`` with ``MASTER_ADDR``/``MASTER_PORT`` naming the
store (torch 2.11 and 2.14 honour it for ``tcp://`` init; 2.14 only when the URL
names that same address, which it does).

The collective libraries open listening sockets of their own on the interface they
pick: NCCL's bootstrap on the first non-loopback interface by default, gloo on the
address the host name resolves to. With the whole group on one node loopback reaches
every rank, so both are pointed at ``lo`` unless the environment already names an
interface. On an H200 (torch 2.11.0+cu130, NCCL 2.28.9) this left every socket of a
NCCL group on 127.0.0.1; without ``NCCL_SOCKET_IFNAME=lo`` its four bootstrap sockets
listened on the host's address.
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
