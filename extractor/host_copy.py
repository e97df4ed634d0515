"""Device-to-host copies of captured states that overlap the next forward.

Each batch's states go into one of a few reused host buffers. On CUDA the
buffers are pinned and the copy runs on a side stream while the compute stream
runs the next batch; nothing waits on a copy until its caller asks for the bytes.
The copy goes to the copy engine only once the next forward has launched
(``start`` of the next batch), or at once when no forward is on its way
(``forward_turn``): SGLang's forward reads sizes back to the host (small
copies, then a wait), and a batch's states that take the copy engine just then
hold those reads up. Measured on an H200 with nothing else beside the forward:
it lost 3.9% beside the copy queued at once, 1.8% beside the copy queued so.
With ``piece_bytes`` the copy goes in pieces, each queued by the batch's own
caller once the one before has landed, so that a read the forward makes
mid-way waits for one piece at most instead of the batch's whole copy (queued
all at once, pieces changed nothing on the H200: they wait in one queue).
With ``by_kernel`` a kernel stores the states into the pinned buffer itself
(``extractor.kernel_copy``), the batch whole, and the copy engine carries
SGLang's reads alone.
A caller holds its buffer (``with pending as batch:``) until it has handed the
bytes on, then the buffer goes back to the pool. With fp8 storage the states
are quantized on the device before the copy, so the copy moves half the bytes.
Each token's states are also checked for NaN/Inf on the device, per layer (one
bool per token and layer crosses to the host), and reduced per sample on the
host: the writer acts on those flags and never scans the states itself. Where
the time goes (the copy's wait, the device's check, quantization and copy) is
added to the engine's ``StageTimes``.
"""

from __future__ import annotations

import contextlib
import queue
import threading
from types import TracebackType
from typing import Callable, Iterator, Optional

import numpy as np
import torch

from extractor.quantize import quantize_fp8
from extractor.timing import DeviceSpans, StageTimes
from extractor.types import CapturedBatch


class _HostBuffer:
    """Host tensors for the largest batch: the states in the stored dtype and, with fp8, their scales."""

    def __init__(self, tokens: int, widths: dict[str, tuple[int, torch.dtype]], pin: bool) -> None:
        self.tensors = {
            name: torch.empty((tokens, width), dtype=dtype, pin_memory=pin) for name, (width, dtype) in widths.items()
        }

    @property
    def tokens(self) -> int:
        return next(iter(self.tensors.values())).shape[0]


