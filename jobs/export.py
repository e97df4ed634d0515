"""``python -m jobs.export output.dir=RUN to=specforge|speculators dest=DIR`` (or ``eagle3-export``).

The command around ``training.export``: parse, export, print. With ``consume=true`` it holds
the run's lock (``.job.lock``, as a running extraction does) for the whole export: the export
then writes the run's manifest, and no job may write it or the shards meanwhile. Exit codes: 0
done, 2 bad config or input (nothing written; or a shard file found damaged, named: extract it again),
3 disk full (no room for the export's peak, or ENOSPC while writing: free space, rerun: it resumes),
4 an error while writing (rerun: it resumes), 5 a job holds the run (consume=true), 129/130/143
stopped by a signal (rerun: it resumes).
"""

from __future__ import annotations

import contextlib
import logging
from typing import Any, Sequence

from jobs.cli import DETAILED, console_entry, run_command
from jobs.config import parse_command
from runtime.errors import (
    EXIT_BAD_INPUT,
    EXIT_BUDGET_EXHAUSTED,
    EXIT_FAULT,
    EXIT_LOCKED,
    EXIT_OK,
    exit_codes,
    full_disk_stops,
)
from runtime.lock import OutputLock
from storage.run_index import DamagedShardError
from training.export import ExportConfig, prepare, write

logger = logging.getLogger("jobs.export")


def load_config(argv: Sequence[str]) -> ExportConfig:
    return parse_command(
        "jobs.export",
        "Export a run's hidden states in the layout SpecForge or speculators trains from. " + exit_codes({
            EXIT_OK: "done",
            EXIT_BAD_INPUT: "bad config or input (nothing written; or a shard file found damaged: extract it again)",
            EXIT_BUDGET_EXHAUSTED: "disk full (free space, rerun: it resumes)",
            EXIT_FAULT: "an error while writing (rerun: it resumes)", EXIT_LOCKED: "a job holds the run (consume=true)",
        }, signals="rerun: it resumes"),
        ExportConfig, argv,
    )[0]


def final_message(report: dict[str, Any]) -> str:
    if report["already_complete"]:
        return (f"nothing to do: {report['dest']} holds the complete {report['format']} export "
                f"({report['samples']} samples)")
    consumed = (f"; {report['consumed']} shards consumed ({report['freed_bytes'] / 1e6:.1f} MB freed)"
                if report["consumed"] else "")
    return (
        f"exported {report['samples']} samples to {report['dest']} ({report['format']}, {report['states']} states; "
        f"final state {report['final_state']}): "
        f"{report['written']} written, {report['skipped']} already there; {report['bytes'] / 1e6:.1f} MB in "
        f"{report['seconds']:.1f} s ({report['samples_per_second']} samples/s, {report['mb_per_second']} MB/s), "
        f"peak RSS {report['peak_rss_mb']:.0f} MB{consumed}"
    )


def main(argv: Sequence[str]) -> int:
    return run_command(
        _export, argv, level=logging.INFO, fmt=DETAILED,
        fault_hint="the files written are whole. Rerun the same command to resume",
    )


def _export(argv: Sequence[str]) -> int:
    print(final_message(export(load_config(argv))))
    return EXIT_OK


def export(config: ExportConfig) -> dict[str, Any]:
    """The export, under the run's lock with ``consume``; returns its report. A ValueError before anything is
    written is a refusal (exit 2), and so is a shard file found damaged while writing (a rerun would meet it again:
    the message names the shard to extract again); a full disk is exit 3; once writing, any other error is a fault
    (exit 4: a rerun resumes)."""
    logger.info("export to=%s: reading the run's shard footers and checking %s", config.to, config.dest or "dest")
    run_directory = config.run_directory() if config.consume else None
    with OutputLock(run_directory) if run_directory is not None else contextlib.nullcontext():
        with full_disk_stops(config.dest, kept="; the files written are whole"):
            job = prepare(config)
            try:
                return write(job)
            except DamagedShardError:
                raise
            except ValueError as error:
                raise RuntimeError(str(error)) from error


cli = console_entry(main)


if __name__ == "__main__":
    cli()
