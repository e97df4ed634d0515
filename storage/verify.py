"""The checks behind ``jobs.verify``: a run's files against its manifest, every problem listed.

``verify_run`` checks each shard the manifest lists as done, where the manifest says its file is
(output.dir or the sink): size and checksum, the footer's schema and metadata, rows, tokens, and
sample ids (together: every sample of the input in exactly one file, or accounted for); ``deep``
also reads every state for NaN/Inf. A shard consumed into an export is checked through the
export's files (``storage.exported``). Each problem is a ``Problem``: the file, what is wrong,
what to do. The whole list of checks: docs/operations.md, "Checking a run".
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
from pathlib import Path
from typing import Any, Callable, Collection, Iterator, Mapping, Optional

import fsspec
import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

import storage.checksum as checksum
import storage.schema as schema
from storage.consumed import mismatch, read_record, record_name
from storage.exported import STATE_FILE, check_dataset_files, check_exported_files, export_directory, list_path
from storage.manifest import CONSUMED, DONE, FAILED, LOCAL, MANIFEST_FILE, SINK, read_manifest
from storage.nonfinite import KEPT, SKIPPED, has_nonfinite
from storage.run_index import DamagedShardError, open_parquet
from storage.schema import ShardMetadata, build_schema, metadata_from_schema
from storage.writer import SHARD_GLOB, TEMP_GLOB, shard_file_name

VERIFY_THREADS = 8
"""Files checked at once: hashing and reading wait on the disk or the network (and release the GIL)."""
IDS_SHOWN = 10
"""Sample ids named in one line; the count says how many there are."""

@dataclasses.dataclass(frozen=True)
class Problem:
    where: str
    """The file (path or URL) or the manifest the problem is in."""
    what: str
    fix: str
    """What to do about it."""
    shard: Optional[int] = None
    """The shard a rerun would write again, when one would."""

    def __str__(self) -> str:
        """One line, whatever an error message quoted in ``what`` held."""
        return " ".join(f"{self.where}: {self.what}; {self.fix}".split())


@dataclasses.dataclass
class VerifyReport:
    output_dir: str
    problems: list[Problem] = dataclasses.field(default_factory=list)
    notes: list[str] = dataclasses.field(default_factory=list)
    """What is fine but worth knowing (samples skipped or kept for NaN/Inf, files declared consumed)."""
    consumed: dict[str, list[int]] = dataclasses.field(default_factory=dict)
    """Where consumed shards' samples went (``consumed_into``) -> those shards."""
    exported_files_checked: int = 0
    """Files of exports that consumed shards, checked against the sizes and checksums listed when they did."""
    shards: int = 0
    files_checked: int = 0
    """Shard files found and checked; with ``files_missing``, every done shard's file that is not consumed."""
    files_missing: int = 0
    rows: int = 0
    tokens: int = 0
    bytes: int = 0

    @property
    def ok(self) -> bool:
        return not self.problems

    @property
    def shards_to_rewrite(self) -> list[int]:
        return sorted({problem.shard for problem in self.problems if problem.shard is not None})


@dataclasses.dataclass
class _ShardCheck:
    """What checking one shard's file found."""

    index: int
    where: str
    problems: list[Problem] = dataclasses.field(default_factory=list)
    metadata: Optional[ShardMetadata] = None
    note: str = ""
    found: bool = False
    """Whether the file is there (the rest of the check ran)."""

    def problem(self, what: str, fix: str) -> None:
        self.problems.append(Problem(self.where, what, fix, self.index))

    @property
    def rerun(self) -> str:
        return f"rerun the job's command with shards=[{self.index}] to write it again"


