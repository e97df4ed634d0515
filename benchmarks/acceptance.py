"""Does the engine match matter? Train EAGLE-3 drafters on SmolLM2-135M-Instruct's states, serve them with
SGLang, measure acceptance length (issue 21).

    python -m benchmarks.acceptance --work DIR [--out results.json] [--stages all] [--gguf FILE] ...
    bash benchmarks/gpu.sh acceptance --work /root/acceptance ...      # on a lent H200 (see below)

Every step is a project command or a peer's released tool, run as a subprocess (but for arm C's HF forward
and arm E's initialisation, made here with transformers and SpecForge's own draft model class):

1. prompts: a few thousand varied single-turn prompts composed here (no data set download) and a disjoint
   held-out set of at least 200 for evaluation;
2. data: ``python -m jobs.prepare`` with regeneration (issue 20): the target answers the prompts itself
   through SGLang, greedy, with its chat template and an assistant-only loss mask;
3. states, one ``python -m jobs.extract`` per arm (canonical layers [1, 14, 26], post-norm final state),
   then ``python -m jobs.export to=specforge``;
4. training: SpecForge 0.2.0's own trainer (``specforge train -c run.yaml``, offline), the same recipe,
   seed and steps for every arm;
5. serving: ``specforge export --to sglang``, then SGLang's EAGLE3 (3 steps, top-k 1, 4 draft tokens,
   temperature 0, flashinfer, no CUDA graphs) over the held-out prompts; acceptance length
   = 1 + sum(spec_num_correct_drafts) / sum(spec_verify_ct), with a bootstrap 95% interval over prompts;
6. ``python -m jobs.check_drafter`` on every arm's served config against the run its states came from.

The arms (same prompts, answers, recipe):
  A  our states; the drafter config as the run wrote it.
  B  the off-by-one bug: states of HF ``hidden_states[k]`` (the input of layer k, as other engines number
     layers), served with a config claiming k. Taken from our own extraction of layers k-1, whose outputs
     are exactly HF ``hidden_states[k]`` (tests/test_real_weights.py), so only the layer numbering differs
     from A.
  C  HF-path states: HF transformers in bf16 on the GPU, right layers (the "other kernels" half of the
     story); with C's relative difference from A per layer.
  D  ours with fp8 states (``output.state_dtype=float8_e4m3fn``), dequantized to bf16 by the export.
  E  an untrained drafter (SpecForge's own initialisation, seeded, exported the same way): the floor.

Results: ``--out`` (JSON) and ``results.md`` beside it (a table for benchmarks/RESULTS.md). Each step
leaves a record under ``DIR/steps/``; a rerun skips the steps recorded there, so the pipeline goes
on across device calls (``--stages`` names which to run, ``--deadline-s`` stops before starting a step
past that time; exit code 75 then means "rerun the same command to go on").

On a lent H200 (10 minutes a call, 30 of device time a session; the machine stays warm only briefly
between calls, so make them back to back): stage SGLang 0.5.17 and Ray (``../shared/gpu/prepare-carry.sh``,
its calls ``bash .gpuN/stage.sh``), then this benchmark's pieces (``bash benchmarks/acceptance_carry.sh
prepare`` here, its three calls ``bash benchmarks/acceptance_carry.sh stage .gpu-accN``: SmolLM2's GGUF,
SpecForge and its deps, the shared flashinfer/triton JIT cache), then, with the same arguments each time
(``ARGS = --work /root/acceptance --gguf /root/acccache/SmolLM2-135M-Instruct.Q4_1.gguf``):

    bash benchmarks/gpu.sh acceptance ARGS --stages checkpoint,prompts,prepare,extract,features --deadline-s 420
    bash benchmarks/gpu.sh acceptance ARGS --stages extract,features,train --deadline-s 240
    bash benchmarks/gpu.sh acceptance ARGS --stages drafters,serve,report --deadline-s 420
    bash benchmarks/gpu.sh acceptance ARGS --stages drafters,serve,report; bash benchmarks/acceptance_carry.sh save-cache

(a call that stops at its deadline exits 75; the next one goes on from the records). The work directory
needs about 35 GB of disk at the default 4,000 prompts (three runs and four exports of ~1M tokens).
Measured on the H200 (2026-12-02, 3,000 prompts, benchmarks/RESULTS.md): staging 7 calls ~2.5 min with the
machine's start; regeneration ~205 s; checkpoint to features ~5.5 min; the four trainings at once 2 min
for 750 steps (0.10 s a step); drafters and checks ~3 min; serving ~105 s per batch of engines.
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import dataclasses
import fcntl
import hashlib
import importlib.metadata
import importlib.util
import json
import logging
import multiprocessing
import os
import random
import re
import socket
import subprocess
import sys
import tempfile
import time
import zipfile
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterable, Optional, Sequence

import numpy as np

from testbeds.smollm2 import build_checkpoint

if TYPE_CHECKING:
    import torch

logger = logging.getLogger("benchmarks.acceptance")

LAYERS = (1, 14, 26)
"""Canonical layers (outputs of decoder layers 1, 14, 26 of SmolLM2's 30): SpecForge's and SGLang's defaults."""
SPEC_STEPS, SPEC_TOPK, SPEC_DRAFT_TOKENS = 3, 1, 4
SPECFORGE = "specforge==0.2.0"
SPECFORGE_CACHE = Path("~/.cache/eagle3-extract/specforge-0.2.0")
ARMS = ("A", "B", "C", "D", "E")
TRAINED_ARMS = ("A", "B", "C", "D")
ARM_STATES = {
    "A": "ours (SGLang, bf16), drafter config as the run wrote it",
    "B": "HF hidden_states[k] (outputs of layers k-1), served with a config claiming k",
    "C": "HF transformers bf16 on the GPU, right layers",
    "D": "ours, fp8 storage (output.state_dtype=float8_e4m3fn)",
    "E": "untrained drafter (the floor)",
}
EXIT_MORE_TO_DO = 75
"""--deadline-s stopped before a step: rerun the same command to go on."""
BOOTSTRAP_RESAMPLES = 10_000
SERVE_MEMORY = 0.75
"""Fraction of the GPU's memory the serving engines take together (SGLang's mem_fraction_static, shared)."""
SERVE_PARALLEL = 2
"""Serving engines at once by default: on the H200 (2026-12-02) five at 0.15 each failed (the engines started
last found less than SGLang's minimum viable fraction, 0.156-0.164, left); two at 0.375 each served fine."""


# -- 1. prompts -----------------------------------------------------------------------------------

TOPICS = (
    "photosynthesis", "the water cycle", "black holes", "the French Revolution", "machine learning",
    "compound interest", "volcanoes", "the immune system", "climate change", "the Roman Empire",
    "plate tectonics", "vaccines", "the internet", "democracy", "jazz music", "chess openings", "honeybees",
    "the moon landing", "renewable energy", "sleep", "coffee", "the stock market", "recycling",
    "earthquakes", "DNA", "electric cars", "the Great Wall of China", "rainbows", "gravity", "inflation",
    "meditation", "the printing press", "coral reefs", "time zones", "blockchains", "the human heart",
    "glaciers", "bread baking", "solar panels", "the Olympic Games", "octopuses", "the Renaissance",
    "antibiotics", "cloud computing", "penguins", "marathon training", "origami", "the periodic table",
    "hurricanes", "public libraries", "quantum computing", "the Silk Road", "composting", "dinosaurs",
    "wind turbines", "the speed of light", "volunteering", "board games", "budget travel", "rivers",
)
AUDIENCES = ("a five-year-old", "a high school student", "a busy manager", "a software engineer",
             "a retired teacher", "someone learning English")
FORMS = ("poem", "haiku", "short story", "limerick", "product description", "news headline", "dialogue",
         "riddle")
LANGUAGES = ("French", "Spanish", "German", "Italian", "Portuguese", "Dutch")
SENTENCES = (
    "The meeting has been moved to Thursday afternoon.", "I would like a table for two, please.",
    "The train was late because of the snow.", "She finished the report before lunch.",
    "Our team won the match last night.", "Please remember to water the plants.",
    "The museum opens at nine in the morning.", "He forgot his umbrella at the office.",
)
CODE_TASKS = (
    "reverses a string", "checks whether a number is prime", "counts the vowels in a sentence",
    "returns the n-th Fibonacci number", "merges two sorted lists", "removes duplicates from a list",
    "converts Celsius to Fahrenheit", "finds the largest word in a sentence", "computes a factorial",
    "checks whether a string is a palindrome", "flattens a nested list", "sums the digits of an integer",
)
ITEMS = ("apples", "notebooks", "pencils", "tickets", "loaves of bread", "bicycles", "lamps", "mugs")
UNITS = (("kilometers", "miles"), ("pounds", "kilograms"), ("liters", "gallons"), ("hours", "minutes"),
         ("inches", "centimeters"))
TEMPLATES: tuple[Callable[[random.Random], str], ...] = (
    lambda r: f"Explain {r.choice(TOPICS)} to {r.choice(AUDIENCES)}.",
    lambda r: f"Write a {r.choice(FORMS)} about {r.choice(TOPICS)}.",
    lambda r: f"List {r.randint(3, 7)} interesting facts about {r.choice(TOPICS)}.",
    lambda r: f"What are the main advantages and disadvantages of {r.choice(TOPICS)}?",
    lambda r: f"Give me a short quiz with {r.randint(2, 5)} questions about {r.choice(TOPICS)}.",
    lambda r: f"Summarize what is known about {r.choice(TOPICS)} in {r.randint(2, 6)} sentences.",
    lambda r: f"How would you teach {r.choice(TOPICS)} to {r.choice(AUDIENCES)}?",
    lambda r: f"Write an email to {r.choice(AUDIENCES)} inviting them to a talk about {r.choice(TOPICS)}.",
    lambda r: "Compare {} and {}.".format(*r.sample(TOPICS, 2)),
    lambda r: f"What is a common misconception about {r.choice(TOPICS)}?",
    lambda r: f"Describe {r.choice(TOPICS)} using an analogy for {r.choice(AUDIENCES)}.",
    lambda r: "Write a {} that mentions both {} and {}.".format(r.choice(FORMS), *r.sample(TOPICS, 2)),
    lambda r: f"What is {r.randint(12, 999)} {r.choice('+-*')} {r.randint(2, 99)}? Show your work.",
    lambda r: f"A shop sells {r.choice(ITEMS)} for ${r.randint(2, 60)} each. How much do {r.randint(3, 40)} cost?",
    lambda r: "Convert {} {} to {}.".format(r.randint(2, 500), *r.choice(UNITS)),
    lambda r: f"Write a Python function that {r.choice(CODE_TASKS)}.",
    lambda r: f"Translate into {r.choice(LANGUAGES)}: '{r.choice(SENTENCES)}'",
    lambda r: f"Rewrite this sentence to sound more formal: '{r.choice(SENTENCES)}'",
    lambda r: f"Write a {r.choice(FORMS)} for {r.choice(AUDIENCES)} that starts with '{r.choice(SENTENCES)}'",
    lambda r: f"Give {r.randint(3, 6)} tips for {r.choice(AUDIENCES)} who wants to learn about {r.choice(TOPICS)}.",
)


def compose_prompts(count: int, seed: int) -> list[str]:
    """``count`` distinct prompts, each a template filled by a seeded RNG; the same list for the same seed."""
    rng = random.Random(seed)
    prompts: dict[str, None] = {}
    attempts = 0
    while len(prompts) < count:
        attempts += 1
        if attempts > 50 * count:
            raise ValueError(f"only {len(prompts)} distinct prompts after {attempts} draws; ask for fewer than {count}")
        prompts.setdefault(TEMPLATES[attempts % len(TEMPLATES)](rng))  # every template in turn: varied tasks
    return list(prompts)


def split_prompts(train: int, held_out: int, seed: int) -> tuple[list[str], list[str]]:
    """A training set and a held-out set of distinct prompts (no prompt in both), shuffled with ``seed``."""
    if held_out < 200:
        raise ValueError(f"held_out={held_out}: evaluate on at least 200 prompts for a usable interval")
    prompts = compose_prompts(train + held_out, seed)
    random.Random(seed + 1).shuffle(prompts)
    return prompts[held_out:], prompts[:held_out]


def write_conversations(prompts: Sequence[str], path: Path) -> None:
    """OpenAI-style conversations, one user turn each (the answers come from the target: regeneration)."""
    with open(path, "w") as handle:
        for prompt in prompts:
            handle.write(json.dumps({"messages": [{"role": "user", "content": prompt}]}) + "\n")


# -- 2. data: jobs.prepare (issue 20) -------------------------------------------------------------

def prepare_command(model: Path, conversations: Path, out: Path, max_new_tokens: int) -> list[str]:
    """The one call of ``jobs.prepare`` with regeneration: the target answers every user turn itself,
    greedy, and the chat template and the assistant-only loss mask are applied to its answers. No decode
    CUDA graphs: as for the serving step, their capture is one more thing that can fail on the lent stack,
    and this step's speed is not what is measured. ``data.on_invalid=skip``: an answer that cannot be trained
    on (on the H200 a greedy answer held the literal text ``<|im_end|>``; 2 of 3,000 rows were left out) is left out and listed in
    ``_skipped_rows.jsonl`` instead of stopping the run."""
    return [sys.executable, "-m", "jobs.prepare", f"model.path={model}", f"data.path={conversations}",
            f"output.path={out}", "regenerate=true", "generation.temperature=0",
            f"generation.max_new_tokens={max_new_tokens}", "model.cuda_graph=false", "data.on_invalid=skip"]


def prepared_data(out: Path) -> str:
    """What ``jobs.extract`` reads (its ``data.path``) from ``prepare_command``'s output: the Parquet files
    at its top (``part-NNNNN.parquet``; its side record ``_prepare.json`` and the ``_regenerated/`` answers
    are not data)."""
    return str(out / "*.parquet") if out.is_dir() else str(out)


# -- 3. states ------------------------------------------------------------------------------------

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


@dataclasses.dataclass
class LayerDifference:
    """Per-token ||C - A|| / ||A|| of one layer, over every token of the run."""

    tokens: int = 0
    total: float = 0.0
    largest: float = 0.0

    def add(self, ours: torch.Tensor, theirs: torch.Tensor) -> None:
        ours, theirs = ours.float(), theirs.float()
        relative = (theirs - ours).norm(dim=-1) / ours.norm(dim=-1).clamp_min(1e-12)
        self.tokens += relative.numel()
        self.total += relative.sum().item()
        self.largest = max(self.largest, relative.max().item())

    def report(self) -> dict[str, float]:
        return {"mean": self.total / max(self.tokens, 1), "max": self.largest, "tokens": self.tokens}


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
    differences = {f"layer {k}": LayerDifference() for k in layers} | {"final (post_norm)": LayerDifference()}
    try:
        for sample in (sample for reader in readers for sample in reader):
            with torch.no_grad():
                out = model(sample.input_ids[None].to(device), output_hidden_states=True)
            aux = torch.cat([out.hidden_states[k + 1][0] for k in layers], dim=-1).cpu()
            final = kept["post_norm"].cpu()
            for j, k in enumerate(layers):
                cols = slice(j * hidden, (j + 1) * hidden)
                differences[f"layer {k}"].add(sample.aux_hidden_states[:, cols], aux[:, cols])
            differences["final (post_norm)"].add(sample.last_hidden_state, final)
            theirs = Sample(sample.sample_id, sample.input_ids, sample.loss_mask, aux, final)
            _save_atomically(specforge_file(theirs), dest / specforge_path(sample.sample_id))
    finally:
        hook.remove()
    return {name: difference.report() for name, difference in differences.items()}


def _save_atomically(record: dict, path: Path) -> None:
    import torch

    path.parent.mkdir(parents=True, exist_ok=True)
    temp = path.with_name(f".{path.name}.tmp")
    torch.save(record, temp)
    os.replace(temp, path)


# -- 4. training: SpecForge 0.2.0 ------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Recipe:
    """What every arm trains with (SpecForge ``training.*``)."""

    epochs: int = 2
    batch_size: int = 4
    learning_rate: float = 1e-4
    seed: int = 0
    ttt_length: int = 7
    max_length: int = 2048
    log_interval: int = 10
    max_steps: int = 0
    """A cap on optimizer steps (SpecForge ``training.max_steps``), the same for every arm; 0: none (the epochs)."""


def specforge_run_config(arm: str, features: Path, target: Path, draft_config: Path, output_dir: Path,
                         recipe: Recipe) -> dict[str, Any]:
    """SpecForge 0.2.0's ``run.yaml`` for one arm, offline from ``features``.

    Its target-head loader reads the lm_head through the target's one ``*.index.json`` and ignores tied
    embeddings: SmolLM2's head is ``model.embed_tokens.weight``. ``vocab_mapping_path`` empty: the draft
    keeps the full vocabulary (``draft_vocab_size`` = ``vocab_size``), so no mapping is derived. sdpa
    attention: the default flex_attention compiles."""
    return {
        "run_id": f"arm-{arm}",
        "output_dir": str(output_dir),
        "model": {"target_model_path": str(target), "draft_model_config": str(draft_config),
                  "embedding_key": "model.embed_tokens.weight", "lm_head_key": "model.embed_tokens.weight",
                  "vocab_mapping_path": "", "torch_dtype": "bfloat16"},
        "data": {"hidden_states_path": str(features), "max_length": recipe.max_length,
                 "cache_dir": str(output_dir / "cache"), "dataloader_num_workers": 2},
        "training": {"strategy": "eagle3", "ttt_length": recipe.ttt_length, "attention_backend": "sdpa",
                     "num_epochs": recipe.epochs, "batch_size": recipe.batch_size,
                     "learning_rate": recipe.learning_rate, "seed": recipe.seed,
                     "log_interval": recipe.log_interval, "save_interval": 0,
                     **({"max_steps": recipe.max_steps} if recipe.max_steps else {})},
        "tracking": {"report_to": "none"},
        "deployment": {"mode": "local_colocated", "trainer": {"nnodes": 1, "nproc_per_node": 1}},
    }


def specforge_pythonpath() -> str:
    """The directory SpecForge 0.2.0 imports from: where it is installed (the CPU lock installs it with
    --no-deps; the GPU machine's staged site), else a cache holding its wheel unpacked, made once (``pip
    download --no-deps``; the wheel is pure Python). Never with its dependencies: its metadata pins sglang
    0.5.14, torch 2.11.0 and transformers 5.8.1, which must not replace ours (its training path needs none of them)."""
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
                               "without the package registry, stage SpecForge (benchmarks/acceptance_carry.sh)")
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


