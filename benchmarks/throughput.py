"""Throughput of the whole job against bare SGLang prefill, measured in one run on one machine.

  (a) bare prefill: the extractor's forward on the job's batches with capture off, nothing copied
  (a2) the extractor alone: capture forward, copy to host, put in Ray's object store (no writers)
  (b) the job: Ray, extractor actor, writer actors, Parquet on local disk (fsynced), tokens/s
      from the first batch to the last committed file
  (c) the disk's raw sequential write speed (write + fsync) and the writers' bytes/s

    python -m benchmarks.throughput --shape tiny --device cpu          # CI smoke test
    python -m benchmarks.throughput --shape llama8b --device cuda      # on a GPU machine

`tiny` and `small` are saved random-weight checkpoints; `llama8b` and `deepseek_v3_reduced` use
SGLang's dummy weights built from a config.json alone (random per process and per TP layout).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import tempfile
import time
from pathlib import Path

import numpy as np
import ray

from jobs.config import load_config
from jobs.dataset import load_tokenized_dataset
from jobs.demo import build_synthetic_dataset, build_tiny_model
from jobs.extract import run
from extractor.checkpoint import read_checkpoint_info
from extractor.layers import default_layer_ids
from jobs.extractor_actor import ExtractorActor, start_extractor
from jobs.pipeline import build_engine_spec, ray_session, resolve_device
from jobs.plan import pack_batches

LLAMA_8B = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 4096, "intermediate_size": 14336,
    "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8, "vocab_size": 128256,
    "max_position_embeddings": 131072, "rms_norm_eps": 1e-5, "rope_theta": 500000.0, "torch_dtype": "bfloat16",
    "tie_word_embeddings": False, "hidden_act": "silu",
}
# DeepSeek-V3 / Kimi-K2.5 width (7168, MLA, top-8 routing) at reduced depth and 64 experts, to fit one GPU.
DEEPSEEK_V3_REDUCED = {
    "architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3", "hidden_size": 7168,
    "intermediate_size": 18432, "moe_intermediate_size": 2048, "num_hidden_layers": 4, "first_k_dense_replace": 1,
    "num_attention_heads": 128, "num_key_value_heads": 128, "n_routed_experts": 64, "num_experts_per_tok": 8,
    "n_shared_experts": 1, "n_group": 8, "topk_group": 4, "routed_scaling_factor": 2.5, "norm_topk_prob": True,
    "q_lora_rank": 1536, "kv_lora_rank": 512, "qk_rope_head_dim": 64, "qk_nope_head_dim": 128, "v_head_dim": 128,
    "vocab_size": 129280, "max_position_embeddings": 163840, "rms_norm_eps": 1e-6, "scoring_func": "sigmoid",
    "topk_method": "noaux_tc", "moe_layer_freq": 1, "torch_dtype": "bfloat16", "tie_word_embeddings": False,
    "hidden_act": "silu", "rope_theta": 10000,
    "rope_scaling": {"type": "yarn", "factor": 40, "original_max_position_embeddings": 4096, "beta_fast": 32,
                     "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0},
}
DISK_PROBE_CHUNK = 64 * 1024 * 1024


def measure_disk(directory: Path, total_bytes: int) -> float:
    """Sequential write + fsync, bytes/s (what a shard commit costs at best)."""
    chunk = np.random.default_rng(0).integers(0, 255, DISK_PROBE_CHUNK, dtype=np.uint8).tobytes()
    path = directory / "disk-probe.bin"
    started = time.perf_counter()
    with open(path, "wb") as file:
        for _ in range(max(1, total_bytes // len(chunk))):
            file.write(chunk)
        file.flush()
        os.fsync(file.fileno())
    seconds = time.perf_counter() - started
    written = path.stat().st_size
    path.unlink()
    return written / seconds


def build_model(shape: str, directory: Path) -> tuple[Path, str]:
    """Checkpoint directory and SGLang load format for ``shape``."""
    if shape == "tiny":
        return build_tiny_model(directory / "model", arch="llama", dtype="bfloat16"), "auto"
    if shape == "small":  # real (saved) random weights: every TP layout loads the same model
        return build_tiny_model(directory / "model", arch="llama", num_layers=8, hidden_size=1024, dtype="bfloat16"), "auto"
    config = {"llama8b": LLAMA_8B, "deepseek_v3_reduced": DEEPSEEK_V3_REDUCED}[shape]
    (directory / "model").mkdir(parents=True, exist_ok=True)
    (directory / "model" / "config.json").write_text(json.dumps(config))
    return directory / "model", "dummy"


def measure_extractor(job_args: list[str], data: Path, batches_of: int) -> tuple[float, float]:
    """tok/s of (a) bare prefill and (a2) the extractor alone (capture, host copy, object store),
    on the job's own batches; a warm-up batch of each is not counted."""
    config = load_config(job_args)
    checkpoint = read_checkpoint_info(config.model.path)
    dataset = load_tokenized_dataset(str(data), checkpoint.vocab_size, 1 << 30)
    spec = build_engine_spec(
        config.model, config.extract, config.extract.layers or default_layer_ids(checkpoint.num_layers),
        resolve_device(config.model.device, config.model.tp_size), int(dataset.lengths.max()),
    )
    tokens = int(dataset.lengths.sum())
    actor = start_extractor(spec)
    try:
        batches = [dataset.input_ids[a:b] for a, b in pack_batches(dataset.lengths, batches_of, 256)]
        ray.get(actor.bare_prefill.remote(batches[0]))  # warm-up: JIT kernels, allocator
        bare = tokens / sum(ray.get(actor.bare_prefill.remote(batch)) for batch in batches)
        ray.get(actor.extract.remote(batches[0]))
        started = time.perf_counter()
        in_flight: list[ray.ObjectRef] = []
        for batch in batches:  # as the job feeds it: the next batch is queued while one is handed on
            in_flight.append(actor.extract.remote(batch))
            if len(in_flight) > ExtractorActor.MAX_CONCURRENCY:
                ray.get(in_flight.pop(0))
        ray.get(in_flight)
        alone = tokens / (time.perf_counter() - started)
        ray.get(actor.close.remote())
    finally:
        ray.kill(actor)
    return bare, alone


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", choices=["tiny", "small", "llama8b", "deepseek_v3_reduced"], default="tiny")
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--tp-size", type=int, default=1)
    parser.add_argument("--samples", type=int, default=32)
    parser.add_argument("--tokens-per-sample", type=int, default=2048)
    parser.add_argument("--max-tokens-per-batch", type=int, default=16384)
    parser.add_argument("--shard-size", type=int, default=16, help="samples per shard file")
    parser.add_argument("--disk-probe-bytes", type=int, default=1 << 30)
    parser.add_argument("--work-dir", default="", help="kept afterwards; default: a temp dir, removed")
    parser.add_argument("--out", default="", help="also write the results as JSON here")
    parser.add_argument("--set", nargs="*", default=[], help="extra job key=value overrides")
    args = parser.parse_args()

    work = Path(args.work_dir or tempfile.mkdtemp(prefix="eagle3-bench-"))
    try:
        results = measure(args, work)
    finally:
        if not args.work_dir:
            shutil.rmtree(work, ignore_errors=True)
    print_table(results)
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=2) + "\n")


