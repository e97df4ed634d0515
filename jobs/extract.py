"""Entry point: ``python -m jobs.extract [--config FILE] [key=value ...]`` (or ``eagle3-extract``).

With neither ``model.path`` nor ``data.path`` it runs the embedded demo: a
tiny random Llama and a synthetic dataset, made locally. Submit to a cluster
with ``ray job submit --working-dir . -- python -m jobs.extract ...`` and
absolute paths. Rerunning the same command resumes; ``shards=failed`` or
``shards=[3,17]`` reruns only those shards. Exit codes: ``runtime.errors``.
The job itself: ``jobs.driver.job.run``.
"""

from __future__ import annotations

import logging
import sys
from pathlib import Path
from typing import Sequence

from jobs.cli import DETAILED, console_entry, run_command
from jobs.config import load_config
from jobs.driver.job import run
from jobs.rundir.summary import DRAFTER_CONFIG_FILE, NOTHING_TO_DO
from runtime.errors import EXIT_OK

logger = logging.getLogger("jobs.extract")


def main(argv: Sequence[str]) -> int:
    return run_command(
        _extract, argv, level=logging.INFO, fmt=DETAILED,
        fault_hint="done shards are kept. Rerun the same command to resume (python -m jobs.status output.dir=DIR "
        "shows where it stands)",
    )


def _extract(argv: Sequence[str]) -> int:
    summary = run(load_config(argv))
    print(final_message(summary))
    for shard, error in summary.get("shards_failed", {}).items():
        print(f"shard {shard} FAILED: {error}", file=sys.stderr)
    if summary.get("message"):
        print(f"error: {summary['message']}", file=sys.stderr)
    return summary.get("exit_code") or EXIT_OK


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
        f"\n{summary['shards_done']} of {summary['plan']['shards']} shards done in {out}: {summary['samples']} samples, "
        f"{summary['tokens']} tokens, {summary['bytes'] / 1e6:.1f} MB; this run extracted "
        f"{this_run['tokens']} tokens in {this_run['seconds']:.1f} s ({summary['tokens_per_second']:.0f} tokens/s"
        f"{_steady(summary)})\n"
        f"layers {engine['layer_ids']} (SGLang {engine['sglang_version']} layers_to_capture "
        f"{engine['layers_to_capture']}); drafter config: {Path(out) / DRAFTER_CONFIG_FILE} "
        f"eagle_aux_hidden_state_layer_ids={engine['drafter_layer_ids']}"
    )


def _steady(summary: dict) -> str:
    """The steady state beside the whole run's rate, where the run measured one
    (``RunResult.steady_tokens_per_second``)."""
    rate = summary.get("steady_tokens_per_second")
    if rate is None:
        return ""
    return (f"; {rate:.0f} tokens/s once the pipeline was full: the first batch took "
            f"{summary['first_batch_seconds']:.1f} s, closing the last shards {summary['drain_seconds']:.1f} s")


cli = console_entry(main)


if __name__ == "__main__":
    cli()
