"""A run's shard files, and an index over their samples built from the files' footers.

A run is an ``output.dir`` (its manifest names every done shard's file, local or at its
``sink_url``) or a URL holding shard files (the ``shard-*.parquet`` there: a file under its final
name is complete). Each file's footer, one small read, gives its row groups, the range of its sample
ids and its ``ShardMetadata``; the index keeps only those, so it pickles small and finding a sample
is two bisects. Files of different runs mix only when everything that shapes a training sample
agrees (``TRAINING_FIELDS``).
"""

from __future__ import annotations

import bisect
import concurrent.futures
import contextlib
import dataclasses
import logging
import os
from pathlib import Path
from typing import Any, Iterator, Mapping, Optional, Sequence

import fsspec
import pyarrow as pa
import pyarrow.parquet as pq
from fsspec.implementations.local import LocalFileSystem

import storage.schema as schema
from storage.consumed import mismatch, read_record, record_name
from storage.manifest import CONSUMED, DONE, MANIFEST_FILE, SINK, read_manifest
from storage.schema import ShardMetadata, metadata_from_schema
from storage.writer import SHARD_GLOB, shard_of_file

logger = logging.getLogger(__name__)

TRAINING_FIELDS = (
    "dtype", "state_dtype", "hidden_size", "layer_ids", "layers_to_capture", "last_hidden_state",
    "language_model_architecture",
)
"""Metadata that must agree between shards read as one dataset: what a sample's tensors mean."""
FOOTER_THREADS = 16
"""Footers read at once when the index is built (remote files: one round trip each)."""


@dataclasses.dataclass(frozen=True)
class ShardFile:
    url: str
    """Absolute local path, or an fsspec URL."""
    group_rows: tuple[int, ...]
    """Rows of each row group, in file order."""
    first_sample_id: int
    last_sample_id: int
    run: int = 0
    """Which of the dataset's runs the file belongs to (its position in the list given)."""
    checksum: str = ""
    """As the manifest recorded it (``storage.checksum``; empty for files listed without a manifest)."""

    @property
    def rows(self) -> int:
        return sum(self.group_rows)


def is_local(url: str, storage_options: Mapping[str, Any] | None = None) -> bool:
    return isinstance(fsspec.core.url_to_fs(url, **(storage_options or {}))[0], LocalFileSystem)


def local_path(url: str) -> str:
    """A local path or ``file://`` URL as a plain absolute path."""
    return os.path.abspath(fsspec.core.url_to_fs(url)[1]) if "://" in url else os.path.abspath(url)


def list_run_files(run: str, storage_options: Mapping[str, Any] | None = None) -> tuple[list[tuple[str, str]], str]:
    """The run's shard files as (url, checksum), and a note on what was left out (empty when nothing was)."""
    options = dict(storage_options or {})
    if is_local(run, options):
        directory = Path(local_path(run))
        if (directory / MANIFEST_FILE).is_file():
            return _files_from_manifest(directory)
        if not directory.is_dir():
            raise ValueError(f"{run}: no such directory; name a run's output.dir or a URL holding its shard files")
        files = [(str(path), "") for path in sorted(directory.glob(SHARD_GLOB))]
    else:
        fs, root = fsspec.core.url_to_fs(run, **options)
        protocol = run.split("://", 1)[0]
        files = [(f"{protocol}://{path}", "") for path in sorted(fs.glob(root.rstrip("/") + "/" + SHARD_GLOB))]
    if not files:
        raise ValueError(f"{run}: no {SHARD_GLOB} files and no {MANIFEST_FILE}; name a run's output.dir")
    return files, ""


def _files_from_manifest(output_dir: Path) -> tuple[list[tuple[str, str]], str]:
    readable, left_out = manifest_shards(output_dir)
    files = [(url, record["checksum"]) for record, url in readable]
    if not files:
        exported = sorted({record["consumed_into"] for record in left_out if record.get("consumed_into")})
        if exported:
            raise ValueError(f"{output_dir}: every done shard was consumed by an export (into {', '.join(exported)}); "
                             "read the export there")
        raise ValueError(f"{output_dir}: the manifest lists no done shard yet; nothing to read")
    return files, left_out_note(output_dir, len(files), len(files) + len(left_out), left_out)


def manifest_shards(output_dir: Path) -> tuple[list[tuple[dict[str, Any], str]], list[dict[str, Any]]]:
    """The manifest's records of a run: (record, url) of every done shard whose file is there to read (in
    output.dir, or at its sink_url), and the records of the others (not done, or consumed: recorded so, or declared
    so by its consumer). ValueError when a done shard's local file is missing without such a declaration."""
    readable: list[tuple[dict[str, Any], str]] = []
    left_out: list[dict[str, Any]] = []
    for record in read_manifest(output_dir)["shards"]:
        if record["state"] != DONE or record["location"] == CONSUMED:
            left_out.append(record)
        elif record["location"] == SINK:
            readable.append((record, record["sink_url"]))
        else:
            path = output_dir / record["file"]
            if path.is_file():
                readable.append((record, str(path)))
                continue
            declared = read_record(output_dir / record_name(record["file"]))
            if declared is None or mismatch(declared, record["bytes"], record["checksum"]):
                node = f" (written on node {record['node']})" if record.get("node") else ""
                raise ValueError(
                    f"{path}: shard {record['index']} is done in {output_dir / MANIFEST_FILE} but its file is not "
                    f"here{node}; copy it back, or read the run where its files are"
                )
            # declared consumed by a consumer (storage.consumed); the job records it at its next look
            left_out.append(dict(record, location=CONSUMED, consumed_into=declared["into"]))
    return readable, left_out