def verify_run(
    output_dir: str | Path, deep: bool = False, storage_options: Mapping[str, Any] | None = None,
    invalid_sample_ids: Collection[int] = (), node_directories: Mapping[str, Path] | None = None,
    export_options: Mapping[str, Any] | None = None,
    expected_metadata: Callable[[Mapping[str, Any]], Mapping[str, Any]] | None = None,
    content_notes: Callable[[Mapping[str, Any]], list[str]] | None = None,
) -> VerifyReport:
    """Check every done shard of the run in ``output_dir``; raises ValueError when there is no manifest.

    ``storage_options`` open the sink's files (``output.sink_options``); ``invalid_sample_ids`` are
    the input rows the run left out under ``data.on_invalid=skip``; ``node_directories`` (node name ->
    directory) say where the shards a record places on a node are, when the run had several nodes;
    ``export_options`` open the files of exports that consumed shards (``jobs.export``'s ``dest_options``);
    ``expected_metadata`` reads from the manifest's ``content`` (whose keys are the job's) what every file
    must record: ShardMetadata field -> value; ``content_notes`` what it says about the run's inputs as they are
    now (the checkpoint replaced since).
    """
    node_directories = dict(node_directories or {})
    output_dir = Path(output_dir)
    manifest = read_manifest(output_dir)
    records = sorted(manifest["shards"], key=lambda record: record["index"])
    report = VerifyReport(str(output_dir), shards=len(records))
    planned = _planned_ids(records, invalid_sample_ids, str(output_dir / MANIFEST_FILE), report)
    to_check, exports = [], []
    for record in records:
        if record["state"] != DONE:
            report.problems.append(_not_done(record, output_dir))
            continue
        report.notes += _nonfinite_notes(record)
        if record["location"] == CONSUMED:
            _count(report, record)
            if not record.get("consumed_into"):
                report.problems.append(_consumed_by_no_one(record, output_dir))
                continue
            report.consumed.setdefault(record["consumed_into"], []).append(record["index"])
            if record.get("exported_files_checksum"):
                exports.append(record)
            continue
        url = record["sink_url"] if record["location"] == SINK else str(_home(record, node_directories, output_dir) / record["file"])
        expected = planned[record["start"] : record["stop"]] if planned is not None else None
        to_check.append((record, url, expected))
    options = dict(storage_options or {})
    threads = VERIFY_THREADS if exports else max(1, min(VERIFY_THREADS, len(to_check)))
    with concurrent.futures.ThreadPoolExecutor(threads) as pool:
        checks = list(pool.map(lambda item: _check_shard(*item, deep, options), to_check))
        for record in exports:
            report.problems += _check_export(record, dict(export_options or {}), pool.map, report)
        for into in sorted({record["consumed_into"] for record in exports}):
            report.problems += _check_export_dataset(into, dict(export_options or {}), pool.map, report)
    for (record, _, _), check in zip(to_check, checks):
        if check.found:  # the samples, tokens and bytes of the files that are there, not of the missing ones
            _count(report, record)
        report.files_checked += check.found
        report.files_missing += not check.found
        report.problems += check.problems
        report.notes += [check.note] if check.note else []
    required = dict(expected_metadata(manifest["content"])) if expected_metadata else {}
    report.notes += content_notes(manifest["content"]) if content_notes else []
    report.problems += _disagreements(checks, required)
    for directory in {output_dir, *node_directories.values()}:
        report.problems += _stray_files(directory, [r for r in records if _home(r, node_directories, output_dir) == directory])
    # Shard by shard, in plan order; problems of no shard (the plan, stray files) last.
    report.problems.sort(key=lambda problem: len(records) if problem.shard is None else problem.shard)
    return report


def _count(report: VerifyReport, record: dict) -> None:
    report.rows += record["rows"]
    report.tokens += record["tokens"]
    report.bytes += record["bytes"]


def _planned_ids(
    records: list[dict], invalid: Collection[int], manifest: str, report: VerifyReport
) -> Optional[np.ndarray]:
    """The input's kept sample ids in plan order: position p of the plan is id ``planned[p]``.

    Sample ids are row indices across the input files; the rows the run left out as invalid
    have ids but no position. None (and a problem) when the plan does not add up.
    """
    position = 0
    for record in records:
        if record["start"] != position or record["stop"] < record["start"]:
            report.problems.append(Problem(
                manifest, f"shard {record['index']} covers positions {record['start']}..{record['stop']} of the "
                f"input but the shards before it end at {position}: the plan has a gap or an overlap",
                "the manifest was edited or damaged; write the run again into a new output.dir",
            ))
            return None
        position = record["stop"]
    left_out = np.unique(np.asarray(list(invalid), dtype=np.int64))
    planned = np.setdiff1d(np.arange(position + len(left_out), dtype=np.int64), left_out)
    if len(planned) != position:
        report.problems.append(Problem(
            manifest, f"the plan's {position} rows and the {len(left_out)} invalid rows left out do not make up "
            f"the sample ids 0..{position + len(left_out) - 1} (the list of invalid rows does not belong to this run?)",
            "check .invalid_rows.jsonl against the input, or write the run again into a new output.dir",
        ))
        return None
    return planned


def _not_done(record: dict, output_dir: Path) -> Problem:
    index = record["index"]
    where = str(output_dir / shard_file_name(index))
    if record["state"] == FAILED:
        return Problem(
            where, f"shard {index} failed after {record['attempts']} attempts and has no file: {record['error']}",
            "fix what the error names, then rerun the job's command with shards=failed", index,
        )
    return Problem(where, f"shard {index} is {record['state']}, not done", "rerun the job's command: it resumes", index)