def write_untrained_checkpoint(draft_config: Path, out: Path, seed: int) -> Path:
    """Arm E: SpecForge's own initialisation of the draft model (seeded), as the training state its exporter
    reads: what a trained checkpoint holds, before any step (embeddings left out, as the trainer leaves
    them out)."""
    import torch

    if (path := specforge_pythonpath()) not in sys.path:
        sys.path.insert(0, path)
    from specforge.modeling.auto import AutoDraftModel, AutoDraftModelConfig

    torch.manual_seed(seed)
    model = AutoDraftModel.from_config(AutoDraftModelConfig.from_file(str(draft_config)), torch_dtype=torch.bfloat16)
    state = {name: tensor for name, tensor in model.state_dict().items() if "embed" not in name.lower()}
    out.mkdir(parents=True, exist_ok=True)
    _save_atomically({"strategy": "eagle3", "draft_state_dict": state, "global_step": 0}, out / "training_state.pt")
    return out / "training_state.pt"


def served_config(drafter_dir: Path, eagle_config: dict[str, Any]) -> dict[str, Any]:
    """Set the exported drafter's ``eagle_config`` (the layer ids SGLang will capture) to the arm's claim;
    returns the config as written."""
    path = drafter_dir / "config.json"
    config = json.loads(path.read_text())
    config["eagle_config"] = eagle_config
    temp = path.with_name(".config.json.tmp")
    temp.write_text(json.dumps(config, indent=2) + "\n")
    os.replace(temp, path)
    return config


