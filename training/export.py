"""Exports a run into the layout a trainer reads: SpecForge's ``.ckpt`` files or speculators' dataset.

Writes a run's samples in the layout a trainer reads (``training.peer_formats`` names what
each one reads, from its code): SpecForge's ``rows_{g}-{g+2000}/data_{sample_id}.ckpt``, or
speculators' preprocessed dataset (``save_to_disk``: ``input_ids``, ``loss_mask``,
``seq_len``, with ``token_freq.pt``) and ``hidden_states/hs_{i}.safetensors`` for its row ``i``.

What the format needs is checked before anything is written: the final state the trainer
reads (post-norm for SpecForge, pre-norm for speculators), a complete run, bit-exact states
when ``exact=true``. Then it streams: one row group of one shard at a time, at most
``2 * threads`` samples being written, each file whole or absent (``training.destination``).
``.export_state.json`` in ``dest`` records what is being exported; a rerun of the same
export skips the files already there, and an export of anything else into that ``dest`` is
refused. Exit codes: 0 done, 2 bad config or input (nothing written), 4 an error while
writing (rerun: it resumes), 130/143 stopped by a signal (rerun: it resumes).
"""

from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import datetime
import hashlib
import importlib.util
import io
import json
import logging
import os
import resource
import shutil
import sys
import tempfile
import time
from typing import Any, Callable, Dict, Iterator, Optional, Sequence

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import torch

from common.checks import check_int, check_seconds
from storage import schema
from storage.reader import Sample, sample_from_table
from storage.run_index import RunIndex, open_parquet
from training import peer_formats
from training.destination import Destination, is_temp
from training.peer_formats import SPECFORGE, SPECULATORS

logger = logging.getLogger("jobs.export")

STATE_FILE = ".export_state.json"
EXPORT_VERSION = 1
INFLIGHT_STATE_BYTES = 512 * 1024 * 1024
"""States of the samples being written at once (each task holds about twice its sample's states: the
file's tensors and their bytes); a sample larger than this is written alone."""


@dataclasses.dataclass
class RunSource:
    dir: str = ""
    """The run: its output.dir (the manifest names its shards, those uploaded to the sink too) or a URL holding its
    shard-*.parquet files."""
    sink_options: Dict[str, Any] = dataclasses.field(default_factory=dict)
    """fsspec options for shards read from a URL (the run's sink, or output.dir given as a URL)."""


@dataclasses.dataclass
class ExportConfig:
    output: RunSource = dataclasses.field(default_factory=RunSource)
    to: str = ""
    """specforge | speculators: the trainer whose layout to write."""
    dest: str = ""
    """Directory (local path or fsspec URL) to write into, created if missing. speculators: the dataset goes at its
    top, the states under hidden_states/."""
    dest_options: Dict[str, Any] = dataclasses.field(default_factory=dict)
    """fsspec options for dest (e.g. client_kwargs for an S3 endpoint)."""
    fp8: Optional[bool] = None
    """speculators: true writes its fp8 variant (float8_e4m3fn, one float32 scale per token), false the model dtype.
    Unset: fp8 when the run stored fp8, else the model dtype."""
    exact: bool = False
    """Refuse unless the files hold the states exactly as SGLang computed them (a run with fp8 states cannot)."""
    allow_partial: bool = False
    """Export a run whose manifest still has shards not done (only the done ones)."""
    threads: int = 4
    """Files written at once (hides an object store's latency); at most 2 x threads samples and 512 MiB of their
    states are held at once."""
    progress_interval_s: float = 30.0
    """Without a terminal, a progress line this often; with one, a tqdm bar."""

    def __post_init__(self) -> None:
        if not self.output.dir:
            raise ValueError("name the run: output.dir=DIR (its output.dir) or a URL holding its shard files")
        if self.to not in peer_formats.FORMATS:
            raise ValueError(f"to={self.to!r}: use {' or '.join(peer_formats.FORMATS)}")
        if not self.dest:
            raise ValueError("name where to write: dest=DIR (a local path or an fsspec URL)")
        if self.fp8 and self.to == SPECFORGE:
            raise ValueError("fp8=true: SpecForge reads model-dtype states only; drop fp8 (or export to=speculators)")
        if self.fp8 and self.exact:
            raise ValueError("fp8=true and exact=true contradict each other: fp8 states are not bit-exact")
        check_int("threads", self.threads, 1)
        check_seconds("progress_interval_s", self.progress_interval_s, positive=True)


