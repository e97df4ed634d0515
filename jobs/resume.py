"""Resume and rerun: which shards to run, and what to clean up in output.dir first."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from storage import shard_file_name
from storage.manifest import DONE, FAILED, LOCAL, PENDING, SINK, Manifest, ShardRecord
from storage.writer import TEMP_SUFFIX

logger = logging.getLogger(__name__)

SELECT_PENDING = "pending"
SELECT_FAILED = "failed"


def check_selection(selection: Any) -> None:
    if selection in (SELECT_PENDING, SELECT_FAILED):
        return
    if isinstance(selection, list) and selection and all(isinstance(i, int) for i in selection):
        return
    raise ValueError(
        f"shards={selection!r}: use `pending` (every shard not done yet: resume), "
        "`failed` (rerun failed shards only) or a list of shard indices like [3,17]"
    )


def select_shards(manifest: Manifest, selection: Any) -> list[ShardRecord]:
    """The shards this run extracts, in plan order."""
    if selection == SELECT_PENDING:
        return manifest.in_state(PENDING, FAILED)
    if selection == SELECT_FAILED:
        return manifest.in_state(FAILED)
    unknown = sorted(set(selection) - set(manifest.shards))
    if unknown:
        raise ValueError(f"shards={selection}: the plan has shards 0..{len(manifest.shards) - 1}, not {unknown}")
    return [manifest.shards[i] for i in sorted(set(selection))]


def clean_output_dir(output_dir: Path, manifest: Manifest, to_run: list[ShardRecord]) -> None:
    """Remove what an interrupted run left: temp files, and shard files the manifest does not vouch for.

    A file renamed into place right before a crash is complete but unrecorded; it is
    deleted and its shard extracted again, so that no row is ever in two files.
    """
    for temp in output_dir.glob(f"*{TEMP_SUFFIX}"):
        if temp.is_file():
            temp.unlink()
    rerun = {record.index for record in to_run}
    for index, record in manifest.shards.items():
        path = output_dir / shard_file_name(index)
        keep = record.state == DONE and record.location == LOCAL and index not in rerun
        if path.exists() and not keep:
            logger.info("removing %s (%s)", path, "uploaded" if record.location == SINK else "not recorded as done")
            path.unlink()
        if index in rerun:
            manifest.shards[index] = ShardRecord(index, record.start, record.stop, attempts=record.attempts)
    manifest.save()


def refuse_foreign_output(output_dir: Path, manifest_exists: bool) -> None:
    """Shard files without a manifest belong to something else: never overwrite them."""
    if manifest_exists:
        return
    existing = sorted(output_dir.glob("shard-*.parquet"))
    if existing:
        raise ValueError(
            f"output.dir={output_dir} holds {len(existing)} shard files (e.g. {existing[0].name}) but no "
            "manifest.json: they are not from a run of this job; choose a new output.dir"
        )
