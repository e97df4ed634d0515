"""The pieces of the acceptance benchmark (benchmarks/acceptance/) that run without a GPU: the prompts and
their split, the arms (what a selection extracts, trains and serves), the HF-path states, SpecForge 0.2.0's
own config, trainer (up to FSDP, which needs an accelerator) and exporter on our export, the served configs
through jobs.check_drafter, arm Q's run with a stand-in serving command and jobs.check_serving of it, the INT4
target's run, engines and checks, the state comparison, the bootstrap per seed and pooled, the report, commands
side by side, the background run. Serving with SGLang's EAGLE3, training and the regeneration (jobs.prepare) run
on the H200 only."""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
from pathlib import Path
from typing import Optional, Sequence

import numpy as np
import pytest
import torch
import yaml
from safetensors import safe_open

from benchmarks.acceptance.arms import (
    ARMS,
    LAYERS,
    arm_b_layers,
    drafters_needed,
    extract_overrides,
    parse_arms,
    quantized_runs,
    quantized_targets,
    runs_needed,
    trained,
)
from benchmarks.acceptance.cli import parse_args
from benchmarks.acceptance.data import data_stats, prepared_data
from benchmarks.acceptance.differences import main as differences_main
from benchmarks.acceptance.differences import run_differences
from benchmarks.acceptance.drafters import check_drafters, served_config
from benchmarks.acceptance.files import save_torch, write_json
from benchmarks.acceptance.hf_states import write_hf_features
from benchmarks.acceptance.pipeline import EXIT_MORE_TO_DO, Job, OutOfTime, Pipeline, Served, project_env
from benchmarks.acceptance.prompts import (
    KINDS,
    TEMPLATES,
    fresh_training_distribution,
    render_prompts,
    split_prompts,
    split_prompts_composed,
    split_sides,
    write_conversations,
)
from benchmarks.acceptance.serving import (
    PromptResult,
    ServeSpec,
    engine_args,
    prompt_results,
    served_results,
    start_serving,
)
from benchmarks.acceptance.stages import (
    check_disk,
    extract_command,
    serving_batches,
    serving_checks,
    stage_drafters,
    stage_extract,
    stage_features,
    stage_prompts,
    stage_report,
    state_difference,
)
from benchmarks.acceptance.stats import acceptance_length, bootstrap_acceptance
from benchmarks.acceptance.trainer import (
    Recipe,
    last_train_metrics,
    specforge_command,
    specforge_env,
    specforge_pythonpath,
    specforge_run_config,
    train_curve,
    training_draft_config,
    write_untrained_checkpoint,
)
from benchmarks.acceptance.warm_start import EMBEDDING, FINAL_NORM, target_tensor, write_vocab_mapping, write_warm_start
from storage import ShardMetadata, ShardReader, ShardWriter
from storage.manifest import read_manifest
from tests.conftest import REPO_ROOT
from tests.helpers import (
    POST_NORM_LAYERS,
    PRE_NORM_LAYERS,
    chat_dataset,
    checkpoint_dir,
    post_norm_run,
    pre_norm_run,
    session_ray_address,
)

FSDP_STOP = "FSDP needs a non-CPU accelerator device"


@pytest.fixture(scope="module")
def specforge_path() -> str:
    try:
        path = specforge_pythonpath()
    except RuntimeError as error:  # neither installed nor fetchable: no package registry here
        reason = f"SpecForge 0.2.0 cannot be fetched: {error}"
        if os.environ.get("CI"):  # CI reaches the registry: a skip there would hide SpecForge's own checks
            pytest.fail(reason)
        pytest.skip(reason)
    if path not in sys.path:
        sys.path.insert(0, path)
    return path


@pytest.fixture(scope="module")
def runs(ray_cluster, tmp_path_factory) -> dict[str, Path]:
    """Arm A's run ([1, 14, 26], post-norm) and a run of B's layers ([0, 13, 25]), shared with
    tests/extractor/test_real_weights.py: whichever file comes first makes them."""
    return {"A": post_norm_run(tmp_path_factory), "B": pre_norm_run(tmp_path_factory)}


@pytest.fixture(scope="module")
def run_a(runs) -> Path:
    return runs["A"]


