"""The driver's schedule: one extractor actor, writer actors, uploader actors, and the disk budget.

One shard is one file written by one writer, in order, then ``finish``. To
keep every writer busy the driver holds up to one open shard per writer and
sends the extractor their batches interleaved, always for the open shard
with the fewest batches in flight. A shard is opened only once its whole
predicted size fits the disk budget, so open shards can always be finished;
while nothing fits, the driver waits on the work in flight (writes, uploads
to the sink) and re-scans output.dir for files a consumer deleted. At most
``output.max_inflight_batches`` batches sit between the extractor and a
finished write, which bounds the states held in memory: a disk slower than
the extractor holds the extractor back.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import logging
import time
from pathlib import Path

import ray

from extractor.config import ExtractConfig, ModelConfig
from extractor.types import CaptureActivity, EngineInfo, EngineSpec
from jobs.budget import DiskBudget, format_bytes
from jobs.dataset import TokenizedDataset
from jobs.errors import BudgetExhausted
from jobs.extractor_actor import EXTRACTOR_CPUS, start_extractor
from jobs.plan import Shard
from jobs.progress import RunProgress
from jobs.sink import UploaderActor
from jobs.writer import BatchRows, WriterActor
from storage import ShardFileInfo, ShardMetadata, shard_file_name
from storage.config import OutputConfig
from storage.manifest import CONSUMED, DONE, FAILED, LOCAL, PENDING, SINK, Manifest, ShardRecord
from storage.writer import state_bytes_per_token

logger = logging.getLogger(__name__)

MAX_AUTO_WRITERS = 8
# Auto max_inflight_batches: one batch per writer, plus one in the extractor's forward and one
# on its way to the object store.
INFLIGHT_BEYOND_WRITERS = 2
# Objects beyond max_inflight_batches the extractor writes into the object store before the run: the
# store does not always hand a freed block to the next object of the same size.
OBJECT_STORE_WARM_EXTRA = 2
WAIT_LOG_PERIOD_S = 30.0


@dataclasses.dataclass
class _OpenShard:
    """A shard whose batches are being sent to its writer."""

    record: ShardRecord
    writer: ray.actor.ActorHandle
    batches: list[tuple[int, int]]
    """[start, stop) of each batch, relative to the shard's first row."""
    sent: int = 0
    inflight: int = 0
    """Batches sent whose write has not finished."""


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


def count_writers(requested: int, extractor_cpus: int) -> int:
    if requested > 0:
        return requested
    spare = int(ray.cluster_resources().get("CPU", 1)) - extractor_cpus
    return max(1, min(MAX_AUTO_WRITERS, spare))