@dataclasses.dataclass(frozen=True)
class ExportPlan:
    trainer: str
    fp8: bool
    """Write fp8 states (speculators' variant)."""
    read_raw: bool
    """Read the shards' raw fp8 values and scales (an fp8 run exported as fp8: re-quantized from float32)."""
    states: str
    """What the files hold: the model dtype's name, or float8_e4m3fn."""
    notes: tuple[str, ...] = ()


def plan_export(config: ExportConfig, index: RunIndex) -> ExportPlan:
    """What will be written, or a ValueError naming what the run lacks and the setting to rerun with."""
    meta, run = index.metadata, config.output.dir
    peer_formats.check_final_state(config.to, meta, run)
    if index.notes and not config.allow_partial:
        raise ValueError(
            f"{'; '.join(index.notes)}. Finish the run first (rerun its jobs.extract command; shards=failed reruns "
            "failed shards), or pass allow_partial=true to export the done shards only"
        )
    notes: list[str] = []
    if meta.fp8 and config.exact:
        raise ValueError(
            f"exact=true but {run} stored fp8 states (output.state_dtype=float8_e4m3fn), which are not the states "
            "SGLang computed; rerun the extraction with output.state_dtype=model into a new output.dir, or drop exact"
        )
    if config.to == SPECULATORS:
        _require("datasets", "safetensors")
    fp8 = config.to == SPECULATORS and (meta.fp8 if config.fp8 is None else bool(config.fp8))
    if meta.fp8 and not fp8:
        notes.append(f"the run stored fp8 states: the files hold them dequantized to {meta.dtype}")
    if fp8:
        notes.append(
            "fp8 states with one scale per token over all layers (speculators' variant): "
            + ("the run's per-layer fp8 values are dequantized in float32 and quantized again, a second rounding "
               "for every layer but the token's largest" if meta.fp8 else f"quantized from the {meta.dtype} states")
        )
    return ExportPlan(config.to, fp8, read_raw=meta.fp8 and fp8, states=schema.FP8 if fp8 else meta.dtype,
                      notes=tuple(notes))


@dataclasses.dataclass
class PreparedExport:
    """Everything checked, nothing written but the export state in ``dest``."""

    config: ExportConfig
    index: RunIndex
    plan: ExportPlan
    ids_per_file: list[np.ndarray]
    """Each shard's sample ids, sorted: speculators' row i is the i-th sample id over the files in order."""
    dest: Destination
    state: dict[str, Any]

    @property
    def samples(self) -> int:
        return sum(len(ids) for ids in self.ids_per_file)


def prepare(config: ExportConfig) -> PreparedExport:
    """Read the run's footers and sample ids, check the format can take it and ``dest`` is this export's;
    raises ValueError (naming what to change) before anything is written."""
    index = RunIndex.build(config.output.dir, config.output.sink_options)
    plan = plan_export(config, index)
    ids_per_file = [_sorted_sample_ids(file.url, config.output.sink_options) for file in index.files]
    dest = Destination(config.dest, config.dest_options)
    state = _claim(dest, _identity(plan, index, ids_per_file))
    return PreparedExport(config, index, plan, ids_per_file, dest, state)


def _require(*modules: str) -> None:
    missing = [name for name in modules if importlib.util.find_spec(name) is None]
    if missing:
        raise ValueError(f"to=speculators needs {', '.join(missing)}: pip install 'eagle3-extract[export]'")


def export(config: ExportConfig) -> dict[str, Any]:
    """Check, then write every file not there yet; returns the report (samples, bytes, seconds, rates, peak RSS)."""
    return write(prepare(config))


