"""The manifest: the state of every shard of a run, a snapshot plus an append-only journal.

One record per shard of the plan (``ShardRecord``: its state, and for a done shard its file, size,
checksum, where the file is now and the samples with NaN/Inf states), and the run's ``content``:
everything that changes what the shards contain, so that a resume with other content is refused,
naming the keys that differ. Only the driver writes it, and ``jobs.export consume=true`` under the
run's lock. What a user reads in it: docs/operations.md and docs/format.md.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import uuid
from pathlib import Path
from typing import Any, Collection, Iterable, Optional

from storage.atomic import replace_atomically
from storage.sink import sink_url_for
from storage.writer import shard_file_name

MANIFEST_FILE = ".manifest.json"
MANIFEST_JOURNAL_FILE = ".manifest.journal"
MANIFEST_VERSION = 2
"""2: checksums are ``<algorithm>:<hex>`` (``checksum``, ``exported_files_checksum``)."""
V1_FIELDS = {"sha256": "checksum", "exported_files_sha256": "exported_files_checksum"}
"""Version 1 (the release before) named its checksums by their algorithm and kept them as plain sha256 hex: read
as version 2's (``_from_v1``); the first run that opens such a manifest writes it as version 2, keeping the
version-1 files beside it (``V1_BACKUP_SUFFIX``)."""
V1_BACKUP_SUFFIX = ".v1"
TEXT_LIMITS = {"error": 2048, "consumed_into": 4352, "node": 256}
"""The most bytes each free-text field of a record takes in JSON (an error, where a consumed shard's samples went, a
node's name): longer text is cut to fit (``clip_text``), so that the manifest has a size bound (``size_bound``)."""
LONGEST_CHECKSUM = "sha256:" + "0" * 64
LONGEST_NUMBER = 10**19
"""Wider than any count a record holds (rows, tokens, bytes, attempts, sample ids: 64-bit)."""

logger = logging.getLogger(__name__)

PENDING, DONE, FAILED = "pending", "done", "failed"
LOCAL, SINK, CONSUMED = "local", "sink", "consumed"


@dataclasses.dataclass
class ShardRecord:
    index: int
    start: int
    stop: int
    state: str = PENDING
    attempts: int = 0
    error: str = ""
    file: str = ""
    rows: int = 0
    tokens: int = 0
    bytes: int = 0
    checksum: str = ""
    """Of the file as its writer wrote it: ``<algorithm>:<hex>`` (``storage.checksum``)."""
    location: str = ""
    """Where a done shard's file is: local | sink | consumed."""
    sink_url: str = ""
    nonfinite: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    """Samples whose states held NaN/Inf: {sample_id, action (skipped | kept), reason} (``storage.nonfinite``)."""
    node: str = ""
    """Name of the node whose local directory holds a done shard's file (data parallel across nodes)."""
    consumed_into: str = ""
    """A consumed shard's samples are there: ``<format>:<dest>`` of the export that verified them, then deleted the
    file (``jobs.export consume=true``), or what the consumer that declared it said (``storage.consumed``)."""
    exported_files_checksum: str = ""
    """Of the list of the files an export made of the shard it consumed, with their sizes and checksums, kept in the
    export (``storage.exported``): what ``jobs.verify`` checks the export, the only copy left, against."""


_RECORD_FIELDS = frozenset(field.name for field in dataclasses.fields(ShardRecord)) - {"index"}


class Manifest:
    """A run's manifest, open for updates.

    An update appends one JSON line to the journal (``MANIFEST_JOURNAL_FILE``) and fsyncs it, so its
    cost does not grow with the number of shards. Once the journal holds as many bytes as the snapshot
    (amortised O(1) per update; the journal never outgrows the snapshot by more than a line), at open and
    at close, the state is compacted into the snapshot (``MANIFEST_FILE``: temp file, fsync, rename) and
    the journal starts over. Each journal line carries a sequence number and the
    snapshot the last one it holds, so lines already in the snapshot are never applied twice, even
    after a crash between the rename and the journal's reset. A crash mid-append leaves a torn last
    line, which is ignored: that update never returned (and a failed write is never continued: the
    next line starts on a line of its own).
    """

    def __init__(
        self, path: Path, content: dict[str, Any], shards: dict[int, ShardRecord], sequence: int = 0, run_id: str = "",
    ) -> None:
        self.path = path
        self.run_id = run_id or uuid.uuid4().hex
        """Names this run for the directories it claims on other nodes (manifests before it get one)."""
        self.journal_path = path.with_name(MANIFEST_JOURNAL_FILE)
        self.content = content
        self.shards = shards
        self._sequence = sequence
        """Updates made over the manifest's life."""
        self._journal: Optional[int] = None
        self._torn = False
        self._snapshot_bytes = 0
        """The snapshot's size as last written; the journal is compacted once it holds as many bytes."""
        self._journal_bytes = 0

    @classmethod
    def open(
        cls, output_dir: Path, content: dict[str, Any], plan: Iterable[tuple[int, int, int]],
        recorded_since: Collection[str] = (),
    ) -> "Manifest":
        """Load the run's manifest, or start one for ``plan`` ((index, start, stop) per shard).

        Raises ValueError if a manifest exists for different content (a key of ``recorded_since`` a manifest
        written before it lacks is not a difference: it is recorded now).
        """
        path = Path(output_dir) / MANIFEST_FILE
        if not path.exists():
            shards = {index: ShardRecord(index, start, stop) for index, start, stop in plan}
            manifest = cls(path, content, shards)
            manifest.save()
            return manifest
        stored = _load(path)
        if stored["migrated_from"] is not None:
            _keep_v1(path)
        differing = content_differences(stored["content"], content, recorded_since)
        if differing:
            raise ValueError(
                f"{path} belongs to a run with different content ({differing}). Resume with the same settings, or "
                "write to a new output.dir"
            )
        shards = {record["index"]: ShardRecord(**record) for record in stored["shards"]}
        manifest = cls(path, content, shards, stored["sequence"], stored.get("run_id", ""))
        manifest.save()  # a journal that ends in a torn line must not be appended to
        return manifest

    def update(self, index: int, **fields: Any) -> ShardRecord:
        """Change fields of one shard's record, durably (one fsynced journal line)."""
        unknown = set(fields) - _RECORD_FIELDS
        if unknown:
            raise TypeError(f"ShardRecord has no fields {sorted(unknown)}")
        record = self.shards[index]
        fields = {name: clip_text(value, TEXT_LIMITS[name]) if name in TEXT_LIMITS else value
                  for name, value in fields.items()}
        line = json.dumps({"seq": self._sequence + 1, "index": index, "fields": fields}, separators=(",", ":"))
        # The number is spent even if the write fails: a later line never reuses it.
        self._sequence += 1
        self._append(line.encode() + b"\n")
        for name, value in fields.items():
            setattr(record, name, value)
        if self._journal_bytes >= self._snapshot_bytes:
            self.save()
        return record

    def save(self) -> None:
        """Compact: write every record to the snapshot (temp, fsync, rename), then empty the journal."""
        payload = {
            "version": MANIFEST_VERSION,
            "sequence": self._sequence,
            "run_id": self.run_id,
            "content": self.content,
            "shards": [dataclasses.asdict(self.shards[i]) for i in sorted(self.shards)],
        }
        snapshot = json.dumps(payload, indent=1).encode()
        # A failure here (a full disk) leaves the snapshot and the journal as they were: together still every change.
        replace_atomically(self.path, snapshot)
        self._snapshot_bytes = len(snapshot)
        self._close_journal()
        # Lines left by a crash (or a failure) right here carry sequence numbers the snapshot already holds.
        replace_atomically(self.journal_path, b"")
        self._journal_bytes = 0
        self._torn = False

    def start_over(self, shards: Iterable[int]) -> None:
        """Forget what earlier runs recorded of ``shards`` (a rerun writes them again): pending, with only
        their attempts kept; saved at once."""
        for index in shards:
            record = self.shards[index]
            self.shards[index] = ShardRecord(index, record.start, record.stop, attempts=record.attempts)
        self.save()

    def close(self) -> None:
        """Compact and release the journal. A compaction that fails (a full disk) is logged, not raised: the
        snapshot and the journal it leaves hold every change already made, and the next open compacts them."""
        try:
            self.save()
        except OSError as error:
            logger.warning("%s: compacting the journal into the snapshot failed (%s: %s); both hold every change, "
                           "and the next run compacts them", self.path, type(error).__name__, error)
        finally:
            self._close_journal()

    def in_state(self, *states: str) -> list[ShardRecord]:
        # Sorted keys, not items: 100K (index, record) tuples set off the garbage collector's full passes over
        # every record (260 ms a call at 100K shards against 17 ms; it runs at every rescan).
        return [record for index in sorted(self.shards) if (record := self.shards[index]).state in states]

    def _append(self, data: bytes) -> None:
        if self._journal is None:
            # Never through a link: ``save`` made the journal a file of its own (a link planted since is refused).
            self._journal = os.open(self.journal_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW
                                    | os.O_CLOEXEC, 0o644)
        if self._torn:
            data = b"\n" + data  # never continue a line a failed write left unfinished
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(self._journal, view):]
            os.fsync(self._journal)
        except OSError:
            self._torn = True
            self._journal_bytes += len(data) - len(view)
            raise
        self._journal_bytes += len(data)
        self._torn = False

    def _close_journal(self) -> None:
        if self._journal is not None:
            os.close(self._journal)
            self._journal = None