def left_out_note(output_dir: Path, read: int, total: int, left_out: Sequence[Mapping[str, Any]]) -> str:
    """What a reader of the run leaves out, and why (empty when nothing is)."""
    reasons: dict[str, int] = {}
    for record in left_out:
        why = record["state"] if record["state"] != DONE else consumed_why(record)
        reasons[why] = reasons.get(why, 0) + 1
    if not reasons:
        return ""
    counts = ", ".join(f"{count} {state}" for state, count in sorted(reasons.items()))
    return f"{output_dir}: {read} of {total} shards are read; left out: {counts}"


def consumed_why(record: Mapping[str, Any]) -> str:
    """Where a consumed shard's samples went, as a note says it."""
    if record.get("consumed_into"):
        return f"consumed into {record['consumed_into']} (deleted from output.dir once its samples were there)"
    return "recorded as consumed without saying where its samples went (its file was gone)"


class DamagedShardError(ValueError):
    """A shard file whose bytes pyarrow cannot read (a page whose CRC fails, a footer cut short): changed or cut short
    after it was written. The message names the file, the shard, its samples where the footer says, and the commands
    that write it again; ``reason`` is pyarrow's own message."""

    def __init__(self, url: str, reason: str, local: bool, where: str = "") -> None:
        self.url, self.reason = url, reason
        name = url.rstrip("/").rsplit("/", 1)[-1]
        shard = shard_of_file(name)
        run = os.path.dirname(local_path(url)) if local else "<the run's output.dir>"
        again = (f"rerun the extraction with shards=[{shard}] to write it again" if shard is not None else
                 "rerun the extraction with the shards=[...] it names to write them again")
        super().__init__(
            f"{url}{f' ({where})' if where else ''}: cannot be read ({reason}): the file was changed or cut short "
            f"after it was written. Run `python -m jobs.verify output.dir={run}` to find every damaged shard, then "
            f"{again}"
        )


class ShardParquetFile(pq.ParquetFile):
    """A shard file open for reading (``open_parquet``), every page checked against its CRC. What pyarrow cannot read
    of it raises DamagedShardError, which names the file, instead of pyarrow's bare error, which names none."""

    def __init__(self, source: Any, url: str, local: bool, **options: Any) -> None:
        self.url, self.local = url, local
        with self._naming_damage():
            super().__init__(source, page_checksum_verification=True, **options)

    def read(self, *args: Any, **kwargs: Any) -> pa.Table:
        with self._naming_damage(groups=range(self.num_row_groups)):
            return super().read(*args, **kwargs)

    def read_row_group(self, i: int, *args: Any, **kwargs: Any) -> pa.Table:
        with self._naming_damage(groups=[i]):
            return super().read_row_group(i, *args, **kwargs)

    @contextlib.contextmanager
    def _naming_damage(self, groups: Optional[Sequence[int]] = None) -> Iterator[None]:
        try:
            yield
        except (pa.ArrowInvalid, OSError) as error:
            if isinstance(error, OSError) and error.errno is not None:
                raise  # the storage's (missing, denied, unreachable), not the file's bytes
            raise DamagedShardError(self.url, " ".join(str(error).split()), self.local, self._where(groups)) from error

    def _where(self, groups: Optional[Sequence[int]]) -> str:
        """"shard 3, row group 0: sample ids 12..14", as much of it as is known (the footer's statistics)."""
        shard = shard_of_file(self.url.rstrip("/").rsplit("/", 1)[-1])
        where = [f"shard {shard}"] if shard is not None else []
        if groups is None:
            return ", ".join(where)
        if len(groups) == 1:
            where.append(f"row group {groups[0]}")
        column = self.metadata.schema.names.index(schema.SAMPLE_ID)
        stats = [self.metadata.row_group(group).column(column).statistics for group in groups]
        if stats and all(s is not None and s.has_min_max for s in stats):
            return f"{', '.join(where)}: sample ids {min(s.min for s in stats)}..{max(s.max for s in stats)}"
        return ", ".join(where)


def open_parquet(url: str, storage_options: Mapping[str, Any] | None = None) -> ShardParquetFile:
    """A shard file opened for reading: memory-mapped when local, range reads through fsspec otherwise.

    Every page read is checked against its CRC (the writer stores one per page): a corrupted page, or a file cut
    short, raises DamagedShardError naming the file instead of returning wrong states."""
    if is_local(url, storage_options):
        return ShardParquetFile(local_path(url), url, True, memory_map=True)
    fs, path = fsspec.core.url_to_fs(url, **(storage_options or {}))
    # No read-ahead cache: pyarrow asks for exactly the footer and the column chunks it needs.
    return ShardParquetFile(fs.open(path, "rb", cache_type="none"), url, False)


