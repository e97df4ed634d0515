"""Exports a run into the layout a trainer reads: SpecForge's ``.ckpt`` files or speculators' dataset.

``prepare`` checks, before anything is written, what the format needs (the final state the trainer
reads, ``training.final_state``; a complete run; bit-exact states when ``exact=true``; room on a local
``dest``) and claims ``dest`` with ``.export_state.json``; ``write`` then goes a shard at a time, with
bounded memory, each file whole or absent (``training.destination``), and a rerun of the same export
resumes. The layouts (``training.peer_formats``), the refusals, the exit codes and export in place
(``consume=true``, ``training.consume``): docs/training.md.
"""

from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import datetime
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
from typing import Any, Callable, Iterator, Optional, Sequence

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import torch

from common.terminal import tqdm_width
from storage import checksum, schema
from storage.exported import DATASET_FILES, STATE_FILE, check_files
from storage.manifest import CONSUMED, DONE, LOCAL, MANIFEST_FILE
from storage.reader import Sample, sample_from_table
from storage.run_index import (
    RunIndex,
    left_out_note,
    list_run_files,
    manifest_shards,
    open_parquet,
)
from storage.schema import ShardMetadata
from storage.token_freq import TokenCounter, token_freq_bytes
from training import peer_formats
from training.consume import ShardConsumer, check_consumed, check_space
from training.destination import Destination, is_temp
from training.export_job import (
    ROWS_DIR,
    ExportConfig,
    ExportPlan,
    ExportShard,
    PreparedExport,
    Put,
    id_ranges,
    rows_file,
)
from training.final_state import FinalNorm, final_norm_for
from training.peer_formats import SPECFORGE, SPECULATORS

logger = logging.getLogger(__name__)

SHARD_BYTES = "shard_bytes"
"""The complete export state's shard file name -> bytes of its samples' files, which a rerun checks them against."""
EXPORT_VERSION = 3
"""The export state's format, part of what a resumed export must match. The state lists every shard (file, rows,
checksum as ``storage.checksum``'s ``<algorithm>:<hex>``, sample ids), so that shards consumed since still count."""
INFLIGHT_STATE_BYTES = 512 * 1024 * 1024
"""States of the samples being written at once (each task holds about twice its sample's states: the
file's tensors and their bytes); a sample larger than this is written alone."""


def plan_export(config: ExportConfig, meta: ShardMetadata, left_out: Sequence[str]) -> ExportPlan:
    """What will be written, or a ValueError naming what the run lacks and the setting to rerun with."""
    run = config.output.dir
    final_norm = final_norm_for(config.to, meta, run, config.model_path, config.exact)
    if left_out and not config.allow_partial:
        raise ValueError(
            f"{'; '.join(left_out)}. Finish the run first (rerun its jobs.extract command; shards=failed reruns "
            "failed shards), or pass allow_partial=true to export the done shards only"
        )
    notes: list[str] = []
    if final_norm is not None:
        notes.append(
            f"the run stored the pre-norm final state: the files' hidden_state is the model's final norm "
            f"({final_norm.describe()}) applied to it at export, as SGLang computes it (in {meta.dtype}: "
            + ("SGLang's own post-norm state bit for bit" if meta.dtype == "float32" else
               "most values SGLang's own post-norm state bit for bit, the others one step apart; docs/training.md")
            + ")"
        )
    if meta.fp8 and config.exact:
        raise ValueError(
            f"exact=true but {run} stored fp8 states (output.state_dtype=float8_e4m3fn), which are not the states "
            "SGLang computed; rerun the extraction with output.state_dtype=model into a new output.dir, or drop exact"
        )
    check_trainer_packages(config.to)
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
                      final_norm=final_norm, notes=tuple(notes))


def export_key(trainer: str, dest: Destination) -> str:
    """``<format>:<dest>`` (a local dest as an absolute path): what a consumed shard's record names."""
    return f"{trainer}:{os.path.abspath(dest.root) if dest.local else dest.url.rstrip('/')}"


