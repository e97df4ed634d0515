"""Entry point: ``python -m jobs.extract [--config FILE] [key=value ...]``.

With neither ``model.path`` nor ``data.path`` it runs the embedded demo: a
tiny random Llama and a synthetic dataset, made locally. Submit to a cluster
with ``ray job submit --working-dir . -- python -m jobs.extract ...``.
Rerunning the same command resumes; ``shards=failed`` or ``shards=[3,17]``
reruns only those shards.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import shutil
import sys
from pathlib import Path
from typing import Any, Sequence

from extractor.checkpoint import read_checkpoint_info
from extractor.layers import check_layer_ids, default_layer_ids
from jobs.budget import DiskBudget
from jobs.config import JobConfig, load_config
from jobs.dataset import load_tokenized_dataset
from jobs.demo import prepare_demo
from jobs.errors import EXIT_BAD_INPUT, EXIT_SHARDS_FAILED, JobStopped
from jobs.pipeline import (
    ExtractionRun, RunResult, build_engine_spec, ray_session, resolve_device,
)
from jobs.plan import plan_shards
from jobs.resume import clean_output_dir, refuse_foreign_output, select_shards
from storage.config import parse_bytes
from storage.manifest import DONE, FAILED, MANIFEST_FILE, SINK, Manifest

logger = logging.getLogger("jobs.extract")

SUMMARY_FILE = "summary.json"
DRAFTER_CONFIG_FILE = "drafter_config.json"


def resolve_demo(config: JobConfig) -> JobConfig:
    """Fill model/data/output paths with the demo's; its output dir is rewritten each run."""
    model_dir, data_path = prepare_demo(config.demo.dir, config.demo.arch, config.demo.num_samples, config.demo.seed)
    output_dir = Path(config.output.dir or Path(config.demo.dir) / "hidden_states")
    shutil.rmtree(output_dir, ignore_errors=True)
    return dataclasses.replace(
        config,
        model=dataclasses.replace(config.model, path=str(model_dir)),
        data=dataclasses.replace(config.data, path=str(data_path), shard_size=min(config.data.shard_size, 16)),
        output=dataclasses.replace(config.output, dir=str(output_dir)),
    )


def run_content(config: JobConfig, spec_fields: dict[str, Any], data_fingerprint: str) -> dict[str, Any]:
    """Everything that changes what the shard files contain: a resume must match it exactly."""
    return {
        "model.path": spec_fields["model_path"],
        "model.dtype": spec_fields["dtype"],
        "model.tp_size": spec_fields["tp_size"],
        "model.device": spec_fields["device"],
        "model.attention_backend": spec_fields["attention_backend"],
        "model.load_format": spec_fields["load_format"],
        "extract.layers": list(spec_fields["layer_ids"]),
        "extract.last_hidden_state": spec_fields["last_hidden_state"],
        "output.state_dtype": spec_fields["state_dtype"],
        "model.engine": spec_fields["engine"],
        "data.fingerprint": data_fingerprint,
        "data.shard_size": config.data.shard_size,
    }


