"""The most bytes the job's own files take in output.dir, fixed before Ray starts: the disk budget counts them first.

``output.disk_budget`` holds everything the job keeps in output.dir, not only its shard files. Each of the job's own
files has a bound known from the plan before anything is written, and counted in whole blocks:

- the manifest: its snapshot (every record at its widest: ``storage.manifest.size_bound``), the snapshot's temp copy
  while it is compacted, and the journal, which is compacted once it holds as many bytes as the snapshot;
- the summary and the room set aside for its final version (``RunSummary.room``: neither is ever larger);
- the lock (this process's owner record), the directory's claim and its temp copy;
- ``.invalid_rows.jsonl`` (known before Ray) and its temp copy; the drafter config (what the checkpoint's config
  makes of it, with the widest engine facts) and its temp copy; the token counts (a pickled dict of at most one entry
  per vocabulary id);
- the version-1 manifest a migrated run keeps beside the new one (as found).

A shard's consumption record (``storage.consumed``) is counted with the shard (``jobs.outdir.budget``).
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any, Iterable

from common.checks import format_bytes
from extractor.checkpoint import read_config, text_config
from extractor.drafter_config import build_drafter_config
from runtime.lock import LockOwner
from storage.manifest import MANIFEST_FILE, MANIFEST_JOURNAL_FILE, TEXT_LIMITS, V1_BACKUP_SUFFIX, size_bound

BLOCK_BYTES = 4096
"""What a file takes is counted in whole blocks of this size (ext4's and xfs's), as ``du`` counts it."""
SUBMISSION_ID_BYTES = 128
"""Longer than any Ray job submission id (raysubmit_ and 16 characters)."""
HOST_NAME_BYTES = 255
"""The longest host name (a fully qualified one)."""
CLAIM_LABELS = 8
"""Node labels a directory's claim can list: the one it was claimed under and the relabellings it saw since."""
ENGINE_FACT_BYTES = 256
"""The longest engine fact the drafter config records (an architecture's name, the SGLang release, the dtype)."""
TOKEN_FREQ_ENTRY_BYTES = 22
"""One pickled entry of the token counts: a 64-bit key and a 64-bit count, each an opcode and up to 10 bytes."""
TOKEN_FREQ_FIXED_BYTES = 4096
"""The token counts' container: torch.save's zip entries and the pickle's framing."""


def on_disk(nbytes: int) -> int:
    """``nbytes`` of a file in whole blocks."""
    return -(-nbytes // BLOCK_BYTES) * BLOCK_BYTES


@dataclasses.dataclass(frozen=True)
class OwnFiles:
    """The most bytes each kind of the job's own files takes at once in output.dir."""

    manifest: int = 0
    summary: int = 0
    lock: int = 0
    claim: int = 0
    side_files: int = 0
    """.invalid_rows.jsonl, .drafter_config.json, .token_freq.pt and what a migrated run keeps."""

    @property
    def total(self) -> int:
        return self.manifest + self.summary + self.lock + self.claim + self.side_files

    def on_other_node(self) -> "OwnFiles":
        """What the job keeps in another node's directory: its claim."""
        return OwnFiles(claim=self.claim)

    def describe(self) -> str:
        return (f"manifest {format_bytes(self.manifest)}, summary and its reserve {format_bytes(self.summary)}, "
                f"lock and claim {format_bytes(self.lock + self.claim)}, other files {format_bytes(self.side_files)}")


def lock_bytes() -> int:
    """output.dir's lock with this process's owner record (``runtime.lock``)."""
    record = dataclasses.asdict(LockOwner.this_process("x" * SUBMISSION_ID_BYTES))
    return on_disk(len(json.dumps(record, indent=1).encode()) + 1)


def claim_bytes(output_dir: Path) -> int:
    """A node directory's claim (run id, output.dir, host, node labels) and its temp copy while it is written."""
    label = "x" * (TEXT_LIMITS["node"] - 2)
    widest = {"run_id": "0" * 32, "output_dir": str(output_dir), "host": "x" * HOST_NAME_BYTES, "node": label,
              "nodes": [label] * CLAIM_LABELS}
    return 2 * on_disk(len(json.dumps(widest).encode()))


def own_files_of(
    output_dir: Path, contents: Iterable[dict[str, Any]], plan: Iterable[tuple[int, int, int]], sink: str,
    nonfinite_reason: str, summary_room: int, invalid_rows: bytes, model_path: str, layer_ids: list[int],
) -> OwnFiles:
    """The bounds of the job's own files in ``output_dir`` for a run of ``plan`` ((index, start, stop) per shard).
    ``contents``: the manifest's content on each device the run may get; ``summary_room``: ``RunSummary.room``;
    ``invalid_rows``: the bytes of .invalid_rows.jsonl."""
    plan = list(plan)
    snapshot, line = max(size_bound(content, plan, sink, nonfinite_reason) for content in contents)
    manifest = 2 * on_disk(snapshot) + on_disk(snapshot + line)
    summary = 2 * on_disk(summary_room)
    text = text_config(read_config(model_path))
    source = {key: "x" * ENGINE_FACT_BYTES for key in (
        "model_architecture", "language_model_architecture", "sglang_version")}
    source.update(layer_ids=list(layer_ids), layers_to_capture=list(layer_ids))
    drafter = build_drafter_config(text, layer_ids, "x" * ENGINE_FACT_BYTES, source)
    drafter_bytes = len(json.dumps(drafter, indent=2).encode()) + 1
    token_freq = TOKEN_FREQ_FIXED_BYTES + TOKEN_FREQ_ENTRY_BYTES * int(text["vocab_size"])
    kept = sum(on_disk(path.stat().st_size) for path in (
        output_dir / (MANIFEST_FILE + V1_BACKUP_SUFFIX), output_dir / (MANIFEST_JOURNAL_FILE + V1_BACKUP_SUFFIX))
        if path.exists())
    side_files = (2 * on_disk(len(invalid_rows)) if invalid_rows else 0) + 2 * on_disk(drafter_bytes) \
        + on_disk(token_freq) + kept
    return OwnFiles(manifest, summary, lock_bytes(), claim_bytes(output_dir), side_files)