def clip_text(text: Any, limit: int) -> Any:
    """``text`` cut to take at most ``limit`` bytes in JSON (an ellipsis ends what was cut); not text: as it is."""
    if not isinstance(text, str) or len(json.dumps(text)) <= limit:
        return text
    keep = limit  # JSON takes at least one byte a character: cut until it fits
    while keep and len(json.dumps(text[:keep] + "...")) > limit:
        keep = keep * limit // len(json.dumps(text[:keep] + "...")) if keep > 64 else keep - 1
    return text[:keep] + "..."


def size_bound(
    content: dict[str, Any], plan: Iterable[tuple[int, int, int]], sink: str, nonfinite_reason: str,
) -> tuple[int, int]:
    """The most bytes the snapshot of a run's manifest takes, whatever happens to its shards, and the most one
    journal line takes: every record at its widest (numbers of 20 digits, the text fields at ``TEXT_LIMITS``, the
    longest checksum, a sink URL, every sample of the shard flagged non-finite with ``nonfinite_reason``)."""
    records = []
    for index, start, stop in plan:
        record = _widest_record(index, start, stop, sink, nonfinite_reason)
        records.append(dataclasses.asdict(record))
    payload = {"version": MANIFEST_VERSION, "sequence": LONGEST_NUMBER, "run_id": uuid.uuid4().hex,
               "content": content, "shards": records}
    widest = max(records, key=lambda record: len(json.dumps(record)), default={})
    line = {"seq": LONGEST_NUMBER, "index": LONGEST_NUMBER, "fields": widest}
    return len(json.dumps(payload, indent=1).encode()), len(json.dumps(line, separators=(",", ":")).encode()) + 2