def run(config: JobConfig) -> dict:
    """Plan, extract and write; returns the run summary (also saved as summary.json)."""
    if config.is_demo:
        config = resolve_demo(config)
    if not config.output.dir:
        raise ValueError("output.dir is empty: name a directory on local disk for the shard files")
    checkpoint = read_checkpoint_info(config.model.path)
    layer_ids = check_layer_ids(config.extract.layers or default_layer_ids(checkpoint.num_layers), checkpoint.num_layers)
    max_length = config.model.context_length or checkpoint.max_position_embeddings
    dataset = load_tokenized_dataset(config.data.path, checkpoint.vocab_size, max_length)
    output_dir = Path(config.output.dir)
    output_dir.mkdir(parents=True, exist_ok=True)
    refuse_foreign_output(output_dir, (output_dir / MANIFEST_FILE).exists())
    budget = DiskBudget(
        output_dir,
        parse_bytes(config.output.disk_budget, "output.disk_budget"),
        parse_bytes(config.output.min_free_bytes, "output.min_free_bytes"),
    )

    with ray_session(config.ray.address):
        device = resolve_device(config.model.device, config.model.tp_size)
        spec = build_engine_spec(
            config.model, config.extract, layer_ids, device, int(dataset.lengths.max()), config.output.state_dtype
        )
        plan = [(s.index, s.start, s.stop) for s in plan_shards(len(dataset), config.data.shard_size)]
        content = run_content(config, dataclasses.asdict(spec), dataset.fingerprint())
        manifest = Manifest.open(output_dir, content, plan)
        to_run = select_shards(manifest, config.shards)
        clean_output_dir(output_dir, manifest, to_run)
        logger.info(
            "%d samples, %d tokens in %d shards; this run extracts %d of them -> %s",
            len(dataset), int(dataset.lengths.sum()), len(plan), len(to_run), output_dir,
        )
        result = ExtractionRun(
            spec, dataset, to_run, config.extract, config.output, output_dir, manifest, budget
        ).run()
    summary = build_summary(config, manifest, result)
    (output_dir / SUMMARY_FILE).write_text(json.dumps(summary, indent=2) + "\n")
    drafter = {"eagle_config": {"eagle_aux_hidden_state_layer_ids": result.engine.drafter_layer_ids}}
    (output_dir / DRAFTER_CONFIG_FILE).write_text(json.dumps(drafter, indent=2) + "\n")
    return summary


def build_summary(config: JobConfig, manifest: Manifest, result: RunResult) -> dict:
    done = manifest.in_state(DONE)
    tokens = sum(record.tokens for record in done)
    return {
        "output_dir": config.output.dir,
        "model_path": config.model.path,
        "data_path": config.data.path,
        "shards_done": len(done),
        "shards_failed": {str(r.index): r.error for r in manifest.in_state(FAILED)},
        "samples": sum(record.rows for record in done),
        "tokens": tokens,
        "bytes": sum(record.bytes for record in done),
        "bytes_in_sink": sum(record.bytes for record in done if record.location == SINK),
        "startup_seconds": round(result.startup_seconds, 3),
        "seconds": round(result.seconds, 3),
        "drain_seconds": round(result.drain_seconds, 3),
        "tokens_per_second": round(tokens / result.seconds, 1) if result.seconds else 0.0,
        "last_hidden_state": config.extract.last_hidden_state,
        "state_dtype": config.output.state_dtype,
        "writers": result.writers,
        "peak_open_shards": result.peak_open_shards,
        "max_inflight_batches": result.max_inflight_batches,
        "disk_budget": {
            "limit": parse_bytes(config.output.disk_budget, "output.disk_budget"),
            "peak": result.budget_peak,
            "overshoot": result.budget_overshoot,
            "blocked_seconds": round(result.blocked_seconds, 3),
        },
        "engine": dataclasses.asdict(result.engine),
        "extractor": dataclasses.asdict(result.extractor),
        "writer_seconds": {
            clock: {stage: round(seconds, 3) for stage, seconds in stages.items()}
            for clock, stages in result.writer_seconds.items()
        },
    }


def main(argv: Sequence[str]) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        config = load_config(argv)
        summary = run(config)
    except ValueError as error:
        logger.error("%s", error)
        return EXIT_BAD_INPUT
    except JobStopped as error:
        logger.error("%s", error)
        return error.exit_code
    engine = summary["engine"]
    print(
        f"\n{summary['shards_done']} shards done in {summary['output_dir']}: {summary['samples']} samples, "
        f"{summary['tokens']} tokens, {summary['bytes'] / 1e6:.1f} MB in {summary['seconds']:.1f} s "
        f"({summary['tokens_per_second']:.0f} tokens/s)\n"
        f"layers {engine['layer_ids']} (SGLang {engine['sglang_version']} layers_to_capture "
        f"{engine['layers_to_capture']}); drafter config: {DRAFTER_CONFIG_FILE} "
        f"eagle_aux_hidden_state_layer_ids={engine['drafter_layer_ids']}"
    )
    if summary["shards_failed"]:
        for shard, error in summary["shards_failed"].items():
            print(f"shard {shard} FAILED: {error}", file=sys.stderr)
        print(
            f"{len(summary['shards_failed'])} shards failed and wrote no file; rerun them with the same "
            "command plus shards=failed", file=sys.stderr,
        )
        return EXIT_SHARDS_FAILED
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