def read_footer(url: str, run: int, checksum: str, storage_options: Mapping[str, Any] | None) -> tuple[ShardFile, ShardMetadata]:
    parquet = open_parquet(url, storage_options)
    try:
        footer = parquet.metadata
        metadata = metadata_from_schema(parquet.schema_arrow, source=url)
        column = footer.schema.names.index(schema.SAMPLE_ID)
        groups = [footer.row_group(g) for g in range(footer.num_row_groups)]
        stats = [group.column(column).statistics for group in groups]
        if all(s is not None and s.has_min_max for s in stats) and groups:
            first, last = min(s.min for s in stats), max(s.max for s in stats)
        else:  # files written without statistics: the column itself (8 bytes a sample)
            ids = parquet.read(columns=[schema.SAMPLE_ID]).column(0).to_numpy()
            first, last = (int(ids.min()), int(ids.max())) if len(ids) else (0, -1)
        shard = ShardFile(url, tuple(g.num_rows for g in groups), int(first), int(last), run, checksum)
    finally:
        parquet.close()
    return shard, metadata


class RunIndex:
    """Every sample of one or more runs: global index -> (file, row group, row), from footers alone."""

    def __init__(self, files: Sequence[ShardFile], metadata: ShardMetadata, notes: Sequence[str] = ()) -> None:
        self.files = list(files)
        self.metadata = metadata
        self.notes = list(notes)
        self._file_starts = _starts(file.rows for file in self.files)
        self._group_starts = [_starts(file.group_rows) for file in self.files]

    @classmethod
    def build(cls, runs: str | os.PathLike | Sequence[str | os.PathLike],
              storage_options: Mapping[str, Any] | None = None) -> "RunIndex":
        """Read the footers of every shard file of ``runs`` (a run, or a list of runs read as one)."""
        sources = [os.fspath(runs)] if isinstance(runs, (str, os.PathLike)) else [os.fspath(r) for r in runs]
        if not sources:
            raise ValueError("name at least one run (an output.dir, or a URL holding its shard files)")
        listed, notes = [], []
        for number, source in enumerate(sources):
            files, note = list_run_files(source, storage_options)
            listed += [(url, number, checksum) for url, checksum in files]
            if note:
                notes.append(note)
                logger.warning("%s", note)
        return cls.from_files(listed, storage_options, notes)

    @classmethod
    def from_files(cls, listed: Sequence[tuple[str, int, str]], storage_options: Mapping[str, Any] | None = None,
                   notes: Sequence[str] = ()) -> "RunIndex":
        """The index over shard files already listed, as (url, run number, checksum or "")."""
        with concurrent.futures.ThreadPoolExecutor(min(FOOTER_THREADS, len(listed))) as pool:
            footers = list(pool.map(lambda item: read_footer(*item, storage_options), listed))
        metadata = _common_metadata(footers)
        files = sorted((shard for shard, _ in footers), key=lambda f: (f.run, f.first_sample_id))
        _check_disjoint(files)
        return cls(files, metadata, notes)

    def __len__(self) -> int:
        return self._file_starts[-1]

    def locate(self, index: int) -> tuple[int, int, int]:
        """Global sample index -> (file number, row group, row within the group)."""
        if not 0 <= index < len(self):
            raise IndexError(f"sample index {index} out of range (0..{len(self) - 1})")
        file = bisect.bisect_right(self._file_starts, index) - 1
        row = index - self._file_starts[file]
        starts = self._group_starts[file]
        group = bisect.bisect_right(starts, row) - 1
        return file, group, row - starts[group]


def _starts(counts: Any) -> list[int]:
    starts = [0]
    for count in counts:
        starts.append(starts[-1] + count)
    return starts


def _common_metadata(footers: Sequence[tuple[ShardFile, ShardMetadata]]) -> ShardMetadata:
    first_file, first = footers[0]
    for shard, metadata in footers[1:]:
        for field in TRAINING_FIELDS:
            mine, theirs = getattr(first, field), getattr(metadata, field)
            if mine != theirs and (field != "language_model_architecture" or (mine and theirs)):
                raise ValueError(
                    f"cannot read these shards as one dataset: {first_file.url} has {field}={mine!r} but "
                    f"{shard.url} has {field}={theirs!r} (different runs); read each run on its own"
                )
    return first


def _check_disjoint(files: Sequence[ShardFile]) -> None:
    for before, after in zip(files, files[1:]):
        if before.run == after.run and after.first_sample_id <= before.last_sample_id:
            raise ValueError(
                f"{before.url} (sample ids {before.first_sample_id}..{before.last_sample_id}) and {after.url} "
                f"({after.first_sample_id}..{after.last_sample_id}) hold the same sample ids: shard files of two "
                "runs in one place? Read each run on its own"
            )