class ExtractionRun:
    """Extracts ``shards`` and keeps ``manifest`` and ``budget`` true at every step."""

    def __init__(
        self, spec: EngineSpec, dataset: TokenizedDataset, plan: list[Shard], shards: list[ShardRecord],
        extract: ExtractConfig, output: OutputConfig, output_dir: Path, manifest: Manifest, budget: DiskBudget,
        progress: RunProgress,
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
        self.progress = progress
        self.appends: dict[ray.ObjectRef, int] = {}  # -> shard
        self.finishes: dict[ray.ObjectRef, int] = {}
        self.uploads: dict[ray.ObjectRef, int] = {}
        self.open: dict[int, _OpenShard] = {}
        self.writer_of: dict[int, ray.actor.ActorHandle] = {}  # shards not yet finished
        self.peak_open_shards = 0
        self.blocked_seconds = 0.0
        self.activity = CaptureActivity(batches=0, tokens=0, busy_seconds=0.0)
        self.writer_seconds: dict[str, dict[str, float]] = {}
        self.last_write_done = 0.0
        self.last_rescan = 0.0
        self.uploaders: list[ray.actor.ActorHandle] = []
        self.next_uploader = 0

    # -- setup ---------------------------------------------------------------------------------

    def _start_actors(self) -> None:
        started = time.perf_counter()
        self.extractor = start_extractor(self.spec, name="extractor")
        self.engine: EngineInfo = ray.get(self.extractor.info.remote())
        logger.info(
            "extractor ready after %.1f s: %s captures layers_to_capture %s for canonical ids %s (drafter ids %s)",
            time.perf_counter() - started, self.engine.model_architecture, self.engine.layers_to_capture,
            self.engine.layer_ids, self.engine.drafter_layer_ids,
        )
        self.metadata = shard_metadata(self.engine, self.spec)
        self.bytes_per_token = state_bytes_per_token(self.metadata)
        writer_class = ray.remote(WriterActor).options(num_cpus=1)
        self.writers = [
            writer_class.remote(str(self.output_dir), self.metadata, self.extract.on_nonfinite)
            for _ in range(count_writers(self.output.num_writers, EXTRACTOR_CPUS))
        ]
        self.max_inflight = self.output.max_inflight_batches or len(self.writers) + INFLIGHT_BEYOND_WRITERS
        # While the writers start: the batches in flight, and a little more, touch the object store's pages.
        warmed = self.extractor.warm_object_store.remote(self.max_inflight + OBJECT_STORE_WARM_EXTRA)
        ray.get([writer.ready.remote() for writer in self.writers])  # process start-up is start-up time
        logger.info(
            "%d writers, at most %d batches in flight (about %s of states in memory); object store warmed in %.1f s",
            len(self.writers), self.max_inflight,
            format_bytes(self.max_inflight * self.spec.max_tokens_per_batch * self.bytes_per_token), ray.get(warmed),
        )
        if self.output.sink:
            # No CPU slot: uploads mostly wait on the network, and the disk budget may be waiting
            # on them, so writers holding every CPU slot must never keep them from starting.
            uploader_class = ray.remote(UploaderActor).options(num_cpus=0)
            self.uploaders = [
                uploader_class.remote(self.output.sink, self.output.sink_options)
                for _ in range(max(1, self.output.num_uploaders))
            ]

    def _stop_actors(self) -> None:
        with contextlib.suppress(Exception):
            self.activity = ray.get(self.extractor.activity.remote(), timeout=60)
        with contextlib.suppress(Exception):
            ray.get(self.extractor.close.remote(), timeout=60)
        with contextlib.suppress(Exception):
            for stats in ray.get([writer.stats.remote() for writer in self.writers], timeout=60):
                for clock, stages in stats.items():
                    totals = self.writer_seconds.setdefault(clock, {})
                    for stage, seconds in stages.items():
                        totals[stage] = totals.get(stage, 0.0) + seconds
        for actor in [self.extractor, *self.writers, *self.uploaders]:
            ray.kill(actor)

    # -- main loop -----------------------------------------------------------------------------

    def run(self) -> RunResult:
        started = time.perf_counter()
        self._start_actors()
        startup = time.perf_counter() - started
        started = time.perf_counter()
        self.progress.begin()
        try:
            self._rescan(force=True)
            for record in self.manifest.in_state(DONE):
                self._maybe_upload(record)
            self._extract_shards()
            while self.appends or self.finishes or self.uploads:
                self._settle_one(timeout=self.output.rescan_s)
                self._rescan()
                self.progress.tick()
        except BaseException:
            # Shards cut short leave no temp file behind (the next run would remove it anyway).
            discards = [writer.discard.remote(shard) for shard, writer in self.writer_of.items()]
            with contextlib.suppress(Exception):
                ray.get(discards, timeout=30)
            raise
        finally:
            self.progress.close()
            self._stop_actors()
        ended = time.perf_counter()
        return RunResult(
            engine=self.engine,
            startup_seconds=startup,
            seconds=ended - started,
            drain_seconds=ended - max(started, self.last_write_done),
            budget_peak=self.budget.peak,
            budget_overshoot=self.budget.overshoot,
            blocked_seconds=self.blocked_seconds,
            writers=len(self.writers),
            peak_open_shards=self.peak_open_shards,
            max_inflight_batches=self.max_inflight,
            extractor=self.activity,
            writer_seconds=self.writer_seconds,
        )

    def _extract_shards(self) -> None:
        waiting = collections.deque(self.shards)
        while waiting or self.open:
            self.progress.tick()
            self._open_shards(waiting)
            if not self.open:
                continue
            while len(self.appends) >= self.max_inflight:
                self._settle_one(timeout=None)
            # Failed shards were closed while settling; the rest still have batches to send.
            if self.open:
                self._send_batch(min(self.open.values(), key=lambda shard: (shard.inflight, shard.record.index)))

    def _open_shards(self, waiting: collections.deque[ShardRecord]) -> None:
        """Open the next shards while a writer is free and their whole size fits the budget."""
        busy = {id(shard.writer) for shard in self.open.values()}
        while waiting and len(self.open) < len(self.writers):
            record = waiting[0]
            batches = self._batches(record)
            nbytes = self._predict_shard(record, len(batches))
            if self.open and self.budget.blocking_policy(nbytes) is not None:
                return  # open shards keep the extractor busy; try again after their next batch
            self._wait_for_disk(nbytes)
            waiting.popleft()
            writer = next(w for w in self.writers if id(w) not in busy)
            busy.add(id(writer))
            self.budget.reserve(record.index, nbytes)
            self.manifest.update(record.index, state=PENDING, attempts=record.attempts + 1, error="")
            self.open[record.index] = _OpenShard(record, writer, batches)
            self.peak_open_shards = max(self.peak_open_shards, len(self.open))
            self.writer_of[record.index] = writer

    def _batches(self, record: ShardRecord) -> list[tuple[int, int]]:
        return list(self.plan[record.index].batches)

    def _predict_shard(self, record: ShardRecord, batches: int) -> int:
        return self.budget.predict(self.plan[record.index].tokens, self.bytes_per_token, batches)

    def _send_batch(self, shard: _OpenShard) -> None:
        start, stop = shard.batches[shard.sent]
        shard.sent += 1
        first, last = shard.record.start + start, shard.record.start + stop
        input_ids, loss_masks = self.dataset.rows(first, last)
        rows = BatchRows(
            shard=shard.record.index,
            sample_ids=self.dataset.sample_ids[first:last].tolist(),
            input_ids=input_ids,
            loss_masks=loss_masks,
        )
        extracted = self.extractor.extract.remote(rows.input_ids)
        self.appends[shard.writer.append.remote(rows, [extracted])] = shard.record.index
        shard.inflight += 1
        if shard.sent == len(shard.batches):
            self._close_shard(shard.record.index)

    def _close_shard(self, index: int) -> None:
        """No more batches for this shard: its writer publishes (or reports) it and is free again."""
        shard = self.open.pop(index)
        self.finishes[shard.writer.finish.remote(index)] = index

    def _wait_for_disk(self, nbytes: int) -> None:
        """Hold the next shard until its bytes fit; raise BudgetExhausted if nothing can free any."""
        policy = self.budget.blocking_policy(nbytes)
        if policy is None:
            return
        started = last_log = time.monotonic()
        idle_since: float | None = None
        self.progress.disk_wait_started()
        logger.warning("waiting for disk budget: %s (next shard needs %s)", policy.describe(self.budget), format_bytes(nbytes))
        try:
            while policy is not None:
                now = time.monotonic()
                if self.appends or self.finishes or self.uploads:
                    idle_since = None
                    self._settle_one(timeout=self.output.rescan_s)
                else:
                    idle_since = idle_since or now
                    if now - idle_since >= self.output.budget_wait_s:
                        raise BudgetExhausted(self._exhausted_message(policy.describe(self.budget)))
                    time.sleep(min(self.output.rescan_s, self.output.budget_wait_s - (now - idle_since)))
                self._rescan()
                self.progress.tick()
                if time.monotonic() - last_log >= WAIT_LOG_PERIOD_S:
                    last_log = time.monotonic()
                    logger.warning("waiting for disk budget: %s", policy.describe(self.budget))
                policy = self.budget.blocking_policy(nbytes)
        finally:
            waited = time.monotonic() - started
            self.blocked_seconds += waited
            self.progress.disk_wait_ended(waited)
        logger.info("disk budget free again after %.1f s: %s", waited, self.budget.policies[0].describe(self.budget))

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

    # -- completions ---------------------------------------------------------------------------

    def _settle_one(self, timeout: float | None) -> None:
        pending = [*self.appends, *self.finishes, *self.uploads]
        if not pending:
            return
        ready, _ = ray.wait(pending, num_returns=1, timeout=timeout)
        if not ready:
            return
        ref = ready[0]
        if ref in self.appends:
            shard = self.appends.pop(ref)
            tokens = ray.get(ref)  # raises if the extractor died: no later batch could succeed
            if shard in self.open:
                self.open[shard].inflight -= 1
                if tokens == 0:  # the writer dropped the shard: spend no more extraction on it
                    self._close_shard(shard)
            self.progress.tokens_written(shard, tokens)
            self.last_write_done = time.perf_counter()
        elif ref in self.finishes:
            self._on_finish(self.finishes.pop(ref), ref)
        else:
            self._on_upload(self.uploads.pop(ref), ref)

    def _on_finish(self, shard: int, ref: ray.ObjectRef) -> None:
        self.writer_of.pop(shard, None)
        try:
            info: ShardFileInfo = ray.get(ref)
        except Exception as error:
            self.budget.release(shard)
            message = _error_text(error)
            self.manifest.update(shard, state=FAILED, error=message)
            logger.error("shard %d failed: %s", shard, message)
        else:
            self.budget.commit(shard, info.bytes, info.tokens, self.bytes_per_token)
            record = self.manifest.update(
                shard, state=DONE, error="", file=Path(info.path).name, rows=info.rows, tokens=info.tokens,
                bytes=info.bytes, sha256=info.sha256, location=LOCAL, sink_url="", nonfinite=list(info.nonfinite),
            )
            self._maybe_upload(record)
        self.progress.shard_settled(shard)

    def _maybe_upload(self, record: ShardRecord) -> None:
        if not self.uploaders or record.location != LOCAL or record.index in self.uploads.values():
            return
        uploader = self.uploaders[self.next_uploader % len(self.uploaders)]
        self.next_uploader += 1
        path = str(self.output_dir / record.file)
        self.uploads[uploader.upload.remote(path, record.bytes, record.sha256)] = record.index

    def _on_upload(self, shard: int, ref: ray.ObjectRef) -> None:
        try:
            url = ray.get(ref)
        except Exception as error:
            message = f"upload to {self.output.sink} failed, the file stays local: {_error_text(error)}"
            self.manifest.update(shard, error=message)
            logger.error("shard %d: %s", shard, message)
            return
        # Record first, then delete: a crash in between leaves a local copy the next run removes.
        self.manifest.update(shard, location=SINK, sink_url=url)
        (self.output_dir / shard_file_name(shard)).unlink(missing_ok=True)
        self.budget.forget(shard)

    def _rescan(self, force: bool = False) -> None:
        """Notice committed files someone else deleted (a trainer consuming them)."""
        now = time.monotonic()
        if not force and now - self.last_rescan < self.output.rescan_s:
            return
        self.last_rescan = now
        for record in self.manifest.in_state(DONE):
            if record.location != LOCAL:
                continue
            if (self.output_dir / record.file).exists():
                self.budget.committed[record.index] = record.bytes
            elif record.index not in self.uploads.values():
                logger.info("shard %d: %s was removed from output.dir; its bytes are free", record.index, record.file)
                self.manifest.update(record.index, location=CONSUMED)
                self.budget.forget(record.index)


def _error_text(error: Exception) -> str:
    cause = getattr(error, "cause", None) or error
    return f"{type(cause).__name__}: {cause}"