def write(job: PreparedExport) -> dict[str, Any]:
    """Write the files ``dest`` does not hold yet, a row group at a time, then (speculators) the dataset."""
    started = time.perf_counter()
    config, plan, dest = job.config, job.plan, job.dest
    for note in plan.notes:
        logger.info("%s", note)
    report = {"dest": config.dest, "format": plan.trainer, "states": plan.states, "samples": job.samples,
              "written": 0, "skipped": 0, "bytes": 0}
    if job.state.get("complete"):
        report["skipped"] = job.samples
        return _finish(report, started, already_complete=True)
    removed = dest.remove_temps()
    if removed:
        logger.info("removed %d temp files a stopped export left in %s", removed, config.dest)
    stream = _SampleStream(job.index, job.ids_per_file, plan, config.output.sink_options)
    present = dest.files(peer_formats.SPECULATORS_HIDDEN_STATES_DIR if plan.trainer == SPECULATORS else "")
    with _Progress(job.samples, config.progress_interval_s) as progress, _Writers(config.threads) as writers:
        for samples, skipped in stream.row_groups(present):
            report["skipped"] += skipped
            progress.update(skipped, 0)
            for path, sample in samples:
                writers.submit(lambda path=path, sample=sample: _write_sample(dest, plan, job.index, path, sample),
                               on_done=lambda size: (progress.update(1, size), _add(report, size)),
                               state_bytes=_state_bytes(sample))
        writers.drain()
    if plan.trainer == SPECULATORS:
        report["bytes"] += _write_speculators_dataset(dest, job.index, job.ids_per_file, config.output.sink_options)
    dest.write_json(STATE_FILE, {**job.state, "complete": True, "completed_at": _now()})
    return _finish(report, started)


def _add(report: dict[str, Any], size: int) -> None:
    report["written"] += 1
    report["bytes"] += size


def _finish(report: dict[str, Any], started: float, already_complete: bool = False) -> dict[str, Any]:
    seconds = time.perf_counter() - started
    report.update(
        already_complete=already_complete,
        seconds=round(seconds, 3),
        samples_per_second=round(report["written"] / seconds, 1) if seconds > 0 else 0.0,
        mb_per_second=round(report["bytes"] / 1e6 / seconds, 1) if seconds > 0 else 0.0,
        peak_rss_mb=round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
    )
    return report


# -- what is exported, and where each sample goes -----------------------------------------------------

def _sorted_sample_ids(url: str, storage_options: dict[str, Any]) -> np.ndarray:
    parquet = open_parquet(url, storage_options)
    try:
        return np.sort(parquet.read(columns=[schema.SAMPLE_ID]).column(0).to_numpy())
    finally:
        parquet.close()


def _id_ranges(ids_per_file: Sequence[np.ndarray]) -> list[list[int]]:
    """The exported sample ids in order, as [start, stop) runs: speculators' row i is the i-th of them."""
    ranges: list[list[int]] = []
    for ids in ids_per_file:
        for sample_id in ids.tolist():
            if ranges and ranges[-1][1] == sample_id:
                ranges[-1][1] += 1
            else:
                ranges.append([sample_id, sample_id + 1])
    return ranges


def _identity(plan: ExportPlan, index: RunIndex, ids_per_file: Sequence[np.ndarray]) -> dict[str, Any]:
    """What a resumed export must match: format, states, the run's metadata and its shard files."""
    shards = [[file.url.rsplit("/", 1)[-1], file.rows, file.sha256] for file in index.files]
    identity = {
        "export_version": EXPORT_VERSION,
        "format": plan.trainer,
        "states": plan.states,
        "run": {field.name: getattr(index.metadata, field.name) for field in dataclasses.fields(index.metadata)},
        "shards": hashlib.sha256(json.dumps(shards).encode()).hexdigest(),
        "samples": int(sum(len(ids) for ids in ids_per_file)),
    }
    if plan.trainer == SPECULATORS:  # hs_{i} names rows, not sample ids: the order is part of what was written
        identity["sample_ids"] = _id_ranges(ids_per_file)
    return identity


def _claim(dest: Destination, identity: dict[str, Any]) -> dict[str, Any]:
    """The export state of ``dest``: started here now, or the same export's; anything else is refused."""
    state = dest.read_json(STATE_FILE)
    if state is None:
        foreign = sorted(path for path in dest.files() if not is_temp(path))
        if foreign:
            raise ValueError(
                f"dest={dest.url} holds {len(foreign)} files ({', '.join(foreign[:3])}, ...) but no {STATE_FILE}: "
                "not an export this command started. Choose an empty or new dest"
            )
        state = {**identity, "complete": False, "started_at": _now()}
        dest.write_json(STATE_FILE, state)
        return state
    differing = sorted(key for key in identity if state.get(key) != identity[key])
    if differing:
        raise ValueError(
            f"dest={dest.url} holds an export of something else ({', '.join(differing)} differ from this one; "
            f"see its {STATE_FILE}). Choose another dest"
        )
    return state


