"""``python -m jobs.status output.dir=DIR`` (or ``eagle3-status``): where a run stands.

From ``.manifest.json``, ``.summary.json``, the lock and the files actually
present: whether a job is running on the directory, its last progress report
(done, rate, ETA, disk; rewritten every ``progress.interval_s``), shards by state
with their samples and tokens (planned ones for shards not done yet), bytes on
local disk against the run's own budget and in the sink, every file the job does
not know about, and the last error of every failed shard.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import shutil
from pathlib import Path
from typing import Any, Optional, Sequence

from common.checks import format_bytes
from common.config import RunDir
from jobs.cli import console_entry, run_command
from jobs.config import parse_command
from jobs.driver.progress import ProgressSnapshot
from jobs.outdir.config import OutputConfig, parse_disk_budget
from jobs.rundir.summary import (
    DRAFTER_CONFIG_FILE,
    INVALID_ROWS_FILE,
    RUNNING,
    SUMMARY_FILE,
    SUMMARY_RESERVE_FILE,
    read_summary,
)
from runtime.errors import EXIT_OK
from runtime.lock import LOCK_FILE, read_owner
from storage.claim import CLAIM_FILE
from storage.consumed import RECORD_GLOB
from storage.manifest import (
    CONSUMED,
    DONE,
    FAILED,
    LOCAL,
    MANIFEST_FILE,
    MANIFEST_JOURNAL_FILE,
    PENDING,
    SINK,
    read_manifest,
)
from storage.nonfinite import KEPT, SKIPPED
from storage.token_freq import TOKEN_FREQ_FILE
from storage.writer import SHARD_GLOB, TEMP_GLOB

# Files the job writes beside the shards, and the temp names they pass through.
JOB_FILES = frozenset(
    name
    for base in (MANIFEST_FILE, MANIFEST_JOURNAL_FILE, SUMMARY_FILE, DRAFTER_CONFIG_FILE, INVALID_ROWS_FILE,
                 TOKEN_FREQ_FILE)
    for name in (base, base + ".tmp")
) | {LOCK_FILE, CLAIM_FILE, SUMMARY_RESERVE_FILE}


@dataclasses.dataclass
class StatusOutput(RunDir):
    """The keys of the ``output`` section ``jobs.status`` reads (the job's own has many more)."""

    disk_budget: str = ""
    """Budget to show the local bytes against (500GB, 1.3TB or bytes). Empty: the run's own, from its .summary.json."""

    def __post_init__(self) -> None:
        self.disk_budget_bytes  # raises naming the key

    @functools.cached_property
    def disk_budget_bytes(self) -> Optional[int]:
        """``disk_budget`` in bytes; None when empty (the run's own)."""
        return parse_disk_budget(self.disk_budget) if self.disk_budget else None


@dataclasses.dataclass
class StatusConfig:
    output: StatusOutput = dataclasses.field(default_factory=StatusOutput)

    def __post_init__(self) -> None:
        self.output.require()


def status_report(output_dir: Path, disk_budget: Optional[int] = None) -> str:
    """The report; ``disk_budget`` overrides the budget the run recorded in its summary."""
    output_dir = Path(output_dir)
    manifest = read_manifest(output_dir)
    summary = read_summary(output_dir)
    shards = manifest["shards"]
    planned = {int(k): v for k, v in ((summary or {}).get("plan", {}).get("shard_tokens") or {}).items()}

    state = job_state(output_dir, summary)
    lines = [f"output.dir {output_dir}", state, *_progress_lines(summary, state.startswith("job: RUNNING")), ""]
    lines.append(f"{'state':<8} {'shards':>7} {'samples':>9} {'tokens':>12}")
    for state in (DONE, PENDING, FAILED):
        selected = [s for s in shards if s["state"] == state]
        if state == DONE:
            samples, tokens, note = sum(s["rows"] for s in selected), sum(s["tokens"] for s in selected), ""
        else:
            samples = sum(s["stop"] - s["start"] for s in selected)
            known = [planned[s["index"]] for s in selected if s["index"] in planned]
            tokens = sum(known) if len(known) == len(selected) else None
            note = "  (planned)" if selected else ""
        tokens_text = "?" if tokens is None else str(tokens)
        lines.append(f"{state:<8} {len(selected):>7} {samples:>9} {tokens_text:>12}{note}")
    lines.append(f"{'total':<8} {len(shards):>7} {sum(s['stop'] - s['start'] for s in shards):>9}")
    nonfinite = [sample for s in shards if s["state"] == DONE for sample in s.get("nonfinite", [])]
    if nonfinite:
        actions = {action: sum(1 for sample in nonfinite if sample["action"] == action) for action in (SKIPPED, KEPT)}
        lines.append(f"NaN/Inf states: {actions[SKIPPED]} samples skipped, {actions[KEPT]} kept flagged "
                     "(extract.on_nonfinite; the manifest lists them)")
    lines.append("")
    lines += _disk_lines(output_dir, shards, summary, disk_budget)
    lines += _node_lines(output_dir, shards, summary)
    lines += _file_lines(output_dir, shards, summary)
    for shard in shards:
        if shard["state"] == FAILED or shard["error"]:
            lines.append(f"shard {shard['index']} ({shard['state']}, {shard['attempts']} attempts): {shard['error']}")
    lines.append(f"check the files themselves: python -m jobs.verify output.dir={output_dir}")
    return "\n".join(lines)


def job_state(output_dir: Path, summary: Optional[dict[str, Any]]) -> str:
    """Running (the lock's owner lives), stopped (it died holding it), or how the last run ended."""
    owner = read_owner(output_dir)
    if owner is not None:
        alive = owner.is_alive()
        if alive:
            return f"job: RUNNING, {owner.describe()}"
        if alive is None:
            return f"job: held by another host, which this one cannot check: {owner.describe()}"
        return (
            f"job: STOPPED, {owner.describe()} ended without releasing output.dir (killed?); "
            "rerun its command to resume"
        )
    if summary is None:
        return "job: not running (no run summary yet)"
    if summary.get("outcome") == RUNNING:
        return "job: not running; the last run ended without writing its summary (killed?); rerun to resume"
    return (
        f"job: not running; the last run ended {summary.get('ended_at')}: {summary.get('outcome')} "
        f"(exit code {summary.get('exit_code')})"
    )


def _progress_lines(summary: Optional[dict[str, Any]], running: bool) -> list[str]:
    """The run's last progress report: live while the job runs, where it stopped otherwise."""
    report = (summary or {}).get("progress")
    if not report:
        return []
    try:
        snapshot = ProgressSnapshot(**report)
    except TypeError:  # written by another version of the job
        return []
    when = "progress" if running else "last progress"
    return [f"{when}: {snapshot.describe()} (as of {snapshot.updated_at})"]


def _disk_lines(output_dir: Path, shards: list[dict], summary: Optional[dict], disk_budget: Optional[int]) -> list[str]:
    done = [s for s in shards if s["state"] == DONE]
    directories = {name: Path(node["directory"]) for name, node in ((summary or {}).get("nodes") or {}).items()}
    local = sum(s["bytes"] for s in done
                if s["location"] == LOCAL and (directories.get(s.get("node", ""), output_dir) / s["file"]).exists())
    in_sink = sum(s["bytes"] for s in done if s["location"] == SINK)
    consumed = sum(1 for s in done if s["location"] == CONSUMED)
    if disk_budget is not None:
        budget, source = disk_budget, "output.disk_budget as given"
    elif summary and summary.get("disk_budget", {}).get("limit"):
        budget, source = int(summary["disk_budget"]["limit"]), "the run's"
    else:
        budget, source = OutputConfig().disk_budget_bytes, "the default; no run summary"
    share = f"{100 * local / budget:.1f}%" if budget > 0 else "no budget"
    lines = [f"on local disk: {format_bytes(local)} of budget {format_bytes(budget)} ({share}; {source})"]
    lines.append(f"in the sink:   {format_bytes(in_sink)}")
    if consumed:
        places = collections.Counter(s.get("consumed_into") or "?" for s in done if s["location"] == CONSUMED)
        where = ", ".join(f"{count} into {place}" for place, count in sorted(places.items()))
        lines.append(f"consumed:      {consumed} shards deleted from output.dir once their samples were elsewhere: "
                     f"{where}")
    return lines


def _node_lines(output_dir: Path, shards: list[dict], summary: Optional[dict]) -> list[str]:
    """With extractor groups on several nodes, or on one whose directory is not output.dir (output.node_dir): each
    node's shards, the bytes left on its disk and its free space (when its directory is visible from here)."""
    nodes = (summary or {}).get("nodes") or {}
    if len(nodes) < 2 and all(Path(node["directory"]) == output_dir for node in nodes.values()):
        return []
    lines = []
    for name, node in sorted(nodes.items()):
        directory = Path(node["directory"])
        done = [s for s in shards if s["state"] == DONE and s.get("node") == name]
        local = sum(s["bytes"] for s in done if s["location"] == LOCAL)
        free = format_bytes(shutil.disk_usage(directory).free) if directory.is_dir() else "? (not on this host)"
        lines.append(
            f"node {name}: {len(done)} shards done, {format_bytes(local)} on its disk, {free} free in {directory}"
        )
    return lines


def _file_lines(output_dir: Path, shards: list[dict], summary: Optional[dict]) -> list[str]:
    """Temp files, shard files the manifest does not vouch for, and anything else under output.dir."""
    recorded = {s["file"] for s in shards if s["state"] == DONE and s["location"] == LOCAL}
    temps = sorted(path.name for path in output_dir.glob(TEMP_GLOB))
    unrecorded = sorted(path.name for path in output_dir.glob(SHARD_GLOB) if path.name not in recorded)
    declared = sorted(path.name for path in output_dir.glob(RECORD_GLOB))
    unknown = sorted(
        path.name + ("/" if path.is_dir() else "")
        for path in output_dir.iterdir()
        if path.name not in JOB_FILES and path.name not in recorded and path.name not in temps
        and path.name not in unrecorded and path.name not in declared
    )
    lines: list[str] = []
    if temps:
        lines.append(f"temp files:    {len(temps)} shards being written, or left by a stopped run "
                     f"(the next run removes them): {', '.join(temps[:5])}")
    if unrecorded:
        lines.append(f"unrecorded:    {len(unrecorded)} shard files the manifest does not list as done here "
                     f"(the next run removes them): {', '.join(unrecorded[:5])}")
    if declared:
        lines.append(f"declared:      {len(declared)} shards declared consumed by their consumer (storage.consumed), "
                     "not recorded yet (the running job's rescan or the next run records them)")
    if unknown:
        lines.append(f"not the job's: {len(unknown)} entries this job did not write: {', '.join(unknown[:10])}")
    return lines


def main(argv: Sequence[str]) -> int:
    return run_command(_status, argv)


def _status(argv: Sequence[str]) -> int:
    config, _ = parse_command("jobs.status", "Where an extraction run stands, from its output directory.", StatusConfig, argv)
    print(status_report(Path(config.output.dir), config.output.disk_budget_bytes))
    return EXIT_OK


cli = console_entry(main)


if __name__ == "__main__":
    cli()
