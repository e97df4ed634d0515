"""Entry point: ``python -m jobs.extract [--config FILE] [key=value ...]`` (or ``eagle3-extract``).

With neither ``model.path`` nor ``data.path`` it runs the embedded demo: a
tiny random Llama and a synthetic dataset, made locally. Submit to a cluster
with ``ray job submit --working-dir . -- python -m jobs.extract ...`` and
absolute paths. Rerunning the same command resumes; ``shards=failed`` or
``shards=[3,17]`` reruns only those shards. Exit codes: ``jobs.errors``.
The job itself: ``jobs.driver.job.run``.
"""

from __future__ import annotations

import logging
import signal
import sys
from pathlib import Path
from typing import Any, Sequence

from jobs.config import load_config
from jobs.driver.job import run
from jobs.errors import EXIT_BAD_INPUT, EXIT_FAULT, EXIT_OK, EXIT_SHARDS_FAILED, JobInterrupted, JobStopped
from jobs.rundir.summary import DRAFTER_CONFIG_FILE, NOTHING_TO_DO

logger = logging.getLogger("jobs.extract")


def _raise_on_signal(signum: int, frame: Any) -> None:
    raise JobInterrupted(signum)


def main(argv: Sequence[str]) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, _raise_on_signal)
    output_dir = ""
    try:
        config = load_config(argv)
        output_dir = config.output.dir
        summary = run(config)
    except ValueError as error:  # config or input: refused before any work
        logger.error("%s", error)
        return EXIT_BAD_INPUT
    except JobStopped as error:
        logger.error("%s", error)
        return error.exit_code
    except Exception as error:  # a fault: what is done stays done
        logger.exception("the job failed: %s", error)
        where = f" output.dir={output_dir}" if output_dir else ""
        logger.error(
            "the job failed (%s); done shards are kept. Rerun the same command to resume "
            "(python -m jobs.status%s shows where it stands)", type(error).__name__, where,
        )
        return EXIT_FAULT
    print(final_message(summary))
    if summary.get("shards_failed"):
        for shard, error in summary["shards_failed"].items():
            print(f"shard {shard} FAILED: {error}", file=sys.stderr)
        print(
            f"{len(summary['shards_failed'])} shards failed and wrote no file; rerun them with the same "
            "command plus shards=failed", file=sys.stderr,
        )
        return EXIT_SHARDS_FAILED
    return EXIT_OK


def final_message(summary: dict) -> str:
    out = summary["output_dir"]
    if summary["outcome"] == NOTHING_TO_DO:
        return (
            f"\nnothing to do: all {summary['shards_done']} shards in {out} are done ({summary['samples']} "
            f"samples, {summary['tokens']} tokens); Ray was not started. Rerun chosen shards with "
            f"shards=[...]; check the files with python -m jobs.verify output.dir={out}"
        )
    engine, this_run = summary["engine"], summary["this_run"]
    return (
        f"\n{summary['shards_done']} shards done in {out}: {summary['samples']} samples, "
        f"{summary['tokens']} tokens, {summary['bytes'] / 1e6:.1f} MB; this run extracted "
        f"{this_run['tokens']} tokens in {this_run['seconds']:.1f} s ({summary['tokens_per_second']:.0f} tokens/s)\n"
        f"layers {engine['layer_ids']} (SGLang {engine['sglang_version']} layers_to_capture "
        f"{engine['layers_to_capture']}); drafter config: {Path(out) / DRAFTER_CONFIG_FILE} "
        f"eagle_aux_hidden_state_layer_ids={engine['drafter_layer_ids']}"
    )


def cli() -> None:
    """Console entry point ``eagle3-extract``."""
    sys.exit(main(sys.argv[1:]))


if __name__ == "__main__":
    cli()