def prepare(config: ExportConfig) -> PreparedExport:
    """Read the run's footers and sample ids, check the format can take it, ``dest`` is this export's and has room;
    raises ValueError (naming what to change) before anything is written."""
    dest = Destination(config.dest, config.dest_options)
    key = export_key(config.to, dest)
    readable, consumed, left_out = _list_run(config, key)
    stored = dest.read_json(STATE_FILE)
    options = config.output.sink_options
    index = RunIndex.from_files([(url, 0, sha) for url, sha, _ in readable], options) if readable else None
    metadata = index.metadata if index is not None else _stored_metadata(stored, config)
    plan = plan_export(config, metadata, left_out)
    shards = _shards(index, readable, consumed, stored, config, dest)
    final_norm = FinalNorm(plan.final_norm, getattr(torch, metadata.dtype)) if plan.final_norm is not None else None
    job = PreparedExport(config, metadata, plan, shards, dest, key, state={}, final_norm=final_norm)
    check_space(job)
    job.state = _claim(dest, _identity(plan, metadata, shards))
    return job


def check_trainer_packages(to: str) -> None:
    """ValueError when this Python lacks what the export to ``to`` writes with (speculators: an HF dataset and
    safetensors files)."""
    missing = [name for name in ("datasets", "safetensors") if importlib.util.find_spec(name) is None]
    if to == SPECULATORS and missing:
        raise ValueError(f"to=speculators needs {', '.join(missing)}: pip install 'eagle3-extract[export]'")


def export(config: ExportConfig) -> dict[str, Any]:
    """Check, then write every file not there yet; returns the report (samples, bytes, seconds, rates, peak RSS).
    With ``consume``, the caller holds the run's lock (``jobs.export`` does: ``runtime.lock.OutputLock``)."""
    return write(prepare(config))


# -- what the run holds, and what the export holds of it --------------------------------------------

def _list_run(config: ExportConfig, key: str) -> tuple[list[tuple[str, str, Optional[dict]]], list[dict], list[str]]:
    """The shard files to read (url, checksum, manifest record), the records of shards consumed into this export,
    and a note on what is left out (not done, or consumed elsewhere)."""
    directory = config.run_directory()
    if directory is None:
        if config.consume:
            raise ValueError(
                f"consume=true deletes shard files of a run and records it in the run's manifest, but "
                f"{config.output.dir} is not a local output.dir with a {MANIFEST_FILE}; name the run's output.dir, "
                "or drop consume"
            )
        files, _ = list_run_files(config.output.dir, config.output.sink_options)
        return [(url, value, None) for url, value in files], [], []
    found, left_out = manifest_shards(directory)
    consumed = [r for r in left_out if r["state"] == DONE and r["location"] == CONSUMED and r["consumed_into"] == key]
    others = [r for r in left_out if r not in consumed]
    if not found and not consumed:
        raise ValueError(f"{directory}: the manifest lists no done shard to export; "
                         + (left_out_note(directory, 0, len(left_out), left_out) or "nothing to read"))
    note = left_out_note(directory, len(found) + len(consumed), len(found) + len(left_out), others)
    if note:
        logger.warning("%s", note)
    return [(url, record["checksum"], record) for record, url in found], consumed, [note] if note else []


def _stored_metadata(stored: Optional[dict[str, Any]], config: ExportConfig) -> ShardMetadata:
    """Every shard left is consumed into this export: the run's metadata is what its state recorded."""
    if stored is None:
        raise ValueError(f"{config.output.dir}: every shard is consumed into dest={config.dest}, which has no "
                         f"{STATE_FILE}: the export there was removed; its samples are gone from the run too")
    return ShardMetadata(**stored["run"])


