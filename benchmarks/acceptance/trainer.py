"""Training: SpecForge 0.2.0's own trainer, its run.yaml, where it is imported from, its console metrics,
and arm E's untrained checkpoint."""

from __future__ import annotations

import ast
import dataclasses
import fcntl
import importlib.util
import json
import os
import re
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path
from typing import Any, Optional

from benchmarks.acceptance.files import save_torch, write_json

SPECFORGE = "specforge==0.2.0"
SPECFORGE_CACHE = Path("~/.cache/eagle3-extract/specforge-0.2.0")


@dataclasses.dataclass(frozen=True)
class Recipe:
    """What every arm trains with (SpecForge ``training.*``)."""

    epochs: int = 3
    batch_size: int = 4
    learning_rate: float = 5e-4
    """3 epochs at 5e-4 trained A to acc ~0.57 and acceptance 1.48 on 3,000 prompts (H200, 2026-12-02); 1 epoch at
    1e-4 left it at acc 0.18 and 1.28."""
    seed: int = 0
    ttt_length: int = 7
    """Draft steps each training step unrolls (SpecForge's test-time training); serving drafts 3."""
    draft_vocab: int = 0
    """The drafter's own vocabulary (``draft_vocab_size``): SpecForge keeps the tokens most frequent in the
    features' loss mask and maps them (``d2t``/``t2d``, exported with the drafter; SGLang serves them as its hot
    tokens); 0: the target's whole vocabulary, as the run's drafter config says."""
    warm_head: bool = False
    """Start the drafter's head from the target's (``benchmarks.acceptance.warm_start``); False: SpecForge's own
    random initialisation."""
    max_length: int = 2048
    log_interval: int = 10
    max_steps: int = 0
    """A cap on optimizer steps (SpecForge ``training.max_steps``), the same for every arm; 0: none (the epochs)."""
    save_interval: int = 0
    """Keep a checkpoint every this many steps (``training.save_interval``; the end of each epoch, to serve the
    drafter as it was then); 0: only the last."""


def specforge_run_config(arm: str, features: Path, target: Path, draft_config: Path, output_dir: Path,
                         recipe: Recipe, warm_start: Optional[Path] = None,
                         vocab_mapping: Optional[Path] = None) -> dict[str, Any]:
    """SpecForge 0.2.0's ``run.yaml`` for one arm, offline from ``features``.

    Its target-head loader reads the lm_head through the target's one ``*.index.json`` and ignores tied
    embeddings: SmolLM2's head is ``model.embed_tokens.weight``. Without ``vocab_mapping``: with the
    full vocabulary (``draft_vocab_size`` = ``vocab_size``, the run's drafter config) no mapping is derived; with a
    smaller one (``Recipe.draft_vocab``) SpecForge derives it from the features' loss-masked tokens. sdpa
    attention: the default flex_attention compiles. ``warm_start``: a weights-only checkpoint the drafter starts
    from; ``vocab_mapping``: the draft vocabulary's map, given rather than derived."""
    return {
        "run_id": f"arm-{arm}",
        "output_dir": str(output_dir),
        "model": {"target_model_path": str(target), "draft_model_config": str(draft_config),
                  "embedding_key": "model.embed_tokens.weight", "lm_head_key": "model.embed_tokens.weight",
                  "vocab_mapping_path": str(vocab_mapping or ""), "torch_dtype": "bfloat16",
                  **({"draft_checkpoint_path": str(warm_start)} if warm_start else {})},
        "data": {"hidden_states_path": str(features), "max_length": recipe.max_length,
                 "cache_dir": str(output_dir / "cache"), "dataloader_num_workers": 2},
        "training": {"strategy": "eagle3", "ttt_length": recipe.ttt_length, "attention_backend": "sdpa",
                     "num_epochs": recipe.epochs, "batch_size": recipe.batch_size,
                     "learning_rate": recipe.learning_rate, "seed": recipe.seed,
                     "log_interval": recipe.log_interval, "save_interval": recipe.save_interval,
                     **({"max_steps": recipe.max_steps} if recipe.max_steps else {})},
        "tracking": {"report_to": "none"},
        "deployment": {"mode": "local_colocated", "trainer": {"nnodes": 1, "nproc_per_node": 1}},
    }


def training_draft_config(draft_config: Path, draft_vocab: int, out_dir: Path) -> Path:
    """The drafter config an arm trains and exports with: the run's own (``draft_config``), or a copy of it in
    ``out_dir`` with a smaller draft vocabulary (``Recipe.draft_vocab``; 0: the run's own)."""
    if not draft_vocab:
        return draft_config
    config = json.loads(draft_config.read_text())
    if not 0 < draft_vocab <= config["vocab_size"]:
        raise ValueError(f"--draft-vocab {draft_vocab}: the target's vocabulary has {config['vocab_size']} "
                         "tokens; give at most that many, or 0 for all of them")
    out = out_dir / f"{draft_config.parent.name}-draft-vocab-{draft_vocab}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    write_json({**config, "draft_vocab_size": draft_vocab}, out)
    return out