def check_drafters(drafter_dirs: Sequence[Path], run_dir: Path) -> list[dict[str, Any]]:
    """``python -m jobs.check_drafter`` on served drafters against the run their states came from (one
    command for all of them: each start imports SGLang); per drafter, PASS or FAIL and SGLang's reading."""
    result = subprocess.run([sys.executable, "-m", "jobs.check_drafter", *map(str, drafter_dirs),
                             f"output.dir={run_dir}"], capture_output=True, text=True, timeout=600, env=project_env())
    if result.returncode not in (0, 1):
        raise RuntimeError(f"jobs.check_drafter could not check {run_dir} (exit {result.returncode}): "
                           f"{result.stderr.strip()[-2000:]}")
    verdicts = []
    for drafter in drafter_dirs:
        lines = [line for line in result.stdout.splitlines() if line.startswith((f"PASS {drafter}:", f"FAIL {drafter}:"))]
        verdicts.append({"passed": bool(lines) and lines[0].startswith("PASS"), "verdict": lines[0] if lines else ""})
    return verdicts


# -- 5. serving and acceptance ---------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class PromptResult:
    verify_ct: int
    correct_drafts: int
    completion_tokens: int
    output_sha: str


def prompt_results(outputs: Iterable[dict[str, Any]]) -> list[PromptResult]:
    """Per prompt, from SGLang's ``meta_info``: verify steps, correct drafts (SGLang omits both when no
    verify step ran), completion tokens, and a hash of the output ids (greedy serving is lossless: every
    arm should give the target's own answers)."""
    results = []
    for out in outputs:
        meta = out["meta_info"]
        ids = json.dumps(out.get("output_ids", [])).encode()
        results.append(PromptResult(int(meta.get("spec_verify_ct", 0)), int(meta.get("spec_num_correct_drafts", 0)),
                                    int(meta["completion_tokens"]), hashlib.sha256(ids).hexdigest()[:16]))
    return results