def _shards(index: Optional[RunIndex], readable: Sequence[tuple[str, str, Optional[dict]]], consumed: Sequence[dict],
            stored: Optional[dict[str, Any]], config: ExportConfig, dest: Destination) -> list[ExportShard]:
    records = {url: record for url, _, record in readable}
    shards = []
    for file in index.files if index is not None else []:
        record = records[file.url] or {}
        ids, tokens = _ids_and_tokens(file.url, config.output.sink_options)
        shards.append(ExportShard(
            name=record.get("file") or file.url.rsplit("/", 1)[-1], rows=file.rows, checksum=file.checksum, ids=ids,
            url=file.url, index=record.get("index"), location=record.get("location", ""),
            bytes=record.get("bytes", 0), tokens=tokens,
        ))
    known = {shard["file"]: shard for shard in (stored or {}).get("shards", [])}
    for record in consumed:
        if record["file"] not in known:
            raise ValueError(
                f"{config.output.dir}: shard {record['index']} ({record['file']}) was consumed into {dest.url}, but "
                f"{dest.url}/{STATE_FILE} does not list it: that dest was replaced since; the shard's samples are "
                f"there or nowhere. Rerun the extraction with shards=[{record['index']}] to write them again"
            )
        mine = known[record["file"]]
        shards.append(ExportShard(
            name=record["file"], rows=mine["rows"], checksum=mine["checksum"], ids=_ids_from_ranges(mine["sample_ids"]),
            index=record["index"], location=CONSUMED, bytes=record["bytes"], tokens=record["tokens"],
            exported_files_checksum=record.get("exported_files_checksum", ""),
        ))
    shards.sort(key=lambda shard: (int(shard.ids[0]) if len(shard.ids) else -1, shard.name))
    row = 0
    for shard in shards:
        shard.first_row, row = row, row + shard.rows
    return shards


def _ids_and_tokens(url: str, storage_options: dict[str, Any]) -> tuple[np.ndarray, int]:
    """A shard file's sample ids, sorted, and its tokens (the input_ids values, from the footer)."""
    parquet = open_parquet(url, storage_options)
    try:
        footer = parquet.metadata
        leaf = [footer.schema.column(i).path for i in range(footer.num_columns)].index(f"{schema.INPUT_IDS}.list.element")
        tokens = sum(footer.row_group(g).column(leaf).num_values for g in range(footer.num_row_groups))
        return np.sort(parquet.read(columns=[schema.SAMPLE_ID]).column(0).to_numpy()), int(tokens)
    finally:
        parquet.close()


def _ids_from_ranges(ranges: Sequence[Sequence[int]]) -> np.ndarray:
    return np.concatenate([np.arange(start, stop, dtype=np.int64) for start, stop in ranges] or [np.zeros(0, np.int64)])


def _identity(plan: ExportPlan, metadata: ShardMetadata, shards: Sequence[ExportShard]) -> dict[str, Any]:
    """What a resumed export must match: format, states, the run's metadata and its shard files (as JSON reads back)."""
    identity = {
        "export_version": EXPORT_VERSION,
        "format": plan.trainer,
        "states": plan.states,
        "run": dataclasses.asdict(metadata),
        "shards": [shard.record() for shard in shards],
        "samples": int(sum(shard.rows for shard in shards)),
    }
    if plan.trainer == SPECULATORS:  # hs_{i} names rows, not sample ids: the order is part of what was written
        identity["sample_ids"] = id_ranges([shard.ids for shard in shards])
    if plan.final_norm is not None:  # its weight is in every file's final state
        identity["final_norm"] = {"weight": plan.final_norm.weight_name, "eps": plan.final_norm.eps}
    return json.loads(json.dumps(identity))


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


# -- writing --------------------------------------------------------------------------------------

