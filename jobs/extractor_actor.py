"""The extractor as a Ray actor: one per job, holding all ``tp_size`` GPUs of its node."""

from __future__ import annotations

from typing import Any

import numpy as np
import ray

from extractor.actor import Extractor
from extractor.types import CapturedBatch, EngineSpec

EXTRACTOR_CPUS = 1


class ExtractorActor(Extractor):
    def extract(self, input_ids: list[np.ndarray]) -> ray.ObjectRef:
        """One batch's states, put in the object store straight from the host buffer (one copy)."""
        return self.capture(input_ids, ray.put)


def start_extractor(spec: EngineSpec, **options: Any) -> ray.actor.ActorHandle:
    """The extractor actor: all ``tp_size`` GPUs of one node on CUDA (it runs the TP ranks itself)."""
    return (
        ray.remote(ExtractorActor)
        .options(
            num_gpus=spec.tp_size if spec.device == "cuda" else 0,
            num_cpus=EXTRACTOR_CPUS,
            max_concurrency=spec.host_buffers,
            **options,
        )
        .remote(spec)
    )


def fetch_batch(extracted: ray.ObjectRef) -> CapturedBatch:
    """The states behind an ``extract`` result (raises the extractor's error if it failed)."""
    return ray.get(ray.get(extracted))
