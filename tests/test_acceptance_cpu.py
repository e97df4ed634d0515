"""The pieces of the acceptance benchmark (benchmarks/acceptance/) that run without a GPU: the prompts,
the arms' layers and HF-path states, SpecForge 0.2.0's own config, trainer (up to FSDP, which needs an
accelerator) and exporter on our export, the served configs through jobs.check_drafter, and the
bootstrap. Serving with SGLang's EAGLE3 and the regeneration (jobs.prepare) run on the H200 only."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml

from benchmarks.acceptance.arms import DRAFT_CONFIG_RUN, LAYERS, arm_b_layers, extract_overrides, states_run
from benchmarks.acceptance.data import data_stats, prepared_data
from benchmarks.acceptance.drafters import check_drafters, served_config
from benchmarks.acceptance.hf_states import write_hf_features
from benchmarks.acceptance.pipeline import EXIT_MORE_TO_DO, project_env
from benchmarks.acceptance.prompts import compose_prompts, render_prompts, split_prompts, write_conversations
from benchmarks.acceptance.report import markdown
from benchmarks.acceptance.serving import PromptResult, engine_args, prompt_results
from benchmarks.acceptance.stats import acceptance_length, bootstrap_acceptance
from benchmarks.acceptance.trainer import (
    Recipe,
    last_train_metrics,
    specforge_command,
    specforge_env,
    specforge_pythonpath,
    specforge_run_config,
    write_untrained_checkpoint,
)
from storage import ShardReader
from tests.conftest import REPO_ROOT
from tests.helpers import (
    POST_NORM_LAYERS,
    PRE_NORM_LAYERS,
    checkpoint_dir,
    post_norm_run,
    pre_norm_run,
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
    tests/test_real_weights.py: whichever file comes first makes them."""
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


def test_prompts_are_varied_distinct_disjoint_and_reproducible():
    train, held_out = split_prompts(3000, 256, seed=0)
    assert (len(train), len(held_out)) == (3000, 256)
    assert len(set(train)) == 3000 and len(set(held_out)) == 256 and not set(train) & set(held_out)
    assert split_prompts(3000, 256, seed=0) == (train, held_out)
    _, other_held_out = split_prompts(3000, 256, seed=1)
    assert other_held_out != held_out and len(set(other_held_out) & set(held_out)) < 50
    # the kinds of task (a template's opening word: 13 of them) on both sides of the split
    kinds = {prompt.split()[0] for prompt in compose_prompts(400, 5)}
    assert len(kinds) == 13 and {prompt.split()[0] for prompt in train} == kinds
    assert len({prompt.split()[0] for prompt in held_out}) >= 11
    with pytest.raises(ValueError, match="at least 200"):
        split_prompts(1000, 100, seed=0)


def test_conversations_are_one_user_turn_each(tmp_path):
    path = tmp_path / "train.jsonl"
    write_conversations(["Hi there", "Name a color."], path)
    assert [json.loads(line) for line in path.read_text().splitlines()] == [
        {"messages": [{"role": "user", "content": "Hi there"}]},
        {"messages": [{"role": "user", "content": "Name a color."}]},
    ]