def measure(args: argparse.Namespace, work: Path) -> dict:
    model, load_format = build_model(args.shape, work)
    vocab = json.loads((model / "config.json").read_text())["vocab_size"]
    data = build_synthetic_dataset(
        work / "data.parquet", args.samples, vocab_size=vocab, min_len=args.tokens_per_sample,
        max_len=args.tokens_per_sample,
    )
    job_args = [
        f"model.path={model}", f"data.path={data}", f"model.device={args.device}", f"model.tp_size={args.tp_size}",
        f"model.load_format={load_format}", f"extract.max_tokens_per_batch={args.max_tokens_per_batch}",
        f"data.shard_size={args.shard_size}", "model.dtype=bfloat16", "output.min_free_bytes=1GB", *args.set,
    ]
    disk_bps = measure_disk(work, args.disk_probe_bytes)
    with ray_session(""):
        bare, extractor_alone = measure_extractor(job_args, data, args.max_tokens_per_batch)
        summary = run(load_config([*job_args, f"output.dir={work / 'out'}"]))
    job_tps = summary["tokens_per_second"]
    bytes_per_token = summary["bytes"] / summary["tokens"]
    writer_bps = summary["bytes"] / summary["seconds"]
    return {
        "shape": args.shape, "device": args.device, "tp_size": args.tp_size, "samples": args.samples,
        "tokens": summary["tokens"], "bytes": summary["bytes"], "writers": summary["writers"],
        "last_hidden_state": summary["last_hidden_state"],
        "layer_ids": summary["engine"]["layer_ids"], "sglang": summary["engine"]["sglang_version"],
        "bare_prefill_tokens_per_s": round(bare, 1), "job_tokens_per_s": job_tps,
        "extractor_alone_tokens_per_s": round(extractor_alone, 1),
        "extractor_alone_over_bare": round(extractor_alone / bare, 3), "job_over_bare": round(job_tps / bare, 3), "states_at_bare_speed_bytes_per_s": round(bare * bytes_per_token),
        "disk_write_bytes_per_s": round(disk_bps), "writer_bytes_per_s": round(writer_bps),
        "writer_over_disk": round(writer_bps / disk_bps, 3), "startup_seconds": summary["startup_seconds"],
        "bytes_per_token": round(bytes_per_token, 1),
    }


