"""How far one set of states is from another, per layer: arm C's HF states from ours, and our bf16 states
(what Q-bf16's and Q4-bf16's drafter trained on) from a quantized target's own (Q's, Q4's).

    python -m benchmarks.acceptance.differences REFERENCE_RUN OTHER_RUN OUT.json

(a process of its own, so that it runs on the CPU while the GPU trains)."""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Iterator

if TYPE_CHECKING:
    import torch

    from storage.reader import Sample


@dataclasses.dataclass
class LayerDifference:
    """Per-token ||theirs - reference|| / ||reference|| of one layer, over every token seen."""

    tokens: int = 0
    total: float = 0.0
    largest: float = 0.0

    def add(self, reference: torch.Tensor, theirs: torch.Tensor) -> None:
        reference, theirs = reference.float(), theirs.float()
        relative = (theirs - reference).norm(dim=-1) / reference.norm(dim=-1).clamp_min(1e-12)
        self.tokens += relative.numel()
        self.total += relative.sum().item()
        self.largest = max(self.largest, relative.max().item())

    def report(self) -> dict[str, float]:
        return {"mean": self.total / max(self.tokens, 1), "max": self.largest, "tokens": self.tokens}


def layer_differences(layers: list[int]) -> dict[str, LayerDifference]:
    """One accumulator per stored layer and the final state, named as the report shows them."""
    return {f"layer {k}": LayerDifference() for k in layers} | {"final (post_norm)": LayerDifference()}


def add_sample(differences: dict[str, LayerDifference], layers: list[int], hidden: int, reference: Sample,
               theirs_aux: torch.Tensor, theirs_final: torch.Tensor) -> None:
    """One sample's tokens: each layer's columns of the aux states, then the final state."""
    for j, k in enumerate(layers):
        cols = slice(j * hidden, (j + 1) * hidden)
        differences[f"layer {k}"].add(reference.aux_hidden_states[:, cols], theirs_aux[:, cols])
    differences["final (post_norm)"].add(reference.last_hidden_state, theirs_final)


def run_samples(run_dir: Path) -> Iterator[tuple[str, list[int], Iterator[Sample]]]:
    """Per shard file of a run: its name, its sample ids, and its samples."""
    from storage import ShardReader

    paths = sorted(run_dir.glob("shard-*.parquet"))
    if not paths:
        raise ValueError(f"{run_dir} holds no shard-*.parquet: run its extraction first")
    for path in paths:
        reader = ShardReader(path)
        yield path.name, reader.sample_ids(), iter(reader)


def run_differences(reference_run: Path, other_run: Path) -> dict[str, dict[str, float]]:
    """Per layer (and the final state), the per-token relative difference of ``other_run``'s states from
    ``reference_run``'s, over every sample: the two runs extracted the same data with the same layers (the same
    plan, so the same samples in each shard file); a ValueError says where they part."""
    from storage import ShardReader

    first = next(iter(sorted(reference_run.glob("shard-*.parquet"))), None)
    if first is None:
        raise ValueError(f"{reference_run} holds no shard-*.parquet: run its extraction first")
    meta = ShardReader(first).metadata
    differences = layer_differences(meta.layer_ids)
    references, others = list(run_samples(reference_run)), list(run_samples(other_run))
    if [(name, ids) for name, ids, _ in references] != [(name, ids) for name, ids, _ in others]:
        raise ValueError(f"{reference_run} and {other_run} hold different samples per shard file: compare runs of "
                         "the same data and plan")
    for (_, _, reference_samples), (_, _, other_samples) in zip(references, others):
        for reference, theirs in zip(reference_samples, other_samples):
            if theirs.aux_hidden_states.shape != reference.aux_hidden_states.shape:
                raise ValueError(f"sample {reference.sample_id}: {other_run} stored states of shape "
                                 f"{tuple(theirs.aux_hidden_states.shape)}, {reference_run} "
                                 f"{tuple(reference.aux_hidden_states.shape)}: compare runs of the same layers")
            add_sample(differences, meta.layer_ids, meta.hidden_size, reference, theirs.aux_hidden_states,
                       theirs.last_hidden_state)
    return {name: difference.report() for name, difference in differences.items()}



def main(argv: list[str]) -> int:
    reference, other, out = map(Path, argv)
    out.write_text(json.dumps(run_differences(reference, other), indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
