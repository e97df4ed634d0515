"""Where an extractor's time goes: per stage, the wall and CPU seconds of the thread that ran it, and device time.

The forward thread's stages run one batch after the other under the forward lock:
``prepare`` (SGLang's batch structures for the packed EXTEND forward), ``forward`` (the call
that launches the model's kernels: on CUDA it returns before they have run, unless SGLang
synchronizes inside), ``capture`` (the final-state tap, the NaN/Inf check and fp8
quantization launched, the copy to the host queued); bare prefill adds ``sync`` (waiting for
the device). Their CPU seconds against the run's wall time say how busy the thread that feeds
the GPU is, and their wall minus CPU how long it waited (on the GIL, a core, or the device).
The thread that hands a batch on: ``copy_wait`` (until its states are on the host) and
``hand_on`` (into Ray's object store). Device spans, from CUDA events, in seconds: ``forward``
(the model with SGLang's own capture, i.e. the aux states' concatenation; for bare prefill the
model alone), ``capture`` (the NaN/Inf check and fp8 quantization), ``copy`` (device to pinned
host memory, on the side stream).
"""

from __future__ import annotations

import contextlib
import threading
import time
from typing import Iterator, Optional

import torch

CLOCKS = ("wall", "cpu", "device")


class StageTimes:
    """Seconds per stage and clock, summed over batches; safe to add to from several threads."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._seconds: dict[str, dict[str, float]] = {clock: {} for clock in CLOCKS}

    @contextlib.contextmanager
    def stage(self, name: str) -> Iterator[None]:
        """Wall and thread-CPU time of the block, under ``name``."""
        wall, cpu = time.perf_counter(), time.thread_time()
        try:
            yield
        finally:
            self.add("wall", name, time.perf_counter() - wall)
            self.add("cpu", name, time.thread_time() - cpu)

    def add(self, clock: str, name: str, seconds: float) -> None:
        with self._lock:
            self._seconds[clock][name] = self._seconds[clock].get(name, 0.0) + seconds

    def clear(self) -> None:
        with self._lock:
            for stages in self._seconds.values():
                stages.clear()

    def snapshot(self) -> dict[str, dict[str, float]]:
        with self._lock:
            return {clock: dict(stages) for clock, stages in self._seconds.items() if stages}


class DeviceSpans:
    """CUDA events of one batch, recorded as its work is queued and read once the batch's copy is done.

    ``mark(name)`` records an event on ``stream`` (the current one by default); ``add_to`` adds the time
    from each mark to the next to ``times``' device clock under the next one's name (a mark named None
    only starts a span). Every mark must precede, in stream order, an event the caller has waited for
    (the copy's): then none is read unfinished."""

    def __init__(self) -> None:
        self._marks: list[tuple[Optional[str], torch.cuda.Event]] = []

    def mark(self, name: Optional[str], stream: Optional[torch.cuda.Stream] = None) -> None:
        event = torch.cuda.Event(enable_timing=True)
        event.record(stream)
        self._marks.append((name, event))

    def add_to(self, times: StageTimes) -> None:
        for (_, start), (name, end) in zip(self._marks, self._marks[1:]):
            if name is not None:
                times.add("device", name, start.elapsed_time(end) / 1000.0)


def maybe_device_spans(device: str) -> Optional[DeviceSpans]:
    """Spans on CUDA; None on CPU (its work is done when the call returns: the stages' wall time tells)."""
    return DeviceSpans() if device == "cuda" else None