def acceptance_length(verify_ct: np.ndarray, correct: np.ndarray) -> float:
    """1 + correct drafts per verify step: the tokens each target forward yields (the bonus token included)."""
    total = int(np.sum(verify_ct))
    if total == 0:
        raise ValueError("no verify step ran: speculative decoding was off, or every answer was one token")
    return 1.0 + float(np.sum(correct)) / total


def bootstrap_acceptance(arms: dict[str, Sequence[PromptResult]], seed: int = 0,
                         resamples: int = BOOTSTRAP_RESAMPLES) -> dict[str, Any]:
    """Acceptance length per arm with a percentile bootstrap 95% interval over prompts, and each arm's
    difference from A on the same resampled prompts (paired: every arm answered the same prompts)."""
    counts = {arm: len(results) for arm, results in arms.items()}
    if len(set(counts.values())) != 1:
        raise ValueError(f"arms served different numbers of prompts: {counts}")
    n = next(iter(counts.values()))
    index = np.random.default_rng(seed).integers(0, n, size=(resamples, n))
    samples, report = {}, {"arms": {}, "differences": {}, "resamples": resamples, "prompts": n}
    for arm, results in arms.items():
        verify = np.array([r.verify_ct for r in results], dtype=np.int64)
        correct = np.array([r.correct_drafts for r in results], dtype=np.int64)
        samples[arm] = 1.0 + correct[index].sum(axis=1) / np.maximum(verify[index].sum(axis=1), 1)
        low, high = np.percentile(samples[arm], [2.5, 97.5])
        report["arms"][arm] = {"acceptance_length": acceptance_length(verify, correct), "ci95": [low, high],
                               "verify_steps": int(verify.sum()), "correct_drafts": int(correct.sum()),
                               "completion_tokens": int(sum(r.completion_tokens for r in results))}
    if "A" in arms:
        for arm in (a for a in arms if a != "A"):
            estimate = report["arms"]["A"]["acceptance_length"] - report["arms"][arm]["acceptance_length"]
            low, high = np.percentile(samples["A"] - samples[arm], [2.5, 97.5])
            report["differences"][f"A-{arm}"] = {"estimate": estimate, "ci95": [low, high]}
    return report


