"""The extractor actor's body: a TensorParallelEngine behind a few methods.

``jobs`` wraps this class with ``ray.remote`` (this package never imports Ray);
SGLang is imported in ``__init__``, i.e. inside the actor process only.
"""

from __future__ import annotations

import logging
from typing import Callable, TypeVar

import numpy as np

from extractor.types import CaptureActivity, CapturedBatch, EngineInfo, EngineSpec

T = TypeVar("T")


class Extractor:
    """Run ``spec.host_buffers`` calls at once: a batch's states are handed on while the next forward runs."""

    def __init__(self, spec: EngineSpec) -> None:
        logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
        from extractor.tensor_parallel import TensorParallelEngine

        self._engine = TensorParallelEngine(spec)

    def info(self) -> EngineInfo:
        return self._engine.info

    def capture(self, input_ids: list[np.ndarray], hand_on: Callable[[CapturedBatch], T]) -> T:
        """Run one batch and pass its states to ``hand_on`` while its host buffer is valid.

        ``hand_on`` must copy what it keeps (e.g. into Ray's object store): the
        buffer is reused by a later batch once it returns.
        """
        with self._engine.capture(input_ids) as batch:
            return hand_on(batch)

    def activity(self) -> CaptureActivity:
        return self._engine.activity()

    def bare_prefill(self, input_ids: list[np.ndarray]) -> float:
        return self._engine.bare_prefill(input_ids)

    def close(self) -> None:
        self._engine.close()
