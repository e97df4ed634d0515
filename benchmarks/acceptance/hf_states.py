"""Arm C: HF transformers' states of arm A's samples, written as SpecForge's files, and how far they are
from ours per layer."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from benchmarks.acceptance.differences import add_sample, layer_differences
from benchmarks.acceptance.files import save_torch


def write_hf_features(model_path: Path, run_dir: Path, dest: Path, device: str, dtype: str) -> dict[str, dict]:
    """Arm C: HF transformers' states for every sample of ``run_dir`` (its ids and loss masks), at the run's
    layers (``hidden_states[k+1]``) with the post-norm final state (the output of ``model.norm``, hooked),
    written as SpecForge's files exactly as ``jobs.export to=specforge`` writes them (``training.peer_formats``);
    returns each layer's relative difference from the run's own states."""
    import torch
    import transformers

    from storage import ShardReader
    from storage.reader import Sample
    from training.peer_formats import specforge_file, specforge_path

    model = transformers.AutoModelForCausalLM.from_pretrained(str(model_path), dtype=getattr(torch, dtype))
    model = model.to(device).eval()
    kept: dict[str, Any] = {}
    hook = model.model.norm.register_forward_hook(lambda module, args, output: kept.update(post_norm=output[0]))
    readers = [ShardReader(path) for path in sorted(run_dir.glob("shard-*.parquet"))]
    if not readers:
        raise ValueError(f"{run_dir} holds no shard-*.parquet: run arm A's extraction first")
    layers, hidden = readers[0].metadata.layer_ids, readers[0].metadata.hidden_size
    differences = layer_differences(layers)
    try:
        for sample in (sample for reader in readers for sample in reader):
            with torch.no_grad():
                out = model(sample.input_ids[None].to(device), output_hidden_states=True)
            aux = torch.cat([out.hidden_states[k + 1][0] for k in layers], dim=-1).cpu()
            final = kept["post_norm"].cpu()
            add_sample(differences, layers, hidden, sample, aux, final)
            theirs = Sample(sample.sample_id, sample.input_ids, sample.loss_mask, aux, final)
            save_torch(specforge_file(theirs), dest / specforge_path(sample.sample_id))
    finally:
        hook.remove()
    return {name: difference.report() for name, difference in differences.items()}