def _widest_record(index: int, start: int, stop: int, sink: str, nonfinite_reason: str) -> ShardRecord:
    file = shard_file_name(index)
    wide = {name: "x" * (limit - 2) for name, limit in TEXT_LIMITS.items()}
    sample = {"sample_id": LONGEST_NUMBER, "action": "skipped", "reason": nonfinite_reason}
    return ShardRecord(
        index, start, stop, state=PENDING, attempts=LONGEST_NUMBER, file=file, rows=LONGEST_NUMBER,
        tokens=LONGEST_NUMBER, bytes=LONGEST_NUMBER, checksum=LONGEST_CHECKSUM, location=CONSUMED,
        sink_url=sink_url_for(sink, file) if sink else "", nonfinite=[sample] * (stop - start),
        exported_files_checksum=LONGEST_CHECKSUM, **wide,
    )


def content_differences(
    stored: dict[str, Any], content: dict[str, Any], recorded_since: Collection[str] = (),
) -> str:
    """``key: was X, now Y`` for each key in which a manifest's ``stored`` content and a run's ``content`` differ,
    joined by ``; ``; empty when they are the same run's. A key of ``recorded_since`` that ``stored`` lacks (written
    before runs recorded it) does not differ."""
    differing = sorted(key for key in set(stored) | set(content) if stored.get(key) != content.get(key)
                       and not (key in recorded_since and key not in stored))
    return "; ".join(f"{key}: was {stored.get(key)!r}, now {content.get(key)!r}" for key in differing)