class PendingCopy:
    """One batch's states on their way to a host buffer; a context manager yielding them as numpy."""

    def __init__(self, copier: "HostCopier", buffer: _HostBuffer, lengths: np.ndarray,
                 done: Optional[torch.cuda.Event], spans: Optional[DeviceSpans] = None) -> None:
        self._copier = copier
        self._buffer: Optional[_HostBuffer] = buffer
        self._lengths = lengths
        self._done = done
        """CUDA: recorded on the copy stream once the copy is queued there (``HostCopier``); None on CPU."""
        self._spans = spans
        self._never_queued: Optional[BaseException] = None
        """Why this copy never went to the device (``never_queued``), if it did not."""

    def never_queued(self, error: BaseException) -> None:
        """The thread queueing this batch's copy failed before it (``HostCopier._release_deferred``): its ``done`` will
        never be recorded, so a wait on it would return at once over another batch's bytes. Entering raises instead."""
        self._never_queued = error

    def __enter__(self) -> CapturedBatch:
        """Waits for the copy; the arrays are views of the buffer, valid until the block ends."""
        if self._done is not None:
            try:
                with self._copier.times.stage("copy_wait"):
                    self._copier.wait_until_queued(self)
                    if self._never_queued is not None:
                        raise RuntimeError("this batch's states were never copied to the host: queueing an "
                                           "earlier batch's copy failed") from self._never_queued
                    self._done.synchronize()  # releases the GIL: the next forward keeps launching
            except BaseException:
                self.__exit__(None, None, None)  # the buffer goes back: a later start would wait for it forever
                raise
            if self._spans is not None:
                self._spans.add_to(self._copier.times)
        buffer = self._buffer
        assert buffer is not None, "a PendingCopy is entered once"
        tokens = int(self._lengths.sum())
        arrays = {name: _as_numpy(tensor[:tokens]) for name, tensor in buffer.tensors.items()}
        # Samples are never empty (the input checks refuse empty rows), as reduceat needs.
        starts = np.concatenate([[0], np.cumsum(self._lengths[:-1])])
        return CapturedBatch(
            lengths=self._lengths,
            aux_hidden_states=arrays["aux_hidden_states"],
            last_hidden_state=arrays.get("last_hidden_state"),
            aux_scales=arrays.get("aux_scales"),
            last_scales=arrays.get("last_scales"),
            finite=np.logical_and.reduceat(arrays["finite"], starts, axis=0),
        )

    def __exit__(self, exc_type: type | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        buffer, self._buffer = self._buffer, None
        if buffer is not None:
            self._copier.give_back(buffer)


class HostCopier:
    """A pool of ``count`` host buffers sized for the largest batch, filled asynchronously on CUDA.

    With ``fp8`` the states are quantized on their device first (``extractor.quantize``), so
    the copy and everything after it carry one byte per element plus a float32 scale per
    token and layer.
    """

    def __init__(self, device: str, dtype: torch.dtype, max_tokens: int, layers: int, hidden_size: int,
                 last_hidden_state: bool, fp8: bool, count: int, times: StageTimes, piece_bytes: int = 0,
                 by_kernel: bool = False) -> None:
        cuda = device == "cuda"
        self.times = times
        """The engine's: the copy's wait and device spans are added to it."""
        self._kernel_copy: Optional[Callable[[torch.Tensor, torch.Tensor], None]] = None
        """CUDA, ``by_kernel``: what stores each batch's states into its host buffer, whole, in place of the copy
        engine (``extractor.kernel_copy``)."""
        if by_kernel and cuda:
            from extractor.kernel_copy import copy_to_pinned, warm_up  # Triton: only where a kernel copies

            warm_up()
            self._kernel_copy = copy_to_pinned
        self._piece_bytes = 0 if self._kernel_copy else piece_bytes
        """0: a batch's copy is queued whole by the next forward's ``start``; else in pieces of about this many
        bytes, each queued by the batch's caller once the one before has landed (``wait_until_queued``)."""
        self._pacing = threading.Lock()
        """Held by the caller sending its batch's pieces: one batch's pieces at a time on the copy stream."""
        self._layers = layers
        self._fp8 = fp8
        stored = torch.uint8 if fp8 else dtype  # fp8 travels as its raw bytes (copies and numpy know uint8)
        widths = {"aux_hidden_states": (layers * hidden_size, stored)}
        if fp8:
            widths["aux_scales"] = (layers, torch.float32)
        if last_hidden_state:
            widths["last_hidden_state"] = (hidden_size, stored)
            if fp8:
                widths["last_scales"] = (1, torch.float32)
        widths["finite"] = (layers + (1 if last_hidden_state else 0), torch.bool)
        self._free: queue.SimpleQueue[_HostBuffer] = queue.SimpleQueue()
        for _ in range(count):  # pinning takes a while: done before the first batch
            self._free.put(_HostBuffer(max_tokens, widths, pin=cuda))
        self._stream = torch.cuda.Stream() if cuda else None
        self._deferred: list[_DeferredCopy] = []
        """Copies prepared on the compute stream, not yet queued on the copy stream (CUDA), oldest first."""
        self._turns = threading.Condition()
        self._forwards_coming = 0
        self.batch_bytes = sum(width * dtype.itemsize for width, dtype in widths.values()) * max_tokens
        """Bytes of the largest batch's states as they leave the host buffer."""

    def _device_tensors(self, aux: torch.Tensor, last: Optional[torch.Tensor]) -> dict[str, torch.Tensor]:
        """What goes to the host, by buffer name; with fp8 quantized here, on the compute stream."""
        if not self._fp8:
            finite = [finite_per_token(aux, self._layers)] + ([finite_per_token(last, 1)] if last is not None else [])
            return {
                "aux_hidden_states": aux, **({"last_hidden_state": last} if last is not None else {}),
                "finite": torch.cat(finite, dim=1),
            }
        values, scales = quantize_fp8(aux, self._layers)
        tensors = {"aux_hidden_states": values.view(torch.uint8), "aux_scales": scales}
        if last is not None:
            values, scales = quantize_fp8(last, 1)
            tensors.update(last_hidden_state=values.view(torch.uint8), last_scales=scales)
        # A slice's scale is its amax / 448, and amax propagates NaN and Inf: the scales tell.
        scales = [tensors["aux_scales"]] + ([tensors["last_scales"]] if last is not None else [])
        tensors["finite"] = torch.isfinite(torch.cat(scales, dim=1))
        return tensors

    def start(self, lengths: np.ndarray, aux: torch.Tensor, last: Optional[torch.Tensor],
              spans: Optional[DeviceSpans] = None) -> PendingCopy:
        """Queue the copy of ``aux`` (and ``last``) into a free buffer; blocks while all are held. ``spans``
        (CUDA) gets the device work of the NaN/Inf check and quantization (``capture``) and of the copy.

        One thread at a time (the engine's forward lock): forwards and their copies keep one order. Called
        once the batch's forward has launched: the copies deferred before it are queued first, before a
        free buffer is waited for (their callers give their buffers back only once they have them).
        """
        if self._stream is not None:
            with self._turns:
                self._release_deferred()
        buffer = self._free.get()
        tokens = aux.shape[0]
        if tokens > buffer.tokens:
            self.give_back(buffer)
            raise ValueError(f"a batch of {tokens} tokens exceeds the host buffers' {buffer.tokens}")
        copies = [(buffer.tensors[name], states) for name, states in self._device_tensors(aux, last).items()
                  if name in buffer.tensors]
        if self._stream is None:
            for host, states in copies:
                host[:tokens].copy_(states)
            return PendingCopy(self, buffer, lengths, done=None)
        if spans is not None:
            spans.mark("capture")
        ready = _waited_event()
        ready.record(torch.cuda.current_stream())  # the forward that produced the states, and their check
        done = _waited_event()
        pending = PendingCopy(self, buffer, lengths, done, spans)
        with self._turns:
            # The states stay referenced until their copy is queued: the allocator must not hand their
            # blocks to the next forward before then.
            self._deferred.append(_DeferredCopy(pending, ready, done, spans, tokens, copies))
        return pending

    @contextlib.contextmanager
    def forward_turn(self) -> Iterator[None]:
        """Around one caller's wait for the device and its forward (``start`` included): while a forward is on its
        way, the batch before it waits for that forward's launch to go to the copy engine."""
        with self._turns:
            self._forwards_coming += 1
        try:
            yield
        finally:
            with self._turns:
                self._forwards_coming -= 1
                self._turns.notify_all()

    def wait_until_queued(self, pending: "PendingCopy") -> None:
        """Return once ``pending``'s copy is on the copy stream: released by the next forward's ``start``, or here
        when no forward is on its way; in pieces, queued here, each piece once the one before has landed."""
        with self._turns:
            while self._forwards_coming and not self._released(pending):
                self._turns.wait()
            if not (self._piece_bytes and self._forwards_coming):  # in pieces, a newer batch waits for its forward
                self._release_deferred()
            mine = [copy for copy in self._deferred if copy.pending is pending]
            self._deferred = [copy for copy in self._deferred if copy.pending is not pending]
        if mine:  # in pieces (a whole copy was queued by _release_deferred)
            with self._pacing:
                for copy in mine:
                    self._queue(copy)

    def _released(self, pending: "PendingCopy") -> bool:
        return not any(copy.pending is pending and not copy.released for copy in self._deferred)

    def _release_deferred(self) -> None:
        """Every deferred copy may go to the copy engine now: whole copies are queued here, oldest first; copies in
        pieces are left to their callers (the caller holds ``_turns``)."""
        if not self._deferred:
            return
        if self._piece_bytes:
            for copy in self._deferred:
                copy.released = True
        else:
            deferred, self._deferred = self._deferred, []
            for index, copy in enumerate(deferred):
                try:
                    self._queue(copy)
                except BaseException as error:  # raised here, in the next forward's thread: tell each owner too
                    for lost in deferred[index:]:
                        lost.pending.never_queued(error)
                    self._turns.notify_all()
                    raise
        self._turns.notify_all()

    def _queue(self, copy: "_DeferredCopy") -> None:
        """One batch's copy on the copy stream, whole or piece by piece, by the copy engine or the kernel. In
        pieces this thread waits (without the GIL) for the batch's forward to end first, so that nothing on the copy
        stream waits for a forward, then queues each piece once the one before has landed."""
        assert self._stream is not None
        landed = _waited_event() if self._piece_bytes else None
        if landed is None:
            self._stream.wait_event(copy.ready)
        else:
            copy.ready.synchronize()
        spans = copy.spans
        queued = False
        with torch.cuda.stream(self._stream):
            if spans is not None:
                spans.mark(None, self._stream)
            for host, states in copy.copies:
                # The allocator must not hand this block to a later forward before the copy has read it.
                states.record_stream(self._stream)
                row_bytes = states.shape[1] * states.element_size()
                for start, end in pieces(copy.tokens, row_bytes, self._piece_bytes):
                    if landed is not None and queued:
                        landed.record(self._stream)
                        landed.synchronize()
                    if self._kernel_copy is None:
                        host[start:end].copy_(states[start:end], non_blocking=True)
                    else:
                        self._kernel_copy(host[start:end], states[start:end])
                    queued = True
            if spans is not None:
                spans.mark("copy", self._stream)
            copy.done.record(self._stream)

    def give_back(self, buffer: _HostBuffer) -> None:
        self._free.put(buffer)


class _DeferredCopy:
    """One batch's copy as ``HostCopier.start`` prepared it: what goes where once it is queued."""

    def __init__(self, pending: PendingCopy, ready: torch.cuda.Event, done: torch.cuda.Event,
                 spans: Optional[DeviceSpans], tokens: int, copies: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        self.pending = pending
        self.ready = ready
        """Recorded on the compute stream after the states and their check: the copy waits for it."""
        self.done = done
        """``pending``'s: recorded on the copy stream after the copy."""
        self.spans = spans
        self.tokens = tokens
        self.copies = copies
        """(host buffer tensor, device states) pairs."""
        self.released = False
        """In pieces: the next forward has launched (or none is coming); its caller queues it."""


def _waited_event() -> torch.cuda.Event:
    """An event a thread beside the forward waits on. Blocking: the waiting thread sleeps until the event
    fires; CUDA's default wait polls the driver for the whole forward from a second thread, beside the
    forward thread's own launches."""
    return torch.cuda.Event(blocking=True)


def pieces(rows: int, row_bytes: int, piece_bytes: int) -> list[tuple[int, int]]:
    """Row ranges [start, end) covering ``rows`` rows in pieces of about ``piece_bytes`` (at least a row each);
    one range when ``piece_bytes`` is 0."""
    step = rows if piece_bytes <= 0 else max(1, piece_bytes // max(1, row_bytes))
    return [(start, min(start + step, rows)) for start in range(0, rows, max(1, step))]


def finite_per_token(states: torch.Tensor, groups: int) -> torch.Tensor:
    """[T, groups*H] -> [T, groups] bool: whether each token's slice of each group is free of NaN/Inf.

    One reduction reads the states once and keeps only [T, groups] values: a slice's minimum and
    maximum are finite exactly when all of it is (aminmax propagates NaN; -Inf is a minimum, +Inf
    a maximum)."""
    lowest, highest = torch.aminmax(states.reshape(states.shape[0], groups, -1), dim=2)
    return torch.isfinite(lowest) & torch.isfinite(highest)


def _as_numpy(states: torch.Tensor) -> np.ndarray:
    """Raw bits as numpy (numpy has no bfloat16), sharing the buffer's memory."""
    if states.dtype == torch.bfloat16:
        states = states.view(torch.int16)
    return states.numpy()