def write(job: PreparedExport) -> dict[str, Any]:
    """Write the files ``dest`` does not hold yet, a shard at a time (consuming each with ``consume``), then
    (speculators) the dataset."""
    started = time.perf_counter()
    config, plan, dest = job.config, job.plan, job.dest
    for note in plan.notes:
        logger.info("%s", note)
    report = {"dest": config.dest, "format": plan.trainer, "states": plan.states, "samples": job.samples,
              "final_state": _final_state(job), "written": 0, "skipped": 0, "bytes": 0, "consumed": 0,
              "freed_bytes": 0}
    was_complete = bool(job.state.get("complete"))
    consuming = config.consume and any(shard.location == LOCAL for shard in job.shards)
    lost_dataset = _lost_dataset(job) if was_complete else set()
    lost = set(lost_dataset)
    if was_complete and not consuming:
        with concurrent.futures.ThreadPoolExecutor(config.threads) as pool:
            for shard in job.shards:  # the only copy of a consumed shard's samples: still as it was exported?
                if shard.consumed:
                    check_consumed(job, shard, pool.map)
        lost |= _lost_files(job, dest.file_sizes())
        if not lost:
            _remove_rows(job)  # left by an export stopped right after it completed
            report["skipped"] = job.samples
            return _finish(report, started, already_complete=True)
        logger.warning("%d files of the complete export in %s are missing or not as they were written (%s): writing "
                       "them again", len(lost), config.dest, ", ".join(sorted(lost)[:3]))
    # speculators: the dataset is made (again) from every shard's rows file
    dataset = plan.trainer == SPECULATORS and (not was_complete or bool(lost_dataset))
    removed = dest.remove_temps()
    if removed:
        logger.info("removed %d temp files a stopped export left in %s", removed, config.dest)
    present = {path: size for path, size in dest.file_sizes().items() if path not in lost}
    with _Progress(job.samples, config.progress_interval_s) as progress, _Writers(config.threads) as writers, \
            ShardConsumer(job, present, report) as consumer:
        for shard in job.shards:
            if shard.consumed:
                consumer.finish_consumed(shard, rows=dataset)
                report["skipped"] += shard.rows
                progress.update(shard.rows, 0)
                continue
            consume = config.consume and shard.location == LOCAL
            puts, ends = _export_shard(job, shard, present, writers, progress, report, rows=dataset or consume)
            if consume:
                consumer.consume(shard, puts, ends)
    state = {**job.state, "complete": True, "completed_at": _now(), SHARD_BYTES: _shard_bytes(job, dest.file_sizes())}
    if dataset:
        state[DATASET_FILES] = _write_speculators_dataset(job)
        report["bytes"] += sum(size for size, _ in state[DATASET_FILES].values())
    dest.write_json(STATE_FILE, state)
    _remove_rows(job)  # after the state says the dataset holds them: a rerun needs them till then
    return _finish(report, started)


def _shard_bytes(job: PreparedExport, sizes: dict[str, int]) -> dict[str, int]:
    """Shard file name -> the bytes of the files the export holds of its samples (shards not consumed into it:
    the files of those are listed with their checksums, ``storage.exported``)."""
    return {shard.name: sum(sizes.get(path, 0) for path in job.paths(shard, rows=False))
            for shard in job.shards if not shard.consumed}


def _lost_files(job: PreparedExport, sizes: dict[str, int]) -> set[str]:
    """The files of a complete export's samples (of shards not consumed into it) that are gone, and every file of a
    shard whose files no longer add up to the bytes the export recorded when it completed (one was cut short or
    changed): what a rerun writes again."""
    recorded = job.state.get(SHARD_BYTES) or {}
    lost: set[str] = set()
    for shard in job.shards:
        if shard.consumed:
            continue
        paths = job.paths(shard, rows=False)
        if shard.name in recorded and sum(sizes.get(path, 0) for path in paths) != recorded[shard.name]:
            lost.update(paths)
        else:
            lost.update(path for path in paths if path not in sizes)
    return lost


def _lost_dataset(job: PreparedExport) -> set[str]:
    """The files of a complete export's dataset (speculators) that are gone or not as the export recorded them when
    it completed: their sizes, and their checksums too once shards are consumed into it (then only the dataset and
    the consumed shards' rows files hold their loss masks)."""
    files = job.state.get(DATASET_FILES) or {}
    if not files:
        return set()
    if job.config.consume or any(shard.consumed for shard in job.shards):
        return {path for path, _ in check_files(job.dest.fs, job.dest.root, files, "written when the export completed",
                                                "the export completed")}
    sizes = job.dest.file_sizes()
    return {path for path, (size, _) in files.items() if sizes.get(path) != size}


def _remove_rows(job: PreparedExport) -> None:
    """speculators: the rows files of the shards the run still holds (the dataset holds their rows); those of shards
    consumed into the export stay, listed with the shard's files: the copy of their loss masks the dataset is made
    (again) from."""
    def kept(shard: ExportShard) -> bool:
        return shard.consumed or (job.config.consume and shard.location == LOCAL)

    if job.plan.trainer != SPECULATORS or not any(kept(shard) for shard in job.shards):
        job.dest.remove(ROWS_DIR)
        return
    for shard in job.shards:
        if not kept(shard):
            job.dest.remove(rows_file(shard))


