"""Entry point: ``python -m jobs.extract [--config FILE] [key=value ...]``.

With neither ``model.path`` nor ``data.path`` it runs the embedded demo: a
tiny random Llama and a synthetic dataset, made locally. Submit to a cluster
with ``ray job submit --working-dir . -- python -m jobs.extract ...``.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import shutil
import sys
from pathlib import Path
from typing import Sequence

from extractor.checkpoint import read_checkpoint_info
from extractor.layers import check_layer_ids, default_layer_ids
from jobs.config import JobConfig, load_config
from jobs.dataset import load_tokenized_dataset
from jobs.demo import prepare_demo
from jobs.pipeline import build_engine_spec, ray_session, resolve_device, run_schedule, ScheduleResult
from jobs.plan import plan_shards
from storage import shard_file_name

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


def prepare_output_dir(output_dir: Path, num_shards: int) -> None:
    if not str(output_dir):
        raise ValueError("output.dir is empty: name a directory on local disk for the shard files")
    existing = [shard_file_name(i) for i in range(num_shards) if (output_dir / shard_file_name(i)).exists()]
    if existing:
        raise ValueError(
            f"output.dir={output_dir} already holds {len(existing)} shard files (e.g. {existing[0]}); "
            "choose a new output.dir or remove the old one"
        )
    output_dir.mkdir(parents=True, exist_ok=True)


def run(config: JobConfig) -> dict:
    """Plan, extract and write; returns the run summary (also saved as summary.json)."""
    if config.is_demo:
        config = resolve_demo(config)
    checkpoint = read_checkpoint_info(config.model.path)
    layer_ids = check_layer_ids(config.extract.layers or default_layer_ids(checkpoint.num_layers), checkpoint.num_layers)
    max_length = config.model.context_length or checkpoint.max_position_embeddings
    dataset = load_tokenized_dataset(config.data.path, checkpoint.vocab_size, max_length)
    shards = plan_shards(len(dataset), config.data.shard_size)
    output_dir = Path(config.output.dir)
    prepare_output_dir(output_dir, len(shards))
    logger.info("%d samples, %d tokens in %d shards -> %s", len(dataset), int(dataset.lengths.sum()), len(shards), output_dir)

    with ray_session(config.ray.address):
        device = resolve_device(config.model.device, config.model.tp_size)
        spec = build_engine_spec(config.model, config.extract, layer_ids, device, checkpoint, int(dataset.lengths.max()))
        result = run_schedule(
            spec, dataset, shards, config.extract, output_dir,
            config.output.num_writers, config.output.max_inflight_batches,
        )
    summary = build_summary(config, result)
    (output_dir / SUMMARY_FILE).write_text(json.dumps(summary, indent=2) + "\n")
    drafter = {"eagle_config": {"eagle_aux_hidden_state_layer_ids": result.engine.drafter_layer_ids}}
    (output_dir / DRAFTER_CONFIG_FILE).write_text(json.dumps(drafter, indent=2) + "\n")
    return summary


def build_summary(config: JobConfig, result: ScheduleResult) -> dict:
    files = sorted(result.done.values(), key=lambda info: info.path)
    tokens = sum(info.tokens for info in files)
    return {
        "output_dir": config.output.dir,
        "model_path": config.model.path,
        "data_path": config.data.path,
        "shards_done": len(files),
        "shards_failed": {str(shard): error for shard, error in sorted(result.failed.items())},
        "samples": sum(info.rows for info in files),
        "tokens": tokens,
        "bytes": sum(info.bytes for info in files),
        "seconds": round(result.seconds, 3),
        "tokens_per_second": round(tokens / result.seconds, 1) if result.seconds else 0.0,
        "engine": dataclasses.asdict(result.engine),
        "files": [dataclasses.asdict(info) for info in files],
    }


def main(argv: Sequence[str]) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        config = load_config(argv)
        summary = run(config)
    except ValueError as error:
        logger.error("%s", error)
        return 2
    engine = summary["engine"]
    print(
        f"\nwrote {summary['shards_done']} shards to {summary['output_dir']}: {summary['samples']} samples, "
        f"{summary['tokens']} tokens, {summary['bytes'] / 1e6:.1f} MB in {summary['seconds']:.1f} s "
        f"({summary['tokens_per_second']:.0f} tokens/s)\n"
        f"layers {engine['layer_ids']} (SGLang {engine['sglang_version']} layers_to_capture "
        f"{engine['layers_to_capture']}); drafter config: {DRAFTER_CONFIG_FILE} "
        f"eagle_aux_hidden_state_layer_ids={engine['drafter_layer_ids']}"
    )
    if summary["shards_failed"]:
        for shard, error in summary["shards_failed"].items():
            print(f"shard {shard} FAILED: {error}", file=sys.stderr)
        print(f"{len(summary['shards_failed'])} shards failed; their files were not written", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
