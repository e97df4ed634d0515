"""The extractor actor's body: an engine behind a few methods.

``jobs`` wraps this class with ``ray.remote`` (this package never imports Ray);
SGLang is imported in ``__init__``, i.e. inside the actor process only, and not
at all with the synthetic engine.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from typing import Any, Callable, TypeVar

import numpy as np

from extractor.checkpoint import checkpoint_on_this_node
from extractor.types import CaptureActivity, CapturedBatch, EngineInfo, EngineSpec, LoadStage, unreported

T = TypeVar("T")


def build_engine(spec: EngineSpec, stage: LoadStage = unreported) -> Any:
    """The engine ``spec.engine`` names: SGLang's runners over the TP group, or the synthetic source; ``stage`` is
    told what the load does now."""
    if spec.engine == "synthetic":
        from extractor.synthetic import SyntheticEngine

        return SyntheticEngine(spec)
    from extractor.tensor_parallel import TensorParallelEngine

    return TensorParallelEngine(spec, stage)


class Extractor:
    """Run ``spec.host_buffers`` calls at once: a batch's states are handed on while the next forward runs."""

    def __init__(self, spec: EngineSpec, stage: LoadStage = unreported) -> None:
        """``stage``: told what the model's load does now (importing SGLang, loading the weights, ...)."""
        logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
        spec = dataclasses.replace(spec, model_path=checkpoint_on_this_node(spec.model_path, spec.download))
        self._engine = build_engine(spec, stage)
        self._lock = threading.Lock()
        self._hand_on = {"wall": 0.0, "cpu": 0.0}

    def info(self) -> EngineInfo:
        return self._engine.info

    def max_batch_bytes(self) -> int:
        """Bytes of the largest batch's states as ``capture`` hands them on."""
        return self._engine.max_batch_bytes

    def capture(self, input_ids: list[np.ndarray], hand_on: Callable[[CapturedBatch], T]) -> T:
        """Run one batch and pass its states to ``hand_on`` while its host buffer is valid.

        ``hand_on`` must copy what it keeps (e.g. into Ray's object store): the
        buffer is reused by a later batch once it returns.
        """
        with self._engine.capture(input_ids) as batch:
            started, cpu = time.perf_counter(), time.thread_time()
            result = hand_on(batch)
            with self._lock:
                self._hand_on["wall"] += time.perf_counter() - started
                self._hand_on["cpu"] += time.thread_time() - cpu
            return result

    def activity(self) -> CaptureActivity:
        """What the engine did, with the hand-on's time (wall and this thread's CPU) as the stage ``hand_on``."""
        activity = self._engine.activity()
        with self._lock:
            stages = {clock: dict(activity.stage_seconds.get(clock, {})) for clock in ("wall", "cpu", "device")}
            for clock, seconds in self._hand_on.items():
                stages[clock]["hand_on"] = seconds
            return dataclasses.replace(activity, hand_on_seconds=self._hand_on["wall"],
                                       stage_seconds={clock: s for clock, s in stages.items() if s})

    def bare_prefill(self, input_ids: list[np.ndarray]) -> float:
        return self._engine.bare_prefill(input_ids)

    def fp8_relative_errors(self, input_ids: list[np.ndarray]) -> list[float]:
        return self._engine.fp8_relative_errors(input_ids)

    def close(self) -> None:
        self._engine.close()