def _consumed_by_no_one(record: dict, output_dir: Path) -> Problem:
    index = record["index"]
    return Problem(
        str(output_dir / record["file"]),
        f"shard {index} is recorded as consumed without saying where its samples went: its file was found gone "
        "and taken for consumed (no consumer declared it); it may have been lost",
        f"if no trainer took its samples, rerun the job's command with shards=[{index}] to write it again", index,
    )


def _check_export(record: dict, options: dict[str, Any], map_: Any, report: VerifyReport) -> list[Problem]:
    """A shard consumed into an export: the export's files of it, the only copy of its samples, against the list
    of their sizes and checksums written when it was consumed (and the list against the manifest)."""
    index, dest = record["index"], export_directory(record["consumed_into"])
    rerun = (f"the export is the only copy of shard {index}'s samples: rerun the job's command with shards=[{index}] "
             "to write the shard again, then the export's command (it writes the shard's files again)")
    try:
        fs, root = fsspec.core.url_to_fs(dest, **options)
        root = root.rstrip("/") or "/"
        listed, found = check_exported_files(fs, root, record["file"], record["exported_files_checksum"], map_)
        report.exported_files_checked += listed
    except Exception as error:  # an unreachable export must not hide the problems of the others
        return [Problem(f"{dest}/{list_path(record['file'])}", f"cannot be read: {type(error).__name__}: {error}",
                        "if the export's storage is unreachable, verify again once it is (dest_options=... as "
                        f"jobs.export had them); otherwise {rerun}", index)]
    return [Problem(f"{dest}/{path}", what, rerun, index) for path, what in found]


def _check_export_dataset(into: str, options: dict[str, Any], map_: Any, report: VerifyReport) -> list[Problem]:
    """An export that consumed shards: the files it wrote once every shard's were (speculators' dataset, the only
    copy of the loss masks besides the rows files kept in the export), against its state's record of them."""
    dest = export_directory(into)
    rerun = ("rerun the export's command: it writes the dataset again from the rows files it keeps of each consumed "
             "shard (.export-rows/)")
    try:
        fs, root = fsspec.core.url_to_fs(dest, **options)
        checked, found = check_dataset_files(fs, root.rstrip("/") or "/", map_)
        report.exported_files_checked += checked
    except Exception as error:  # an unreachable export must not hide the problems of the others
        return [Problem(f"{dest}/{STATE_FILE}", f"cannot be read: {type(error).__name__}: {error}",
                        "if the export's storage is unreachable, verify again once it is (dest_options=... as "
                        f"jobs.export had them); otherwise {rerun}")]
    return [Problem(f"{dest}/{path}", what, rerun) for path, what in found]


def _nonfinite_notes(record: dict) -> list[str]:
    notes = []
    for action, setting, meaning in ((SKIPPED, "skip", "left out"), (KEPT, "keep", "written, flagged")):
        ids = [sample["sample_id"] for sample in record.get("nonfinite", []) if sample["action"] == action]
        if ids:
            notes.append(
                f"shard {record['index']}: {len(ids)} samples with NaN/Inf states {meaning} "
                f"(extract.on_nonfinite={setting}): {_ids(ids)}"
            )
    return notes


def _check_shard(
    record: dict, url: str, expected: Optional[np.ndarray], deep: bool, options: dict[str, Any]
) -> _ShardCheck:
    check = _ShardCheck(record["index"], url)
    try:
        fs, path = fsspec.core.url_to_fs(url, **options)
        try:
            size = fs.info(path)["size"]
        except FileNotFoundError:
            declared = read_record(Path(url).with_name(record_name(record["file"])))
            if declared is not None and mismatch(declared, record["bytes"], record["checksum"]):
                declared = None  # not the recorded file's: the next run drops it, and extracts the shard again
            if record["location"] == SINK:
                check.problem(f"missing: the manifest lists shard {check.index} as done in the sink", check.rerun)
            elif declared is not None:
                check.note = (f"shard {check.index}: declared consumed into {declared['into']} and deleted; the next "
                              "run of the job records it")
            else:
                check.problem(
                    f"missing: the manifest lists shard {check.index} as done here and no consumer declared it "
                    "consumed (storage.consumed.consume_shard): it was lost",
                    "rerun the job's command: it extracts the shard again",
                )
            return check
        check.found = True
        if size != record["bytes"]:
            check.problem(f"{size} bytes, the manifest recorded {record['bytes']}",
                          "the file was changed or cut short after it was written; " + check.rerun)
        else:
            found = checksum.of_remote(fs, path, checksum.algorithm_of(record["checksum"]))
            if found != record["checksum"]:
                check.problem(
                    f"checksum {found} differs from the manifest's {record['checksum']}",
                    "the file changed after it was written (disk, copy or sink corruption); " + check.rerun,
                )
        parquet = open_parquet(url, options)
        try:
            _check_contents(parquet, record, expected, deep, check)
        finally:
            parquet.close()
    except DamagedShardError as error:
        check.problem(f"cannot be read: {error.reason}", "the file changed after it was written; " + check.rerun)
    except Exception as error:  # one unreadable file must not hide the problems of the others
        unreachable = "if the sink is unreachable, verify again once it is; otherwise " if record["location"] == SINK else ""
        check.problem(f"cannot be read: {type(error).__name__}: {error}", unreachable + check.rerun)
    return check


