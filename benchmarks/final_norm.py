"""How far the final norm applied at export is from SGLang's own post-norm final state.

    python -m benchmarks.final_norm [--samples N] [--smollm2] [--dtype bfloat16]

For each model (the demo's tiny Llama, DeepSeek-V3 and Qwen3, and with ``--smollm2`` SmolLM2-135M-Instruct,
real trained weights; ``testbeds/smollm2.py``), two real CPU runs of the job over the same synthetic tokens:
one storing SGLang's post-norm final state, one its pre-norm state. The pre-norm states go through
``training.final_state.FinalNorm`` (what ``jobs.export to=specforge`` writes for a pre-norm run) and are
compared with the post-norm ones, token by token: the share of values equal bit for bit, the largest
difference in units in the last place of the model dtype, and relative differences (per value, over values
that are not zero, and per token, as the L2 norm of the difference over that of SGLang's state). For scale,
the same figures for HF transformers' post-norm state of the same model and dtype against SGLang's.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import tempfile
from pathlib import Path
from typing import Optional

import torch

from inputs.demo import build_synthetic_dataset, build_tiny_model
from jobs.config import load_config
from jobs.driver.job import run
from storage import ShardReader
from training.final_state import FinalNorm, find_final_norm

logger = logging.getLogger("benchmarks.final_norm")

DEMO_ARCHS = ("llama", "deepseek_v3", "qwen3")


@dataclasses.dataclass
class Difference:
    tokens: int
    values: int
    equal_share: float
    """Share of values equal bit for bit."""
    max_ulps: float
    """Largest difference, in units in the last place of the reference value (where it is not zero)."""
    max_relative: float
    mean_relative: float
    """Per value |a - b| / |b|, over values where b is not zero."""
    max_token_relative: float
    mean_token_relative: float
    """Per token ||a - b|| / ||b||."""


def compare(mine: list[torch.Tensor], reference: list[torch.Tensor]) -> Difference:
    a = torch.cat(mine).float()
    b = torch.cat(reference).float()
    dtype = reference[0].dtype
    diff = (a - b).abs()
    nonzero = b != 0
    # One unit in the last place of each reference value (of its binade), in the model dtype.
    ulp = torch.finfo(dtype).eps * torch.exp2(torch.floor(torch.log2(b.abs()[nonzero])))
    relative = diff[nonzero] / b.abs()[nonzero]
    per_token = diff.norm(dim=-1) / b.norm(dim=-1).clamp(min=1e-30)
    equal = torch.cat([torch.eq(x.view(torch.int16 if x.element_size() == 2 else torch.int32),
                                y.view(torch.int16 if y.element_size() == 2 else torch.int32)).flatten()
                       for x, y in zip(mine, reference)])
    return Difference(
        tokens=b.shape[0], values=b.numel(), equal_share=equal.float().mean().item(),
        max_ulps=(diff[nonzero] / ulp).max().item(), max_relative=relative.max().item(), mean_relative=relative.mean().item(),
        max_token_relative=per_token.max().item(), mean_token_relative=per_token.mean().item(),
    )


def extract(model: Path, data: Path, out: Path, final_state: str, dtype: str, address: str) -> dict[int, torch.Tensor]:
    """The final states of a real run, by sample id."""
    summary = run(load_config([
        f"model.path={model}", f"data.path={data}", f"output.dir={out}", "model.device=cpu", f"model.dtype={dtype}",
        f"extract.last_hidden_state={final_state}", "output.min_free=1GB", f"ray.address={address}",
    ]))
    assert summary["exit_code"] == 0 and not summary["shards_failed"], summary
    states = {}
    for path in sorted(out.glob("shard-*.parquet")):
        states.update((sample.sample_id, sample.last_hidden_state.clone()) for sample in ShardReader(path))
    return states


def hf_post_norm(model: Path, data: Path, dtype: str) -> dict[int, torch.Tensor]:
    """HF transformers' post-norm final state (its last ``hidden_states``) of every sample."""
    import pyarrow.parquet as pq
    import transformers

    hf = transformers.AutoModelForCausalLM.from_pretrained(model, dtype=getattr(torch, dtype)).eval()
    states = {}
    with torch.no_grad():
        for sample_id, ids in enumerate(pq.read_table(data).column("input_ids").to_pylist()):
            output = hf(torch.tensor([ids]), output_hidden_states=True)
            states[sample_id] = output.hidden_states[-1][0]
    return states


def measure(name: str, model: Path, data: Path, work: Path, dtype: str, address: str) -> dict[str, Difference]:
    post = extract(model, data, work / f"{name}-post", "post_norm", dtype, address)
    pre = extract(model, data, work / f"{name}-pre", "pre_norm", dtype, address)
    # The demo's and SmolLM2's config.json name SGLang's class: no multimodal wrapper among them.
    architecture = json.loads((model / "config.json").read_text())["architectures"][0]
    source = find_final_norm(str(model), architecture)
    norm = FinalNorm(source, getattr(torch, dtype))
    ids = sorted(post)
    exported = [norm(pre[i]) for i in ids]
    found = {"export vs SGLang": compare(exported, [post[i] for i in ids])}
    hf = hf_post_norm(model, data, dtype)
    found["HF vs SGLang"] = compare([hf[i].to(post[i].dtype) for i in ids], [post[i] for i in ids])
    return found


def main(argv: Optional[list[str]] = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--samples", type=int, default=16)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--smollm2", action="store_true", help="also SmolLM2-135M-Instruct (testbeds/smollm2.py)")
    parser.add_argument("--archs", default=",".join(DEMO_ARCHS), help="the demo models to measure (comma-separated)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    import ray

    with tempfile.TemporaryDirectory(prefix="final-norm-") as scratch:
        work = Path(scratch)
        ray.init(_node_ip_address="127.0.0.1", include_dashboard=False, num_cpus=3,
                 runtime_env={"env_vars": {"PYTHONPATH": str(Path(__file__).resolve().parent.parent)}})
        address = ray.get_runtime_context().gcs_address
        archs = [arch for arch in args.archs.split(",") if arch]
        models = {arch: build_tiny_model(work / arch, arch=arch, dtype=args.dtype) for arch in archs}
        data = {arch: build_synthetic_dataset(work / f"{arch}.parquet", args.samples, max_len=256) for arch in models}
        if args.smollm2:
            from testbeds.smollm2 import checkpoint_dir

            models["smollm2"] = checkpoint_dir()
            data["smollm2"] = build_synthetic_dataset(work / "smollm2.parquet", args.samples, vocab_size=49152,
                                                      max_len=256)
        print("| model | compared | tokens | bit-equal values | max ulps | max / mean relative (values) | "
              "max / mean relative (tokens, L2) |")
        print("|---|---|---|---|---|---|---|")
        for name, model in models.items():
            for label, d in measure(name, model, data[name], work, args.dtype, address).items():
                print(f"| {name} | {label} | {d.tokens} | {d.equal_share:.2%} | {d.max_ulps:.1f} | "
                      f"{d.max_relative:.2e} / {d.mean_relative:.2e} | {d.max_token_relative:.2e} / "
                      f"{d.mean_token_relative:.2e} |", flush=True)
        ray.shutdown()


if __name__ == "__main__":
    main()