class _SampleStream:
    """The run's samples a row group at a time, each with the file it goes to."""

    def __init__(self, index: RunIndex, ids_per_file: Sequence[np.ndarray], plan: ExportPlan,
                 storage_options: dict[str, Any]) -> None:
        self.index, self.ids_per_file, self.plan, self.options = index, ids_per_file, plan, storage_options

    def row_groups(self, present: set[str]) -> Iterator[tuple[list[tuple[str, Sample]], int]]:
        """Per row group: the (path, sample) pairs whose files are not in ``present``, and how many are.
        A row group whose files are all there is not read beyond its sample ids."""
        row_offset = 0
        for number, file in enumerate(self.index.files):
            ids = self.ids_per_file[number]
            parquet = open_parquet(file.url, self.options)
            try:
                for group in range(parquet.num_row_groups):
                    group_ids = parquet.read_row_group(group, columns=[schema.SAMPLE_ID]).column(0).to_numpy()
                    paths = [self._path(int(sample_id), row_offset + int(np.searchsorted(ids, sample_id)))
                             for sample_id in group_ids]
                    missing = [row for row, path in enumerate(paths) if path not in present]
                    if not missing:
                        yield [], len(paths)
                        continue
                    table = parquet.read_row_group(group)
                    meta, raw = self.index.metadata, self.plan.read_raw
                    yield [(paths[row], sample_from_table(table, row, meta, raw)) for row in missing], \
                        len(paths) - len(missing)
            finally:
                parquet.close()
            row_offset += len(ids)

    def _path(self, sample_id: int, row: int) -> str:
        if self.plan.trainer == SPECFORGE:
            return peer_formats.specforge_path(sample_id)
        return peer_formats.speculators_path(row)


def _state_bytes(sample: Sample) -> int:
    states = (sample.aux_hidden_states, sample.last_hidden_state)
    return sum(t.numel() * t.element_size() for t in states if t is not None)


def _write_sample(dest: Destination, plan: ExportPlan, index: RunIndex, path: str, sample: Sample) -> int:
    if plan.trainer == SPECFORGE:
        payload = peer_formats.specforge_file(sample)
        return dest.write(path, lambda file: torch.save(payload, file))
    from safetensors.torch import save as safetensors_bytes

    tensors = peer_formats.speculators_file(sample, index.metadata.hidden_size, plan.fp8)
    return dest.write_bytes(path, safetensors_bytes(tensors))


# -- speculators' preprocessed dataset --------------------------------------------------------------

def _write_speculators_dataset(dest: Destination, index: RunIndex, ids_per_file: Sequence[np.ndarray],
                               storage_options: dict[str, Any]) -> int:
    """``save_to_disk`` of input_ids, loss_mask, seq_len in hs_{i} order (torch format, as speculators'
    prepare_data leaves it), and ``token_freq.pt``; streamed through a local Arrow file. Returns bytes written."""
    import datasets
    from datasets.arrow_writer import ArrowWriter

    list_type = getattr(datasets, "List", None) or datasets.Sequence  # List since datasets 4
    int64_list = list_type(datasets.Value("int64"))
    features = datasets.Features({"input_ids": int64_list, "loss_mask": int64_list, "seq_len": datasets.Value("int64")})
    frequencies = np.zeros(0, dtype=np.int64)
    scratch = tempfile.mkdtemp(prefix="eagle3-export-")
    try:
        arrow_path = os.path.join(scratch, "rows.arrow")
        with ArrowWriter(features=features, path=arrow_path) as writer:
            for file in index.files:
                columns = _token_columns(file.url, storage_options)
                writer.write_table(columns.cast(features.arrow_schema))
                frequencies = _count_tokens(columns, frequencies)
            writer.finalize()
        rows = datasets.Dataset.from_file(arrow_path).with_format("torch")
        if len(rows) != sum(len(ids) for ids in ids_per_file):
            raise RuntimeError(f"{len(rows)} dataset rows for {sum(len(i) for i in ids_per_file)} exported samples")
        rows.save_to_disk(dest.url, storage_options=dict(dest.fs.storage_options))
        counts = {int(token): int(frequencies[token]) for token in np.flatnonzero(frequencies)}
        buffer = io.BytesIO()
        torch.save(counts, buffer)
        size = dest.write_bytes(peer_formats.SPECULATORS_TOKEN_FREQ_FILE, buffer.getvalue())
        return size + os.path.getsize(arrow_path)  # save_to_disk writes the same Arrow data
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def _token_columns(url: str, storage_options: dict[str, Any]) -> pa.Table:
    """input_ids, loss_mask (int64 lists) and seq_len of one shard, rows in sample-id order."""
    parquet = open_parquet(url, storage_options)
    try:
        table = parquet.read(columns=[schema.SAMPLE_ID, schema.INPUT_IDS, schema.LOSS_MASK])
    finally:
        parquet.close()
    table = table.take(pc.sort_indices(table.column(schema.SAMPLE_ID)))
    return pa.table({
        "input_ids": table.column(schema.INPUT_IDS).cast(pa.list_(pa.int64())),
        "loss_mask": table.column(schema.LOSS_MASK).cast(pa.list_(pa.int64())),
        "seq_len": pc.list_value_length(table.column(schema.INPUT_IDS)).cast(pa.int64()),
    })


