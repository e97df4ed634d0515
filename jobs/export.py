"""``python -m jobs.export output.dir=RUN to=specforge|speculators dest=DIR`` (or ``eagle3-export``).

The command around ``training.export``: parse, export, print. Exit codes: 0 done, 2 bad
config or input (nothing written), 4 an error while writing (rerun: it resumes), 130/143
stopped by a signal (rerun: it resumes).
"""

from __future__ import annotations

import logging
import signal
import sys
from typing import Any, Sequence

from jobs.config import build_config, build_parser, program_name
from jobs.errors import EXIT_BAD_INPUT, EXIT_FAULT, EXIT_OK, JobInterrupted
from training.export import ExportConfig, prepare, write

logger = logging.getLogger("jobs.export")



def load_config(argv: Sequence[str]) -> ExportConfig:
    parser = build_parser(
        program_name("jobs.export"),
        "Export a run's hidden states in the layout SpecForge or speculators trains from. Exit codes: 0 done, "
        "2 bad config or input (nothing written), 4 an error while writing (rerun: it resumes), 130/143 stopped "
        "by a signal (rerun: it resumes).",
        ExportConfig,
    )
    args = parser.parse_args(list(argv))
    return build_config(ExportConfig, args.config, args.overrides, prog=parser.prog)


def final_message(report: dict[str, Any]) -> str:
    if report["already_complete"]:
        return (f"nothing to do: {report['dest']} holds the complete {report['format']} export "
                f"({report['samples']} samples)")
    return (
        f"exported {report['samples']} samples to {report['dest']} ({report['format']}, {report['states']} states): "
        f"{report['written']} written, {report['skipped']} already there; {report['bytes'] / 1e6:.1f} MB in "
        f"{report['seconds']:.1f} s ({report['samples_per_second']} samples/s, {report['mb_per_second']} MB/s), "
        f"peak RSS {report['peak_rss_mb']:.0f} MB"
    )


def _raise_on_signal(signum: int, frame: Any) -> None:
    raise JobInterrupted(signum)


def main(argv: Sequence[str]) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    previous = {signum: signal.signal(signum, _raise_on_signal) for signum in (signal.SIGTERM, signal.SIGINT)}
    try:
        try:
            job = prepare(load_config(argv))
        except ValueError as error:  # config or input (ConfigError too): refused before anything is written
            logger.error("%s", error)
            return EXIT_BAD_INPUT
        report = write(job)
    except JobInterrupted as error:
        logger.error("export stopped by %s; the files written are whole. Rerun the same command to resume",
                     signal.Signals(error.signum).name)
        return error.exit_code
    except Exception as error:
        logger.exception("the export failed: %s", error)
        logger.error("the export failed (%s); the files written are whole. Rerun the same command to resume",
                     type(error).__name__)
        return EXIT_FAULT
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
    print(final_message(report))
    return EXIT_OK


def cli() -> None:
    """Console entry point ``eagle3-export``."""
    sys.exit(main(sys.argv[1:]))


if __name__ == "__main__":
    cli()