def _final_state(job: PreparedExport) -> str:
    """What the files' final state is, for the report."""
    if job.plan.final_norm is not None:
        return f"post_norm from the run's pre_norm, the final norm ({job.plan.final_norm.describe()}) applied at export"
    return job.metadata.last_hidden_state


def _export_shard(job: PreparedExport, shard: ExportShard, present: dict[str, int], writers: "_Writers",
                  progress: "_Progress", report: dict[str, Any], rows: bool) -> tuple[list[Put], list[Sample]]:
    """Write the shard's files (with ``consume``: every one, those there already read back and rewritten if they
    differ; else the missing ones); returns what each file is now, and copies of the first and last samples read
    (with ``consume``: the shard's first and last, which its verification loads back)."""
    check = present if job.config.consume else None
    puts: list[Put] = []
    ends: list[Sample] = []

    def done(put: Put) -> None:
        puts.append(put)
        report["written" if put.wrote else "skipped"] += 1
        report["bytes"] += put.size if put.wrote else 0
        progress.update(1, put.size if put.wrote else 0)

    skip = (lambda path: False) if check is not None else (lambda path: path in present)
    for samples, skipped, last_group in _shard_samples(job, shard, skip):
        report["skipped"] += skipped
        progress.update(skipped, 0)
        for path, sample in samples:
            writers.submit(lambda path=path, sample=sample: _put(job.dest, path, _file_bytes(job, sample), check),
                           on_done=done, state_bytes=_state_bytes(sample))
        if check is not None and samples:  # every row is read: the first group's first, the last group's last
            # Copies: a sample is a view on its row group, which is let go once its files are written.
            ends += ([_copy(samples[0][1])] if not ends else []) + ([_copy(samples[-1][1])] if last_group else [])
    writers.drain()
    if job.plan.trainer == SPECULATORS and rows and (check is not None or rows_file(shard) not in present):
        put = _put(job.dest, rows_file(shard), _rows_bytes(shard, job.config.output.sink_options), check)
        report["bytes"] += put.size if put.wrote else 0
        puts.append(put)
    return puts, ends


def _copy(sample: Sample) -> Sample:
    return dataclasses.replace(sample, **{field.name: getattr(sample, field.name).clone()
                                          for field in dataclasses.fields(sample)
                                          if isinstance(getattr(sample, field.name), torch.Tensor)})


def _shard_samples(job: PreparedExport, shard: ExportShard,
                   skip: Callable[[str], bool]) -> Iterator[tuple[list[tuple[str, Sample]], int, bool]]:
    """Per row group of the shard: the (path, sample) pairs whose files are not skipped, how many are, and whether
    it is the shard's last group. A row group whose files are all skipped is not read beyond its sample ids."""
    parquet = open_parquet(shard.url, job.config.output.sink_options)
    try:
        for group in range(parquet.num_row_groups):
            last_group = group == parquet.num_row_groups - 1
            group_ids = parquet.read_row_group(group, columns=[schema.SAMPLE_ID]).column(0).to_numpy()
            paths = [job.path(shard, int(sample_id)) for sample_id in group_ids]
            wanted = [row for row, path in enumerate(paths) if not skip(path)]
            if not wanted:
                yield [], len(paths), last_group
                continue
            table = parquet.read_row_group(group)
            yield [(paths[row], job.as_trained(sample_from_table(table, row, job.metadata, job.plan.read_raw)))
                   for row in wanted], \
                len(paths) - len(wanted), last_group
    finally:
        parquet.close()


def _file_bytes(job: PreparedExport, sample: Sample) -> bytes | memoryview:
    tensors = job.file_tensors(sample)
    if job.plan.trainer == SPECFORGE:
        buffer = io.BytesIO()
        torch.save(tensors, buffer)
        return buffer.getbuffer()
    from safetensors.torch import save as safetensors_bytes

    return safetensors_bytes(tensors)


