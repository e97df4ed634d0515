"""A drafter that starts from the target's own head (``--warm-head``): its ``lm_head`` rows are the target's
(tied) embedding rows of the tokens it drafts, its final norm the target's, the rest SpecForge's own seeded
initialisation; with a smaller draft vocabulary, the map to the target's ids that those rows follow.

A drafter's head maps its last hidden state to tokens, as the target's head maps the target's final state; starting
from the target's makes the drafter's output space the target's from the first step, where SpecForge starts it at
random. SpecForge loads the state as a weights-only warm start (``model.draft_checkpoint_path``) and the map as
``model.vocab_mapping_path`` (so that the rows and the map agree: SpecForge would otherwise derive its own map).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Optional

from benchmarks.acceptance.files import save_torch
from benchmarks.acceptance.trainer import initial_draft_state, save_draft_state, specforge_pythonpath

if TYPE_CHECKING:
    import torch

EMBEDDING, FINAL_NORM = "model.embed_tokens.weight", "model.norm.weight"
"""The Llama target's tensors the drafter's head starts from (SmolLM2 ties its lm_head to the embedding)."""


def target_tensor(target: Path, name: str) -> torch.Tensor:
    """One tensor of a safetensors checkpoint, through its index when it has one."""
    from safetensors import safe_open

    index = target / "model.safetensors.index.json"
    file = json.loads(index.read_text())["weight_map"][name] if index.is_file() else "model.safetensors"
    with safe_open(str(target / file), "pt") as weights:
        return weights.get_tensor(name)


def write_vocab_mapping(features: Path, draft_vocab: int, vocab_size: int, max_length: int, out: Path) -> Path:
    """The draft vocabulary's map to the target's ids: the ``draft_vocab`` tokens most frequent under the loss mask
    of SpecForge's feature files (each cut at ``max_length``, as training cuts them), counted and mapped by
    SpecForge's own functions (``{"d2t", "t2d"}``, as its ``vocab_mapping_path`` reads it)."""
    if (path := specforge_pythonpath()) not in sys.path:
        sys.path.insert(0, path)
    from specforge.data.preprocessing import process_token_dict_to_mappings
    from specforge.training.vocab_mapping import count_effective_feature_tokens

    counts = count_effective_feature_tokens(str(features), max_length=max_length, target_vocab_size=vocab_size)
    d2t, t2d = process_token_dict_to_mappings(counts, draft_vocab, vocab_size)
    save_torch({"d2t": d2t, "t2d": t2d}, out)
    return out


def write_warm_start(draft_config: Path, target: Path, seed: int, out: Path,
                     vocab_mapping: Optional[Path] = None) -> Path:
    """A weights-only SpecForge checkpoint directory (``training_state.pt``) whose head is the target's."""
    import torch

    state = initial_draft_state(draft_config, seed, vocab_mapping)
    drafted = state["d2t"] + torch.arange(len(state["d2t"]))  # target ids of the draft tokens (all, full vocab)
    head, norm = state["lm_head.weight"], state["norm.weight"]
    state["lm_head.weight"] = target_tensor(target, EMBEDDING)[drafted].to(head.dtype)
    state["norm.weight"] = target_tensor(target, FINAL_NORM).to(norm.dtype)
    if state["lm_head.weight"].shape != head.shape or state["norm.weight"].shape != norm.shape:
        raise ValueError(f"the target {target}'s embedding or final norm does not fit {draft_config}'s drafter")
    save_draft_state(state, out)
    return out