def render_prompts(tokenizer: Any, prompts: Path) -> list[list[int]]:
    """The held-out prompts as the target's chat template renders a user turn with its generation prompt
    (what jobs.prepare renders before each answer it regenerates)."""
    return [list(tokenizer.apply_chat_template([{"role": "user", "content": line["prompt"]}],
                                               add_generation_prompt=True, tokenize=True,
                                               return_dict=True)["input_ids"])
            for line in map(json.loads, prompts.read_text().splitlines())]


def engine_args(target: Path, drafter: Path, attention_backend: str, mem_fraction_static: float) -> dict[str, Any]:
    """``sglang.Engine``'s arguments for one arm: EAGLE3 with the drafter, bf16, greedy-ready."""
    return dict(
        model_path=str(target), dtype="bfloat16", speculative_algorithm="EAGLE3",
        speculative_draft_model_path=str(drafter), speculative_num_steps=SPEC_STEPS,
        speculative_eagle_topk=SPEC_TOPK, speculative_num_draft_tokens=SPEC_DRAFT_TOKENS,
        # flashinfer: the default FA3 is not in the staged stack; CUDA graphs: the draft worker's capture
        # imports deep_gemm, which is not either (../shared/README.md section 10).
        attention_backend=attention_backend, disable_cuda_graph=True, mem_fraction_static=mem_fraction_static,
        random_seed=0, log_level="warning")


def serve_arm(target: Path, drafter: Path, prompts: Path, out: Path, max_new_tokens: int,
              attention_backend: str, mem_fraction_static: float) -> None:
    """GPU only, in a process of its own: SGLang's EAGLE3 over the held-out prompts, all submitted at once
    (greedy: batching changes no answer); writes per-prompt results."""
    import sglang
    import transformers

    input_ids = render_prompts(transformers.AutoTokenizer.from_pretrained(str(target)), prompts)
    engine = sglang.Engine(**engine_args(target, drafter, attention_backend, mem_fraction_static))
    started = time.perf_counter()
    try:
        outputs = engine.generate(input_ids=input_ids,
                                  sampling_params={"temperature": 0.0, "max_new_tokens": max_new_tokens})
    finally:
        engine.shutdown()
    results = [dataclasses.asdict(r) for r in prompt_results(outputs)]
    out.write_text(json.dumps({"seconds": time.perf_counter() - started, "prompts": results}) + "\n")


def start_serving(target: Path, drafter: Path, prompts: Path, out: Path, max_new_tokens: int,
                  attention_backend: str, mem_fraction_static: float) -> multiprocessing.Process:
    """``serve_arm`` in a fresh spawned process (each arm's engine starts clean and frees the GPU after)."""
    process = multiprocessing.get_context("spawn").Process(
        target=serve_arm, args=(target, drafter, prompts, out, max_new_tokens, attention_backend, mem_fraction_static))
    process.start()
    return process


def served_results(process: multiprocessing.Process, out: Path) -> list[PromptResult]:
    process.join()
    if process.exitcode != 0 or not out.is_file():
        raise RuntimeError(f"serving for {out.stem} failed (exit {process.exitcode}); its log is above. Rerun "
                           "with --serve-parallel 1 if engines sharing the GPU were the cause")
    return [PromptResult(**r) for r in json.loads(out.read_text())["prompts"]]


# -- 6. results -----------------------------------------------------------------------------------

def versions() -> dict[str, str]:
    found = {}
    for name in ("sglang", "torch", "transformers", "flashinfer-python", "specforge", "ray"):
        with contextlib.suppress(importlib.metadata.PackageNotFoundError):
            found[name] = importlib.metadata.version(name)
    return found


def markdown(results: dict[str, Any]) -> str:
    """The table for benchmarks/RESULTS.md: acceptance with its interval per arm, training, differences."""
    arms, train = results["acceptance"]["arms"], results.get("training", {})
    lines = [
        f"Acceptance length = 1 + correct drafts / verify steps over {results['acceptance']['prompts']} held-out "
        f"prompts (SGLang EAGLE3, {SPEC_STEPS} steps, top-k {SPEC_TOPK}, {SPEC_DRAFT_TOKENS} draft tokens, "
        "temperature 0), bootstrap 95% interval over prompts.", "",
    ]
    if "data" in results and "recipe" in results:
        data, recipe = results["data"], results["recipe"]
        epochs = recipe["epochs"]  # a --max-steps cap below the epochs' steps trains fewer
        if recipe.get("max_steps"):
            epochs = min(epochs, recipe["max_steps"] * recipe["batch_size"] / data["samples"])
        lines += [f"Training data (every arm): {data['samples']} samples, {data['tokens']} tokens, "
                  f"{data['loss_tokens_per_epoch']} loss tokens per epoch x {epochs:.2f} epochs = "
                  f"{round(data['loss_tokens_per_epoch'] * epochs)} tokens trained; batch {recipe['batch_size']}, "
                  f"learning rate {recipe['learning_rate']}, seed {recipe['seed']}"
                  + (f", capped at {recipe['max_steps']} steps." if recipe.get("max_steps") else "."), ""]
    lines += [
        "| arm | states | acceptance length (95% CI) | final train loss / acc | steps | check_drafter |",
        "|---|---|---|---|---|---|",
    ]
    for arm, stats in arms.items():
        metrics = train.get(arm, {}).get("metrics", {})
        fit = (f"{metrics['loss']:.3f} / {metrics['acc']:.3f}" if "loss" in metrics else "(untrained)")
        check = results.get("check_drafter", {}).get(arm, {})
        verdict = "PASS" if check.get("passed") else ("FAIL" if check else "")
        low, high = stats["ci95"]
        lines.append(f"| {arm} | {ARM_STATES[arm]} | **{stats['acceptance_length']:.3f}** ({low:.3f}-{high:.3f}) "
                     f"| {fit} | {metrics.get('step', 0)} | {verdict} |")
    lines += ["", "| difference | estimate (95% CI) |", "|---|---|"]
    for name, diff in results["acceptance"]["differences"].items():
        lines.append(f"| {name} | {diff['estimate']:+.3f} ({diff['ci95'][0]:+.3f} to {diff['ci95'][1]:+.3f}) |")
    if "c_vs_a" in results:
        lines += ["", "| C vs A, per-token relative difference | mean | max |", "|---|---|---|"]
        lines += [f"| {name} | {d['mean']:.4f} | {d['max']:.4f} |" for name, d in results["c_vs_a"].items()]
    lines += ["", "Step wall times: " + ", ".join(f"{k} {v:.0f} s" for k, v in results.get("seconds", {}).items()),
              "Versions: " + ", ".join(f"{k} {v}" for k, v in results.get("versions", {}).items())]
    return "\n".join(lines) + "\n"


