"""The output directory of ``jobs.prepare``: what it holds, and the rules for writing into it.

Parts (``part-NNNNN.parquet``, what ``jobs.extract`` reads) are written under hidden temp names and
renamed into place together at the end, then the side record ``_prepare.json`` says ``complete``: a
reader never sees the parts of a run that did not finish. Regenerated answers are published a shard
at a time, so a killed run resumes from those. A directory that is not this command's, or holds a
prepare of other settings or inputs, is refused untouched (exit 2); nothing the user named is ever
deleted. The layout and the refusals: docs/conversations.md.
"""

from __future__ import annotations

import dataclasses
import datetime
import hashlib
import json
import os
from pathlib import Path
from typing import Any, Iterable, Iterator, Optional, Sequence

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from conversations.reader import RowSource
from conversations.template import Encoded
from runtime.lock import LOCK_FILE
from storage.atomic import fsync_path, open_new, remove_quietly, write_synced

RECORD_FILE = "_prepare.json"
SKIPPED_FILE = "_skipped_rows.jsonl"
REGENERATED_DIR = "_regenerated"
RECORD_FORMAT = "eagle3-prepare-v1"
RUNNING, COMPLETE = "running", "complete"
PART_METADATA_KEY = b"eagle3_prepare"
"""Parquet key-value metadata of a part: which run wrote it (its content hash) and the shard it holds."""
ROW_GROUP_ROWS = 2048
"""jobs.extract reads a Parquet input by row group: small ones keep its reads of a few rows small."""
INPUT_DIGESTS = "input.digests"
"""The content key of the input files' checksums. A record written before it existed compares without it: those
inputs were identified by their names and sizes only."""
SCHEMA = pa.schema([
    pa.field("conversation_id", pa.int64(), nullable=False),
    pa.field("id", pa.string()),  # the input row's own id (ShareGPT's), null without one
    pa.field("input_ids", pa.list_(pa.int32()), nullable=False),
    pa.field("loss_mask", pa.list_(pa.uint8()), nullable=False),
])
_COMPRESSION = "zstd"


def part_name(shard: int) -> str:
    return f"part-{shard:05d}.parquet"


def regenerated_name(shard: int) -> str:
    return f"part-{shard:05d}.jsonl"


def temp_path(path: Path) -> Path:
    """Hidden, same directory: publishing is one rename, and readers skip it meanwhile."""
    return path.with_name(f".{path.name}.tmp")


def content_sha256(content: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(content, sort_keys=True).encode()).hexdigest()


def now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")


# -- atomic files -------------------------------------------------------------------------------


def write_atomic(path: Path, text: str) -> None:
    """``text`` under ``path``, whole or not at all (temp name, fsync, rename)."""
    temp = temp_path(path)  # hidden, unlike replace_atomically's: readers of output.dir skip it
    write_synced(temp, text.encode())
    os.replace(temp, path)
    fsync_path(path.parent)


def write_record(out: Path, record: dict[str, Any]) -> None:
    write_atomic(out / RECORD_FILE, json.dumps(record, indent=1, sort_keys=True) + "\n")


def read_record(out: Path) -> Optional[dict[str, Any]]:
    path = out / RECORD_FILE
    if not path.exists():
        return None
    try:
        record = json.loads(path.read_text())
    except ValueError as error:
        raise ValueError(f"{path} is not valid JSON ({error}); it is not a record this command wrote whole. Move "
                         "the directory away or choose another output.dir") from None
    if record.get("format") != RECORD_FORMAT:
        raise ValueError(f"{path} is not a jobs.prepare record (format {record.get('format')!r}); choose another "
                         "output.dir")
    return record


# -- what is there --------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Existing:
    """What output.dir holds before this run."""

    record: Optional[dict[str, Any]]

    @property
    def complete(self) -> bool:
        return self.record is not None and self.record.get("state") == COMPLETE


def inspect_output(out: Path, content: dict[str, Any], regeneration: Optional[dict[str, Any]]) -> Existing:
    """Whether this run may write into ``out``; raises ValueError (nothing touched) where it may not."""
    if out.exists() and not out.is_dir():
        raise ValueError(f"output.dir={out} is a file; name a directory for the tokenized parts")
    record = read_record(out) if out.is_dir() else None
    if record is None:
        held = sorted(p.name for p in out.iterdir() if p.name != LOCK_FILE) if out.is_dir() else []
        if held:
            shown = ", ".join(held[:5]) + (f" and {len(held) - 5} more" if len(held) > 5 else "")
            raise ValueError(f"output.dir={out} holds {shown} and no {RECORD_FILE}: it is not a jobs.prepare output. "
                             "Choose an empty or new directory; nothing there was touched")
        return Existing(None)
    foreign = [path.name for path in sorted(out.iterdir()) if not _is_own_entry(path)]
    if foreign:
        raise ValueError(f"output.dir={out} holds {', '.join(foreign[:5])}, which jobs.prepare did not write: readers "
                         "of the directory would take it for data. Move it away, or choose another output.dir")
    answers = list_regenerated(out)
    regenerated = record.get("regeneration") or {}
    if answers and regeneration is not None and regenerated != _as_recorded(regenerated, regeneration):
        differs = _differences(regenerated, _as_recorded(regenerated, regeneration))
        raise ValueError(
            f"output.dir={out} holds {len(answers)} shards of answers regenerated with other settings (differs in: "
            f"{differs}); rerun with those settings to resume, or choose another output.dir. Nothing was touched"
        )
    stored = record.get("content") or {}
    content = _as_recorded(stored, content)
    if record.get("state") == COMPLETE and stored != content:
        differs = _differences(stored, content)
        raise ValueError(
            f"output.dir={out} holds a complete prepare of other inputs or settings (differs in: {differs}); "
            "choose another output.dir (nothing was touched), or move that one away first"
        )
    return Existing(record)