def test_arm_layers_and_the_runs_they_are_checked_against():
    assert arm_b_layers(LAYERS) == PRE_NORM_LAYERS == [0, 13, 25]
    assert list(LAYERS) == POST_NORM_LAYERS
    with pytest.raises(ValueError, match="embedding"):
        arm_b_layers([0, 5])
    assert extract_overrides("B", LAYERS)[0] == "extract.layers=[0, 13, 25]"
    assert "output.state_dtype=float8_e4m3fn" in extract_overrides("D", LAYERS)
    assert "output.state_dtype=float8_e4m3fn" not in extract_overrides("A", LAYERS)
    # B is served claiming A's ids but checked against its own run; C and E have A's states' layers
    assert DRAFT_CONFIG_RUN["B"] == "A" and states_run("B") == "B"
    assert states_run("C") == states_run("E") == "A"


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
    """SpecForge 0.2.0's own `specforge train` takes the benchmark's run.yaml, the run's drafter config,
    the target (its head through model.safetensors.index.json) and reads every feature file of our export
    (SPECFORGE_VALIDATE_OFFLINE_FEATURES=1), then stops where FSDP needs an accelerator."""
    config = specforge_run_config("A", export_a, checkpoint_dir(), run_a / ".drafter_config.json",
                                  tmp_path / "out", Recipe())
    (tmp_path / "run.yaml").write_text(yaml.safe_dump(config, sort_keys=False))
    from specforge.config import load_config

    assert load_config(str(tmp_path / "run.yaml")).mode == "offline"  # its own strict schema accepts every key
    env = specforge_env({"SPECFORGE_VALIDATE_OFFLINE_FEATURES": "1"})
    result = subprocess.run(specforge_command("train", "-c", str(tmp_path / "run.yaml")), cwd=tmp_path,
                            env=env, capture_output=True, text=True, timeout=600)
    errors = [line for line in result.stderr.splitlines() if "Error:" in line]
    assert result.returncode != 0 and errors and all(FSDP_STOP in line for line in errors), result.stderr[-3000:]


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


def test_acceptance_length_and_its_bootstrap():
    def arm(verify, correct):
        return [PromptResult(v, c, v + c, "") for v, c in zip(verify, correct)]

    # every prompt the same: the interval is the point
    exact = bootstrap_acceptance({"A": arm([10] * 50, [15] * 50), "E": arm([10] * 50, [0] * 50)},
                                 resamples=500)
    assert exact["arms"]["A"]["acceptance_length"] == 2.5 and exact["arms"]["A"]["ci95"] == [2.5, 2.5]
    assert exact["arms"]["E"]["acceptance_length"] == 1.0
    assert exact["differences"]["A-E"] == {"estimate": 1.5, "ci95": [1.5, 1.5]}

    # a ratio of sums over prompts, not a mean of per-prompt ratios
    assert acceptance_length(np.array([1, 9]), np.array([3, 0])) == 1.3

    rng = np.random.default_rng(0)
    verify = rng.integers(20, 80, 400)
    a_correct = rng.binomial(verify * 3, 0.5)
    b_correct = np.maximum(a_correct - rng.integers(0, 10, 400), 0)
    report = bootstrap_acceptance({"A": arm(verify, a_correct), "B": arm(verify, b_correct)}, seed=3)
    for name, stats in report["arms"].items():
        low, high = stats["ci95"]
        assert low < stats["acceptance_length"] < high and high - low < 0.2, (name, stats)
    low, high = report["differences"]["A-B"]["ci95"]
    assert 0 < low < report["differences"]["A-B"]["estimate"] < high  # paired: B is below A on every prompt
    assert bootstrap_acceptance({"A": arm(verify, a_correct), "B": arm(verify, b_correct)}, seed=3) == report
    # fewer prompts: a wider interval
    small = bootstrap_acceptance({"A": arm(verify[:40], a_correct[:40])}, seed=3)["arms"]["A"]["ci95"]
    assert small[1] - small[0] > report["arms"]["A"]["ci95"][1] - report["arms"]["A"]["ci95"][0]

    with pytest.raises(ValueError, match="different numbers"):
        bootstrap_acceptance({"A": arm([1, 2], [0, 0]), "B": arm([1], [0])})
    with pytest.raises(ValueError, match="no verify step"):
        acceptance_length(np.array([0]), np.array([0]))