# -- the pipeline: steps recorded under DIR/steps, skipped when recorded ---------------------------

STAGES = ("checkpoint", "prompts", "prepare", "extract", "features", "train", "drafters", "serve", "report")
DRAFT_CONFIG_RUN = {"A": "A", "B": "A", "C": "A", "D": "D", "E": "A"}
"""Whose ``.drafter_config.json`` an arm trains with and claims when served: B claims A's layer ids."""


class OutOfTime(Exception):
    """--deadline-s passed before a step could start."""


class Pipeline:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.work = Path(args.work).expanduser().absolute()
        self.started = time.monotonic()
        self.recipe = Recipe(epochs=args.epochs, batch_size=args.batch_size, learning_rate=args.learning_rate,
                             seed=args.seed, max_steps=args.max_steps)
        (self.work / "steps").mkdir(parents=True, exist_ok=True)

    @property
    def model(self) -> Path:
        return self.work / "model"

    @property
    def train_conversations(self) -> Path:
        return self.work / "prompts" / "train.jsonl"

    @property
    def eval_prompts(self) -> Path:
        return self.work / "prompts" / "eval.jsonl"

    @property
    def data(self) -> Path:
        return self.work / "data"

    def run_dir(self, arm: str) -> Path:
        return self.work / "runs" / arm

    def features(self, arm: str) -> Path:
        return self.work / "features" / arm

    def drafter(self, arm: str) -> Path:
        return self.work / "drafters" / arm

    def draft_config(self, arm: str) -> Path:
        return self.run_dir(DRAFT_CONFIG_RUN[arm]) / ".drafter_config.json"

    def record(self, name: str) -> Optional[dict[str, Any]]:
        path = self.work / "steps" / f"{name}.json"
        return json.loads(path.read_text()) if path.is_file() else None

    def step(self, name: str, action: Callable[[], dict[str, Any]]) -> dict[str, Any]:
        """Run ``action`` unless its record exists; its result (and wall time) become the record."""
        if (done := self.record(name)) is not None:
            return done
        if self.args.deadline_s and time.monotonic() - self.started > self.args.deadline_s:
            raise OutOfTime(name)
        logger.info("step %s", name)
        started = time.perf_counter()
        return self.save(name, action(), time.perf_counter() - started)

    def save(self, name: str, result: dict[str, Any], seconds: float) -> dict[str, Any]:
        """Record a finished step (also those run side by side, whose records are written as each ends)."""
        result = {**result, "seconds": round(seconds, 1)}
        path = self.work / "steps" / f"{name}.json"
        path.with_suffix(".tmp").write_text(json.dumps(result, indent=2) + "\n")
        os.replace(path.with_suffix(".tmp"), path)
        logger.info("step %s done in %.0f s", name, seconds)
        return result

    def command(self, command: list[str], log_name: str, env: Optional[dict[str, str]] = None) -> str:
        """Run a project command or a peer's tool; its output goes to DIR/logs; a failure names the log."""
        log = self.work / "logs" / f"{log_name}.log"
        log.parent.mkdir(parents=True, exist_ok=True)
        with open(log, "w") as handle:
            result = subprocess.run(command, stdout=handle, stderr=subprocess.STDOUT, text=True,
                                    env=env or project_env())
        if result.returncode != 0:
            raise RuntimeError(f"`{' '.join(command)}` exited {result.returncode}; its output: {log}\n"
                               + log.read_text()[-3000:])
        return log.read_text()


def project_env() -> dict[str, str]:
    """Project commands import from the checkout, whatever the current directory."""
    root = str(Path(__file__).resolve().parent.parent)
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
    return env


def stage_checkpoint(p: Pipeline) -> None:
    p.step("checkpoint", lambda: {"path": str(build_checkpoint(p.model, Path(p.args.gguf) if p.args.gguf else None))})


def stage_prompts(p: Pipeline) -> None:
    def make() -> dict[str, Any]:
        train, held_out = split_prompts(p.args.train_prompts, p.args.eval_prompts, p.args.seed)
        p.train_conversations.parent.mkdir(parents=True, exist_ok=True)
        write_conversations(train, p.train_conversations)
        p.eval_prompts.write_text("".join(json.dumps({"prompt": prompt}) + "\n" for prompt in held_out))
        return {"train": len(train), "held_out": len(held_out)}
    p.step("prompts", make)


def stage_prepare(p: Pipeline) -> None:
    def make() -> dict[str, Any]:
        if importlib.util.find_spec("jobs.prepare") is None:
            raise RuntimeError("jobs.prepare (issue 20) is not in this checkout: merge it, then rerun")
        p.command(prepare_command(p.model, p.train_conversations, p.data, p.args.max_new_tokens), "prepare")
        return data_stats(p.data, p.recipe.max_length)
    p.step("prepare", make)