def _put(dest: Destination, path: str, data: bytes | memoryview, present: Optional[dict[str, int]]) -> Put:
    """Write ``data`` to ``path``; with ``present`` (consume: the file is verified later, against the checksum of
    ``data``), a file already there is read back and kept only if it holds exactly ``data``."""
    value = checksum.of_bytes(data) if present is not None else ""
    size = len(data)
    if present is not None and path in present:
        if present[path] == size and dest.digest(path, checksum.DEFAULT_ALGORITHM) == (size, value):
            return Put(path, size, value, wrote=False)
        logger.warning("%s/%s: not the bytes the run's shard gives (changed since it was written); writing it again",
                       dest.url, path)
    dest.write_bytes(path, data)
    return Put(path, size, value, wrote=True)


def _state_bytes(sample: Sample) -> int:
    states = (sample.aux_hidden_states, sample.last_hidden_state)
    return sum(t.numel() * t.element_size() for t in states if t is not None)


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


# -- speculators' preprocessed dataset --------------------------------------------------------------

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


def _rows_bytes(shard: ExportShard, storage_options: dict[str, Any]) -> bytes:
    """The shard's dataset rows as an Arrow IPC file (the same bytes for the same rows: a rerun can compare them)."""
    table = _token_columns(shard.url, storage_options)
    sink = pa.BufferOutputStream()
    with pa.ipc.new_file(sink, table.schema) as writer:
        writer.write_table(table)
    return sink.getvalue().to_pybytes()


def _write_speculators_dataset(job: PreparedExport) -> dict[str, list[int | str]]:
    """``save_to_disk`` of input_ids, loss_mask, seq_len in hs_{i} order (torch format, as speculators'
    prepare_data leaves it), and ``token_freq.pt``, from the shards' rows files, through a local Arrow file.
    Returns each file written: path -> [size, checksum] (of the bytes made; the export's state records them)."""
    import datasets
    from datasets.arrow_writer import ArrowWriter

    dest = job.dest
    list_type = getattr(datasets, "List", None) or datasets.Sequence  # List since datasets 4
    int64_list = list_type(datasets.Value("int64"))
    features = datasets.Features({"input_ids": int64_list, "loss_mask": int64_list, "seq_len": datasets.Value("int64")})
    counter = TokenCounter()
    scratch = tempfile.mkdtemp(prefix="eagle3-export-")
    try:
        arrow_path = os.path.join(scratch, "rows.arrow")
        with ArrowWriter(features=features, path=arrow_path) as writer:
            for shard in job.shards:
                table = pa.ipc.open_file(pa.py_buffer(dest.read_bytes(rows_file(shard)))).read_all()
                if table.num_rows != shard.rows:
                    raise RuntimeError(f"{dest.url}/{rows_file(shard)} holds {table.num_rows} rows, {shard.name} "
                                       f"{shard.rows}: delete it and rerun the export")
                writer.write_table(table.cast(features.arrow_schema))
                counter.add(table.column("input_ids"), table.column("loss_mask"))
            writer.finalize()
        rows = datasets.Dataset.from_file(arrow_path).with_format("torch")
        if len(rows) != job.samples:
            raise RuntimeError(f"{len(rows)} dataset rows for {job.samples} exported samples")
        # Saved here, then each file published into dest whole (temp, fsync, rename), never written through a link
        # there; state.json, which makes it a dataset for load_from_disk, last.
        saved = os.path.join(scratch, "dataset")
        rows.save_to_disk(saved)
        del rows
        os.remove(arrow_path)
        files: dict[str, list[int | str]] = {}
        for name in sorted(os.listdir(saved), key=lambda name: (name == "state.json", name)):
            path = os.path.join(saved, name)
            files[name] = [dest.write(name, lambda file, path=path: _copy_file(path, file)),
                           checksum.of_file(path, checksum.DEFAULT_ALGORITHM)]
        token_freq = token_freq_bytes(counter.counts())
        files[peer_formats.SPECULATORS_TOKEN_FREQ_FILE] = [
            dest.write_bytes(peer_formats.SPECULATORS_TOKEN_FREQ_FILE, token_freq), checksum.of_bytes(token_freq)]
        return files
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def _copy_file(source: str, file: Any) -> None:
    with open(source, "rb") as handle:
        shutil.copyfileobj(handle, file, 8 << 20)


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

            self._bar = tqdm(total=total, unit="sample", desc="export", **tqdm_width(sys.stderr))

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