def _load(path: Path) -> dict[str, Any]:
    """The snapshot with the journal's complete lines applied in order."""
    # The journal first: a compaction between the two reads then finds every line it read in the
    # newer snapshot, never a journal ahead of an older one.
    journal = path.with_name(MANIFEST_JOURNAL_FILE)
    data = journal.read_bytes() if journal.exists() else b""
    try:
        stored = json.loads(path.read_text())
    except ValueError as error:
        raise ValueError(
            f"{path} is damaged: not whole JSON ({error}). The job writes it whole (a temp file renamed), so something "
            "else cut it short or changed it: restore it from a backup or a copy of output.dir; without one, move "
            "the shard files aside and extract again into a new output.dir"
        ) from None
    version = stored.get("version")
    if version not in (1, MANIFEST_VERSION):
        raise ValueError(
            f"{path}: manifest version {version!r}, which this release does not read (it reads 1 and "
            f"{MANIFEST_VERSION}): the run was written by a newer release; use that release for it"
        )
    stored["migrated_from"] = 1 if version == 1 else None
    convert = _from_v1 if version == 1 else (lambda fields: fields)
    stored.setdefault("sequence", 0)
    records = {record["index"]: convert(record) for record in stored["shards"]}
    for line in data.split(b"\n")[:-1]:  # what follows the last newline is a torn write (or nothing)
        try:
            entry = json.loads(line)
        except ValueError:
            continue  # a write cut short (blank or partial): that update never returned
        if entry["seq"] <= stored["sequence"]:
            continue  # already in the snapshot
        records[entry["index"]].update(convert(entry["fields"]))
        stored["sequence"] = entry["seq"]
    stored["shards"] = [records[i] for i in sorted(records)]
    return stored


def _from_v1(fields: dict[str, Any]) -> dict[str, Any]:
    """A version-1 record's (or journal line's) fields as version 2 names them: ``sha256: <hex>`` is
    ``checksum: sha256:<hex>``, ``exported_files_sha256`` likewise ``exported_files_checksum``."""
    converted = {key: value for key, value in fields.items() if key not in V1_FIELDS}
    for old, new in V1_FIELDS.items():
        if old in fields:
            converted[new] = f"sha256:{fields[old]}" if fields[old] else ""
    return converted


def _keep_v1(path: Path) -> None:
    """Before a version-1 manifest is written as version 2: a copy of its snapshot and journal beside it (the first
    copy is kept), for a user who goes back to the release before."""
    for source in (path, path.with_name(MANIFEST_JOURNAL_FILE)):
        backup = source.with_name(source.name + V1_BACKUP_SUFFIX)
        if source.exists() and not backup.exists():
            replace_atomically(backup, source.read_bytes())
    logger.warning("%s was written by the release before (manifest version 1): it is written as version %d now; "
                   "the version-1 files are kept as %s%s", path, MANIFEST_VERSION, path.name, V1_BACKUP_SUFFIX)


def read_manifest(output_dir: Path) -> dict[str, Any]:
    """The manifest as stored (snapshot + journal), for status reports (no content check)."""
    path = Path(output_dir) / MANIFEST_FILE
    if not path.exists():
        raise ValueError(f"{output_dir}: no {MANIFEST_FILE}; is this the output.dir of a run?")
    return _load(path)