def specforge_pythonpath() -> str:
    """The directory SpecForge 0.2.0 imports from: where it is installed (the CPU lock installs it with
    --no-deps; on a GPU node, the offline install's ``acceptance`` lock), else a cache holding its wheel
    unpacked, made once (``pip download --no-deps``; the wheel is pure Python). Never with its dependencies:
    its metadata pins sglang 0.5.14, torch 2.11.0 and transformers 5.8.1, which must not replace ours (its
    training path needs none of them)."""
    if (spec := importlib.util.find_spec("specforge")) is not None and spec.origin:
        return str(Path(spec.origin).parent.parent)
    site = SPECFORGE_CACHE.expanduser()
    site.parent.mkdir(parents=True, exist_ok=True)
    with open(site.parent / f".{site.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # several test processes may ask at once: one downloads
        if not (site / "specforge" / "cli.py").is_file():
            _unpack_specforge(site)
    return str(site)


def _unpack_specforge(site: Path) -> None:
    with tempfile.TemporaryDirectory(dir=site.parent) as temp:
        command = [sys.executable, "-m", "pip", "download", "-q", "--disable-pip-version-check", "--no-deps",
                   SPECFORGE, "-d", temp]
        result = subprocess.run(command, capture_output=True, text=True, timeout=300)
        wheels = sorted(Path(temp).glob("specforge-0.2.0-*.whl"))
        if result.returncode != 0 or not wheels:
            raise RuntimeError(f"`{' '.join(command)}` failed: {result.stderr.strip()[-1000:]}; on a machine "
                               "without the package registry, install it from a wheelhouse built where the "
                               "registry is reachable (scripts/wheelhouse.sh --extra acceptance, docs/install.md)")
        with zipfile.ZipFile(wheels[0]) as wheel:
            wheel.extractall(Path(temp) / "site")
        os.replace(Path(temp) / "site", site)  # the cache appears whole or not at all


def specforge_env(extra: Optional[dict[str, str]] = None) -> dict[str, str]:
    """The environment SpecForge's commands run in: its import path before the project's."""
    env = dict(os.environ, **(extra or {}))
    paths = [p for p in (specforge_pythonpath(), env.get("PYTHONPATH")) if p]
    env["PYTHONPATH"] = os.pathsep.join(paths)
    return env


def specforge_command(*args: str) -> list[str]:
    return [sys.executable, "-m", "specforge.cli", *args]


STEP_LINE = re.compile(r"^step (\d+): (\{.*\})$", re.MULTILINE)


def last_train_metrics(log: str) -> dict[str, Any]:
    """The last ``step N: {...}`` line SpecForge's console logger printed: step, loss, acc, per-position acc."""
    matches = STEP_LINE.findall(log)
    if not matches:
        return {}
    step, values = matches[-1]
    return {"step": int(step), **ast.literal_eval(values)}


def train_curve(log: str, steps_per_epoch: int) -> list[dict[str, Any]]:
    """Per epoch, from SpecForge's console lines (every ``log_interval`` steps): the mean and the last logged
    loss, accuracy over the TTT positions and first-position accuracy (``acc_0``: what a first draft token
    hits). A curve still rising at the last epoch says more training would help, without serving."""
    logged = [(int(step), ast.literal_eval(values)) for step, values in STEP_LINE.findall(log)]
    epochs: dict[int, list[tuple[int, dict[str, Any]]]] = {}
    for step, values in logged:
        epochs.setdefault((step - 1) // steps_per_epoch + 1 if steps_per_epoch > 0 else 1, []).append((step, values))
    curve = []
    for epoch, points in sorted(epochs.items()):
        entry: dict[str, Any] = {"epoch": epoch, "steps": [points[0][0], points[-1][0]]}
        for key in ("loss", "acc", "acc_0"):
            values = [float(v[key]) for _, v in points if key in v]
            if values:
                entry[f"mean_{key}"], entry[key] = sum(values) / len(values), values[-1]
        curve.append(entry)
    return curve


def initial_draft_state(draft_config: Path, seed: int, vocab_mapping: Optional[Path] = None) -> dict[str, Any]:
    """SpecForge's own initialisation of the draft model (seeded), without the embedding (the trainer leaves it
    out of every checkpoint), with a draft vocabulary map (``d2t``/``t2d``) when given."""
    import torch

    if (path := specforge_pythonpath()) not in sys.path:
        sys.path.insert(0, path)
    from specforge.modeling.auto import AutoDraftModel, AutoDraftModelConfig

    torch.manual_seed(seed)
    model = AutoDraftModel.from_config(AutoDraftModelConfig.from_file(str(draft_config)), torch_dtype=torch.bfloat16)
    if vocab_mapping is not None:
        model.load_vocab_mapping(str(vocab_mapping))
    return {name: tensor for name, tensor in model.state_dict().items() if "embed" not in name.lower()}


def save_draft_state(state: dict[str, Any], out: Path) -> Path:
    """A draft model's weights as the training state SpecForge's exporter and weights-only warm start read
    (``out/training_state.pt``, before any step); returns that file."""
    save_torch({"strategy": "eagle3", "draft_state_dict": state, "global_step": 0}, out / "training_state.pt")
    return out / "training_state.pt"


def write_untrained_checkpoint(draft_config: Path, out: Path, seed: int) -> Path:
    """Arm E: the draft model as SpecForge initialises it: what a trained checkpoint holds, before any step."""
    return save_draft_state(initial_draft_state(draft_config, seed), out)
