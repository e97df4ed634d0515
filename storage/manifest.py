"""``.manifest.json``: the state of every shard of a run, updated atomically.

One record per shard of the plan: ``pending``, ``done`` or ``failed``, how
many attempts it took, the last error, and for a done shard its file, rows,
tokens, bytes, sha256 and where the file is now (local, in the sink, or
consumed: deleted locally by someone else). The ``content`` block holds
everything that changes what the shards contain; resuming with different
content is refused, naming the keys that differ.

Only the driver writes it: to ``.manifest.json.tmp``, fsync, rename, so a
crash at any point leaves the previous or the new version, never a mix. The
leading dot makes Parquet dataset readers skip it beside the shards.
"""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path
from typing import Any, Iterable

MANIFEST_FILE = ".manifest.json"
MANIFEST_VERSION = 1

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
    sha256: str = ""
    location: str = ""
    """Where a done shard's file is: local | sink | consumed."""
    sink_url: str = ""


class Manifest:
    def __init__(self, path: Path, content: dict[str, Any], shards: dict[int, ShardRecord]) -> None:
        self.path = path
        self.content = content
        self.shards = shards

    @classmethod
    def open(cls, output_dir: Path, content: dict[str, Any], plan: Iterable[tuple[int, int, int]]) -> "Manifest":
        """Load the run's manifest, or start one for ``plan`` ((index, start, stop) per shard).

        Raises ValueError if a manifest exists for different content.
        """
        path = Path(output_dir) / MANIFEST_FILE
        if not path.exists():
            shards = {index: ShardRecord(index, start, stop) for index, start, stop in plan}
            manifest = cls(path, content, shards)
            manifest.save()
            return manifest
        stored = json.loads(path.read_text())
        if stored.get("version") != MANIFEST_VERSION:
            raise ValueError(f"{path}: manifest version {stored.get('version')} is not {MANIFEST_VERSION}")
        differing = sorted(
            key for key in set(stored["content"]) | set(content) if stored["content"].get(key) != content.get(key)
        )
        if differing:
            details = "; ".join(
                f"{key}: was {stored['content'].get(key)!r}, now {content.get(key)!r}" for key in differing
            )
            raise ValueError(
                f"{path} belongs to a run with different content ({details}). Resume with the same "
                "settings, or write to a new output.dir"
            )
        shards = {record["index"]: ShardRecord(**record) for record in stored["shards"]}
        return cls(path, content, shards)

    def save(self) -> None:
        payload = {
            "version": MANIFEST_VERSION,
            "content": self.content,
            "shards": [dataclasses.asdict(self.shards[i]) for i in sorted(self.shards)],
        }
        temp = self.path.with_name(self.path.name + ".tmp")
        with open(temp, "w") as file:
            json.dump(payload, file, indent=1)
            file.flush()
            os.fsync(file.fileno())
        os.replace(temp, self.path)

    def update(self, index: int, **fields: Any) -> ShardRecord:
        record = self.shards[index]
        for name, value in fields.items():
            setattr(record, name, value)
        self.save()
        return record

    def in_state(self, *states: str) -> list[ShardRecord]:
        return [record for _, record in sorted(self.shards.items()) if record.state in states]


def read_manifest(output_dir: Path) -> dict[str, Any]:
    """The manifest as stored, for status reports (no content check)."""
    path = Path(output_dir) / MANIFEST_FILE
    if not path.exists():
        raise ValueError(f"{output_dir}: no {MANIFEST_FILE}; is this the output.dir of a run?")
    return json.loads(path.read_text())