def _count_tokens(columns: pa.Table, counts: np.ndarray) -> np.ndarray:
    """Add the shard's loss-masked tokens to ``counts`` (indexed by token id), as speculators' token_freq.pt counts."""
    ids = pc.list_flatten(columns.column("input_ids")).to_numpy()
    mask = pc.list_flatten(columns.column("loss_mask")).to_numpy()
    found = np.bincount(ids[mask == 1], minlength=len(counts))
    if len(found) > len(counts):
        counts = np.concatenate([counts, np.zeros(len(found) - len(counts), dtype=np.int64)])
    counts[: len(found)] += found
    return counts


# -- writing threads and progress -----------------------------------------------------------------

class _Writers:
    """A thread pool writing one sample per task. At most ``2 * threads`` samples, and at most
    ``INFLIGHT_STATE_BYTES`` of their states (one sample whatever its size), are held at once."""

    def __init__(self, threads: int) -> None:
        self._pool = concurrent.futures.ThreadPoolExecutor(threads, thread_name_prefix="export")
        self._limit = 2 * threads
        self._bytes = 0
        self._inflight: collections.deque[tuple[concurrent.futures.Future, Callable[[int], Any], int]] = \
            collections.deque()

    def submit(self, work: Callable[[], int], on_done: Callable[[int], Any], state_bytes: int) -> None:
        while self._inflight and (len(self._inflight) >= self._limit or self._bytes + state_bytes > INFLIGHT_STATE_BYTES):
            self._reap()
        self._bytes += state_bytes
        self._inflight.append((self._pool.submit(work), on_done, state_bytes))

    def drain(self) -> None:
        while self._inflight:
            self._reap()

    def _reap(self) -> None:
        future, on_done, state_bytes = self._inflight.popleft()
        self._bytes -= state_bytes
        on_done(future.result())

    def __enter__(self) -> "_Writers":
        return self

    def __exit__(self, *exc: Any) -> None:
        # On an error or a signal: writes under way finish (each is whole or absent), queued ones are dropped.
        self._pool.shutdown(wait=True, cancel_futures=True)


class _Progress:
    """A tqdm bar on a terminal; otherwise one log line per ``interval_s``."""

    def __init__(self, total: int, interval_s: float) -> None:
        self.total, self.interval_s = total, interval_s
        self.done = self.bytes = 0
        self._started = self._last = time.monotonic()
        self._bar = None
        if sys.stderr.isatty():
            from tqdm import tqdm

            self._bar = tqdm(total=total, unit="sample", desc="export", dynamic_ncols=True)

    def update(self, samples: int, size: int) -> None:
        self.done += samples
        self.bytes += size
        if self._bar is not None:
            self._bar.update(samples)
            return
        now = time.monotonic()
        if now - self._last >= self.interval_s:
            self._last = now
            self._log(now)

    def _log(self, now: float) -> None:
        seconds = max(now - self._started, 1e-9)
        logger.info("export: %d/%d samples, %.1f MB written, %.1f MB/s", self.done, self.total, self.bytes / 1e6,
                    self.bytes / 1e6 / seconds)

    def __enter__(self) -> "_Progress":
        return self

    def __exit__(self, *exc: Any) -> None:
        if self._bar is not None:
            self._bar.close()
        else:
            self._log(time.monotonic())


def _now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
