"""The extractor as a Ray actor (one per data-parallel group, holding ``tp_size`` GPUs of its node), and its host.

``ExtractorHost`` is the driver's side of it: it starts the actor, waits for its
model, and starts it again when it dies (its process, or a tensor-parallel rank
whose loss its watchdog turns into the end of its process), at most
``extract.max_restarts`` times in a row: a batch extracted in between starts that
count anew, so a fault a day never adds up over a week-long run while an extractor
that dies at every start ends it. While it loads, the actor posts what its load
does now (importing SGLang, loading the weights, ...) to Ray's key-value store,
where the host reads it for the driver's progress line: the actor answers no call
before its constructor returns.
"""

from __future__ import annotations

import contextlib
import logging
import time
import uuid
from typing import Any

import numpy as np
import ray
from ray.experimental import internal_kv

from extractor.actor import Extractor
from extractor.types import (
    CaptureActivity,
    CapturedBatch,
    EngineInfo,
    EngineSpec,
    LoadStage,
    TokenBatch,
    unreported,
)
from runtime.errors import RERUN, JobFault

logger = logging.getLogger(__name__)

EXTRACTOR_CPUS = 1
STOP_TIMEOUT_S = 60.0
REASON_CHARS = 400
"""Of Ray's many-line report of an actor's death, what a log line and the stop's message keep."""
LOAD_STAGE_NAMESPACE = "eagle3-extractor-load"
"""Where in Ray's key-value store (its GCS) loading extractors post their stage."""


def _post_load_stage(key: str) -> LoadStage:
    if not key:
        return unreported

    def post(stage: str) -> None:
        with contextlib.suppress(Exception):  # a note for the progress line: the load goes on without it
            internal_kv._internal_kv_put(key, stage, namespace=LOAD_STAGE_NAMESPACE)

    return post


def read_load_stage(key: str) -> str:
    """What the extractor posting under ``key`` is loading now; empty if it posted nothing (yet)."""
    try:
        stage = internal_kv._internal_kv_get(key, namespace=LOAD_STAGE_NAMESPACE)
    except Exception:  # noqa: BLE001 - a note for the progress line, never a reason to stop
        return ""
    return stage.decode() if stage else ""


