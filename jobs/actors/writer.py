"""CPU writer actors: they turn captured batches into shard files; ``WriterPool`` starts and replaces them.

The writers start while the model loads (their processes and imports take
seconds); what every shard file records of the model (``ShardMetadata``: what
SGLang captures, its release) is known only once it has loaded, and reaches
them in ``set_metadata`` before any batch. The driver sends each shard's
batches to one writer, in order, then ``finish``. A batch arrives as a
reference to the extractor's result (wrapped in a list so that Ray does not
resolve it for us): if extraction failed, the writer learns it here, drops the
shard's temp file, and ``finish`` reports the failure instead of publishing a
file with rows missing.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
from pathlib import Path
from typing import Any, Optional, Sequence

import numpy as np
import ray

from extractor.types import CapturedBatch, TokenBatch, split_flat
from jobs.actors.cpus import WriterCpus, place_this_process
from runtime.errors import RERUN, JobFault, is_disk_full
from storage import ShardFileInfo, ShardMetadata, ShardWriter, shard_file_name
from storage.writer import StageClock, temp_file_name

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class BatchRows:
    """The dataset rows of one batch, as the driver sends them: a few flat arrays (see ``TokenBatch``)."""

    shard: int
    sample_ids: np.ndarray
    tokens: TokenBatch
    loss_masks: np.ndarray
    """uint8, flat like ``tokens.ids``."""

    @classmethod
    def of(cls, dataset: Any, shard: int, first: int, last: int) -> "BatchRows":
        """Kept rows [first, last) of ``dataset`` (a ``TokenizedDataset``), for ``shard``."""
        tokens, loss_masks = dataset.flat_rows(first, last)
        return cls(shard=shard, sample_ids=dataset.sample_ids[first:last], tokens=tokens, loss_masks=loss_masks)


class ShardFailed(RuntimeError):
    pass


class ShardDiskFull(ShardFailed):
    """The shard's write met ENOSPC: no other shard can be written there either, so the driver stops."""


class ExtractorLost(RuntimeError):
    """The extractor actor died with the shard's batches: the driver starts it again and the shard over."""


# What the extractor's death looks like from here: its task failed with it, or the batch it had
# already put in the object store went with its owner.
_EXTRACTOR_GONE = (ray.exceptions.ActorDiedError, ray.exceptions.ActorUnavailableError, ray.exceptions.ObjectLostError)


@dataclasses.dataclass(frozen=True)
class WriterSettings:
    """What every writer of a node is started with."""

    on_nonfinite: str = "fail"
    """extract.on_nonfinite: what a shard writer does with a sample whose states hold NaN/Inf."""
    checksum: str = "xxh3_128"
    """output.checksum: the algorithm of each file's checksum (``storage.checksum``)."""
    cpus: WriterCpus = WriterCpus("all", 0)
    """Where on the node the writer runs (``jobs.actors.cpus``)."""