def test_train_metrics_are_read_from_specforge_console_lines():
    log = ("noise\nstep 10: {'acc_0': 0.25, 'loss': 3.5, 'acc': 0.2, 'lr': 1e-05}\n"
           "step 20: {'acc_0': 0.5, 'loss': 2.25, 'acc': 0.4, 'lr': 2e-05}\nSaved checkpoint\n")
    assert last_train_metrics(log) == {"step": 20, "acc_0": 0.5, "loss": 2.25, "acc": 0.4, "lr": 2e-05}
    assert last_train_metrics("no steps") == {}


def test_results_table():
    results = {
        "acceptance": {"prompts": 256, "arms": {
            "A": {"acceptance_length": 2.41, "ci95": [2.3, 2.5]}, "B": {"acceptance_length": 1.02, "ci95": [1.0, 1.05]}},
            "differences": {"A-B": {"estimate": 1.39, "ci95": [1.25, 1.5]}}},
        "training": {"A": {"metrics": {"loss": 1.5, "acc": 0.6, "step": 100}}, "B": {"metrics": {"loss": 3.0, "acc": 0.1,
                                                                                                   "step": 100}}},
        "check_drafter": {"A": {"passed": True}, "B": {"passed": False}},
        "c_vs_a": {"layer 1": {"mean": 0.004, "max": 0.02}},
        "seconds": {"train-A": 60.0}, "versions": {"sglang": "0.5.17"},
    }
    table = markdown(results)
    assert "| A | ours (SGLang, bf16), drafter config as the run wrote it | **2.410** (2.300-2.500) | 1.500 / 0.600 | 100 | PASS |" in table
    assert "| B |" in table and "| FAIL |" in table and "| A-B | +1.390 (+1.250 to +1.500) |" in table
    assert "| layer 1 | 0.0040 | 0.0200 |" in table


def test_the_command_records_each_step_and_skips_it_on_a_rerun(tmp_path):
    work = tmp_path / "work"
    work.mkdir()
    (work / "model").symlink_to(checkpoint_dir())  # the checkpoint step finds it made

    def run(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "benchmarks.acceptance", "--work", str(work), *args], cwd=REPO_ROOT,
                              env=project_env(), capture_output=True, text=True, timeout=300)

    first = run("--stages", "checkpoint,prompts", "--device", "cpu", "--train-prompts", "300", "--eval-prompts", "200")
    assert first.returncode == 0, first.stderr[-2000:]
    assert "prompts: " in first.stdout and "checkpoint: " in first.stdout  # what a device call shows
    records = {path.name: path.read_text() for path in (work / "steps").iterdir()}
    assert sorted(records) == ["checkpoint.json", "prompts.json"]
    assert json.loads(records["prompts.json"])["held_out"] == 200
    assert len((work / "prompts" / "train.jsonl").read_text().splitlines()) == 300
    again = run("--stages", "checkpoint,prompts", "--device", "cpu", "--train-prompts", "300", "--eval-prompts", "200")
    assert again.returncode == 0 and {p.name: p.read_text() for p in (work / "steps").iterdir()} == records
    late = run("--stages", "prompts,extract", "--device", "cpu", "--deadline-s", "1e-9")
    assert late.returncode == EXIT_MORE_TO_DO and "stopped before step extract-A" in late.stderr
    refused = run("--stages", "train", "--device", "cpu")
    assert refused.returncode == 2 and "run on CUDA only" in refused.stderr
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
    a msgspec Struct; 0.5.17, which serves on the H200, a dataclass with the same names: checked by hand)."""
    import dataclasses

    from sglang.srt.server_args import ServerArgs

    fields = set(getattr(ServerArgs, "__struct_fields__", ())) or {field.name for field in dataclasses.fields(ServerArgs)}
    args = engine_args(Path("/target"), Path("/drafter"), "flashinfer", 0.15)
    assert set(args) <= fields, set(args) - fields
    assert (args["speculative_num_steps"], args["speculative_eagle_topk"], args["speculative_num_draft_tokens"]) == (3, 1, 4)
    assert args["speculative_algorithm"] == "EAGLE3" and args["disable_cuda_graph"] is True


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
