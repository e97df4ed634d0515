"""The driver: the job's actors, the scheduler, the disk budget and the upload queue, run to the end.

``ExtractionRun`` starts the actors, lets the scheduler open shards and send
batches, and handles each completion of the work in flight by its type:
a batch written, a shard published (or failed), an attempt discarded after a
fault, an upload verified. At most ``output.max_inflight_batches`` batches sit
between the extractor and a finished write, which bounds the states held in
memory: a disk slower than the extractor holds the extractor back. While no
shard fits the disk budget the budget's own wait loop settles the work in
flight (writes, uploads) and re-scans output.dir for files a consumer deleted.

Faults are survived in the same run: a dead extractor is started again (at
most ``extract.max_restarts`` times), a dead writer is replaced, and every
shard a fault cut short is discarded (no temp file stays) and extracted again
(at most ``extract.max_attempts`` tries per shard); past those bounds the job
stops with ``JobFault`` (exit 4) and a rerun resumes.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import time
from pathlib import Path
from typing import Any

import ray

from extractor.config import ExtractConfig, ModelConfig
from extractor.types import CaptureActivity, EngineInfo, EngineSpec
from jobs.actors import ExtractorHost, WriterPool, count_writers
from jobs.budget import DiskBudget, format_bytes
from jobs.dataset import TokenizedDataset
from jobs.errors import DiskFull
from jobs.metrics import RunMetrics
from jobs.plan import Shard
from jobs.scheduler import Scheduler
from jobs.uploads import UploadQueue
from jobs.work import Append, Discard, Finish, PendingWork, ShardAttempt, Upload
from jobs.writer import ExtractorLost, ShardDiskFull
from storage import ShardFileInfo, ShardMetadata, shard_file_name
from storage.config import OutputConfig
from storage.manifest import CONSUMED, DONE, FAILED, LOCAL, SINK, Manifest, ShardRecord
from storage.writer import state_bytes_per_token

logger = logging.getLogger(__name__)

# Auto max_inflight_batches: one batch per writer, plus one in the extractor's forward and one
# on its way to the object store.
INFLIGHT_BEYOND_WRITERS = 2
# Objects beyond max_inflight_batches the extractor writes into the object store before the run: the
# store does not always hand a freed block to the next object of the same size.
OBJECT_STORE_WARM_EXTRA = 2
DISCARD_TIMEOUT_S = 30.0


@dataclasses.dataclass
class RunResult:
    engine: EngineInfo
    startup_seconds: float
    """Actors up and the model loaded: the time to the first batch."""
    seconds: float
    """From the first batch to the last file committed (and uploaded)."""
    drain_seconds: float
    """From the last batch written (not yet fsynced) to the end: closing, syncing, uploading."""
    budget_peak: int
    budget_overshoot: int
    blocked_seconds: float
    writers: int
    peak_open_shards: int
    """Most shards written at once (at most one per writer; fewer when the disk budget is tight)."""
    max_inflight_batches: int
    extractor: CaptureActivity
    writer_seconds: dict[str, dict[str, float]]
    """Wall and CPU seconds per stage, summed over writers (``WriterActor.stats``)."""
    extractor_restarts: int = 0
    """Times the extractor was started again after a fault in this run."""


def resolve_device(requested: str, tp_size: int) -> str:
    gpus = int(ray.cluster_resources().get("GPU", 0))
    if requested == "auto":
        return "cuda" if gpus >= tp_size else "cpu"
    if requested == "cuda" and gpus < tp_size:
        raise ValueError(f"model.device=cuda with model.tp_size={tp_size}, but the Ray cluster has {gpus} GPUs")
    return requested


def build_engine_spec(
    model: ModelConfig, extract: ExtractConfig, layer_ids: list[int], device: str, longest_sample: int,
    state_dtype: str = "model",
) -> EngineSpec:
    return EngineSpec(
        model_path=str(Path(model.path).resolve()),
        dtype=model.dtype,
        device=device,
        tp_size=model.tp_size,
        attention_backend=model.attention_backend or ("torch_native" if device == "cpu" else "flashinfer"),
        layer_ids=tuple(layer_ids),
        last_hidden_state=extract.last_hidden_state,
        state_dtype=state_dtype,
        engine=model.engine,
        synthetic_tokens_per_s=model.synthetic_tokens_per_s,
        max_tokens_per_batch=max(extract.max_tokens_per_batch, longest_sample),
        max_samples_per_batch=extract.max_samples_per_batch,
        context_length=model.context_length,
        mem_fraction_static=model.mem_fraction_static,
        load_format=model.load_format,
        trust_remote_code=model.trust_remote_code,
    )


def shard_metadata(engine: EngineInfo, spec: EngineSpec) -> ShardMetadata:
    return ShardMetadata(
        dtype=engine.dtype,
        state_dtype=engine.dtype if spec.state_dtype == "model" else spec.state_dtype,
        hidden_size=engine.hidden_size,
        layer_ids=engine.layer_ids,
        layers_to_capture=engine.layers_to_capture,
        drafter_layer_ids=engine.drafter_layer_ids,
        last_hidden_state=spec.last_hidden_state,
        model_path=spec.model_path,
        model_architecture=engine.model_architecture,
        language_model_architecture=engine.language_model_architecture,
        sglang_version=engine.sglang_version,
        tp_size=engine.tp_size,
    )


class ExtractionRun:
    """Extracts ``shards`` and keeps ``manifest`` and ``budget`` true at every step."""

    def __init__(
        self, spec: EngineSpec, dataset: TokenizedDataset, plan: list[Shard], shards: list[ShardRecord],
        extract: ExtractConfig, output: OutputConfig, output_dir: Path, manifest: Manifest, budget: DiskBudget,
    ) -> None:
        self.spec = spec
        self.dataset = dataset
        self.plan = plan
        self.shards = shards
        self.extract = extract
        self.output = output
        self.output_dir = output_dir
        self.manifest = manifest
        self.budget = budget
        self.work = PendingWork()
        # Built once Ray runs, by _start_actors.
        self.extractor: ExtractorHost | None = None
        self.writers: WriterPool | None = None
        self.uploads: UploadQueue | None = None
        self.scheduler: Scheduler | None = None
        self.last_write_done = 0.0
        self.last_rescan = 0.0

    # -- setup and teardown ----------------------------------------------------------------------

    def _start_actors(self) -> None:
        writers = count_writers(self.output.num_writers)
        self.extractor = ExtractorHost(self.spec, self.extract.max_restarts)
        self.engine = self.extractor.start()
        self.metadata = shard_metadata(self.engine, self.spec)
        self.bytes_per_token = state_bytes_per_token(self.metadata)
        self.writers = WriterPool(self.output_dir, self.metadata, writers)
        self.max_inflight = self.output.max_inflight_batches or len(self.writers) + INFLIGHT_BEYOND_WRITERS
        # While the writers start: the batches in flight, and a little more, touch the object store's pages.
        warmed = self.extractor.warm_object_store(self.max_inflight + OBJECT_STORE_WARM_EXTRA)
        self.writers.wait_ready()
        logger.info(
            "%d writers, at most %d batches in flight (about %s of states in memory); object store warmed in %.1f s",
            len(self.writers), self.max_inflight,
            format_bytes(self.max_inflight * self.spec.max_tokens_per_batch * self.bytes_per_token), ray.get(warmed),
        )
        self.uploads = UploadQueue(
            self.output.sink, self.output.sink_options, self.output.num_uploaders, self.output_dir,
            self.extract.max_attempts,
        )
        self.scheduler = Scheduler(
            self.dataset, self.plan, self.shards, self.manifest, self.budget, self.extractor, self.writers,
            self.work, self.bytes_per_token, self.extract.max_attempts,
        )

    def _stop_actors(self) -> tuple[CaptureActivity, dict[str, dict[str, float]]]:
        activity = self.extractor.stop() if self.extractor is not None else CaptureActivity(batches=0, tokens=0, busy_seconds=0.0)
        writer_seconds = self.writers.stop() if self.writers is not None else {}
        if self.uploads is not None:
            self.uploads.stop()
        return activity, writer_seconds

    def _discard_active(self) -> None:
        """Shards cut short leave no temp file behind (the next run would remove it anyway)."""
        discards = [
            attempt.writer.discard.remote(index) for index, attempt in self.scheduler.active.items()
            if self.writers.is_member(attempt.writer)
        ]
        with contextlib.suppress(Exception):
            ray.get(discards, timeout=DISCARD_TIMEOUT_S)

    # -- main loop -------------------------------------------------------------------------------

    def run(self) -> RunResult:
        started = time.perf_counter()
        self.metrics = RunMetrics(
            len(self.shards), sum(self.plan[s.index].tokens for s in self.shards), self.budget.limit
        )
        try:
            self._start_actors()
            startup = time.perf_counter() - started
            started = time.perf_counter()
            self._rescan(force=True)
            for record in self.manifest.in_state(DONE):
                self.uploads.offer(record, self.work)
            self._extract_shards()
            while self.work or self.uploads.retries:
                if self.work:
                    self._settle_one(timeout=self.output.rescan_s)
                else:  # only failed uploads left: the next rescan offers them again
                    time.sleep(self.output.rescan_s)
                self._rescan()
        except BaseException:
            if self.scheduler is not None:
                self._discard_active()
            raise
        finally:
            self.metrics.close()
            activity, writer_seconds = self._stop_actors()
        ended = time.perf_counter()
        return RunResult(
            engine=self.engine,
            startup_seconds=startup,
            seconds=ended - started,
            drain_seconds=ended - max(started, self.last_write_done),
            budget_peak=self.budget.peak,
            budget_overshoot=self.budget.overshoot,
            blocked_seconds=self.budget.blocked_seconds,
            writers=len(self.writers),
            peak_open_shards=self.scheduler.peak_open_shards,
            max_inflight_batches=self.max_inflight,
            extractor=activity,
            writer_seconds=writer_seconds,
            extractor_restarts=self.extractor.generation,
        )

    def _extract_shards(self) -> None:
        while self.scheduler.has_work:
            self.scheduler.open_shards(self._wait_for_disk)
            if not self.scheduler.open_attempts:
                # Nothing to send: shards cut short by a fault come back once discarded.
                self._settle_one(timeout=self.output.rescan_s)
                continue
            while self.work.appends >= self.max_inflight:
                self._settle_one(timeout=None)
            # Shards that failed or met a fault were dropped while settling; the rest have batches to send.
            if self.scheduler.open_attempts:
                self.scheduler.send_batch()

    def _wait_for_disk(self, nbytes: int) -> None:
        """Hold the next shard until its bytes fit; BudgetExhausted if nothing can free any."""
        if self.budget.blocking_policy(nbytes) is None:
            return
        self.metrics.waiting(True)
        try:
            waited = self.budget.wait_until_fits(
                nbytes, self._settle_one_if_any, self._rescan, self.output.budget_wait_s, self.output.rescan_s,
                self._exhausted_message,
            )
        finally:
            self.metrics.waiting(False)
        self.metrics.waited(waited)

    def _exhausted_message(self, state: str) -> str:
        remaining = [r for r in self.manifest.shards.values() if r.state != DONE]
        tokens = sum(self.plan[r.index].tokens for r in remaining)
        return (
            f"stopped after waiting {self.output.budget_wait_s:.0f} s for disk budget ({state}) with nothing "
            f"in flight that could free space. {len(remaining)} shards remain, about "
            f"{format_bytes(tokens * self.bytes_per_token)} to write. Raise output.disk_budget, set "
            "output.sink, or free space under output.dir (e.g. let the trainer consume shards), then "
            "rerun the same command: it resumes where this run stopped"
        )

    # -- completions -----------------------------------------------------------------------------

    def _settle_one_if_any(self, timeout: float) -> bool:
        """Handle one completion within ``timeout``; False if nothing is in flight."""
        if not self.work:
            return False
        self._settle_one(timeout)
        return True

    def _settle_one(self, timeout: float | None) -> None:
        done = self.work.next_done(timeout)
        if done is None:
            return
        item, ref = done
        if isinstance(item, Append):
            self._on_append(item, ref)
        elif isinstance(item, Finish):
            self._on_finish(item.attempt, ref)
        elif isinstance(item, Discard):
            self._on_discard(item.attempt, ref)
        elif isinstance(item, Upload):
            self._on_upload(item.shard, ref)

    def _on_append(self, item: Append, ref: ray.ObjectRef) -> None:
        attempt = item.attempt
        attempt.inflight -= 1
        try:
            tokens = ray.get(ref)
        except ExtractorLost as error:
            if item.generation == self.extractor.generation:
                self.extractor.restart(_error_text(error))
            self._lose(attempt, f"the extractor died: {_error_text(error)}")
            return
        except ray.exceptions.RayActorError as error:
            self._writer_died(attempt.writer, error)
            return
        if tokens == 0 and not attempt.lost:  # the writer dropped the shard: spend no more extraction on it
            self.scheduler.close(attempt)
        self.last_write_done = time.perf_counter()
        self.metrics.tokens_written(tokens)

    def _on_finish(self, attempt: ShardAttempt, ref: ray.ObjectRef) -> None:
        try:
            info: ShardFileInfo = ray.get(ref)
        except ExtractorLost as error:  # the extractor's restart follows the batch that met the fault
            self._lose(attempt, f"the extractor died: {_error_text(error)}")
            return
        except ray.exceptions.RayActorError as error:
            self._writer_died(attempt.writer, error)
            return
        except Exception as error:
            if not attempt.lost:  # a lost attempt is settled by its Discard
                self._shard_failed(attempt, error)
            return
        if attempt.lost:  # every batch was written before the fault hit: the file is whole
            logger.info("shard %d was published before the fault reached it", attempt.index)
        self.scheduler.settled(attempt)
        self.budget.commit(attempt.index, info.bytes, info.tokens, self.bytes_per_token)
        record = self.manifest.update(
            attempt.index, state=DONE, error="", file=Path(info.path).name, rows=info.rows, tokens=info.tokens,
            bytes=info.bytes, sha256=info.sha256, location=LOCAL, sink_url="",
        )
        self.uploads.offer(record, self.work)
        self.metrics.disk_used(self.budget.used)
        self.metrics.shard_done()

    def _shard_failed(self, attempt: ShardAttempt, error: Exception) -> None:
        self.scheduler.settled(attempt)
        self.budget.release(attempt.index)
        message = _error_text(error)
        self.manifest.update(attempt.index, state=FAILED, error=message)
        logger.error("shard %d failed: %s", attempt.index, message)
        self.metrics.disk_used(self.budget.used)
        self.metrics.shard_failed()
        if isinstance(error, ShardDiskFull):
            raise DiskFull(
                f"output.dir={self.output_dir} is full: {message}. The shard's temp file was removed. Free space "
                "there (or set output.sink, or lower output.disk_budget below the space the disk has), then "
                "rerun the same command: it resumes where this run stopped"
            )

    # -- faults ----------------------------------------------------------------------------------

    def _writer_died(self, writer: Any, error: Exception) -> None:
        """Replace the writer; every attempt it held is lost (once: its other failures change nothing)."""
        if self.writers.replace(writer) is None:
            return
        for attempt in list(self.scheduler.active.values()):
            if attempt.writer is writer:
                self._lose(attempt, f"its writer died: {_error_text(error)}")

    def _lose(self, attempt: ShardAttempt, reason: str) -> None:
        """A fault cut the attempt short: stop sending its batches and discard what its writer holds."""
        if attempt.lost:
            return
        attempt.lost = reason
        logger.warning("shard %d: %s; it will be written again", attempt.index, reason)
        self.scheduler.drop(attempt)
        writer = attempt.writer if self.writers.is_member(attempt.writer) else self._writer_for_cleanup()
        # After the writer's calls for this shard (one caller's calls run in order): no write of
        # the attempt can follow the discard, which also removes a temp file a dead writer left.
        attempt.writer = writer
        self.work.add(writer.discard.remote(attempt.index), Discard(attempt))

    def _writer_for_cleanup(self) -> Any:
        return self.writers.writers[0]

    def _on_discard(self, attempt: ShardAttempt, ref: ray.ObjectRef) -> None:
        try:
            ray.get(ref)
        except ray.exceptions.RayActorError as error:  # the writer asked to clean up died too
            self._writer_died(attempt.writer, error)
            attempt.lost, reason = "", attempt.lost
            self._lose(attempt, reason)
            return
        self.budget.release(attempt.index)
        self.metrics.disk_used(self.budget.used)
        self.scheduler.retry(attempt)

    # -- uploads and rescans ---------------------------------------------------------------------

    def _on_upload(self, shard: int, ref: ray.ObjectRef) -> None:
        try:
            url = ray.get(ref)
        except Exception as error:
            left = self.uploads.failed(shard)
            message = f"upload to {self.output.sink} failed, the file stays local: {_error_text(error)}"
            self.manifest.update(shard, error=message)
            logger.error("shard %d: %s (%s)", shard, message,
                         f"tried again in {self.output.rescan_s:.0f} s" if left else "a rerun tries again")
            return
        self.uploads.succeeded(shard)
        # Record first, then delete: a crash in between leaves a local copy the next run removes.
        self.manifest.update(shard, location=SINK, sink_url=url, error="")
        (self.output_dir / shard_file_name(shard)).unlink(missing_ok=True)
        self.budget.forget(shard)
        self.metrics.disk_used(self.budget.used)

    def _rescan(self, force: bool = False) -> None:
        """Notice committed files someone else deleted (a trainer consuming them); offer failed uploads again."""
        now = time.monotonic()
        if not force and now - self.last_rescan < self.output.rescan_s:
            return
        self.last_rescan = now
        local = [
            record for record in self.manifest.in_state(DONE)
            if record.location == LOCAL and not self.uploads.uploading(record.index)
        ]
        for shard in self.budget.rescan((r.index, r.file, r.bytes) for r in local):
            logger.info("shard %d: %s was removed from output.dir; its bytes are free", shard, shard_file_name(shard))
            self.manifest.update(shard, location=CONSUMED)
            self.uploads.gone(shard)
        for record in local:
            if record.location == LOCAL:
                self.uploads.offer(record, self.work)
        self.metrics.disk_used(self.budget.used)


def _error_text(error: Exception) -> str:
    cause = getattr(error, "cause", None) or error
    return f"{type(cause).__name__}: {cause}"
