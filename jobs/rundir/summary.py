"""``.summary.json`` and ``.drafter_config.json``: what a run did, written beside the shards.

The summary is written when the run starts (outcome ``running``, the plan and the
budget, so that ``jobs.status`` can show planned tokens and the run's own budget),
every ``progress.interval_s`` while it runs (its ``progress`` block: done, rate,
ETA, disk; ``jobs.driver.progress``), and again when it ends, whatever the end: complete,
shards failed, budget exhausted, a fault or a signal. Totals cover every done shard of the output directory; the
``this_run`` block and ``tokens_per_second`` only what this run extracted, over this
run's time. Both names start with a dot, so that Parquet dataset readers skip them. Room
for the final summary is set aside when the run starts (``.summary.json.reserve``), so
that a run stopped by a full disk still writes how it ended. While the run goes on, each summary
is padded with spaces to the size of that room (JSON allows them) and written into the room, which
then swaps names with the summary (``storage.atomic.swap_in``): the old summary becomes the room.
The summary and its room are all it ever takes on disk, twice the room (what the disk budget counts:
``room``), and no write needs a block the disk may no longer have.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import time
from pathlib import Path
from typing import Any, Optional, Sequence

from inputs.dataset import InvalidRow
from jobs.config import JobConfig
from runtime.display.timeline import Timeline
from storage.atomic import remove_quietly, replace_atomically, reserve_space, swap_in
from storage.manifest import DONE, FAILED, SINK, Manifest
from storage.nonfinite import KEPT, SKIPPED

SUMMARY_FILE = ".summary.json"
INVALID_ROWS_FILE = ".invalid_rows.jsonl"
"""Every row left out under data.on_invalid=skip, one JSON line each."""
INVALID_ROWS_IN_SUMMARY = 5
NONFINITE_IN_SUMMARY = 5
"""Non-finite samples listed in the summary; the manifest lists them all, shard by shard."""
DRAFTER_CONFIG_FILE = ".drafter_config.json"
SUMMARY_RESERVE_FILE = ".summary.json.reserve"
SUMMARY_RESERVE_BYTES = 256 * 1024
"""Room for the final summary beyond twice the size of the first (what a finished run adds: timings, nodes): the
most bytes a summary takes."""

RUNNING = "running"
COMPLETE = "complete"
NOTHING_TO_DO = "nothing_to_do"
SHARDS_FAILED = "shards_failed"
UPLOADS_FAILED = "uploads_failed"
BAD_INPUT = "bad_input"


def _now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")


def write_json(path: Path, payload: dict[str, Any], reserve: Optional[Path] = None) -> None:
    """Write atomically: a reader sees the old file or the new one (``reserve``: see ``storage.atomic``)."""
    replace_atomically(path, json.dumps(payload, indent=2) + "\n", reserve=reserve)


def manifest_totals(manifest: Manifest) -> dict[str, Any]:
    """Done shards of the whole output directory (every run's), and the failed ones."""
    done = manifest.in_state(DONE)
    return {
        "shards_done": len(done),
        "shards_failed": {str(r.index): r.error for r in manifest.in_state(FAILED)},
        "samples": sum(record.rows for record in done),
        "tokens": sum(record.tokens for record in done),
        "bytes": sum(record.bytes for record in done),
        "bytes_in_sink": sum(record.bytes for record in done if record.location == SINK),
    }


def nonfinite_samples(manifest: Manifest) -> dict[str, Any]:
    """Samples whose states held NaN/Inf in the done shards: how many were skipped and kept, the first few."""
    records = [{"shard": r.index, **sample} for r in manifest.in_state(DONE) for sample in r.nonfinite]
    return {
        "skipped": sum(1 for sample in records if sample["action"] == SKIPPED),
        "kept": sum(1 for sample in records if sample["action"] == KEPT),
        "first": records[:NONFINITE_IN_SUMMARY],
    }


def read_invalid_rows(output_dir: Path) -> list[dict[str, Any]]:
    """The rows a run left out under data.on_invalid=skip (empty when there were none)."""
    path = Path(output_dir) / INVALID_ROWS_FILE
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def read_summary(output_dir: Path) -> Optional[dict[str, Any]]:
    try:
        return json.loads((Path(output_dir) / SUMMARY_FILE).read_text())
    except (FileNotFoundError, ValueError):
        return None


def write_drafter_config(output_dir: Path, drafter_config: dict[str, Any]) -> None:
    """The drafter config that makes SGLang capture the same layers when it serves the drafter."""
    write_json(output_dir / DRAFTER_CONFIG_FILE, drafter_config)


def write_invalid_rows(output_dir: Path, invalid: Sequence[InvalidRow]) -> None:
    """Every row left out under data.on_invalid=skip (file, file_row, sample_id, reason), atomically."""
    if not invalid:
        return
    replace_atomically(output_dir / INVALID_ROWS_FILE, invalid_rows_bytes(invalid))


def invalid_rows_bytes(invalid: Sequence[InvalidRow]) -> bytes:
    """What ``write_invalid_rows`` writes."""
    return "".join(json.dumps(dataclasses.asdict(row)) + "\n" for row in invalid).encode()


class RunSummary:
    """The summary of one run, kept in ``output_dir/.summary.json``."""

    def __init__(
        self, config: JobConfig, output_dir: Path, shard_tokens: dict[int, int], to_run: list[int],
        invalid: Sequence[InvalidRow] = (), timeline: Optional[Timeline] = None,
    ) -> None:
        """``timeline``: the command's phases, recorded as ``wall_seconds`` (up to the run's end) when given."""
        self.config = config
        self.timeline = timeline
        self.invalid = list(invalid)
        self.path = output_dir / SUMMARY_FILE
        self.reserve = output_dir / SUMMARY_RESERVE_FILE
        """Blocks set aside when the run starts, which the first final summary is written into: a run stopped by a
        full disk (another process filled it, or this run's own writers took the last blocks) still says so."""
        self.shard_tokens = shard_tokens
        self.to_run = set(to_run)
        self.started_at = _now()
        self.started = time.monotonic()
        self.progress: Optional[dict[str, Any]] = None
        """The last progress report (``jobs.driver.progress.ProgressSnapshot``), kept in the final summary too."""
        self._ended = False
        self._room: Optional[int] = None
        self.own_files = 0
        """The most the job's own files take in output.dir: what the disk budget counts before any shard."""

    def room(self, manifest: Manifest) -> int:
        """The bytes set aside for the summary (``reserve``), fixed the first time they are asked for: room for the
        final summary beyond twice the size of the first. The summary and its room together take twice this."""
        if self._room is None:
            first = self._build(manifest, RUNNING, None, "", None)
            self._room = SUMMARY_RESERVE_BYTES + 2 * len(json.dumps(first, indent=2))
        return self._room

    @property
    def ended(self) -> bool:
        """Whether ``finish`` has recorded how the run ended."""
        return self._ended

    def select(self, to_run: list[int]) -> None:
        """The shards this run extracts, once the looks at every node's directory have settled them."""
        self.to_run = set(to_run)

    def include(self, shards: Sequence[int]) -> None:
        """Shards this run wrote beyond those it set out to: done ones whose files were lost meanwhile."""
        self.to_run.update(shards)

    def start(self, manifest: Manifest) -> None:
        """The summary of a run that starts; and room set aside for its final summary (``reserve``)."""
        remove_quietly(self.reserve)  # a stopped run's room: this run sets its own aside
        replace_atomically(self.path, self._running(manifest))
        reserve_space(self.reserve, self.room(manifest))

    def update(self, manifest: Manifest, progress: dict[str, Any]) -> None:
        """The running summary with the latest progress (``jobs.driver.progress`` calls this every interval),
        swapped in through the room set aside; once the run has ended (``finish``), a late report changes nothing."""
        self.progress = progress
        if self._ended:
            return
        data = self._running(manifest)
        if not swap_in(self.reserve, self.path, data, final=False):
            replace_atomically(self.path, data)

    def _running(self, manifest: Manifest) -> bytes:
        """The running summary, padded with spaces to the room's size."""
        return (json.dumps(self._build(manifest, RUNNING, None, "", None), indent=2) + "\n").encode() \
            .ljust(self.room(manifest))

    def finish(self, manifest: Manifest, outcome: str, exit_code: int, message: str, result: Any = None) -> dict:
        """Write and return the final summary; ``result`` is the pipeline's RunResult when it got that far.
        A run that stops early finishes twice: at once (a stop may be followed by SIGKILL within seconds),
        then once its open shards are wound down, with the final counts."""
        self._ended = True
        summary = self._build(manifest, outcome, exit_code, message, result)
        if not swap_in(self.reserve, self.path, (json.dumps(summary, indent=2) + "\n").encode(), final=True):
            write_json(self.path, summary, reserve=self.reserve)
        return summary

    def _build(self, manifest: Manifest, outcome: str, exit_code: Optional[int], message: str, result: Any) -> dict:
        done = manifest.in_state(DONE)
        this_run = [record for record in done if record.index in self.to_run]
        run_tokens = sum(record.tokens for record in this_run)
        # The pipeline's clock runs from the first batch to the last commit; without it (a run
        # that stopped early), from the start of this run.
        seconds = round(result.seconds if result is not None else time.monotonic() - self.started, 3)
        summary: dict[str, Any] = {
            "outcome": outcome,
            "exit_code": exit_code,
            "message": message,
            "started_at": self.started_at,
            "ended_at": None if outcome == RUNNING else _now(),
            "output_dir": self.config.output.dir,
            "model_path": self.config.model.path,
            "data_path": self.config.data.path,
            "plan": {
                "shards": len(manifest.shards),
                "samples": sum(record.stop - record.start for record in manifest.shards.values()),
                "tokens": sum(self.shard_tokens.values()),
                "shard_tokens": {str(index): tokens for index, tokens in sorted(self.shard_tokens.items())},
            },
            **manifest_totals(manifest),
            "this_run": {
                "shards_selected": len(self.to_run),
                "shards_done": len(this_run),
                "samples": sum(record.rows for record in this_run),
                "tokens": run_tokens,
                "seconds": seconds,
            },
            "tokens_per_second": round(run_tokens / seconds, 1) if seconds > 0 else 0.0,
            "progress": self.progress,
            **({"wall_seconds": self.timeline.seconds()} if self.timeline is not None and outcome != RUNNING else {}),
            "invalid_rows": {
                "count": len(self.invalid),
                "first": [dataclasses.asdict(row) for row in self.invalid[:INVALID_ROWS_IN_SUMMARY]],
                "file": INVALID_ROWS_FILE if self.invalid else "",
            },
            "nonfinite_samples": {"on_nonfinite": self.config.extract.on_nonfinite, **nonfinite_samples(manifest)},
            "last_hidden_state": self.config.extract.last_hidden_state,
            "state_dtype": self.config.output.state_dtype,
            "disk_budget": {
                "limit": self.config.output.disk_budget_bytes,
                "min_free_bytes": self.config.output.min_free_bytes,
                "own_files": self.own_files,
            },
        }
        if result is not None:
            summary.update(_result_fields(result))
            summary["disk_budget"].update(
                peak=result.budget_peak, overshoot=result.budget_overshoot,
                blocked_seconds=round(result.blocked_seconds, 3),
            )
        return summary


def _result_fields(result: Any) -> dict[str, Any]:
    """What the pipeline measured (RunResult)."""
    return {
        "startup_seconds": round(result.startup_seconds, 3),
        "seconds": round(result.seconds, 3),
        "first_batch_seconds": round(result.first_batch_seconds, 3),
        "steady_seconds": round(result.steady_seconds, 3),
        "steady_tokens": result.steady_tokens,
        "steady_tokens_per_second": (round(rate, 1) if (rate := result.steady_tokens_per_second) is not None
                                     else None),
        "drain_seconds": round(result.drain_seconds, 3),
        "writers": result.writers,
        "peak_open_shards": result.peak_open_shards,
        "max_inflight_batches": result.max_inflight_batches,
        "extractor_restarts": result.extractor_restarts,
        "nodes": result.nodes,
        "engine": dataclasses.asdict(result.engine),
        "extractor": dataclasses.asdict(result.extractor),
        "writer_seconds": {
            clock: {stage: round(seconds, 3) for stage, seconds in stages.items()}
            for clock, stages in result.writer_seconds.items()
        },
    }