class WriterActor:
    def __init__(self, output_dir: str, settings: WriterSettings = WriterSettings()) -> None:
        self._cpus = place_this_process(settings.cpus)  # first: the threads started later inherit it
        self._dir = Path(output_dir)
        self._metadata: Optional[ShardMetadata] = None
        """Set by ``set_metadata`` (the model loads meanwhile); no shard opens before."""
        self._settings = settings
        self._open: dict[int, ShardWriter] = {}
        self._failed: dict[int, ShardFailed | ExtractorLost] = {}
        """Why a shard failed, raised again by its later calls."""
        self._clock = StageClock(("wait", "fetch"))

    def ready(self) -> str:
        """Answers once the actor's process is up (the driver starts the first batch after that), with
        the id of the node it runs on."""
        return ray.get_runtime_context().get_node_id()

    def set_metadata(self, metadata: ShardMetadata) -> None:
        """What every shard file of the run records, known once the model has loaded; sent before any batch
        (one caller's calls run in order)."""
        self._metadata = metadata

    def cpus(self) -> str:
        """The cores and priority this writer runs with (``jobs.actors.cpus``)."""
        return self._cpus

    def append(self, rows: BatchRows, captured: list[ray.ObjectRef]) -> int:
        """Write one batch; returns its token count (0 once the shard has failed). Raises ExtractorLost
        if this batch's extraction died with the extractor (``finish`` then raises it too)."""
        if rows.shard in self._failed:
            return 0
        try:
            with self._clock.stage("wait"):  # for the extractor to return the batch's object reference
                states = ray.get(captured[0])
            with self._clock.stage("fetch"):  # from the object store into this process (zero-copy)
                batch: CapturedBatch = ray.get(states)
            writer = self._open.get(rows.shard)
            if writer is None:
                path = self._dir / shard_file_name(rows.shard)
                writer = ShardWriter(path, self._metadata, self._settings.on_nonfinite,
                                     self._settings.checksum).__enter__()
                self._open[rows.shard] = writer
            writer.append(
                rows.sample_ids.tolist(), rows.tokens.samples(), split_flat(rows.loss_masks, rows.tokens.offsets),
                batch.aux_hidden_states, batch.last_hidden_state,
                batch.aux_scales, batch.last_scales, batch.finite,
            )
        except Exception as error:  # the shard is lost, the job goes on
            self._fail(rows.shard, error, rows.sample_ids)
            if isinstance(self._failed[rows.shard], ExtractorLost):
                raise self._failed[rows.shard] from None
            return 0
        return int(batch.lengths.sum())

    def finish(self, shard: int) -> ShardFileInfo:
        """Publish the shard's file, or raise what failed it: ShardFailed (ShardDiskFull on ENOSPC)
        with the first error it met, or ExtractorLost."""
        if shard in self._failed:
            raise self._failed.pop(shard)
        writer = self._open.pop(shard, None)
        if writer is None:
            raise ShardFailed(f"shard {shard}: finish() before any batch was written")
        try:
            return writer.finalize()
        except OSError as error:
            writer.abort()
            if is_disk_full(error):
                raise ShardDiskFull(f"shard {shard}: {type(error).__name__}: {error}") from None
            raise
        except BaseException:
            writer.abort()
            raise
        finally:
            self._clock.add(writer.clock)

    def stats(self) -> dict[str, dict[str, float]]:
        """Where this writer's time went over the shards it finished: ``{"wall": {stage: s}, "cpu": {...}}``
        for waiting on the extractor, fetching from the object store, then ``storage.writer.STAGES``."""
        return {"wall": dict(self._clock.wall), "cpu": dict(self._clock.cpu)}

    def discard(self, shard: int) -> None:
        """Drop a shard the driver stopped feeding (the job is ending, or a fault cut it short); its temp
        file goes, also one a writer that died left behind."""
        self._failed.pop(shard, None)
        writer = self._open.pop(shard, None)
        if writer is not None:
            writer.abort()
        (self._dir / temp_file_name(shard_file_name(shard))).unlink(missing_ok=True)

    def _fail(self, shard: int, error: Exception, sample_ids: Sequence[int]) -> None:
        where = f"samples {sample_ids[0]}..{sample_ids[-1]}" if len(sample_ids) else "an empty batch"
        message = f"shard {shard} ({where}): {type(error).__name__}: {error}"
        if isinstance(error, _EXTRACTOR_GONE):
            self._failed[shard] = ExtractorLost(message)
        elif is_disk_full(error):
            self._failed[shard] = ShardDiskFull(message)
        else:
            self._failed[shard] = ShardFailed(message)
        writer = self._open.pop(shard, None)
        if writer is not None:
            writer.abort()


# Writers start in a few seconds; much longer means Ray has no CPU slot for them.
WRITER_START_TIMEOUT_S = 300.0
STOP_TIMEOUT_S = 60.0


