"""The extractor actor's body: a TensorParallelEngine behind two methods.

``jobs`` wraps this class with ``ray.remote`` (this package never imports Ray);
SGLang is imported in ``__init__``, i.e. inside the actor process only.
"""

from __future__ import annotations

import logging

import numpy as np

from extractor.types import CapturedBatch, EngineInfo, EngineSpec


class Extractor:
    def __init__(self, spec: EngineSpec) -> None:
        logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
        from extractor.tensor_parallel import TensorParallelEngine

        self._engine = TensorParallelEngine(spec)

    def info(self) -> EngineInfo:
        return self._engine.info

    def extract(self, input_ids: list[np.ndarray]) -> CapturedBatch:
        return self._engine.capture(input_ids)

    def bare_prefill(self, input_ids: list[np.ndarray]) -> float:
        return self._engine.bare_prefill(input_ids)

    def close(self) -> None:
        self._engine.close()