@pytest.fixture(scope="module")
def export_a(run_a, tmp_path_factory):
    """``jobs.export to=specforge`` of arm A's run (CPU float32 here; bf16 on the GPU)."""
    dest = tmp_path_factory.mktemp("export") / "A"
    result = subprocess.run([sys.executable, "-m", "jobs.export", f"output.dir={run_a}", "to=specforge", f"dest={dest}"],
                            cwd=REPO_ROOT, env=project_env(), capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    return dest


def test_prompts_are_varied_distinct_disjoint_reproducible_and_held_out_of_another_distribution():
    training, held_out = split_prompts_composed(3000, 256, seed=0)
    train, evaluation = [p.text for p in training], [p.text for p in held_out]
    assert split_prompts(3000, 256, seed=0) == (train, evaluation)
    assert (len(train), len(evaluation)) == (3000, 256)
    assert len(set(train)) == 3000 and len(set(evaluation)) == 256 and not set(train) & set(evaluation)
    # every kind of task on both sides, in proportion to its phrasings; most phrasings used
    assert len(TEMPLATES) >= 50 and {"code", "math", "rewrite", "list", "explain", "instructions"} <= set(KINDS)
    assert {p.kind for p in training} == {p.kind for p in held_out} == set(KINDS)
    assert len({p.template for p in training}) + len({p.template for p in held_out}) == len(TEMPLATES)
    # another distribution: no phrasing, topic or other pool entry of the held-out prompts is in a training prompt
    assert not {p.template for p in training} & {p.template for p in held_out}
    drawn_train = {entry for p in training for entry in p.drawn}
    drawn_held = {entry for p in held_out for entry in p.drawn}
    assert not drawn_train & drawn_held and len({value for pool, value in drawn_held if pool == "topic"}) >= 25
    _, other_held_out = split_prompts(3000, 256, seed=1)
    assert len(set(other_held_out) & set(evaluation)) < 20
    with pytest.raises(ValueError, match="at least 200"):
        split_prompts(1000, 100, seed=0)
    # fresh prompts of the training distribution: the training side's phrasings and pool entries, no training prompt
    fresh = fresh_training_distribution(train, 256, seed=0)
    assert len({p.text for p in fresh}) == 256 and not {p.text for p in fresh} & (set(train) | set(evaluation))
    assert {p.template for p in fresh} <= {p.template for p in training} and {p.kind for p in fresh} == set(KINDS)
    train_pools = split_sides(0)[0].pools
    assert all(value in train_pools[pool] for p in fresh for pool, value in p.drawn)
    assert [p.text for p in fresh_training_distribution(train, 256, seed=0)] == [p.text for p in fresh]


def test_conversations_are_one_user_turn_each(tmp_path):
    path = tmp_path / "train.jsonl"
    write_conversations(["Hi there", "Name a color."], path)
    assert [json.loads(line) for line in path.read_text().splitlines()] == [
        {"messages": [{"role": "user", "content": "Hi there"}]},
        {"messages": [{"role": "user", "content": "Name a color."}]},
    ]


def test_the_training_distributions_prompts_are_fresh_and_served_by_a_s0_alone(tmp_path):
    p = Pipeline(parse_args(["--work", str(tmp_path / "work"), "--device", "cpu", "--stages", "prompts", "--arms",
                             "A,B", "--seeds", "0,1", "--train-prompts", "300", "--eval-prompts", "200",
                             "--training-distribution-eval"]))
    stage_prompts(p)
    assert [unit.name for unit in p.served()] == ["A-s0", "B-s0", "A-s1", "B-s1", "A-s0-train-dist"]
    assert [unit.name for unit in p.drafters()] == ["A-s0", "B-s0", "A-s1", "B-s1"]  # A-s0's drafter serves both
    fresh = p.prompts(p.served()[-1])
    assert p.prompts(p.served()[0]) == p.eval_prompts and fresh != p.eval_prompts
    training = {json.loads(line)["messages"][0]["content"] for line in p.train_conversations.read_text().splitlines()}
    held_out = {json.loads(line)["prompt"] for line in p.eval_prompts.read_text().splitlines()}
    texts = [json.loads(line)["prompt"] for line in fresh.read_text().splitlines()]
    assert len(set(texts)) == 200 and not set(texts) & (training | held_out)
    assert p.prompts(p.served()[-1]).read_text() == fresh.read_text()  # made once


def test_arm_layers_and_the_runs_they_are_checked_against():
    assert arm_b_layers(LAYERS) == PRE_NORM_LAYERS == [0, 13, 25]
    assert list(LAYERS) == POST_NORM_LAYERS
    with pytest.raises(ValueError, match="embedding"):
        arm_b_layers([0, 5])
    assert extract_overrides("B", LAYERS)[0] == "extract.layers=[0, 13, 25]"
    assert "output.state_dtype=float8_e4m3fn" in extract_overrides("D", LAYERS)
    assert extract_overrides("A", LAYERS) == extract_overrides("Q", LAYERS)  # Q differs by its serving command only
    # B is served claiming A's ids but checked against its own run; C and E have A's states' layers; Q-bf16 serves
    # A's drafter on the quantized target
    assert ARMS["B"].draft_config_run == "A" and ARMS["B"].run == "B"
    assert ARMS["C"].run == ARMS["E"].run == ARMS["Q-bf16"].run == "A"
    assert ARMS["Q-bf16"].drafter_of == "A" and ARMS["Q-bf16"].quantized and ARMS["Q"].quantized
    assert not any(ARMS[arm].quantized for arm in "ABCDE")


def test_what_a_selection_of_arms_trains_extracts_checks_and_serves(tmp_path):
    assert parse_arms("Q-bf16,A , Q") == ("A", "Q", "Q-bf16") and parse_arms("all") == tuple(ARMS)
    with pytest.raises(ValueError, match="unknown arms \\['F'\\]"):
        parse_arms("A,F")
    # Q-bf16 needs A's drafter (so A trains) and Q's run (its states are compared with Q's): the quantized run first
    assert trained(("Q-bf16",)) == ("A",) and runs_needed(("Q-bf16",)) == ("Q", "A")
    assert quantized_runs(("A", "Q", "Q-bf16")) == quantized_runs(("Q-bf16",)) == ("Q", "A")
    assert quantized_runs(("Q",)) == ("Q",) and quantized_runs(("A", "B")) == ()
    assert trained(("A", "Q", "Q-bf16")) == ("A", "Q") and drafters_needed(("E",)) == ("E",) and trained(("E",)) == ()
    assert runs_needed(("B",)) == ("A", "B") and runs_needed(("C",)) == ("A",) and runs_needed(("D",)) == ("D",)
    assert trained(tuple(ARMS)) == ("A", "B", "C", "D", "Q", "Q4")
    assert runs_needed(tuple(ARMS)) == ("Q", "Q4", "A", "B", "D")
    # the INT4 target as the fp8 one: Q4-bf16 serves A's drafter on it and is compared with Q4's run
    assert trained(("Q4-bf16",)) == ("A",) and runs_needed(("Q4-bf16",)) == ("Q4", "A")
    assert quantized_runs(("A", "Q-bf16", "Q4-bf16"), "int4") == ("Q4", "A") and quantized_runs(("Q4",), "fp8") == ()
    assert quantized_targets(("Q4", "A", "Q-bf16")) == ("fp8", "int4") and quantized_targets(("A", "B")) == ()

    def pipeline(*args: str) -> Pipeline:
        return Pipeline(parse_args(["--work", str(tmp_path / "work"), "--device", "cpu", "--stages", "prompts", *args]))

    p = pipeline("--arms", "A,Q,Q-bf16", "--seeds", "0,1")
    assert p.args.quantized_serving == ("--quantization", "fp8", "--attention-backend", "flashinfer")
    # the quantized target's engines first; Q-bf16 serves A's drafter of the same seed
    assert [unit.name for unit in p.served()] == ["Q-s0", "Q-bf16-s0", "Q-s1", "Q-bf16-s1", "A-s0", "A-s1"]
    assert [unit.name for unit in p.drafters()] == ["Q-s0", "A-s0", "Q-s1", "A-s1"]
    # two engines side by side, the quantized target's first (each started once the one before holds its memory)
    assert [[unit.name for unit in batch] for batch in serving_batches(p.served(), 2)] == [
        ["Q-s0", "Q-bf16-s0"], ["Q-s1", "Q-bf16-s1"], ["A-s0", "A-s1"]]
    assert [len(batch) for batch in serving_batches(p.served(), 1)] == [1] * 6
    assert p.drafter(Served("Q-bf16", 1)) == p.drafter(Served("A", 1)) == p.work / "drafters" / "A-s1"
    assert p.recipe(1) == Recipe(seed=1) and (Recipe.epochs, Recipe.learning_rate, Recipe.batch_size) == (3, 5e-4, 4)
    assert pipeline("--lr", "1e-3", "--epochs", "2", "--max-steps", "9", "--ttt-length", "4", "--draft-vocab",
                    "16384").recipe(0) == Recipe(epochs=2, learning_rate=1e-3, max_steps=9, ttt_length=4,
                                                 draft_vocab=16384)
    for refused in (["--draft-vocab", "-1"], ["--ttt-length", "0"]):
        with pytest.raises(SystemExit):
            pipeline(*refused)
    # the drafter at each earlier epoch's end, for the arms trained on their own states
    (p.work / "steps" / "prepare.json").write_text(json.dumps({"samples": 403, "seconds": 1}))
    epochs = pipeline("--arms", "Q-bf16,E", "--epoch-acceptance",
                      "--quantized-serving", "--json-model-override-args {}")
    assert epochs.args.quantized_serving == ("--json-model-override-args", "{}")
    assert [unit.name for unit in epochs.served()] == ["Q-bf16-s0", "E-s0"]
    epochs = pipeline("--arms", "A,E", "--epoch-acceptance")
    assert [unit.name for unit in epochs.served()] == ["A-s0", "E-s0", "A-s0-e1", "A-s0-e2"]
    assert epochs.recipe(0).save_interval == 100
    assert epochs.checkpoint(Served("A", 0, 2)) == p.work / "train" / "A-s0" / "out" / "arm-A-step200"
    assert epochs.checkpoint(Served("E", 0)) == p.work / "train" / "E-s0" / "training_state.pt"



def test_the_int4_target_its_run_engines_and_checks(tmp_path):
    """Arms Q4 and Q4-bf16: Q4's run extracts the INT4 checkpoint with its serving command as model.serving, their
    engines serve that checkpoint with it, jobs.check_serving compares it with Q4's run and A's, and
    Q4-bf16's states are compared with Q4's; fp8's steps keep their names."""
    p = Pipeline(parse_args(["--work", str(tmp_path / "work"), "--device", "cpu", "--stages", "prompts",
                             "--arms", "A,Q-bf16,Q4,Q4-bf16", "--attention-backend", "fa3"]))
    int4 = ("--quantization", "compressed-tensors", "--speculative-draft-model-quantization", "unquant",
            "--attention-backend", "fa3")
    assert p.serving("int4") == p.args.int4_serving == int4 and p.serving("bf16") == ()
    assert p.target_model("int4") == p.work / "model-int4" and p.target_model("fp8") == p.model
    assert [unit.name for unit in p.served()] == ["Q-bf16-s0", "Q4-s0", "Q4-bf16-s0", "A-s0"]
    assert [[unit.name for unit in batch] for batch in serving_batches(p.served(), 2)] == [
        ["Q-bf16-s0", "Q4-s0"], ["Q4-bf16-s0", "A-s0"]]
    command = extract_command(p, "Q4")
    assert f"model.path={p.work / 'model-int4'}" in command and "--config" in command
    assert not any(word.startswith("model.dtype=") for word in command)
    assert yaml.safe_load((p.work / "serving" / "Q4.yaml").read_text()) == {"model": {"serving": list(int4)}}
    assert f"model.path={p.model}" in extract_command(p, "A")
    checks = serving_checks(p)
    assert list(checks) == ["check-serving-Q", "check-serving-A", "check-serving-Q4-int4", "check-serving-A-int4"]
    assert checks["check-serving-A-int4"].command[-(len(int4) + 2):] == [f"output.dir={p.run_dir('A')}", "--", *int4]
    differences = state_difference(p)
    assert list(differences) == ["states-Q-bf16-vs-Q", "states-Q4-bf16-vs-Q4"]
    assert differences["states-Q4-bf16-vs-Q4"].command[-3:-1] == [str(p.run_dir("Q4")), str(p.run_dir("A"))]


@pytest.mark.extended
def test_arm_c_states_are_hf_written_as_our_export_writes_them(run_a, export_a, tmp_path):
    """Arm C on CPU float32: HF's states in SpecForge's files, the same files (paths, keys, dtypes,
    ids, masks) as jobs.export writes for arm A, and the same states here (on the GPU, bf16 kernels
    differ: that difference is C's per-layer report)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # HF on one thread is bit-identical with SGLang here (test_real_weights)
    try:
        report = write_hf_features(checkpoint_dir(), run_a, tmp_path / "C", "cpu", "float32")
    finally:
        torch.set_num_threads(threads)
    ours = sorted(p.relative_to(export_a) for p in export_a.rglob("*.ckpt"))
    theirs = sorted(p.relative_to(tmp_path / "C") for p in (tmp_path / "C").rglob("*.ckpt"))
    assert ours == theirs and len(ours) == 8
    for name in ours:
        a = torch.load(export_a / name, weights_only=True)
        c = torch.load(tmp_path / "C" / name, weights_only=True)
        assert list(a) == list(c) == ["input_ids", "loss_mask", "hidden_state", "aux_hidden_state"]
        assert all(a[key].dtype == c[key].dtype and a[key].shape == c[key].shape for key in a)
        assert torch.equal(a["input_ids"], c["input_ids"]) and torch.equal(a["loss_mask"], c["loss_mask"])
        for key in ("hidden_state", "aux_hidden_state"):
            assert (a[key] - c[key]).abs().max() <= 2e-5 * a[key].abs().max(), (name, key)
    assert list(report) == ["layer 1", "layer 14", "layer 26", "final (post_norm)"]
    tokens = sum(sample.input_ids.numel() for path in run_a.glob("shard-*.parquet") for sample in ShardReader(path))
    assert all(entry["max"] <= 2e-5 and entry["tokens"] == tokens for entry in report.values()), report


@pytest.mark.extended
def test_specforge_trains_on_our_export_up_to_fsdp(specforge_path, run_a, export_a, tmp_path):
    """SpecForge 0.2.0's own `specforge train` takes the benchmark's run.yaml, the run's drafter config with a
    smaller draft vocabulary (--draft-vocab), the target (its head through model.safetensors.index.json), reads
    every feature file of our export (SPECFORGE_VALIDATE_OFFLINE_FEATURES=1) and maps the draft vocabulary to the
    answers' most frequent tokens, then stops where FSDP needs an accelerator."""
    recipe = Recipe(draft_vocab=1024)
    draft_config = training_draft_config(run_a / ".drafter_config.json", recipe.draft_vocab, tmp_path / "train")
    own = json.loads((run_a / ".drafter_config.json").read_text())
    assert json.loads(draft_config.read_text()) == {**own, "draft_vocab_size": 1024} and own["draft_vocab_size"] > 1024
    assert training_draft_config(run_a / ".drafter_config.json", 0, tmp_path) == run_a / ".drafter_config.json"
    with pytest.raises(ValueError, match="--draft-vocab 100000: the target's vocabulary has 49152 tokens"):
        training_draft_config(run_a / ".drafter_config.json", 100000, tmp_path)
    config = specforge_run_config("A", export_a, checkpoint_dir(), draft_config, tmp_path / "out", recipe)
    (tmp_path / "run.yaml").write_text(yaml.safe_dump(config, sort_keys=False))
    from specforge.config import load_config

    assert load_config(str(tmp_path / "run.yaml")).mode == "offline"  # its own strict schema accepts every key
    env = specforge_env({"SPECFORGE_VALIDATE_OFFLINE_FEATURES": "1"})
    result = subprocess.run(specforge_command("train", "-c", str(tmp_path / "run.yaml")), cwd=tmp_path,
                            env=env, capture_output=True, text=True, timeout=600)
    errors = [line for line in result.stderr.splitlines() if "Error:" in line]
    assert result.returncode != 0 and errors and all(FSDP_STOP in line for line in errors), result.stderr[-3000:]
    (mapping,) = (tmp_path / "out" / "cache" / "vocab_mapping").glob("*.pt")
    derived = torch.load(mapping, weights_only=True)
    assert derived["d2t"].shape == (1024,) and int(derived["t2d"].sum()) == 1024 and derived["t2d"].numel() == 49152

    # --warm-head: the map made here, the head the target's embedding rows of its tokens, SpecForge's own
    # weights-only warm start and map loading take both (a mismatch would stop it before FSDP)
    ours = write_vocab_mapping(export_a, 1024, 49152, recipe.max_length, tmp_path / "vocab.pt")
    assert torch.equal(torch.load(ours, weights_only=True)["t2d"], derived["t2d"])  # the tokens SpecForge would keep
    warm = write_warm_start(draft_config, checkpoint_dir(), 0, tmp_path / "warm", ours)
    state = torch.load(warm / "training_state.pt", weights_only=True)["draft_state_dict"]
    drafted = state["d2t"] + torch.arange(1024)
    assert torch.equal(state["lm_head.weight"], target_tensor(checkpoint_dir(), EMBEDDING)[drafted].to(torch.bfloat16))
    assert torch.equal(state["norm.weight"], target_tensor(checkpoint_dir(), FINAL_NORM).to(torch.bfloat16))
    config = specforge_run_config("A", export_a, checkpoint_dir(), draft_config, tmp_path / "warm-out", recipe,
                                  warm, ours)
    assert config["model"]["draft_checkpoint_path"] == str(warm) and config["model"]["vocab_mapping_path"] == str(ours)
    (tmp_path / "warm.yaml").write_text(yaml.safe_dump(config, sort_keys=False))
    result = subprocess.run(specforge_command("train", "-c", str(tmp_path / "warm.yaml")), cwd=tmp_path,
                            env=env, capture_output=True, text=True, timeout=600)
    errors = [line for line in result.stderr.splitlines() if "Error:" in line]
    assert result.returncode != 0 and errors and all(FSDP_STOP in line for line in errors), result.stderr[-3000:]
    # and it did read the warm start: one without the final norm stops before FSDP, naming it
    save_torch({"strategy": "eagle3", "draft_state_dict": {k: v for k, v in state.items() if k != "norm.weight"}},
               warm / "training_state.pt")
    result = subprocess.run(specforge_command("train", "-c", str(tmp_path / "warm.yaml")), cwd=tmp_path,
                            env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode != 0 and "missing draft weights required" in result.stderr, result.stderr[-3000:]
    assert FSDP_STOP not in result.stderr and "norm.weight" in result.stderr


@pytest.mark.extended
def test_untrained_drafter_exports_and_the_checker_flags_b(specforge_path, runs, tmp_path):
    """Arm E's checkpoint through `specforge export --to sglang`, served claiming A's layer ids: against
    the run of B's states (layers k-1) jobs.check_drafter flags it, naming the ids that would serve those
    states, and passes a copy claiming them."""
    run_a, run_b = runs["A"], runs["B"]  # the check reads only the layers a run stored, not its final state
    draft_config = run_a / ".drafter_config.json"
    checkpoint = write_untrained_checkpoint(draft_config, tmp_path / "E", seed=0)
    served = tmp_path / "served"
    command = specforge_command("export", "--to", "sglang", "--checkpoint", str(checkpoint),
                                "--draft-config", str(draft_config), "--output-dir", str(served))
    from specforge.cli import main as specforge_main

    # the command's arguments through SpecForge's own CLI, in this process (a new one imports torch again)
    assert command[:3] == [sys.executable, "-m", "specforge.cli"] and specforge_main(command[3:]) == 0
    config = served_config(served, json.loads(draft_config.read_text())["eagle_config"])
    assert json.loads((served / "config.json").read_text()) == config
    assert config["architectures"] == ["LlamaForCausalLMEagle3"] and config["draft_vocab_size"] == 49152
    assert config["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == POST_NORM_LAYERS
    assert config["tie_word_embeddings"] is False and "norm_output" not in config
    assert (served / "model.safetensors").is_file()
    # with a smaller draft vocabulary (--draft-vocab) the drafter carries its map to the target's ids
    small = training_draft_config(draft_config, 1024, tmp_path / "train")
    small_checkpoint = write_untrained_checkpoint(small, tmp_path / "E-small", seed=0)
    assert specforge_main(["export", "--to", "sglang", "--checkpoint", str(small_checkpoint), "--draft-config",
                           str(small), "--output-dir", str(tmp_path / "served-small")]) == 0
    assert json.loads((tmp_path / "served-small" / "config.json").read_text())["draft_vocab_size"] == 1024
    with safe_open(str(tmp_path / "served-small" / "model.safetensors"), "pt") as weights:
        assert weights.get_slice("d2t").get_shape() == [1024] and weights.get_slice("lm_head.weight").get_shape()[0] == 1024

    fixed = tmp_path / "fixed"
    fixed.mkdir()
    (fixed / "config.json").write_text((served / "config.json").read_text())
    served_config(fixed, {"eagle_aux_hidden_state_layer_ids": PRE_NORM_LAYERS, "use_aux_hidden_state": True})
    flagged, passed = check_drafters([served, fixed], run_b)
    assert not flagged["passed"] and flagged["verdict"].startswith(f"FAIL {served}:"), flagged
    assert f"to {PRE_NORM_LAYERS}" in flagged["verdict"]
    assert passed["passed"] and passed["verdict"].startswith(f"PASS {fixed}:"), passed


def test_prompt_results_read_sglang_meta_info():
    outputs = [
        {"meta_info": {"spec_verify_ct": 10, "spec_num_correct_drafts": 17, "completion_tokens": 27},
         "output_ids": [5, 6, 7]},
        {"meta_info": {"completion_tokens": 1}, "output_ids": [9]},  # no verify step: SGLang omits the keys
    ]
    first, second = prompt_results(outputs)
    assert (first.verify_ct, first.correct_drafts, first.completion_tokens) == (10, 17, 27)
    assert (second.verify_ct, second.correct_drafts) == (0, 0)
    assert first.output_sha != second.output_sha


def test_engines_side_by_side_start_one_after_the_other_holds_its_memory(tmp_path):
    """The next engine starts once the one before holds its GPU memory (SGLang sizes a KV pool from the memory free
    when its engine's load began), the two still serve side by side, and an engine that dies before holding any
    neither hangs the start nor goes unnamed."""
    import engine_stand_ins

    def spec(name: str) -> ServeSpec:
        return ServeSpec(tmp_path, tmp_path, tmp_path / "prompts.jsonl", tmp_path / f"{name}.json", max_new_tokens=8,
                         attention_backend="triton", mem_fraction_static=0.375)

    first, second = spec("A-s0"), spec("A-s1")
    processes = [start_serving(s, engine_stand_ins.engine_taking_its_memory_after_a_second) for s in (first, second)]
    for process, s in zip(processes, (first, second)):
        assert served_results(process, s.out) == []
    one, two = (json.loads(s.out.read_text()) for s in (first, second))
    assert one["holds"] <= two["started"] < one["ended"]
    failing = spec("B-s0")
    process = start_serving(failing, engine_stand_ins.engine_failing_to_start)
    with pytest.raises(RuntimeError, match=r"serving for B-s0 failed \(exit 3\)"):
        served_results(process, failing.out)


def _results(verify, correct, sha: str = "") -> list[PromptResult]:
    return [PromptResult(int(v), int(c), int(v + c), sha) for v, c in zip(verify, correct)]


def test_acceptance_length_and_its_bootstrap():
    # every prompt the same: the interval is the point
    exact = bootstrap_acceptance({"A": {0: _results([10] * 50, [15] * 50)}, "E": {0: _results([10] * 50, [0] * 50)}},
                                 pairs=[("A", "E")], resamples=500)
    assert exact["arms"]["A"]["seeds"]["0"]["acceptance_length"] == 2.5
    assert exact["arms"]["A"]["seeds"]["0"]["ci95"] == [2.5, 2.5] and "pooled" not in exact["arms"]["A"]
    assert exact["arms"]["E"]["seeds"]["0"]["acceptance_length"] == 1.0
    assert exact["differences"]["A-E"]["seeds"]["0"] == {"estimate": 1.5, "ci95": [1.5, 1.5]}
    assert "pooled" not in exact["differences"]["A-E"] and not exact["differences"]["A-E"]["main"]

    # a ratio of sums over prompts, not a mean of per-prompt ratios
    assert acceptance_length(np.array([1, 9]), np.array([3, 0])) == 1.3

    rng = np.random.default_rng(0)
    verify = rng.integers(20, 80, 400)
    a_correct = rng.binomial(verify * 3, 0.5)
    b_correct = np.maximum(a_correct - rng.integers(0, 10, 400), 0)
    report = bootstrap_acceptance({"A": {0: _results(verify, a_correct)}, "B": {0: _results(verify, b_correct)}},
                                  pairs=[("A", "B")], main=[("A", "B")], seed=3)
    for name, entry in report["arms"].items():
        stats = entry["seeds"]["0"]
        low, high = stats["ci95"]
        assert low < stats["acceptance_length"] < high and high - low < 0.2, (name, stats)
    difference = report["differences"]["A-B"]
    low, high = difference["seeds"]["0"]["ci95"]
    assert difference["main"] and 0 < low < difference["seeds"]["0"]["estimate"] < high  # paired: B below A
    assert bootstrap_acceptance({"A": {0: _results(verify, a_correct)}, "B": {0: _results(verify, b_correct)}},
                                pairs=[("A", "B")], main=[("A", "B")], seed=3) == report
    # fewer prompts: a wider interval
    small = bootstrap_acceptance({"A": {0: _results(verify[:40], a_correct[:40])}}, seed=3)
    width = report["arms"]["A"]["seeds"]["0"]["ci95"][1] - report["arms"]["A"]["seeds"]["0"]["ci95"][0]
    assert small["arms"]["A"]["seeds"]["0"]["ci95"][1] - small["arms"]["A"]["seeds"]["0"]["ci95"][0] > width

    with pytest.raises(ValueError, match="different numbers"):
        bootstrap_acceptance({"A": {0: _results([1, 2], [0, 0])}, "B": {0: _results([1], [0])}})
    with pytest.raises(ValueError, match="no verify step"):
        acceptance_length(np.array([0]), np.array([0]))


def test_two_seeds_pooled_and_the_paired_difference_of_the_quantized_arms():
    """Per seed and pooled over seeds (a ratio of sums over every seed's prompts, resampling the same prompts),
    for each arm and for Q-(Q-bf16); pairs with an arm not served are left out."""
    verify = np.full(300, 40)
    q_bf16 = {0: np.full(300, 20), 1: np.full(300, 30)}
    q = {seed: correct + 4 for seed, correct in q_bf16.items()}  # Q above Q-bf16 on every prompt, by 0.1
    q[1][::2] += 8  # seed 1 better on half the prompts: its interval is not a point
    served = {"Q": {s: _results(verify, q[s]) for s in (0, 1)},
              "Q-bf16": {s: _results(verify, q_bf16[s]) for s in (0, 1)}}
    report = bootstrap_acceptance(served, pairs=[("A", "B"), ("Q", "Q-bf16")], main=[("Q", "Q-bf16")], seed=1,
                                  resamples=2000)
    assert report["seeds"] == [0, 1] and list(report["differences"]) == ["Q-(Q-bf16)"]
    arm = report["arms"]["Q-bf16"]
    assert arm["seeds"]["0"]["acceptance_length"] == 1.5 and arm["seeds"]["1"]["acceptance_length"] == 1.75
    assert arm["pooled"]["acceptance_length"] == 1.625 and arm["pooled"]["ci95"] == [1.625, 1.625]
    assert arm["pooled"]["verify_steps"] == 2 * 300 * 40
    difference = report["differences"]["Q-(Q-bf16)"]
    assert difference["pair"] == ["Q", "Q-bf16"] and difference["main"]
    assert difference["seeds"]["0"] == {"estimate": pytest.approx(0.1), "ci95": [pytest.approx(0.1)] * 2}
    low, high = difference["seeds"]["1"]["ci95"]
    assert difference["seeds"]["1"]["estimate"] == pytest.approx(0.2) and 0.1 < low < 0.2 < high
    pooled = difference["pooled"]
    assert pooled["estimate"] == pytest.approx(0.15) and 0.1 < pooled["ci95"][0] < 0.15 < pooled["ci95"][1] < 0.2


def test_train_metrics_and_the_curve_are_read_from_specforge_console_lines():
    log = ("noise\nstep 10: {'acc_0': 0.25, 'loss': 3.5, 'acc': 0.2, 'lr': 1e-05}\n"
           "step 20: {'acc_0': 0.5, 'loss': 2.25, 'acc': 0.4, 'lr': 2e-05}\nSaved checkpoint\n"
           "step 30: {'acc_0': 0.75, 'loss': 1.5, 'acc': 0.6, 'lr': 2e-05, 'perf/optimizer_step_time_s': 0.1}\n")
    assert last_train_metrics(log) == {"step": 30, "acc_0": 0.75, "loss": 1.5, "acc": 0.6, "lr": 2e-05,
                                       "perf/optimizer_step_time_s": 0.1}
    assert last_train_metrics("no steps") == {} and train_curve("no steps", 20) == []
    first, second = train_curve(log, steps_per_epoch=20)  # steps 1-20 are epoch 1
    assert first == {"epoch": 1, "steps": [10, 20], "mean_loss": 2.875, "loss": 2.25, "mean_acc": pytest.approx(0.3),
                     "acc": 0.4, "mean_acc_0": 0.375, "acc_0": 0.5}
    assert second["epoch"] == 2 and second["steps"] == [30, 30] and second["mean_acc"] == 0.6
    assert [point["epoch"] for point in train_curve(log, steps_per_epoch=0)] == [1]


def _record(work: Path, name: str, value: dict) -> None:
    (work / "steps" / f"{name}.json").write_text(json.dumps({**value, "seconds": 1.0}))


def test_the_report_of_the_quantized_arms_over_two_seeds(tmp_path, capsys):
    """The report stage over records and served results a run of --arms A,Q,Q-bf16 --seeds 0,1 leaves: each arm
    per seed and pooled, Q-(Q-bf16) first among the differences, Q-bf16 shown with A's training and A's drafter
    check, jobs.check_serving per run, the states' difference, the training curve, the tables."""
    p = Pipeline(parse_args(["--work", str(tmp_path / "work"), "--device", "cpu", "--stages", "report",
                             "--arms", "A,Q,Q-bf16", "--seeds", "0,1", "--training-distribution-eval"]))
    (p.work / "serve").mkdir()
    base = {"Q-bf16": 20, "Q": 24, "A": 28}  # correct drafts per 40 verify steps on every prompt (+4 for seed 1)
    for unit in p.served():  # A-s0 also over fresh prompts of the training distribution: 8 more
        shas = ["x", "y"] * 100 if unit.arm == "Q-bf16" else ["x"] * 200
        correct = base[unit.arm] + 4 * unit.seed + 8 * unit.training_distribution
        prompts = [dataclasses.asdict(PromptResult(40, correct, 60, sha)) for sha in shas]
        answers = [{"prompt": "Name 2 primary colors.", "answer": f"{unit.name}: red | blue\n" + "x" * 300}]
        (p.work / "serve" / f"{unit.name}.json").write_text(json.dumps({"engine": {"quantization": "fp8"},
                                                                         "prompts": prompts, "answers": answers}))
    _record(p.work, "prompts", {"train": 300, "held_out": 200, "prompt_seed": 0})
    _record(p.work, "prepare", {"samples": 300, "tokens": 90000, "loss_tokens_per_epoch": 40000})
    curve = [{"epoch": 1, "steps": [10, 70], "mean_loss": 4.0, "loss": 3.0, "mean_acc": 0.3, "acc": 0.4}]
    for seed in (0, 1):
        for arm, acc in (("A", 0.55), ("Q", 0.6)):
            _record(p.work, f"train-{arm}-s{seed}", {"metrics": {"step": 225, "loss": 1.5, "acc": acc}, "curve": curve})
            verdict = {"passed": True, "verdict": f"PASS {p.work}/drafters/{arm}-s{seed}: SGLang reads ids [1, 14, 26]"}
            _record(p.work, f"check-drafter-{arm}-s{seed}", {str(p.work / "drafters" / f"{arm}-s{seed}"): verdict})
    _record(p.work, "check-serving-Q", {"passed": True, "lines": ["PASS the server runs ..."], "differences": []})
    _record(p.work, "check-serving-A", {"passed": False, "lines": ["DIFF --quantization: ..."],
                                        "differences": ["--quantization"]})
    layers = {"layer 1": {"mean": 0.03, "max": 0.2, "tokens": 1234},
              "final (post_norm)": {"mean": 0.05, "max": 0.3, "tokens": 1234}}
    _record(p.work, "states-Q-bf16-vs-Q", {"q_bf16_vs_q": layers})
    _record(p.work, "states-Q4-bf16-vs-Q4", {"q4_bf16_vs_q4": {name: {**entry, "mean": 2 * entry["mean"]}
                                                               for name, entry in layers.items()}})
    _record(p.work, "probe", {"prompts": 16, "acceptance_length": 1.0})

    results = stage_report(p)
    assert json.loads((p.work / "results.json").read_text()) == json.loads(json.dumps(results))
    table = (p.work / "results.md").read_text()
    assert table in capsys.readouterr().out
    arms = results["acceptance"]["arms"]
    assert list(arms) == ["Q", "Q-bf16", "A"] and results["acceptance"]["prompts"] == 200
    assert [arms["Q"]["seeds"][s]["acceptance_length"] for s in ("0", "1")] == [pytest.approx(1.6), pytest.approx(1.7)]
    assert arms["Q-bf16"]["pooled"]["acceptance_length"] == pytest.approx(1.55)
    assert list(results["acceptance"]["differences"]) == ["Q-(Q-bf16)", "A-Q"]
    assert results["acceptance"]["differences"]["Q-(Q-bf16)"]["pooled"]["estimate"] == pytest.approx(0.1)
    assert results["check_drafter"]["Q-bf16-s1"] == results["check_drafter"]["A-s1"]
    assert results["check_drafter"]["Q-bf16-s1"]["verdict"].startswith(f"PASS {p.work}/drafters/A-s1:")
    assert results["check_serving"]["A"]["command"] == ["--quantization", "fp8", "--attention-backend", "flashinfer"]
    assert results["same_output"] == {"Q-bf16-s0": 0.5, "Q-bf16-s1": 0.5}  # against Q's outputs of the same seed
    assert p.served()[-1].name == "A-s0-train-dist" and not p.served()[-1].final
    assert results["training_distribution_acceptance"]["A-s0"]["acceptance_length"] == pytest.approx(1.9)
    assert arms["A"]["seeds"]["0"]["acceptance_length"] == pytest.approx(1.7)  # the held-out prompts' alone
    # each target's answers from its own arm at the first seed: Q's on fp8, A's on bf16
    assert [(target, [a["answer"][:7] for a in answers]) for target, answers in results["answers"].items()] == [
        ("bf16", ["A-s0: r"]), ("fp8", ["Q-s0: r"])]
    assert set(results["training"]) == {"A-s0", "Q-s0", "A-s1", "Q-s1"} and results["recipe"]["seeds"] == [0, 1]
    assert results["serving"]["engines"]["Q-s0"] == {"quantization": "fp8"} and results["probe"]["prompts"] == 16
    for row in ("| Q | ours, extracted with the quantized server's settings (model.serving) | fp8 | 0 "
                "| **1.600** (1.600-1.600) | 1.500 / 0.600 | 225 | PASS |",
                "| Q-bf16 | A's drafter (our bf16 states: any bf16 path), served on the quantized target "
                "| fp8 | 1 "
                "| **1.600** (1.600-1.600) | 1.500 / 0.550 (A's) | 225 | PASS |",
                "| A | | bf16 | pooled | **1.750** (1.750-1.750) | | | |",
                "| **Q-(Q-bf16)** | 0 | +0.100 (+0.100 to +0.100) |", "| **Q-(Q-bf16)** | pooled | +0.100",
                "| A-Q | 1 | +0.100", "| A | FAIL | --quantization |", "| Q | PASS | - |",
                "| our bf16 states (A) vs the quantized target's, per-token relative difference (fp8 (Q) 1,234, "
                "INT4 (Q4) 1,234 tokens) | fp8 (Q) mean | fp8 (Q) max | INT4 (Q4) mean | INT4 (Q4) max |",
                "| final (post_norm) | 0.0500 | 0.3000 | 0.1000 | 0.3000 |",
                "| Q-s1 | 1 | 10-70 | 4.000 | 0.300 |  | 0.400 |",
                "| held-out prompt | answer on the bf16 target | answer on the fp8 target |",
                f"| Name 2 primary colors. | A-s0: red \\| blue {'x' * 143}... | Q-s0: red \\| blue {'x' * 143}... |",
                "Quantized target fp8: the bf16 checkpoint served with `--quantization fp8 --attention-backend "
                "flashinfer`", "an untrained drafter served on the fp8 target over 16 prompts, acceptance 1.000",
                "| A-s0 | 1.700 (1.700-1.700) | 1.900 (1.900-1.900) |"):
        assert row in table, row
    assert table.index("**Q-(Q-bf16)**") < table.index("| A-Q |")


def test_each_drafter_exports_with_the_config_it_trained_with(tmp_path):
    """--draft-vocab: a trained arm exports with the copy of its run's drafter config it trained with, arm E's
    untrained checkpoint with the run's own; a command asking for another vocabulary than the recorded trainings'
    is refused before anything is exported."""
    def pipeline(*args: str) -> Pipeline:
        return Pipeline(parse_args(["--work", str(tmp_path / "work"), "--device", "cpu", "--stages", "drafters",
                                    "--arms", "A,E", *args]))

    p = pipeline("--draft-vocab", "1024")
    p.run_dir("A").mkdir(parents=True)
    write_json({"vocab_size": 49152, "draft_vocab_size": 49152, "eagle_config": {}}, p.draft_config("A"))
    _record(p.work, "train-A-s0", {"metrics": {}, "curve": [], "ttt_length": 7, "draft_vocab": 1024,
                                   "warm_head": False})
    _record(p.work, "train-E-s0", {"checkpoint": str(p.train_dir("E", 0) / "training_state.pt")})
    calls = []
    p.run_jobs = lambda jobs, at_once: calls.append(jobs)  # the commands, not their runs
    stage_drafters(p)
    exports = {name: job.command[job.command.index("--draft-config") + 1] for name, job in calls[0].items()}
    assert exports == {"drafter-A-s0": str(p.work / "train" / "A-draft-vocab-1024.json"),
                       "drafter-E-s0": str(p.draft_config("A"))}
    assert json.loads((p.work / "train" / "A-draft-vocab-1024.json").read_text())["draft_vocab_size"] == 1024
    # a map made from A's features goes when they are exported again (not while their export is recorded)
    (p.work / "train" / "vocab-A-1024.pt").write_bytes(b"map")
    _record(p.work, "export-A", {})
    stage_features(p)  # run_jobs stubbed: nothing is exported
    assert (p.work / "train" / "vocab-A-1024.pt").is_file()
    (p.work / "steps" / "export-A.json").unlink()
    stage_features(p)
    assert not (p.work / "train" / "vocab-A-1024.pt").exists()
    for other in (pipeline(), pipeline("--draft-vocab", "1024", "--ttt-length", "4"),
                  pipeline("--draft-vocab", "1024", "--warm-head")):
        other.run_jobs = lambda jobs, at_once: pytest.fail("exported drafters of another recipe")
        with pytest.raises(ValueError, match="step train-A-s0 was trained with --ttt-length 7 --draft-vocab 1024 "
                                             "without --warm-head: run with those"):
            stage_drafters(other)


def test_runs_and_exports_that_the_disk_cannot_hold_are_refused_before_the_first_extraction(tmp_path):
    work = tmp_path / "work"
    (work / "model").mkdir(parents=True)
    (work / "model" / "config.json").write_text(json.dumps({"hidden_size": 576}))
    (work / "steps").mkdir()
    p = Pipeline(parse_args(["--work", str(work), "--device", "cpu", "--stages", "extract", "--arms", "A,B"]))
    free = shutil.disk_usage(work).free
    per_copy = 4 * 576 * 2  # bytes a token: three layers and the final state, bf16
    _record(work, "prepare", {"tokens": free // per_copy})  # one copy alone fills the disk; four are to write
    with pytest.raises(ValueError, match=r"runs A, B and exports A, B need about .* GB free: run with fewer "
                                         r"--train-prompts"):
        stage_extract(p)
    assert not (work / "logs").exists(), "refused before any extraction ran"
    for done in ("extract-A", "extract-B", "export-A"):  # what is written already needs no room
        _record(work, done, {})
    _record(work, "prepare", {"tokens": free // per_copy // 2})
    check_disk(p)  # export B alone: half the free space


def test_the_command_records_each_step_and_skips_it_on_a_rerun(tmp_path):
    work = tmp_path / "work"
    work.mkdir()
    (work / "model").symlink_to(checkpoint_dir())  # the checkpoint step finds it made

    def run(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "benchmarks.acceptance", "--work", str(work), *args], cwd=REPO_ROOT,
                              env=project_env(), capture_output=True, text=True, timeout=300)

    # arms not served on the INT4 target: the checkpoint stage makes no INT4 checkpoint (test_quantize_int4.py's)
    first = run("--stages", "checkpoint,prompts", "--device", "cpu", "--train-prompts", "300", "--eval-prompts", "200",
                "--arms", "A,Q,Q-bf16")
    assert first.returncode == 0, first.stderr[-2000:]
    assert "prompts: " in first.stdout and "checkpoint: " in first.stdout  # what a device call shows
    records = {path.name: path.read_text() for path in (work / "steps").iterdir()}
    assert sorted(records) == ["checkpoint.json", "prompts.json"]
    assert json.loads(records["prompts.json"])["held_out"] == 200
    assert len((work / "prompts" / "train.jsonl").read_text().splitlines()) == 300
    again = run("--stages", "checkpoint,prompts", "--device", "cpu", "--train-prompts", "300", "--eval-prompts", "200",
                "--arms", "A,Q,Q-bf16")
    assert again.returncode == 0 and {p.name: p.read_text() for p in (work / "steps").iterdir()} == records
    late = run("--stages", "prompts,extract", "--device", "cpu", "--deadline-s", "1e-9")
    assert late.returncode == EXIT_MORE_TO_DO and "stopped before step extract-Q" in late.stderr  # Q's run first
    refused = run("--stages", "train", "--device", "cpu")
    assert refused.returncode == 2 and "run on CUDA only" in refused.stderr
    unknown = run("--stages", "prompts", "--device", "cpu", "--arms", "A,Q-fp16")
    assert unknown.returncode == 2 and "unknown arms ['Q-fp16']" in unknown.stderr
    too_few = run("--stages", "prompts", "--device", "cpu", "--work", str(tmp_path / "other"), "--eval-prompts", "50")
    assert too_few.returncode == 2 and "at least 200" in too_few.stderr


def test_held_out_prompts_are_rendered_with_the_generation_prompt(tmp_path):
    import transformers

    tokenizer = transformers.AutoTokenizer.from_pretrained(str(checkpoint_dir()))
    prompts = tmp_path / "eval.jsonl"
    prompts.write_text(json.dumps({"prompt": "What is 12 times 7?"}) + "\n")
    (ids,) = render_prompts(tokenizer, prompts)
    text = tokenizer.decode(ids)
    assert text.endswith("<|im_start|>user\nWhat is 12 times 7?<|im_end|>\n<|im_start|>assistant\n"), text
    assert text.startswith("<|im_start|>system\n")  # SmolLM2's template adds its default system prompt


def test_engine_arguments_are_sglang_server_args():
    """Every argument the serving engine gets is a field of the installed SGLang's ServerArgs (0.5.23 here,
    a msgspec Struct; 0.5.17, which serves on the H200, a dataclass with the same names: checked by hand); the
    quantized target's engine takes what its serving command sets that reaches the forward, as SGLang's parser
    reads it, and keeps the benchmark's own drafting settings."""
    from sglang.srt.server_args import ServerArgs

    fields = set(getattr(ServerArgs, "__struct_fields__", ())) or {field.name for field in dataclasses.fields(ServerArgs)}
    args = engine_args(Path("/target"), Path("/drafter"), "flashinfer", 0.15)
    assert set(args) <= fields, set(args) - fields
    assert (args["speculative_num_steps"], args["speculative_eagle_topk"], args["speculative_num_draft_tokens"]) == (3, 1, 4)
    assert args["speculative_algorithm"] == "EAGLE3" and args["disable_cuda_graph"] is True
    assert (args["dtype"], args["attention_backend"]) == ("bfloat16", "flashinfer") and "quantization" not in args

    serving = ["sglang", "serve", "--quantization", "fp8", "--attention-backend", "triton", "--port", "30000",
               "--speculative-num-steps", "5", "--speculative-draft-model-quantization", "unquant"]
    quantized = engine_args(Path("/target"), Path("/drafter"), "flashinfer", 0.375, serving)
    assert set(quantized) <= fields, set(quantized) - fields
    assert quantized == {**args, "quantization": "fp8", "attention_backend": "triton", "mem_fraction_static": 0.375,
                         "speculative_draft_model_quantization": "unquant"}


def test_data_stats_count_the_tokens_specforge_trains_on(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"input_ids": [[1, 2, 3, 4], [5, 6, 7]], "loss_mask": [[0, 1, 1, 1], [0, 1, 0]],
                             "conversation_id": [0, 1]}), tmp_path / "part-0.parquet")
    (tmp_path / "prepare.json").write_text("{}")  # a side record is not data
    assert prepared_data(tmp_path) == str(tmp_path / "*.parquet")
    # SpecForge cuts each sample to max_length and zeroes the last loss-mask entry
    assert data_stats(tmp_path, max_length=3) == {"samples": 2, "tokens": 7, "loss_tokens_per_epoch": 2}
    assert data_stats(tmp_path, max_length=2048)["loss_tokens_per_epoch"] == 3


def _write_run(run: Path, shards: dict[str, list[int]], scale: dict[str, float], seed: int = 0) -> None:
    """Shard files of a run (float32, layers [1, 14, 26] of width 8, post-norm final state); every state
    multiplied by ``scale`` of its layer (or of "final")."""
    meta = ShardMetadata(dtype="float32", state_dtype="float32", hidden_size=8, layer_ids=[1, 14, 26],
                         layers_to_capture=[2, 15, 27], drafter_layer_ids=[1, 14, 26], last_hidden_state="post_norm",
                         model_path="/m", model_architecture="LlamaForCausalLM", sglang_version="0.5.23", tp_size=1)
    generator = torch.Generator().manual_seed(seed)
    for name, sample_ids in shards.items():
        lengths = [3 + sample_id % 4 for sample_id in sample_ids]
        aux = torch.randn(sum(lengths), 24, generator=generator) + 2
        last = torch.randn(sum(lengths), 8, generator=generator) + 2
        for j, layer in enumerate((1, 14, 26)):
            aux[:, j * 8:(j + 1) * 8] *= scale.get(f"layer {layer}", 1.0)
        last *= scale.get("final", 1.0)
        with ShardWriter(run / name, meta) as writer:
            writer.append(sample_ids, [np.arange(n, dtype=np.int32) for n in lengths],
                          [np.ones(n, dtype=np.uint8) for n in lengths], aux.numpy(), last.numpy())
            writer.finalize()


def test_how_far_one_runs_states_are_from_anothers_per_layer(tmp_path):
    """What Q-bf16's report row is made of: per layer and for the final state, the mean and largest per-token
    ||other - reference|| / ||reference|| over every token of two runs of the same samples."""
    shards = {"shard-00000.parquet": [0, 1, 2], "shard-00001.parquet": [3, 4]}
    _write_run(tmp_path / "Q", shards, {})
    _write_run(tmp_path / "A", shards, {"layer 1": 1.01, "layer 26": 0.9, "final": 1.5})  # same draws, scaled
    tokens = sum(3 + i % 4 for i in range(5))
    report = run_differences(tmp_path / "Q", tmp_path / "A")
    assert list(report) == ["layer 1", "layer 14", "layer 26", "final (post_norm)"]
    for name, expected in (("layer 1", 0.01), ("layer 14", 0.0), ("layer 26", 0.1), ("final (post_norm)", 0.5)):
        assert report[name]["mean"] == pytest.approx(expected, abs=1e-6), (name, report[name])
        assert report[name]["max"] == pytest.approx(expected, abs=1e-6) and report[name]["tokens"] == tokens
    assert all(d["mean"] == 0 for d in run_differences(tmp_path / "A", tmp_path / "A").values())
    assert differences_main([str(tmp_path / "Q"), str(tmp_path / "A"), str(tmp_path / "out.json")]) == 0
    assert json.loads((tmp_path / "out.json").read_text()) == report

    _write_run(tmp_path / "other", {"shard-00000.parquet": [0, 1, 2], "shard-00001.parquet": [3, 5]}, {})
    with pytest.raises(ValueError, match="different samples per shard file"):
        run_differences(tmp_path / "Q", tmp_path / "other")
    with pytest.raises(ValueError, match="no shard-"):
        run_differences(tmp_path / "empty", tmp_path / "Q")


def test_commands_side_by_side_are_each_recorded_and_every_failure_named(tmp_path):
    p = Pipeline(parse_args(["--work", str(tmp_path / "work"), "--device", "cpu", "--stages", "prompts"]))

    def python(code: str) -> list[str]:
        return [sys.executable, "-c", code]

    jobs = {
        "said": Job(python("print('hello')"), result=lambda output, code: {"said": output.strip()}),
        "verdict": Job(python("import sys, time; time.sleep(2); print('FAIL x'); sys.exit(1)"), ok=(0, 1),
                       result=lambda output, code: {"code": code}),
        "broken": Job(python("import sys; print('no luck'); sys.exit(3)")),
        "late": Job(python("import time; time.sleep(0.5); print('late')"), result=lambda output, code: {"ok": 1}),
    }
    with pytest.raises(RuntimeError, match=r"broken \(exit 3\): .*broken.log\nno luck"):
        p.run_jobs(jobs, at_once=3)
    # the others ran to their end and are recorded; no job starts after a failure (though a slot was free while
    # "verdict" still ran)
    assert p.record("said")["said"] == "hello" and p.record("verdict")["code"] == 1 and p.record("broken") is None
    assert p.record("late") is None and (p.work / "logs" / "verdict.log").read_text() == "FAIL x\n"
    # a rerun runs only what is not recorded
    (p.work / "logs" / "said.log").unlink()
    jobs["broken"] = Job(python("print('fixed')"))
    p.run_jobs(jobs, at_once=1)
    assert not (p.work / "logs" / "said.log").exists() and p.record("broken") is not None and p.record("late")["ok"]
    # past the deadline nothing starts
    p.args.deadline_s = 1e-9
    with pytest.raises(OutOfTime, match="first"):
        p.run_jobs({"first": Job(python("")), "second": Job(python(""))}, at_once=2)
    assert p.record("first") is None


def test_the_background_run_goes_to_its_end_and_a_status_call_collects_it(tmp_path):
    """The benchmark started in a session of its own runs every stage asked for to the end; status waits for
    it, says where it stands and copies what it left into a folder; a refused start starts nothing; a run that
    died is told apart."""
    work = tmp_path / "work"
    work.mkdir()
    (work / "model").symlink_to(checkpoint_dir())  # the checkpoint step finds it made

    def background(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "benchmarks.acceptance.background", *args], cwd=tmp_path,
                              env=project_env(), capture_output=True, text=True, timeout=300)

    arguments = ["--work", str(work), "--device", "cpu", "--stages", "checkpoint,prompts", "--train-prompts", "300",
                 "--eval-prompts", "200", "--arms", "A,Q,Q-bf16"]  # no arm on the INT4 target: no INT4 checkpoint
    refused = background("start", *arguments, "--arms", "Z")
    assert refused.returncode == 2 and "unknown arms" in refused.stderr and not (work / "background").exists()
    started = background("start", *arguments)
    assert started.returncode == 0 and "started the benchmark in the background" in started.stdout, started.stderr
    pid = json.loads((work / "background" / "started.json").read_text())["pid"]
    try:
        done = background("status", "--work", str(work), "--wait-s", "240", "--collect", str(tmp_path / "out"))
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)  # only if it outlived the wait
    assert done.returncode == 0, done.stdout + done.stderr
    assert "finished with exit code 0 after" in done.stdout and "stage finished" in done.stdout
    assert "steps done (2): checkpoint" in done.stdout and "step prompts done" in done.stdout  # the log's tail
    collected = sorted(str(path.relative_to(tmp_path / "out")) for path in (tmp_path / "out").rglob("*"))
    assert collected == ["exit.json", "log-tail.txt", "progress.json", "steps.json"]
    steps = json.loads((tmp_path / "out" / "steps.json").read_text())
    assert sorted(steps) == ["checkpoint", "prompts"]
    assert len((work / "prompts" / "train.jsonl").read_text().splitlines()) == 300
    held_out = (work / "prompts" / "eval.jsonl").read_bytes()
    assert len(held_out.splitlines()) == 200 and steps["prompts"]["held_out_sha256"] == hashlib.sha256(held_out).hexdigest()

    # still running (a live pid, no exit record): the steps so far are collected, no results yet
    (work / "background" / "exit.json").unlink()
    record = json.loads((work / "background" / "started.json").read_text())
    (work / "background" / "started.json").write_text(json.dumps({**record, "pid": os.getpid()}))
    (work / "results.json").write_text("{}")  # an earlier run's results: not this run's
    running = background("status", "--work", str(work), "--collect", str(tmp_path / "midway"))
    assert running.returncode == 3 and "running (pid" in running.stdout, running.stdout + running.stderr
    midway = sorted(str(path.relative_to(tmp_path / "midway")) for path in (tmp_path / "midway").rglob("*"))
    assert midway == ["log-tail.txt", "progress.json", "steps.json"]

    # killed: its pid gone without an exit record
    dead = subprocess.Popen([sys.executable, "-c", ""])
    dead.wait()
    record = json.loads((work / "background" / "started.json").read_text())
    (work / "background" / "started.json").write_text(json.dumps({**record, "pid": dead.pid}))
    lost = background("status", "--work", str(work))
    assert lost.returncode == 4 and "no exit code recorded: it was killed" in lost.stdout
    nothing = background("status", "--work", str(tmp_path / "nowhere"))
    assert nothing.returncode == 4 and "no background run" in nothing.stdout


def test_a_run_cut_short_is_reported_elsewhere_from_what_a_status_call_collected(tmp_path):
    """A run whose machine went before its report stage: what a status call collected (the step records, each
    finished engine's results with the run's own arguments) builds the report on CPU in a new directory, with the
    versions the engines served with, naming the engine never served; a directory that exists is refused."""
    work = tmp_path / "work"
    run_argv = ["--work", str(work), "--device", "cuda", "--gguf", "/root/offline/x.gguf", "--arms", "A,B",
                "--seeds", "0,1", "--stages=checkpoint,prompts,prepare,extract,features,train,drafters,serve,report",
                "--batch-size", "32", "--out", str(work / "results.json")]
    p = Pipeline(parse_args(["--work", str(work), "--device", "cpu", "--stages", "report", "--arms", "A,B",
                             "--seeds", "0,1"]))
    (work / "serve").mkdir()
    (work / "background").mkdir()
    for unit in p.served()[:3]:  # the machine went while B-s1 was served
        prompts = [dataclasses.asdict(PromptResult(40, 20 + 8 * (unit.arm == "A") + 4 * unit.seed, 60, "x"))] * 50
        write_json({"engine": {"dtype": "bfloat16"}, "versions": {"sglang": "0.5.17"}, "prompts": prompts,
                    "answers": []}, work / "serve" / f"{unit.name}.json")
    _record(work, "prompts", {"train": 300, "held_out": 50, "prompt_seed": 0})
    _record(work, "prepare", {"samples": 300, "tokens": 90000, "loss_tokens_per_epoch": 40000})
    for unit in p.served():
        _record(work, f"train-{unit.name}", {"metrics": {"step": 225, "loss": 1.5, "acc": 0.6}, "curve": [],
                                             "ttt_length": 7, "draft_vocab": 0, "warm_head": False})
    write_json({"pid": 2 ** 22 + 1, "started": 0.0, "argv": run_argv, "out": str(work / "results.json")},
               work / "background" / "started.json")

    def background(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "benchmarks.acceptance.background", *args], cwd=tmp_path,
                              env=project_env(), capture_output=True, text=True, timeout=120)

    lost = background("status", "--work", str(work), "--collect", str(tmp_path / "out"))
    assert lost.returncode == 4 and "served.json" in lost.stdout, lost.stdout + lost.stderr
    assert sorted(json.loads((tmp_path / "out" / "served.json").read_text())["engines"]) == ["A-s0", "A-s1", "B-s0"]

    local = tmp_path / "local"
    built = background("report", "--collected", str(tmp_path / "out"), "--work", str(local))
    assert built.returncode == 0, built.stdout + built.stderr
    assert "--gguf /root/offline/x.gguf --arms A,B --seeds 0,1 --batch-size 32 --work" in built.stdout
    results = json.loads((local / "results.json").read_text())
    assert results["not_served"] == ["B-s1"] and results["versions"] == {"sglang": "0.5.17"}
    arms = results["acceptance"]["arms"]
    assert arms["A"]["pooled"]["acceptance_length"] == pytest.approx(1.75) and list(arms["B"]["seeds"]) == ["0"]
    assert results["acceptance"]["differences"]["A-B"]["seeds"]["0"]["estimate"] == pytest.approx(0.2)
    assert "pooled" not in results["acceptance"]["differences"]["A-B"]  # only seed 0 has both arms
    assert "Not served (the run ended before them): B-s1." in (local / "results.md").read_text()
    assert not (work / "results.json").exists()  # the run's own directory is left as it was

    again = background("report", "--collected", str(tmp_path / "out"), "--work", str(local))
    assert again.returncode == 2 and "exists" in again.stderr
    nothing = background("report", "--collected", str(tmp_path / "nowhere"), "--work", str(tmp_path / "other"))
    assert nothing.returncode == 2 and "lacks steps.json" in nothing.stderr and not (tmp_path / "other").exists()


def _collected_run(folder: Path, seeds: str, results: dict[str, int], extra: Sequence[str] = (),
                   held_out_sha256: Optional[str] = "same") -> Path:
    """What a status call brings back from a run of arms A and B over ``seeds``: its step records and each engine's
    per-prompt results (``results``: engine name to correct drafts per 40 verify steps, over 50 prompts)."""
    argv = ["--work", "/root/acceptance", "--device", "cuda", "--arms", "A,B", "--seeds", seeds, "--batch-size", "32",
            "--lr", "1e-3", *extra]
    engines = {name: {"engine": {"dtype": "bfloat16"}, "versions": {"sglang": "0.5.17"}, "answers": [],
                      "prompts": [dataclasses.asdict(PromptResult(40, correct, 60, "x"))] * 50}
               for name, correct in results.items()}
    prompts = {"train": 300, "held_out": 50, "prompt_seed": 0, "seconds": 1.0}
    steps = {"prompts": prompts | ({"held_out_sha256": held_out_sha256} if held_out_sha256 else {}),
             "prepare": {"samples": 300, "tokens": 90000 + int(seeds[0]), "loss_tokens_per_epoch": 40000,
                         "seconds": 2.0}}
    steps |= {f"train-{name}": {"metrics": {"step": 225, "loss": 1.5, "acc": 0.6}, "curve": [], "ttt_length": 7,
                                "draft_vocab": 0, "warm_head": False, "seconds": 3.0} for name in results}
    folder.mkdir()
    write_json(steps, folder / "steps.json")
    write_json({"argv": argv, "engines": engines}, folder / "served.json")
    return folder


def test_one_report_pools_the_runs_of_each_seed_and_refuses_runs_that_do_not_pair(tmp_path):
    """Seed 0 served on one machine, seed 1 on another (one run per machine's half hour): the report over both
    folders gives each arm per seed and pooled, and A-B per seed and pooled, as one run of both seeds would; runs of
    another recipe, with other held-out prompts or serving the same engine twice are refused, naming the folder."""
    first = _collected_run(tmp_path / "seed0", "0", {"A-s0": 28, "B-s0": 20})
    second = _collected_run(tmp_path / "seed1", "1", {"A-s1": 32, "B-s1": 24})

    def report(*folders: Path, work: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "benchmarks.acceptance.background", "report", "--collected",
                               *map(str, folders), "--work", str(tmp_path / work)], cwd=tmp_path, env=project_env(),
                              capture_output=True, text=True, timeout=120)

    built = report(first, second, work="both")
    assert built.returncode == 0, built.stdout + built.stderr
    assert "from 2 runs" in built.stdout and "--arms A,B --seeds 0,1 --batch-size 32 --lr 1e-3" in built.stdout
    assert "step prepare recorded other values" in built.stdout  # each machine regenerated its own answers
    results = json.loads((tmp_path / "both" / "results.json").read_text())
    assert results["not_served"] == [] and results["data"]["tokens"] == 90000  # the first folder's
    arms = results["acceptance"]["arms"]
    assert arms["A"]["seeds"]["1"]["acceptance_length"] == pytest.approx(1.8)
    assert arms["A"]["pooled"]["acceptance_length"] == pytest.approx(1.75)
    assert arms["B"]["pooled"]["acceptance_length"] == pytest.approx(1.55)
    assert results["acceptance"]["differences"]["A-B"]["pooled"]["estimate"] == pytest.approx(0.2)
    assert sorted(results["training"]) == ["A-s0", "A-s1", "B-s0", "B-s1"]

    # how a run was scheduled is not what it measured; an option's other spelling is the same option; a run
    # recorded before the prompts' digest was kept is taken on its arguments
    rescheduled = _collected_run(tmp_path / "rescheduled", "2", {"A-s2": 30, "B-s2": 22},
                                 extra=["--deadline-s", "1500", "--serve-parallel", "1", "--learning-rate", "0.001"],
                                 held_out_sha256=None)
    pooled = report(first, rescheduled, work="report-rescheduled")
    assert pooled.returncode == 0 and "recorded no digest" in pooled.stdout, pooled.stdout + pooled.stderr
    other_recipe = _collected_run(tmp_path / "lr", "1", {"A-s1": 32, "B-s1": 24}, extra=["--lr", "3e-4"])
    refused = report(first, other_recipe, work="report-recipe")
    assert refused.returncode == 2 and "in more than its seeds: learning_rate 0.0003 against 0.001" in refused.stderr
    assert str(other_recipe) in refused.stderr
    other_prompts = _collected_run(tmp_path / "prompts", "1", {"A-s1": 32, "B-s1": 24}, held_out_sha256="other")
    refused = report(first, other_prompts, work="report-prompts")
    assert refused.returncode == 2 and "held out other prompts" in refused.stderr
    twice = report(first, _collected_run(tmp_path / "again", "0,1", {"A-s0": 28, "A-s1": 30}), work="report-twice")
    assert twice.returncode == 2 and "(A-s0)" in twice.stderr
    assert not any((tmp_path / work).exists() for work in ("report-recipe", "report-prompts", "report-twice"))


