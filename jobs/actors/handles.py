"""The job's actors: starting them, starting them again after a fault, and stopping them.

The extractor is started again when it dies (its process, or a tensor-parallel
rank whose loss its watchdog turns into the end of its process), at most
``extract.max_restarts`` times per run. A writer that dies is replaced at once;
what bounds writer faults is ``extract.max_attempts`` per shard.
"""

from __future__ import annotations

import contextlib
import logging
import time
from pathlib import Path
from typing import Any

import ray

from extractor.types import CaptureActivity, EngineInfo, EngineSpec, TokenBatch
from jobs.actors.extractor import start_extractor
from jobs.actors.uploader import UploaderActor
from jobs.actors.writer import WriterActor
from jobs.errors import JobFault
from storage import ShardMetadata

logger = logging.getLogger(__name__)

# Writers start in a few seconds; much longer means Ray has no CPU slot for them.
WRITER_START_TIMEOUT_S = 300.0
STOP_TIMEOUT_S = 60.0
RERUN = "Done shards are kept; rerun the same command to resume"


class ExtractorHost:
    """The extractor actor and its restarts; ``generation`` counts its starts (0 = the first)."""

    def __init__(self, spec: EngineSpec, max_restarts: int, placement: dict[str, Any], where: str) -> None:
        self.spec = spec
        self.max_restarts = max_restarts
        self.placement = placement
        self.where = where
        """The node it runs on, for log lines."""
        self.generation = 0
        self.actor: Any = None
        self._started = 0.0

    def launch(self) -> None:
        """Start the actor; ``ready`` waits for its model."""
        self._started = time.perf_counter()
        self.actor = start_extractor(self.spec, **self.placement)

    def ready(self) -> EngineInfo:
        """Wait for the model to load."""
        return self.loaded(ray.get(self.actor.info.remote()))

    def loaded(self, engine: EngineInfo) -> EngineInfo:
        """Log what the started extractor captures."""
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

    def restart(self, reason: str) -> ray.ObjectRef:
        """Start a new extractor after a fault in generation ``self.generation``, without waiting for its
        model: returns the reference that completes with its EngineInfo once loaded (or raises if it
        died meanwhile). Batches sent before then wait in its queue (Ray runs an actor's calls after
        its constructor), so a load of minutes holds up neither the driver nor other nodes' extractors.
        JobFault past ``max_restarts``."""
        if self.generation >= self.max_restarts:
            raise JobFault(
                f"the extractor died {self.generation + 1} times in this run (extract.max_restarts="
                f"{self.max_restarts}); last: {reason}. {RERUN}"
            )
        logger.error("the extractor on %s died (%s); starting it again (%d of at most %d restarts)",
                     self.where, reason, self.generation + 1, self.max_restarts)
        with contextlib.suppress(Exception):
            ray.kill(self.actor, no_restart=True)
        self.generation += 1
        self.launch()
        return self.actor.info.remote()

    def stop(self) -> CaptureActivity:
        activity = CaptureActivity(batches=0, tokens=0, busy_seconds=0.0)
        if self.actor is None:
            return activity
        with contextlib.suppress(Exception):
            activity = ray.get(self.actor.activity.remote(), timeout=STOP_TIMEOUT_S)
        with contextlib.suppress(Exception):
            ray.get(self.actor.close.remote(), timeout=STOP_TIMEOUT_S)
        with contextlib.suppress(Exception):
            ray.kill(self.actor)
        return activity


class WriterPool:
    """The writer actors; a dead one is replaced by a new one in its slot."""

    def __init__(
        self, output_dir: Path, metadata: ShardMetadata, on_nonfinite: str, count: int, placement: dict[str, Any]
    ) -> None:
        self._output_dir = str(output_dir)
        self._metadata = metadata
        self._on_nonfinite = on_nonfinite
        self._class = ray.remote(WriterActor).options(num_cpus=1, **placement)
        self.writers = [self._new() for _ in range(count)]

    def __len__(self) -> int:
        return len(self.writers)

    def _new(self) -> Any:
        return self._class.remote(self._output_dir, self._metadata, self._on_nonfinite)

    def wait_ready(self) -> list[str]:
        """Every writer's process is up (process start-up is start-up time); returns their node ids."""
        refs = [writer.ready.remote() for writer in self.writers]
        ready, _ = ray.wait(refs, num_returns=len(refs), timeout=WRITER_START_TIMEOUT_S)
        if len(ready) < len(refs):
            raise JobFault(
                f"{len(refs) - len(ready)} of {len(refs)} writer actors did not start within "
                f"{WRITER_START_TIMEOUT_S:.0f} s: Ray has no CPU slot for them (each takes 1 CPU; "
                f"{ray.available_resources().get('CPU', 0):.0f} free now). Lower output.num_writers or "
                f"free the cluster's CPUs. {RERUN}"
            )
        return ray.get(refs)  # raises if a writer failed to start

    def is_member(self, writer: Any) -> bool:
        return any(writer is current for current in self.writers)

    def replace(self, dead: Any) -> Any:
        """A new writer in the dead one's slot (once: later faults of the dead one change nothing)."""
        for slot, writer in enumerate(self.writers):
            if writer is dead:
                logger.error("a writer actor died; starting a new one in its place")
                self.writers[slot] = self._new()
                return self.writers[slot]
        return None

    def stop(self) -> dict[str, dict[str, float]]:
        """Kill every writer; returns their stage seconds summed (``WriterActor.stats``)."""
        totals: dict[str, dict[str, float]] = {}
        with contextlib.suppress(Exception):
            for stats in ray.get([writer.stats.remote() for writer in self.writers], timeout=STOP_TIMEOUT_S):
                for clock, stages in stats.items():
                    clock_totals = totals.setdefault(clock, {})
                    for stage, seconds in stages.items():
                        clock_totals[stage] = clock_totals.get(stage, 0.0) + seconds
        for writer in self.writers:
            ray.kill(writer)
        return totals


def start_uploaders(sink: str, options: dict[str, Any], count: int, placement: dict[str, Any]) -> list[Any]:
    """Uploaders on the node whose files they upload (``placement``)."""
    # No CPU slot: uploads mostly wait on the network, and the disk budget may be waiting
    # on them, so writers holding every CPU slot must never keep them from starting.
    uploader_class = ray.remote(UploaderActor).options(num_cpus=0, **placement)
    return [uploader_class.remote(sink, options) for _ in range(max(1, count))]