def _check_contents(
    parquet: pq.ParquetFile, record: dict, expected: Optional[np.ndarray], deep: bool, check: _ShardCheck
) -> None:
    metadata = metadata_from_schema(parquet.schema_arrow, source=check.where)
    check.metadata = metadata
    written, built = parquet.schema_arrow, build_schema(metadata)
    # Parquet names a list's child `element` where Arrow says `item`: compare types and the key-value
    # metadata, not the children's names.
    if not written.remove_metadata().equals(built.remove_metadata()) or written.metadata != built.metadata:
        check.problem(
            "its columns or key-value metadata are not what the format writes for its own ShardMetadata",
            "it was not written by this job's writer, or was rewritten since; " + check.rerun,
        )
    if parquet.metadata.num_rows != record["rows"]:
        check.problem(f"{parquet.metadata.num_rows} rows, the manifest recorded {record['rows']}", check.rerun)
    table = parquet.read(columns=[schema.SAMPLE_ID, schema.INPUT_IDS])
    ids = table.column(schema.SAMPLE_ID).to_numpy()
    tokens = int(pc.sum(pc.list_value_length(table.column(schema.INPUT_IDS))).as_py() or 0)
    if tokens != record["tokens"]:
        check.problem(f"{tokens} tokens, the manifest recorded {record['tokens']}", check.rerun)
    nonfinite = record.get("nonfinite", [])
    skipped = np.asarray([s["sample_id"] for s in nonfinite if s["action"] == SKIPPED], dtype=np.int64)
    if expected is not None:
        _check_ids(ids, np.setdiff1d(expected, skipped), skipped, check)
    if deep:
        kept = {s["sample_id"] for s in nonfinite if s["action"] == KEPT}
        _scan_states(parquet, metadata, kept, check)


def _check_ids(ids: np.ndarray, wanted: np.ndarray, skipped: np.ndarray, check: _ShardCheck) -> None:
    """The file holds exactly the ``wanted`` ids, each once."""
    unique, counts = np.unique(ids, return_counts=True)
    twice = unique[counts > 1]
    if len(twice):
        check.problem(f"{len(twice)} sample ids are written more than once: {_ids(twice)}", check.rerun)
    missing = np.setdiff1d(wanted, unique)
    if len(missing):
        check.problem(f"{len(missing)} sample ids of the shard's planned rows are missing: {_ids(missing)}", check.rerun)
    extra = np.setdiff1d(unique, wanted)
    left_out = np.intersect1d(extra, skipped)
    if len(left_out):
        check.problem(f"{len(left_out)} sample ids the manifest lists as skipped (NaN/Inf) are in the file: "
                      f"{_ids(left_out)}", check.rerun)
    others = np.setdiff1d(extra, skipped)
    if len(others):
        check.problem(f"{len(others)} sample ids that are not this shard's: {_ids(others)}",
                      "the file holds rows of another shard or run; " + check.rerun)