def _as_recorded(stored: dict[str, Any], content: dict[str, Any]) -> dict[str, Any]:
    """``content`` as ``stored`` was recorded: without the inputs' checksums where the record has none."""
    if INPUT_DIGESTS in stored:
        return content
    return {key: value for key, value in content.items() if key != INPUT_DIGESTS}


def _is_own_entry(path: Path) -> bool:
    name = path.name
    if name in (RECORD_FILE, SKIPPED_FILE, LOCK_FILE) or (name.startswith(".") and name.endswith(".tmp")):
        return True
    if name == REGENERATED_DIR:
        return path.is_dir() and not path.is_symlink()
    return name.startswith("part-") and name.endswith(".parquet") and is_own_part(path)


def _differences(old: dict[str, Any], new: dict[str, Any]) -> str:
    keys = sorted(key for key in set(old) | set(new) if old.get(key) != new.get(key))
    return ", ".join(keys) or "the record's layout"


def list_regenerated(out: Path) -> list[Path]:
    directory = out / REGENERATED_DIR
    return sorted(directory.glob("part-*.jsonl")) if directory.is_dir() else []


def remove_own_temp_files(out: Path) -> None:
    """Temp files of a run that was killed (ours by name, in a directory holding our record)."""
    for directory in (out, out / REGENERATED_DIR):
        if directory.is_dir():
            for path in directory.glob(".*.tmp"):
                path.unlink()


# -- parts --------------------------------------------------------------------------------------


def write_part(out: Path, shard: int, conversation_ids: Sequence[int], row_ids: Sequence[Optional[str]],
               rows: Sequence[Encoded], metadata: dict[str, Any]) -> Path:
    """One shard's kept conversations, under the part's temp name (published by ``publish_parts``)."""
    ids = pa.array([row.input_ids for row in rows], type=SCHEMA.field("input_ids").type)
    masks = np.frombuffer(b"".join(row.loss_mask for row in rows), dtype=np.uint8)
    table = pa.table(
        [pa.array(np.asarray(conversation_ids, dtype=np.int64)), pa.array(row_ids, type=pa.string()), ids,
         pa.ListArray.from_arrays(ids.offsets, pa.array(masks))],  # a mask has its ids' length: same offsets
        schema=SCHEMA.with_metadata({PART_METADATA_KEY: json.dumps(metadata, sort_keys=True)}),
    )
    temp = temp_path(out / part_name(shard))
    try:
        with open_new(temp) as handle:  # never through a link planted at the temp name
            pq.write_table(table, handle, row_group_size=ROW_GROUP_ROWS, compression=_COMPRESSION)
            handle.flush()
            os.fsync(handle.fileno())
    except BaseException:
        remove_quietly(temp)
        raise
    return temp


def is_own_part(path: Path) -> bool:
    try:
        metadata = pq.read_schema(path).metadata or {}
    except (OSError, pa.ArrowException):
        return False
    return PART_METADATA_KEY in metadata


def publish_parts(out: Path, shards: Iterable[int]) -> list[str]:
    """Rename every part of this run into place and remove parts an earlier run of ours left (a larger
    shard count, say); returns the part names."""
    names = [part_name(shard) for shard in shards]
    keep = set(names)
    for stale in out.glob("part-*.parquet"):
        if stale.name not in keep and is_own_part(stale):
            stale.unlink()
    for name in names:
        os.replace(temp_path(out / name), out / name)
    fsync_path(out)
    return names


# -- skipped rows ----------------------------------------------------------------------------------


class SkippedRows:
    """Rows left out, streamed to a temp file and published with the parts (bounded memory)."""

    FIRST = 10
    """Rows the side record quotes."""

    def __init__(self, out: Path) -> None:
        self.path = out / SKIPPED_FILE
        self._temp = temp_path(self.path)
        self._handle = open_new(self._temp, "w")
        self.count = 0
        self.by_kind: dict[str, int] = {}
        self.first: list[dict[str, Any]] = []

    def add(self, conversation_id: int, source: RowSource, kind: str, reason: str) -> None:
        entry = {"conversation_id": conversation_id, "file": source.file, "file_row": source.row, "line": source.line,
                 "kind": kind, "reason": reason}
        self._handle.write(json.dumps(entry) + "\n")
        self.count += 1
        self.by_kind[kind] = self.by_kind.get(kind, 0) + 1
        if len(self.first) < self.FIRST:
            self.first.append(entry)

    def publish(self) -> None:
        """Under its final name if any row was left out; otherwise none (nor one from an earlier run)."""
        self._handle.close()
        if self.count:
            os.replace(self._temp, self.path)
        else:
            self._temp.unlink()
            self.path.unlink(missing_ok=True)

    def discard(self) -> None:
        self._handle.close()
        self._temp.unlink(missing_ok=True)


# -- regenerated shards ------------------------------------------------------------------------------


def write_regenerated(out: Path, shard: int, records: Iterable[dict[str, Any]]) -> Path:
    """A regenerated shard, whole or absent: the unit a killed run resumes from."""
    directory = out / REGENERATED_DIR
    directory.mkdir(exist_ok=True)
    if directory.is_symlink():  # its files would land wherever it points
        raise ValueError(f"{directory} is a symbolic link (to {os.readlink(directory)}), not the directory this "
                         "command makes: remove it, then rerun")
    path = directory / regenerated_name(shard)
    write_atomic(path, "".join(json.dumps(record, ensure_ascii=False) + "\n" for record in records))
    return path


def read_regenerated(path: Path) -> Iterator[dict[str, Any]]:
    with open(path) as handle:
        for line in handle:
            yield json.loads(line)
