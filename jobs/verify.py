"""``python -m jobs.verify output.dir=DIR [--deep] [--details]`` (or ``eagle3-verify``): are a run's files whole?

Checks every shard the manifest lists as done, where it is (output.dir or the sink,
opened with ``output.sink_options``): size and checksum, schema and metadata, rows,
tokens, sample ids complete and each written once; ``--deep`` reads every state for
NaN/Inf too. A shard consumed into an export: the export's files of it (opened with
``dest_options``) against the sizes and checksums listed when it was consumed; consumed
shards are summed up per destination (``--details`` names them). ``storage.verify`` does
the checking; this prints every problem, one line each, and exits 0 when there is none,
6 (``EXIT_VERIFY_FAILED``) when there is any, 2 when the directory holds no run. Starts
no Ray and imports no torch.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any, Dict, Sequence

from common.checks import format_bytes
from common.config import RunFiles
from jobs.cli import console_entry, run_command
from jobs.config import parse_command
from jobs.planning.content import checkpoint_notes, expected_metadata
from jobs.rundir.summary import read_invalid_rows, read_summary
from runtime.errors import EXIT_OK, EXIT_VERIFY_FAILED
from runtime.lock import read_owner
from storage.verify import Problem, VerifyReport, verify_run


@dataclasses.dataclass
class VerifyConfig:
    output: RunFiles = dataclasses.field(default_factory=RunFiles)
    dest_options: Dict[str, Any] = dataclasses.field(default_factory=dict)
    """fsspec options for the exports that consumed shards (jobs.export consume=true), as the export had them: their
    files are checked against the sizes and checksums listed when each shard was consumed."""

    def __post_init__(self) -> None:
        self.output.require()


DESCRIPTION = (
    "Check a run's shard files against its manifest (exit 0: all whole; 6: problems, one line each; 2: no run there)."
)


def verify(
    output_dir: Path, deep: bool = False, sink_options: dict | None = None, dest_options: dict | None = None,
) -> VerifyReport:
    """Check the run in ``output_dir``; a job still running there is a problem too (its files are in flux)."""
    invalid = [row["sample_id"] for row in read_invalid_rows(output_dir)]
    report = verify_run(
        output_dir, deep=deep, storage_options=sink_options, invalid_sample_ids=invalid,
        node_directories=_node_directories(output_dir), export_options=dest_options,
        expected_metadata=expected_metadata, content_notes=checkpoint_notes,
    )
    owner = read_owner(output_dir)
    if owner is not None and owner.is_alive() is not False:
        report.problems.insert(0, Problem(
            str(output_dir), f"a job holds output.dir ({owner.describe()}): shards are being written",
            "verify again once it has ended",
        ))
    return report


def _node_directories(output_dir: Path) -> dict[str, Path]:
    """Each node's directory as the run's summary recorded it (seen from this host); the run's own
    output.dir is the one given, so that a copied or moved run is checked where it is now."""
    summary = read_summary(output_dir) or {}
    recorded = Path(summary.get("output_dir") or output_dir)
    return {
        name: output_dir if Path(node["directory"]) == recorded else Path(node["directory"])
        for name, node in (summary.get("nodes") or {}).items()
    }


def format_report(report: VerifyReport, details: bool = False) -> str:
    """Every problem, one line each; the notes; one line per place consumed shards went (``details``: which shards);
    then OK or FAILED with the rerun that writes the shards with problems again."""
    lines = [f"{problem}" for problem in report.problems] + [f"note: {note}" for note in report.notes]
    for into, shards in sorted(report.consumed.items()):
        which = f": shards {_ranges(shards)}" if details else ""
        lines.append(f"note: {len(shards)} shards consumed into {into} (deleted from output.dir once their samples "
                     f"were there; counted as the manifest recorded them){which}")
    if report.exported_files_checked:
        lines.append(f"note: {report.exported_files_checked} files of the exports that consumed shards checked against "
                     "the sizes and checksums listed when they did (the dataset's: when the export completed)")
    missing = f" ({report.files_missing} not found)" if report.files_missing else ""
    checked = (
        f"{report.files_checked} files of {report.shards} shards{missing}: {report.rows} samples, {report.tokens} "
        f"tokens, {format_bytes(report.bytes)}"
    )
    if report.ok:
        lines.append(f"OK: {checked} in {report.output_dir}")
    else:
        lines.append(f"FAILED: {len(report.problems)} problems in {report.output_dir} ({checked})")
        if report.shards_to_rewrite:
            shards = ",".join(map(str, report.shards_to_rewrite))
            lines.append(f"to write the shards with problems again: rerun the job's command with shards=[{shards}]")
    return "\n".join(lines)


def _ranges(shards: Sequence[int]) -> str:
    """[0, 1, 2, 5] -> 0-2, 5."""
    spans: list[list[int]] = []
    for shard in sorted(shards):
        if spans and shard == spans[-1][1] + 1:
            spans[-1][1] = shard
        else:
            spans.append([shard, shard])
    return ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in spans)


def main(argv: Sequence[str]) -> int:
    return run_command(_verify, argv)


def _verify(argv: Sequence[str]) -> int:
    flags = {"--deep": "also read every state and scan it for NaN/Inf",
             "--details": "name the consumed shards, not only how many went where"}
    config, args = parse_command("jobs.verify", DESCRIPTION, VerifyConfig, argv, flags)
    report = verify(Path(config.output.dir), args.deep, config.output.sink_options, config.dest_options)
    print(format_report(report, args.details))
    return EXIT_OK if report.ok else EXIT_VERIFY_FAILED


cli = console_entry(main)


if __name__ == "__main__":
    cli()