def print_table(results: dict) -> None:
    states_bps, disk_bps = results["states_at_bare_speed_bytes_per_s"], results["disk_write_bytes_per_s"]
    rows = [
        ("(a) bare SGLang prefill", f"{results['bare_prefill_tokens_per_s']:,.0f} tok/s", ""),
        ("(a2) extractor alone (copy + object store)", f"{results['extractor_alone_tokens_per_s']:,.0f} tok/s",
         f"a2/a = {results['extractor_alone_over_bare']:.3f}"),
        ("(b) full job (Ray + Parquet, fsync)", f"{results['job_tokens_per_s']:,.0f} tok/s",
         f"b/a = {results['job_over_bare']:.3f}"),
        ("    states at (a)'s speed", f"{states_bps / 1e6:,.0f} MB/s",
         f"{results['bytes_per_token']:,.0f} B/token"),
        ("(c) disk sequential write (fsync)", f"{disk_bps / 1e6:,.0f} MB/s", ""),
        (f"    writer pool ({results['writers']} writers)", f"{results['writer_bytes_per_s'] / 1e6:,.0f} MB/s",
         f"writer/disk = {results['writer_over_disk']:.3f}"),
        ("    time to first batch (model load)", f"{results['startup_seconds']:.1f} s", ""),
    ]
    print(f"\n{results['shape']} on {results['device']} (TP={results['tp_size']}), SGLang {results['sglang']}, "
          f"layers {results['layer_ids']}{' + final state' if results['last_hidden_state'] else ''}, "
          f"{results['tokens']:,} tokens in {results['samples']} samples")
    for name, value, ratio in rows:
        print(f"  {name:<44} {value:>16}  {ratio}")
    if disk_bps < states_bps:
        print(f"  the disk ({disk_bps / 1e6:,.0f} MB/s) is slower than the states arrive "
              f"({states_bps / 1e6:,.0f} MB/s): the job runs at the disk's pace, "
              "the in-flight cap holds the extractor back")


if __name__ == "__main__":
    main()