STAND_IN = ["--dtype", "float32", "--json-model-override-args", '{"rms_norm_eps": 0.5}']
"""The quantized server's command on CPU (fp8 needs AMX, which this CPU lacks): a setting that changes the
states here as fp8 does on the H200."""


@pytest.mark.extended
def test_the_quantized_run_its_serving_checks_and_how_far_a_bf16_run_is(ray_cluster, run_a, tmp_path,
                                                                        tmp_path_factory):
    """On CPU with a stand-in serving command: Q's extraction takes it as model.serving; jobs.check_serving of
    that command passes on Q's run and names the one setting A's run lacks; A's states differ from Q's."""
    work = tmp_path / "work"
    (work / "runs").mkdir(parents=True)
    (work / "model").symlink_to(checkpoint_dir())
    (work / "data").mkdir()
    (work / "data" / "part-00000.parquet").symlink_to(chat_dataset(tmp_path_factory))  # A's data
    (work / "runs" / "A").symlink_to(run_a)  # arm A's run as the benchmark would make it, float32 here
    p = Pipeline(parse_args(["--work", str(work), "--device", "cpu", "--stages", "extract", "--arms", "Q-bf16",
                             "--dtype", "float32", "--quantized-serving", shlex.join(STAND_IN),
                             "--extract-set", f"ray.address={session_ray_address()}",
                             "--extract-set", "output.min_free=1GB"]))
    _record(work, "extract-A", {})
    stage_extract(p)
    assert p.record("extract-Q")["samples"] == 8
    content = read_manifest(work / "runs" / "Q")["content"]
    assert content["model.serving"] == {"json_model_override_args": STAND_IN[-1]}
    assert content["model.dtype"] == "float32"

    p.run_jobs({**serving_checks(p), **state_difference(p)}, at_once=3)  # as the drafters and train stages run them
    passed, failed = p.record("check-serving-Q"), p.record("check-serving-A")
    assert passed["passed"] and passed["differences"] == [] and passed["lines"][-1].startswith("PASS"), passed
    assert not failed["passed"] and failed["differences"] == ["--json-model-override-args"], failed

    report = p.record("states-Q-bf16-vs-Q")["q_bf16_vs_q"]
    tokens = sum(sample.input_ids.numel() for path in run_a.glob("shard-*.parquet") for sample in ShardReader(path))
    assert all(entry["tokens"] == tokens and entry["mean"] > 1e-3 for entry in report.values()), report