class WriterPool:
    """The writer actors, started before the model has loaded; a dead one is replaced by a new one in its slot."""

    def __init__(self, output_dir: Path, settings: WriterSettings, count: int, placement: dict[str, Any]) -> None:
        self._output_dir = str(output_dir)
        self._metadata: Optional[ShardMetadata] = None
        self._settings = settings
        self._class = ray.remote(WriterActor).options(num_cpus=1, **placement)
        self.writers = [self._new() for _ in range(count)]
        self._ready = [writer.ready.remote() for writer in self.writers]
        """Each first writer's answer once its process is up (the start's timeout, ``ready_count``)."""
        self.cpus = ""
        """Where the writers run, as the first of them reported it (``wait_ready``)."""

    def __len__(self) -> int:
        return len(self.writers)

    def _new(self) -> Any:
        writer = self._class.remote(self._output_dir, self._settings)
        if self._metadata is not None:  # a replacement: before the batches the driver sends it next
            writer.set_metadata.remote(self._metadata)
        return writer

    def set_metadata(self, metadata: ShardMetadata) -> None:
        """What every shard file records (known once the model has loaded), to every writer before its first
        batch, and to every writer started later in the run."""
        self._metadata = metadata
        for writer in self.writers:
            writer.set_metadata.remote(metadata)

    def ready_count(self) -> int:
        """How many writers are up now (for the progress line; does not wait)."""
        ready, _ = ray.wait(self._ready, num_returns=len(self._ready), timeout=0)
        return len(ready)

    def wait_ready(self) -> list[str]:
        """Every writer's process is up (process start-up is start-up time); returns their node ids."""
        ready, _ = ray.wait(self._ready, num_returns=len(self._ready), timeout=WRITER_START_TIMEOUT_S)
        if len(ready) < len(self._ready):
            raise JobFault(
                f"{len(self._ready) - len(ready)} of {len(self._ready)} writer actors did not start within "
                f"{WRITER_START_TIMEOUT_S:.0f} s: Ray has no CPU slot for them (each takes 1 CPU; "
                f"{ray.available_resources().get('CPU', 0):.0f} free now). Lower output.num_writers or "
                f"free the cluster's CPUs. {RERUN}"
            )
        nodes = [self._alive_on(slot) for slot in range(len(self.writers))]
        self.cpus = ray.get(self.writers[0].cpus.remote())
        return nodes

    def _alive_on(self, slot: int) -> str:
        """The node of the writer in ``slot``, asked now (the model's load can take minutes after the writers
        started): one that died meanwhile is replaced once; a second death, or a writer that cannot start at all,
        fails the start with its error."""
        try:
            return ray.get(self.writers[slot].ready.remote(), timeout=WRITER_START_TIMEOUT_S)
        except ray.exceptions.RayActorError:
            logger.error("writer %d died while the model loaded; starting a new one in its place", slot)
            self.writers[slot] = self._new()
            return ray.get(self.writers[slot].ready.remote(), timeout=WRITER_START_TIMEOUT_S)

    def is_member(self, writer: Any) -> bool:
        return any(writer is current for current in self.writers)

    def replace(self, dead: Any) -> Any:
        """A new writer in the dead one's slot (once: later faults of the dead one change nothing). The old one is
        killed first: Ray also reports a writer it cannot reach for now (``ActorUnavailableError``) as dead, and
        such a one would go on holding its CPU, and the files it had open, beside its replacement."""
        for slot, writer in enumerate(self.writers):
            if writer is dead:
                logger.error("a writer actor died; starting a new one in its place")
                with contextlib.suppress(Exception):
                    ray.kill(dead, no_restart=True)
                self.writers[slot] = self._new()
                return self.writers[slot]
        return None

    def stop(self, collect_stats: bool = True) -> dict[str, dict[str, float]]:
        """Kill every writer; returns their stage seconds summed (``WriterActor.stats``, with ``collect_stats``)."""
        totals: dict[str, dict[str, float]] = {}
        if collect_stats:
            with contextlib.suppress(Exception):
                for stats in ray.get([writer.stats.remote() for writer in self.writers], timeout=STOP_TIMEOUT_S):
                    for clock, stages in stats.items():
                        clock_totals = totals.setdefault(clock, {})
                        for stage, seconds in stages.items():
                            clock_totals[stage] = clock_totals.get(stage, 0.0) + seconds
        for writer in self.writers:
            ray.kill(writer)
        return totals
