"""The arms: which run each one's states come from, what it trains on, which drafter it serves and on which
target; which runs, trainings and drafters a selection of arms needs."""

from __future__ import annotations

import dataclasses
from typing import Optional, Sequence

LAYERS = (1, 14, 26)
"""Canonical layers (outputs of decoder layers 1, 14, 26 of SmolLM2's 30): SpecForge's and SGLang's defaults."""


@dataclasses.dataclass(frozen=True)
class Arm:
    name: str
    states: str
    """What its drafter trained on, for the table."""
    run: str
    """The run whose stored layers its served drafter must capture (jobs.check_drafter's output.dir)."""
    draft_config_run: str
    """Whose ``.drafter_config.json`` its drafter trains with and claims when served (B claims A's ids)."""
    features: Optional[str]
    """The SpecForge features it trains on (``DIR/features/NAME``); None: it trains nothing of its own."""
    drafter_of: str
    """Whose trained drafter it serves: itself, or another arm's (Q-bf16 serves A's)."""
    target: str = "bf16"
    """The target it is served on: the bf16 checkpoint, or a quantized one (``QUANTIZED``)."""

    @property
    def quantized(self) -> bool:
        return self.target != "bf16"


ARMS: dict[str, Arm] = {arm.name: arm for arm in (
    Arm("A", "ours (SGLang, bf16), drafter config as the run wrote it", "A", "A", "A", "A"),
    Arm("B", "HF hidden_states[k] (outputs of layers k-1), served with a config claiming k", "B", "A", "B", "B"),
    Arm("C", "HF transformers bf16 on the GPU, right layers", "A", "A", "C", "C"),
    Arm("D", "ours, fp8 storage (output.state_dtype=float8_e4m3fn)", "D", "D", "D", "D"),
    Arm("E", "untrained drafter (the floor)", "A", "A", None, "E"),
    Arm("Q", "ours, extracted with the quantized server's settings (model.serving)", "Q", "Q", "Q", "Q",
        target="fp8"),
    Arm("Q-bf16", "A's drafter (our bf16 states: any bf16 path), served on the quantized target", "A", "A", None, "A",
        target="fp8"),
    Arm("Q4", "ours, extracted on the INT4 checkpoint with its server's settings (model.serving)", "Q4", "Q4", "Q4",
        "Q4", target="int4"),
    Arm("Q4-bf16", "A's drafter (our bf16 states), served on the INT4 target", "A", "A", None, "A", target="int4"),
)}
QUANTIZED = {"fp8": "Q", "int4": "Q4"}
"""Each quantized target and its own run (extracted as its server serves it): fp8, the bf16 checkpoint served with
``--quantization fp8``; int4, the INT4 checkpoint (``benchmarks.acceptance.quantize_int4``) served with SGLang's
compressed-tensors W4A16 path."""
UNTRAINED = "E"
"""The arm whose drafter is SpecForge's own initialisation, never trained."""
RUNS = ("Q", "Q4", "A", "B", "D")
"""The extraction runs, in the order they run: the quantized path first, so that a failure of it shows before the
rest of the device time is spent."""
MAIN_DIFFERENCES = (("A", "B"), ("Q", "Q-bf16"), ("Q4", "Q4-bf16"))
"""What the benchmark is for: the layer offset, and what serve-exact states buy on a quantized target."""
OTHER_DIFFERENCES = (("A", "C"), ("A", "D"), ("A", "E"), ("A", "Q"), ("A", "Q4"))


def parse_arms(text: str) -> tuple[str, ...]:
    """``A,Q,Q-bf16`` (or ``all``) -> the arms in the table's order; ValueError names an unknown one."""
    if text.strip() == "all":
        return tuple(ARMS)
    names = [name.strip() for name in text.split(",") if name.strip()]
    unknown = [name for name in names if name not in ARMS]
    if unknown or not names:
        raise ValueError(f"--arms {text!r}: unknown arms {unknown}; choose among {', '.join(ARMS)} (or all)")
    return tuple(name for name in ARMS if name in names)


def drafters_needed(arms: Sequence[str]) -> tuple[str, ...]:
    """The arms whose drafters are made (trained, or E's initialisation): those the selected arms serve."""
    wanted = {ARMS[arm].drafter_of for arm in arms}
    return tuple(name for name in ARMS if name in wanted)


def trained(arms: Sequence[str]) -> tuple[str, ...]:
    """The arms trained for a selection: Q-bf16 needs A's drafter, so A trains even when not served."""
    return tuple(name for name in drafters_needed(arms) if ARMS[name].features is not None)


def runs_needed(arms: Sequence[str]) -> tuple[str, ...]:
    """The extraction runs a selection needs, in ``RUNS`` order: the runs its drafters train on and are checked
    against, whose drafter configs they use, and for an arm served on a quantized target that target's run (the
    states of Q-bf16 and Q4-bf16 are compared with it)."""
    wanted = set()
    for name in (*arms, *drafters_needed(arms)):
        arm = ARMS[name]
        wanted |= {arm.run, arm.draft_config_run}
        if arm.features is not None and arm.features != "C":
            wanted.add(arm.features)
        if arm.quantized:
            wanted.add(QUANTIZED[arm.target])
    return tuple(run for run in RUNS if run in wanted)


def quantized_runs(arms: Sequence[str], target: str = "fp8") -> tuple[str, ...]:
    """A quantized target's run and those whose states feed a drafter served on that target:
    ``jobs.check_serving`` compares the target's serving command with each (its own run passes; a bf16 run names
    what differs)."""
    served = {ARMS[arm].run for arm in arms if ARMS[arm].target == target}
    return tuple(run for run in RUNS if run in served | ({QUANTIZED[target]} if served else set()))


def quantized_targets(arms: Sequence[str]) -> tuple[str, ...]:
    """The quantized targets a selection serves on, in ``QUANTIZED`` order."""
    return tuple(target for target in QUANTIZED if any(ARMS[arm].target == target for arm in arms))


def arm_b_layers(layers: Sequence[int]) -> list[int]:
    """The canonical layers whose outputs are HF ``hidden_states[k]`` for each k: the states a tool that
    numbers layers by their input captures when asked for layer k."""
    if min(layers) < 1:
        raise ValueError(f"layers {list(layers)}: arm B needs every layer >= 1 (HF hidden_states[0] is the embedding)")
    return [k - 1 for k in layers]


def extract_overrides(run: str, layers: Sequence[int]) -> list[str]:
    """The ``jobs.extract`` settings of a run beyond its model, data and serving settings."""
    ids = arm_b_layers(layers) if run == "B" else list(layers)
    extra = ["output.state_dtype=float8_e4m3fn"] if run == "D" else []
    return [f"extract.layers={ids}", "extract.last_hidden_state=post_norm", *extra]
