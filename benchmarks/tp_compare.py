"""TP=N against TP=1 through the real job: max relative error per captured layer, and whether
two TP=N runs are bit-identical.

    python -m benchmarks.tp_compare --shape small --device cuda --tp-size 2

Only saved checkpoints compare: SGLang's dummy weights are drawn per process, so a TP=2 model
with dummy weights is not the TP=1 model.
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

import torch

from benchmarks.throughput import build_model
from inputs.demo import build_synthetic_dataset
from jobs.config import load_config
from jobs.extract import run
from runtime.cluster.session import ray_session
from storage import ShardReader


def extract(job_args: list[str], out: Path) -> dict[int, object]:
    run(load_config([*job_args, f"output.dir={out}"]))
    return {s.sample_id: s for path in sorted(out.glob("shard-*.parquet")) for s in ShardReader(path)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", choices=["tiny", "small"], default="tiny")
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--tp-size", type=int, default=2)
    parser.add_argument("--samples", type=int, default=8)
    parser.add_argument("--tokens-per-sample", type=int, default=512)
    parser.add_argument("--out", default="")
    args = parser.parse_args()

    work = Path(tempfile.mkdtemp(prefix="eagle3-tp-"))
    model, load_format = build_model(args.shape, work)
    vocab = json.loads((model / "config.json").read_text())["vocab_size"]
    data = build_synthetic_dataset(work / "data.parquet", args.samples, vocab_size=vocab,
                                   min_len=args.tokens_per_sample // 2, max_len=args.tokens_per_sample)
    base = [f"model.path={model}", f"data.path={data}", f"model.device={args.device}", "model.dtype=bfloat16",
            f"model.load_format={load_format}", "output.min_free=1GB"]
    with ray_session(""):
        one = extract([*base, "model.tp_size=1"], work / "tp1")
        many_a = extract([*base, f"model.tp_size={args.tp_size}"], work / "tpN-a")
        many_b = extract([*base, f"model.tp_size={args.tp_size}"], work / "tpN-b")
    first = next(iter(one.values()))
    hidden = first.last_hidden_state.shape[1]
    layer_ids = ShardReader(next((work / "tp1").glob("shard-*.parquet"))).metadata.layer_ids
    identical = all(
        torch.equal(many_a[i].aux_hidden_states.view(torch.int16), many_b[i].aux_hidden_states.view(torch.int16))
        and torch.equal(many_a[i].last_hidden_state.view(torch.int16), many_b[i].last_hidden_state.view(torch.int16))
        for i in one
    )
    report = {"tp_size": args.tp_size, f"two_tp{args.tp_size}_runs_bit_identical": identical, "max_rel_error": {}}
    columns = [(f"layer {k}", slice(j * hidden, (j + 1) * hidden), "aux") for j, k in enumerate(layer_ids)]
    columns.append(("final", slice(0, hidden), "last"))
    for name, cols, kind in columns:
        worst = 0.0
        for i, ref in one.items():
            a = (ref.aux_hidden_states if kind == "aux" else ref.last_hidden_state)[:, cols].float()
            b = (many_a[i].aux_hidden_states if kind == "aux" else many_a[i].last_hidden_state)[:, cols].float()
            worst = max(worst, ((a - b).norm(dim=-1) / a.norm(dim=-1).clamp_min(1e-12)).max().item())
        report["max_rel_error"][name] = worst
    print(json.dumps(report, indent=2))
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