def _scan_states(parquet: pq.ParquetFile, metadata: ShardMetadata, kept: set[int], check: _ShardCheck) -> None:
    """Every state value's length against its tokens, and NaN/Inf in samples not flagged as kept."""
    columns = []  # (name, bytes per token, dtype of its elements)
    for name, layers in [(schema.AUX_HIDDEN_STATES, len(metadata.layer_ids))] + (
        [(schema.LAST_HIDDEN_STATE, 1)] if metadata.has_last_hidden_state else []
    ):
        columns.append((name, layers * metadata.hidden_size * metadata.itemsize, metadata.state_dtype))
        if metadata.fp8:
            columns.append((name + schema.SCALES_SUFFIX, layers * schema.SCALE_ITEMSIZE, "float32"))
    wrong_size: dict[str, list[int]] = {}
    nonfinite: dict[str, list[int]] = {}
    for group in range(parquet.num_row_groups):
        table = parquet.read_row_group(group, columns=[schema.SAMPLE_ID, schema.INPUT_IDS] + [c[0] for c in columns])
        ids = table.column(schema.SAMPLE_ID).to_numpy()
        lengths = pc.list_value_length(table.column(schema.INPUT_IDS)).to_numpy()
        for name, token_bytes, dtype in columns:
            for row, (data, start, stop) in enumerate(_values(table.column(name))):
                sample = int(ids[row])
                if stop - start != lengths[row] * token_bytes:
                    wrong_size.setdefault(name, []).append(sample)
                elif sample not in kept and has_nonfinite(data, dtype, start, stop):
                    nonfinite.setdefault(name, []).append(sample)
    for name, samples in wrong_size.items():
        check.problem(f"{name} of {len(samples)} samples does not hold tokens x {name} width values: {_ids(samples)}",
                      check.rerun)
    for name, samples in nonfinite.items():
        check.problem(
            f"{name} of {len(samples)} samples holds NaN/Inf the manifest does not flag: {_ids(samples)}",
            f"{check.rerun}; extract.on_nonfinite=fail (the default) names the layer, skip leaves such samples out",
        )


def _values(column: pa.ChunkedArray) -> Iterator[tuple[Any, int, int]]:
    """(data buffer, start byte, stop byte) of each large_binary value, without copying."""
    for chunk in column.chunks:
        offsets = np.frombuffer(chunk.buffers()[1], dtype=np.int64, count=len(chunk) + 1, offset=chunk.offset * 8)
        data = chunk.buffers()[2]
        for row in range(len(chunk)):
            yield data, int(offsets[row]), int(offsets[row + 1])


def _disagreements(checks: list[_ShardCheck], expected: dict[str, Any]) -> list[Problem]:
    """Every file's metadata equals the first file's, and the first file's has the ``expected`` fields."""
    readable = [check for check in checks if check.metadata is not None]
    if not readable:
        return []
    first = readable[0]
    problems = []
    differing = [f"{field}={getattr(first.metadata, field)!r} in the file, {value!r} in the manifest"
                 for field, value in expected.items() if getattr(first.metadata, field) != value]
    if differing:
        problems.append(Problem(first.where, "metadata does not match the run's manifest: " + "; ".join(differing),
                                first.rerun, first.index))
    for check in readable[1:]:
        differing = [
            f"{field.name}={getattr(check.metadata, field.name)!r} here, {getattr(first.metadata, field.name)!r} there"
            for field in dataclasses.fields(ShardMetadata)
            if getattr(check.metadata, field.name) != getattr(first.metadata, field.name)
        ]
        if differing:
            problems.append(Problem(
                check.where, f"metadata differs from {first.where}: " + "; ".join(differing),
                "files of two runs or versions in one output.dir? " + check.rerun, check.index,
            ))
    return problems


def _stray_files(output_dir: Path, records: list[dict]) -> list[Problem]:
    """Temp files and shard files the manifest does not vouch for: a reader of the directory would see
    the second kind as data."""
    recorded = {r["file"] for r in records if r["state"] == DONE and r["location"] == LOCAL}
    exported = {r["file"]: r["consumed_into"] for r in records if r["location"] == CONSUMED and r.get("consumed_into")}
    problems = [
        Problem(str(path), "a temp file: a shard being written, or one a stopped run left",
                "if no job runs on output.dir, delete it (the next run removes it too)")
        for path in sorted(output_dir.glob(TEMP_GLOB))
    ]
    problems += [
        Problem(str(path), f"consumed into {exported[path.name]}, but still here (that export stopped before deleting "
                "it): Parquet readers of output.dir read it as data",
                "its samples are in that export: delete it, or rerun that export's command (it deletes it)")
        if path.name in exported else
        Problem(str(path), "a shard file the manifest does not list as done here: Parquet readers of output.dir "
                "read it as data", "delete it, or rerun the job's command (it removes such files)")
        for path in sorted(output_dir.glob(SHARD_GLOB)) if path.name not in recorded
    ]
    return problems


def _home(record: dict, node_directories: Mapping[str, Path], output_dir: Path) -> Path:
    """The directory a done shard's file is in: its node's, or output.dir."""
    return node_directories.get(record.get("node", ""), output_dir)


def _ids(ids: Collection[int]) -> str:
    shown = [int(i) for i in list(ids)[:IDS_SHOWN]]
    return str(shown)[:-1] + (", ...]" if len(ids) > IDS_SHOWN else "]")