class ExtractorActor(Extractor):
    def __init__(self, spec: EngineSpec, load_stage_key: str = "") -> None:
        """``load_stage_key``: where the load posts its stage (``read_load_stage``); empty: nowhere."""
        super().__init__(spec, _post_load_stage(load_stage_key))

    def extract(self, tokens: TokenBatch) -> ray.ObjectRef:
        """One batch's states, put in the object store straight from the host buffer (one copy)."""
        return self.capture(tokens.samples(), ray.put)

    def node_id(self) -> str:
        return ray.get_runtime_context().get_node_id()

    def warm_object_store(self, batches: int) -> float:
        """Put and drop ``batches`` objects of the largest batch's size; returns the seconds it took.

        The first write into a page of Ray's shared-memory store allocates and zeroes it, and
        maps it into this process: a put into such pages ran at 0.4-1 GB/s on the CPU test
        machine, against 4-14 GB/s into pages written before. The store hands freed space
        to later objects, so after this the run's batches land in pages already paid for.
        """
        started = time.perf_counter()
        capacity = int(ray.available_resources().get("object_store_memory", 0))
        nbytes = self.max_batch_bytes()
        count = min(batches, max(0, capacity // max(1, nbytes) - 1))
        zeros = np.zeros(nbytes, dtype=np.uint8)  # untouched zero pages: reading them costs nothing
        refs = [ray.put(zeros) for _ in range(count)]
        del refs
        return time.perf_counter() - started


def start_extractor(spec: EngineSpec, load_stage_key: str = "", **options: Any) -> ray.actor.ActorHandle:
    """The extractor actor: all ``tp_size`` GPUs of one node on CUDA (it runs the TP ranks itself); its load posts
    its stage under ``load_stage_key`` (none if empty)."""
    return (
        ray.remote(ExtractorActor)
        .options(
            num_gpus=spec.tp_size if spec.device == "cuda" else 0,
            num_cpus=EXTRACTOR_CPUS,
            max_concurrency=spec.host_buffers,
            **options,
        )
        .remote(spec, load_stage_key)
    )


def fetch_batch(extracted: ray.ObjectRef) -> CapturedBatch:
    """The states behind an ``extract`` result (raises the extractor's error if it failed)."""
    return ray.get(ray.get(extracted))


class ExtractorHost:
    """The extractor actor and its restarts; ``generation`` counts its starts (0 = the first)."""

    def __init__(self, spec: EngineSpec, max_restarts: int, placement: dict[str, Any], where: str) -> None:
        self.spec = spec
        self.max_restarts = max_restarts
        self.placement = placement
        self.where = where
        """The node it runs on, for log lines."""
        self.generation = 0
        self.deaths_in_a_row = 0
        """Deaths since a batch was last extracted: ``restart`` refuses past ``max_restarts``."""
        self.actor: Any = None
        self.is_loaded = False
        self._started = 0.0
        self._load_stage_key = ""

    def launch(self) -> None:
        """Start the actor; ``ready`` waits for its model."""
        self._started = time.perf_counter()
        self.is_loaded = False
        self._load_stage_key = f"{self.where}/{uuid.uuid4().hex}"
        self.actor = start_extractor(self.spec, self._load_stage_key, **self.placement)

    def load_stage(self) -> str:
        """What its model's load does now (``importing SGLang``, ...); empty once loaded or before it says."""
        return "" if self.is_loaded else read_load_stage(self._load_stage_key)

    def ready(self) -> EngineInfo:
        """Wait for the model to load; an extractor that dies while it loads is started again like one that
        dies later (``restart``: JobFault past ``max_restarts``)."""
        loading = self.actor.info.remote()
        while True:
            try:
                return self.loaded(ray.get(loading))
            except ray.exceptions.RayError as error:
                cause = getattr(error, "cause", None) or error
                why = " ".join(str(cause).split())[:REASON_CHARS]
                loading = self.restart(f"while loading the model: {type(cause).__name__}: {why}")

    def loaded(self, engine: EngineInfo) -> EngineInfo:
        """Log what the started extractor captures."""
        self.is_loaded = True
        with contextlib.suppress(Exception):
            internal_kv._internal_kv_del(self._load_stage_key, namespace=LOAD_STAGE_NAMESPACE)
        logger.info(
            "extractor on %s ready after %.1f s: %s captures layers_to_capture %s for canonical ids %s "
            "(drafter ids %s)",
            self.where, time.perf_counter() - self._started, engine.model_architecture, engine.layers_to_capture,
            engine.layer_ids, engine.drafter_layer_ids,
        )
        return engine

    def node_id(self) -> str:
        return ray.get(self.actor.node_id.remote())

    def warm_object_store(self, batches: int) -> ray.ObjectRef:
        return self.actor.warm_object_store.remote(batches)

    def extract(self, tokens: TokenBatch) -> ray.ObjectRef:
        return self.actor.extract.remote(tokens)

    def batch_extracted(self, generation: int) -> None:
        """A batch extracted by start ``generation`` was written: if it is the running one, it works."""
        if generation == self.generation:
            self.deaths_in_a_row = 0

    def restart(self, reason: str) -> ray.ObjectRef:
        """Start a new extractor after a fault in generation ``self.generation``, without waiting for its
        model: returns the reference that completes with its EngineInfo once loaded (or raises if it
        died meanwhile). Batches sent before then wait in its queue (Ray runs an actor's calls after
        its constructor), so a load of minutes holds up neither the driver nor other nodes' extractors.
        JobFault past ``max_restarts`` deaths in a row."""
        if self.deaths_in_a_row >= self.max_restarts:
            raise JobFault(
                f"the extractor died {self.deaths_in_a_row + 1} times in a row with no batch extracted in between "
                f"(extract.max_restarts={self.max_restarts}); last: {reason}. {RERUN}"
            )
        self.deaths_in_a_row += 1
        logger.error("the extractor on %s died (%s); starting it again (%d of at most %d restarts in a row)",
                     self.where, reason, self.deaths_in_a_row, self.max_restarts)
        with contextlib.suppress(Exception):
            ray.kill(self.actor, no_restart=True)
        self.generation += 1
        self.launch()
        return self.actor.info.remote()

    def stop(self, collect_stats: bool = True) -> CaptureActivity:
        """What it did (with ``collect_stats``), then close and kill it; a run ending early only kills it."""
        activity = CaptureActivity(batches=0, tokens=0, busy_seconds=0.0)
        if self.actor is None:
            return activity
        if collect_stats:
            with contextlib.suppress(Exception):
                activity = ray.get(self.actor.activity.remote(), timeout=STOP_TIMEOUT_S)
            with contextlib.suppress(Exception):
                ray.get(self.actor.close.remote(), timeout=STOP_TIMEOUT_S)
        with contextlib.suppress(Exception):
            ray.kill(self.actor)
        return activity