def data_stats(data: Path, max_length: int) -> dict[str, Any]:
    """Samples and tokens of the prepared data, and the tokens one epoch trains on (SpecForge cuts each
    sample to max_length and zeroes its last loss-mask entry)."""
    import glob

    import pyarrow.dataset

    files = sorted(glob.glob(prepared_data(data)))
    table = pyarrow.dataset.dataset(files, format="parquet").to_table(columns=["input_ids", "loss_mask"])
    masks = [np.asarray(mask[:max_length]) for mask in table.column("loss_mask").to_pylist()]
    lengths = [len(ids) for ids in table.column("input_ids").to_pylist()]
    return {"samples": len(lengths), "tokens": int(sum(lengths)),
            "loss_tokens_per_epoch": int(sum(int(mask.sum()) - int(mask[-1]) for mask in masks))}


def stage_extract(p: Pipeline) -> None:
    device = "auto" if p.args.device == "cuda" else p.args.device
    for arm in ("A", "B", "D"):
        def run(arm: str = arm) -> dict[str, Any]:
            p.command([sys.executable, "-m", "jobs.extract", f"model.path={p.model}", f"data.path={prepared_data(p.data)}",
                       f"output.dir={p.run_dir(arm)}", f"model.device={device}", "model.dtype=bfloat16",
                       *extract_overrides(arm, LAYERS)], f"extract-{arm}")
            return json.loads((p.run_dir(arm) / ".summary.json").read_text())["this_run"]
        p.step(f"extract-{arm}", run)


def stage_features(p: Pipeline) -> None:
    for arm in ("A", "B", "D"):
        p.step(f"export-{arm}", lambda arm=arm: {"log": p.command(
            [sys.executable, "-m", "jobs.export", f"output.dir={p.run_dir(arm)}", "to=specforge",
             f"dest={p.features(arm)}"], f"export-{arm}").strip().splitlines()[-1]})
    p.step("features-C", lambda: {"c_vs_a": write_hf_features(
        p.model, p.run_dir("A"), p.features("C"), p.args.device, "bfloat16")})


def stage_train(p: Pipeline) -> None:
    """The trained arms at once, one SpecForge process each on the one GPU (each is small and mostly waits
    on kernel launches), then arm E's untrained checkpoint."""
    pending = [arm for arm in TRAINED_ARMS if p.record(f"train-{arm}") is None]
    if pending and p.args.deadline_s and time.monotonic() - p.started > p.args.deadline_s:
        raise OutOfTime(f"train-{pending[0]}")
    import yaml

    processes, ports = {}, free_ports(len(pending))
    for arm, port in zip(pending, ports):
        directory = p.work / "train" / arm
        directory.mkdir(parents=True, exist_ok=True)
        config = specforge_run_config(arm, p.features(arm), p.model, p.draft_config(arm), directory / "out", p.recipe)
        (directory / "run.yaml").write_text(yaml.safe_dump(config, sort_keys=False))
        env = specforge_env({"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1",
                             "MASTER_PORT": str(port)})
        log = open(directory / "log.txt", "w")
        processes[arm] = (subprocess.Popen(specforge_command("train", "-c", str(directory / "run.yaml")), env=env,
                                           stdout=log, stderr=subprocess.STDOUT, text=True), log, time.perf_counter())
    failed = []
    while processes:  # polled, so each arm's wall time is its own
        for arm in [arm for arm, (process, _, _) in processes.items() if process.poll() is not None]:
            process, log, started = processes.pop(arm)
            log.close()
            text = (p.work / "train" / arm / "log.txt").read_text()
            if process.returncode != 0:
                failed.append(f"arm {arm} (exit {process.returncode}): {p.work / 'train' / arm / 'log.txt'}\n"
                              f"{text[-2000:]}")
                continue
            p.save(f"train-{arm}", {"metrics": last_train_metrics(text)}, time.perf_counter() - started)
        time.sleep(1)
    if failed:
        raise RuntimeError("SpecForge training failed for " + "\n".join(failed))
    p.step("train-E", lambda: {"checkpoint": str(write_untrained_checkpoint(
        p.draft_config("E"), p.work / "train" / "E", p.recipe.seed))})


def free_ports(count: int) -> list[int]:
    """Ports for each trainer's torch.distributed rendezvous, all held at once so they differ."""
    with contextlib.ExitStack() as stack:
        sockets = [stack.enter_context(socket.socket()) for _ in range(count)]
        for sock in sockets:
            sock.bind(("127.0.0.1", 0))
        return [sock.getsockname()[1] for sock in sockets]


def stage_drafters(p: Pipeline) -> None:
    """Each arm's SpecForge checkpoint exported for SGLang, its eagle_config set to the arm's claim, then
    jobs.check_drafter on the served configs, grouped by the run each arm's states came from."""
    for arm in ARMS:
        def make(arm: str = arm) -> dict[str, Any]:
            checkpoint = (p.work / "train" / "E" / "training_state.pt" if arm == "E"
                          else p.work / "train" / arm / "out" / f"arm-{arm}-latest")
            p.command(specforge_command("export", "--to", "sglang", "--checkpoint", str(checkpoint), "--draft-config",
                                        str(p.draft_config(arm)), "--output-dir", str(p.drafter(arm))),
                      f"specforge-export-{arm}", env=specforge_env())
            claimed = json.loads(p.draft_config(arm).read_text())["eagle_config"]
            return {"eagle_config": served_config(p.drafter(arm), claimed)["eagle_config"]}
        p.step(f"drafter-{arm}", make)
    for run in sorted(set(map(states_run, ARMS))):
        arms = [arm for arm in ARMS if states_run(arm) == run]
        p.step(f"check-run-{run}", lambda arms=arms, run=run: dict(zip(
            arms, check_drafters([p.drafter(arm) for arm in arms], p.run_dir(run)))))


