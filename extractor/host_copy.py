"""Device-to-host copies of captured states that overlap the next forward.

Each batch's states go into one of a few reused host buffers. On CUDA the
buffers are pinned and the copy is queued on a side stream right after the
forward, so the compute stream can start the next batch while the DMA engines
drain this one; nothing waits on a copy until its caller asks for the bytes.
A caller holds its buffer (``with pending as batch:``) until it has handed the
bytes on, then the buffer goes back to the pool.
"""

from __future__ import annotations

import queue
from types import TracebackType
from typing import Optional

import numpy as np
import torch

from extractor.types import CapturedBatch


class _HostBuffer:
    def __init__(self, tokens: int, aux_width: int, last_width: int, dtype: torch.dtype, pin: bool) -> None:
        self.aux = torch.empty((tokens, aux_width), dtype=dtype, pin_memory=pin)
        self.last = torch.empty((tokens, last_width), dtype=dtype, pin_memory=pin) if last_width else None


class PendingCopy:
    """One batch's states on their way to a host buffer; a context manager yielding them as numpy."""

    def __init__(self, copier: "HostCopier", buffer: _HostBuffer, lengths: np.ndarray,
                 done: Optional[torch.cuda.Event]) -> None:
        self._copier = copier
        self._buffer: Optional[_HostBuffer] = buffer
        self._lengths = lengths
        self._done = done

    def __enter__(self) -> CapturedBatch:
        """Waits for the copy; the arrays are views of the buffer, valid until the block ends."""
        if self._done is not None:
            self._done.synchronize()  # releases the GIL: the next forward keeps launching
        buffer = self._buffer
        assert buffer is not None, "a PendingCopy is entered once"
        tokens = int(self._lengths.sum())
        return CapturedBatch(
            lengths=self._lengths,
            aux_hidden_states=_as_numpy(buffer.aux[:tokens]),
            last_hidden_state=None if buffer.last is None else _as_numpy(buffer.last[:tokens]),
        )

    def __exit__(self, exc_type: type | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        buffer, self._buffer = self._buffer, None
        if buffer is not None:
            self._copier.give_back(buffer)


class HostCopier:
    """A pool of ``count`` host buffers sized for the largest batch, filled asynchronously on CUDA."""

    def __init__(self, device: str, dtype: torch.dtype, max_tokens: int, aux_width: int, last_width: int,
                 count: int) -> None:
        cuda = device == "cuda"
        self._free: queue.SimpleQueue[_HostBuffer] = queue.SimpleQueue()
        for _ in range(count):  # pinning takes a while: done before the first batch
            self._free.put(_HostBuffer(max_tokens, aux_width, last_width, dtype, pin=cuda))
        self._stream = torch.cuda.Stream() if cuda else None

    def start(self, lengths: np.ndarray, aux: torch.Tensor, last: Optional[torch.Tensor]) -> PendingCopy:
        """Queue the copy of ``aux`` (and ``last``) into a free buffer; blocks while all are held.

        One thread at a time (the engine's forward lock): forwards and their copies keep one order.
        """
        buffer = self._free.get()
        tokens = aux.shape[0]
        if tokens > buffer.aux.shape[0]:
            self.give_back(buffer)
            raise ValueError(f"a batch of {tokens} tokens exceeds the host buffers' {buffer.aux.shape[0]}")
        copies = [(buffer.aux, aux)] + ([(buffer.last, last)] if last is not None and buffer.last is not None else [])
        if self._stream is None:
            for host, states in copies:
                host[:tokens].copy_(states)
            return PendingCopy(self, buffer, lengths, done=None)
        self._stream.wait_stream(torch.cuda.current_stream())  # the forward that produced the states
        with torch.cuda.stream(self._stream):
            for host, states in copies:
                host[:tokens].copy_(states, non_blocking=True)
                # The allocator must not hand this block to the next forward before the copy has read it.
                states.record_stream(self._stream)
            done = torch.cuda.Event()
            done.record(self._stream)
        return PendingCopy(self, buffer, lengths, done)

    def give_back(self, buffer: _HostBuffer) -> None:
        self._free.put(buffer)


def _as_numpy(states: torch.Tensor) -> np.ndarray:
    """Raw bits as numpy (numpy has no bfloat16), sharing the buffer's memory."""
    if states.dtype == torch.bfloat16:
        states = states.view(torch.int16)
    return states.numpy()
