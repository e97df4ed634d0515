"""The arms: which layers each stores, which run its drafter config comes from and is checked against."""

from __future__ import annotations

from typing import Sequence

LAYERS = (1, 14, 26)
"""Canonical layers (outputs of decoder layers 1, 14, 26 of SmolLM2's 30): SpecForge's and SGLang's defaults."""
ARMS = ("A", "B", "C", "D", "E")
TRAINED_ARMS = ("A", "B", "C", "D")
ARM_STATES = {
    "A": "ours (SGLang, bf16), drafter config as the run wrote it",
    "B": "HF hidden_states[k] (outputs of layers k-1), served with a config claiming k",
    "C": "HF transformers bf16 on the GPU, right layers",
    "D": "ours, fp8 storage (output.state_dtype=float8_e4m3fn)",
    "E": "untrained drafter (the floor)",
}
DRAFT_CONFIG_RUN = {"A": "A", "B": "A", "C": "A", "D": "D", "E": "A"}
"""Whose ``.drafter_config.json`` an arm trains with and claims when served: B claims A's layer ids."""


def arm_b_layers(layers: Sequence[int]) -> list[int]:
    """The canonical layers whose outputs are HF ``hidden_states[k]`` for each k: the states a tool that
    numbers layers by their input captures when asked for layer k."""
    if min(layers) < 1:
        raise ValueError(f"layers {list(layers)}: arm B needs every layer >= 1 (HF hidden_states[0] is the embedding)")
    return [k - 1 for k in layers]


def extract_overrides(arm: str, layers: Sequence[int]) -> list[str]:
    """The ``jobs.extract`` settings of an arm's run (A, B, D; C and E have no run of their own)."""
    ids = {"A": list(layers), "B": arm_b_layers(layers), "D": list(layers)}[arm]
    extra = ["output.state_dtype=float8_e4m3fn"] if arm == "D" else []
    return [f"extract.layers={ids}", "extract.last_hidden_state=post_norm", *extra]


def states_run(arm: str) -> str:
    """The run whose stored layers an arm's served drafter must capture (jobs.check_drafter's output.dir)."""
    return {"A": "A", "B": "B", "C": "A", "D": "D", "E": "A"}[arm]