def stage_serve(p: Pipeline) -> None:
    """Each arm's drafter served over the held-out prompts, ``--serve-parallel`` engines at once on the one
    GPU (135M parameters each: the GPU's memory is shared out, each gets an equal fraction)."""
    pending = [arm for arm in ARMS if p.record(f"serve-{arm}") is None]
    (p.work / "serve").mkdir(parents=True, exist_ok=True)
    parallel = max(1, p.args.serve_parallel)
    for start in range(0, len(pending), parallel):
        if p.args.deadline_s and time.monotonic() - p.started > p.args.deadline_s:
            raise OutOfTime(f"serve-{pending[start]}")
        started = time.perf_counter()
        batch = {arm: start_serving(p.model, p.drafter(arm), p.eval_prompts, p.work / "serve" / f"{arm}.json",
                                    p.args.max_new_tokens, p.args.attention_backend, SERVE_MEMORY / parallel)
                 for arm in pending[start : start + parallel]}
        for arm, process in batch.items():
            results = served_results(process, p.work / "serve" / f"{arm}.json")
            p.save(f"serve-{arm}", {"prompts": len(results), "engines_at_once": len(batch)},
                   time.perf_counter() - started)


def stage_report(p: Pipeline) -> dict[str, Any]:
    served = {arm: [PromptResult(**r) for r in json.loads((p.work / "serve" / f"{arm}.json").read_text())["prompts"]]
              for arm in ARMS}
    acceptance = bootstrap_acceptance(served, seed=p.args.seed)
    reference = [r.output_sha for r in served["A"]]
    results = {
        "acceptance": acceptance,
        "same_output_as_A": {arm: float(np.mean([r.output_sha == a for r, a in zip(served[arm], reference)]))
                             for arm in ARMS},
        "training": {arm: p.record(f"train-{arm}") for arm in ARMS},
        "check_drafter": {arm: p.record(f"check-run-{states_run(arm)}")[arm] for arm in ARMS},
        "c_vs_a": p.record("features-C")["c_vs_a"],
        "data": {**p.record("prompts"), **p.record("prepare")},
        "recipe": dataclasses.asdict(p.recipe),
        "serving": {"speculative_num_steps": SPEC_STEPS, "speculative_eagle_topk": SPEC_TOPK,
                    "speculative_num_draft_tokens": SPEC_DRAFT_TOKENS, "temperature": 0,
                    "max_new_tokens": p.args.max_new_tokens, "attention_backend": p.args.attention_backend},
        "seconds": {path.stem: json.loads(path.read_text())["seconds"] for path in sorted((p.work / "steps").glob("*.json"))},
        "versions": versions(),
        "command": " ".join(sys.argv),
    }
    out = Path(p.args.out) if p.args.out else p.work / "results.json"
    out.write_text(json.dumps(results, indent=2) + "\n")
    out.with_suffix(".md").write_text(markdown(results))
    print(markdown(results))
    return results


STAGE_FUNCTIONS: dict[str, Callable[[Pipeline], Any]] = {
    "checkpoint": stage_checkpoint, "prompts": stage_prompts, "prepare": stage_prepare, "extract": stage_extract,
    "features": stage_features, "train": stage_train, "drafters": stage_drafters, "serve": stage_serve,
    "report": stage_report,
}


def parse_args(argv: Optional[Sequence[str]]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.acceptance", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--work", required=True, help="working directory (kept: every step's output and record)")
    parser.add_argument("--out", default="", help="results JSON (default DIR/results.json); the table beside it (.md)")
    parser.add_argument("--stages", default="all", help=f"comma-separated, in order: {','.join(STAGES)} (default all)")
    parser.add_argument("--deadline-s", type=float, default=0, help="start no step after this many seconds (0: none)")
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    parser.add_argument("--gguf", default="", help="SmolLM2's GGUF file (a machine without the package registry)")
    parser.add_argument("--train-prompts", type=int, default=4000)
    parser.add_argument("--eval-prompts", type=int, default=256)
    parser.add_argument("--max-new-tokens", type=int, default=256, help="answer length, regenerating and serving")
    parser.add_argument("--epochs", type=int, default=Recipe.epochs)
    parser.add_argument("--batch-size", type=int, default=Recipe.batch_size)
    parser.add_argument("--learning-rate", type=float, default=Recipe.learning_rate)
    parser.add_argument("--seed", type=int, default=Recipe.seed)
    parser.add_argument("--max-steps", type=int, default=0,
                        help="cap every arm's training at this many steps (0: none; bounds a device call's training time)")
    parser.add_argument("--attention-backend", default="flashinfer", help="SGLang's, when serving")
    parser.add_argument("--serve-parallel", type=int, default=SERVE_PARALLEL, help="serving engines at once on the GPU")
    args = parser.parse_args(argv)
    stages = STAGES if args.stages == "all" else tuple(s.strip() for s in args.stages.split(","))
    unknown = [s for s in stages if s not in STAGES]
    if unknown:
        parser.error(f"unknown stages {unknown}; known: {', '.join(STAGES)}")
    needs_gpu = [s for s in stages if s in ("prepare", "train", "serve")]
    if args.device != "cuda" and needs_gpu:
        parser.error(f"stages {needs_gpu} run on CUDA only (SGLang's EAGLE3 serving and regeneration, SpecForge's "
                     "FSDP trainer); on CPU run the others, or tests/test_acceptance_cpu.py")
    args.stages = stages
    return args


def print_steps(p: Pipeline) -> None:
    """Every step recorded so far, one line each (what a device call that ends before the report shows)."""
    for path in sorted((p.work / "steps").glob("*.json"), key=lambda path: path.stat().st_mtime):
        record = json.loads(path.read_text())
        print(f"{path.stem}: {record.pop('seconds')} s {json.dumps(record)[:300]}")


def main(argv: Optional[Sequence[str]] = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    args = parse_args(argv)
    pipeline = Pipeline(args)
    try:
        for stage in args.stages:
            STAGE_FUNCTIONS[stage](pipeline)
    except OutOfTime as stopped:
        logger.warning("stopped before step %s (--deadline-s %.0f): rerun the same command to go on", stopped,
                       args.deadline_s)
        return EXIT_MORE_TO_DO
    except ValueError as error:  # a setting or an input the benchmark cannot use
        logger.error("%s", error)
        return 2
    except RuntimeError as error:  # a step's command failed; its log is named
        logger.error("%s", error)
        return 1
    finally:
        print_steps(pipeline)
    return 0


if __name__ == "__main__":
    sys.exit(main())
