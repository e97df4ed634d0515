"""``python -m jobs.plan``, the dry run: the job's numbers before anything starts, and its refusals, which end as
the job's: for each refusal jobs.extract makes before it extracts anything, jobs.plan exits with the same code and
the same message. Under them, the shard plan and the batch packing (jobs.planning.shards).

Both commands run through their own ``main`` on real files (the job on the session's Ray cluster). The synthetic
states source (``model.engine=synthetic``) needs config.json alone, so these runs build no model;
``tests/extractor/test_kimi.py`` checks the dry run's SGLang layers against a real run.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from jobs.extract import main as extract
from jobs.extract import run
from jobs.plan import main
from jobs.planning.inputs import read_inputs
from jobs.planning.shards import pack_batches, plan_shards
from runtime.errors import EXIT_BAD_INPUT, EXIT_BUDGET_EXHAUSTED, EXIT_LOCKED, EXIT_OK, ConfigError
from storage import ShardReader
from storage.manifest import MANIFEST_FILE, Manifest, read_manifest
from storage.writer import state_bytes_per_token
from tests.conftest import REPO_ROOT
from tests.helpers import LOCK_HOLDER, job_config, python_env

SETTINGS = ("model.engine=synthetic", "data.shard_size=8", "extract.max_tokens_per_batch=300", "model.device=cpu",
            "output.min_free=1GB")
REFUSAL_SETTINGS = (*SETTINGS[:-1], "output.min_free=0")
"""The refusals' runs ask for no free space: what this disk has left never adds a refusal of its own."""


@pytest.fixture(scope="module")
def synthetic_model(tmp_path_factory):
    """A checkpoint as the synthetic source reads it: config.json only."""
    model = tmp_path_factory.mktemp("synthetic-model")
    (model / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "num_hidden_layers": 8, "hidden_size": 32, "num_attention_heads": 4,
        "intermediate_size": 64, "vocab_size": 512, "max_position_embeddings": 4096,
    }))
    return model


def dry_run(capsys, model, data, out, *extra) -> tuple[int, dict]:
    code = main([f"model.path={model}", f"data.path={data}", f"output.dir={out}", *SETTINGS, *extra, "--json"])
    return code, json.loads(capsys.readouterr().out)


def test_the_plan_is_what_the_job_then_writes(ray_cluster, capsys, synthetic_model, demo_dataset, tmp_path):
    out = tmp_path / "out"
    code, plan = dry_run(capsys, synthetic_model, demo_dataset, out, "output.state_dtype=float8_e4m3fn")
    assert code == EXIT_OK and plan["problems"] == [] and not out.exists()  # nothing written
    run(job_config(synthetic_model, demo_dataset, out, *SETTINGS, "output.state_dtype=float8_e4m3fn"))

    shards = read_manifest(out)["shards"]
    assert (plan["samples"], plan["shards"]) == (sum(s["rows"] for s in shards), len(shards)) == (20, 3)
    assert plan["tokens"] == sum(s["tokens"] for s in shards)
    meta = ShardReader(next(out.glob("shard-*.parquet"))).metadata
    assert plan["layers"]["layer_ids"] == meta.layer_ids == [2, 4, 5]
    assert plan["layers"]["layers_to_capture"] == meta.layers_to_capture
    assert plan["layers"]["drafter_layer_ids"] == meta.drafter_layer_ids
    # fp8: 4 states (3 layers + the final one) of 32 bytes plus a float32 scale each
    assert plan["state_bytes_per_token"] == state_bytes_per_token(meta) == 4 * (32 + 4)
    # The prediction is the budget's reservation: never below the file, never below the states alone.
    written = sum(s["bytes"] for s in shards)
    assert plan["tokens"] * plan["state_bytes_per_token"] < written <= plan["predicted_bytes"]
    assert max(s["bytes"] for s in shards) <= plan["largest_shard_bytes"]

    # The same command on the finished run: nothing left to write, the files' bytes counted.
    code, again = dry_run(capsys, synthetic_model, demo_dataset, out, "output.state_dtype=float8_e4m3fn")
    assert code == EXIT_OK
    assert (again["done_shards"], again["predicted_bytes"], again["done_local_bytes"]) == (3, 0, written)


def test_a_shard_larger_than_the_budget_is_refused_as_the_job_refuses_it(capsys, synthetic_model, demo_dataset,
                                                                         tmp_path):
    code, plan = dry_run(capsys, synthetic_model, demo_dataset, tmp_path / "a", "output.disk_budget=100KB")
    assert code == EXIT_BAD_INPUT and plan["largest_shard_bytes"] > 100_000
    with pytest.raises(ConfigError) as refused:
        run(job_config(synthetic_model, demo_dataset, tmp_path / "b", *SETTINGS, "output.disk_budget=100KB"))
    assert plan["problems"][0] == {"exit_code": EXIT_BAD_INPUT, "text": str(refused.value)}


def test_a_run_larger_than_the_budget_fits_only_with_a_sink(capsys, synthetic_model, demo_dataset, tmp_path):
    code, plan = dry_run(capsys, synthetic_model, demo_dataset, tmp_path / "out")
    # every shard fits beside the job's own files, the run does not
    budget = plan["own_files_bytes"] + (plan["predicted_bytes"] + plan["largest_shard_bytes"]) // 2
    code, plan = dry_run(capsys, synthetic_model, demo_dataset, tmp_path / "out", f"output.disk_budget={budget}")
    assert code == EXIT_BUDGET_EXHAUSTED
    assert [p["exit_code"] for p in plan["problems"]] == [EXIT_BUDGET_EXHAUSTED]
    assert "output.sink is empty" in plan["problems"][0]["text"]
    # As people read it: the numbers, then one line per problem
    assert main([f"model.path={synthetic_model}", f"data.path={demo_dataset}", f"output.dir={tmp_path / 'out'}",
                 *SETTINGS, f"output.disk_budget={budget}"]) == EXIT_BUDGET_EXHAUSTED
    text = capsys.readouterr().out.splitlines()
    assert text[-1] == f"WILL NOT FIT (exit 3): {plan['problems'][0]['text']}"
    assert f"plan     3 shards of 8 samples, {plan['batches']} batches" in "\n".join(text)
    code, plan = dry_run(capsys, synthetic_model, demo_dataset, tmp_path / "out", f"output.disk_budget={budget}",
                         f"output.sink=file://{tmp_path / 'sink'}")
    assert code == EXIT_OK and plan["problems"] == []


def test_invalid_rows_are_counted_and_judged_by_on_invalid(capsys, synthetic_model, tmp_path):
    data = tmp_path / "data.jsonl"
    rows = [[1, 2, 3], list(range(1, 13)), [1, 999], [5, 6]]  # row 1: too long, row 2: outside the vocabulary
    data.write_text("".join(json.dumps({"input_ids": ids}) + "\n" for ids in rows))
    code, plan = dry_run(capsys, synthetic_model, data, tmp_path / "out", "model.context_length=10")
    assert code == EXIT_BAD_INPUT
    assert (plan["invalid_rows"], plan["invalid_over_context"], plan["samples"]) == (2, 1, 2)
    with pytest.raises(ValueError) as refused:  # the job names the same first row
        run(job_config(synthetic_model, data, tmp_path / "job", *SETTINGS, "model.context_length=10"))
    assert "row 1 (" in str(refused.value) and "12 tokens exceed the context length 10" in str(refused.value)
    assert "row 1 (" in plan["problems"][0]["text"] and "12 tokens exceed the context length 10" in plan["problems"][0]["text"]
    code, plan = dry_run(capsys, synthetic_model, data, tmp_path / "out", "model.context_length=10",
                         "data.on_invalid=skip")
    assert code == EXIT_OK and plan["invalid_rows"] == 2 and plan["tokens"] == 5


def test_a_config_mistake_is_one_line_and_exit_2(synthetic_model, demo_dataset, tmp_path):
    result = subprocess.run(
        [sys.executable, "-m", "jobs.plan", f"model.path={synthetic_model}", f"data.path={demo_dataset}",
         f"output.dir={tmp_path}", "data.shard_sz=3"],
        cwd=REPO_ROOT, env=python_env(), capture_output=True, text=True, timeout=120,
    )
    assert result.returncode == EXIT_BAD_INPUT and result.stdout == ""
    assert result.stderr.strip().splitlines() == [
        "error: unknown key data.shard_sz; did you mean data.shard_size? (python -m jobs.plan --help lists every key)"
    ]


def test_the_plan_says_which_exports_the_run_serves(capsys, llama_fp32, demo_dataset, tmp_path):
    """The default (pre-norm) run serves both trainers, SpecForge's with the checkpoint's own final norm, found
    before the run starts (Kimi-K2.5's under its language model's prefix, eps from text_config); a post-norm run
    serves SpecForge only, and the plan says so."""
    from inputs.demo import build_tiny_model

    kimi = build_tiny_model(tmp_path / "kimi", arch="kimi_k25", num_layers=4, dtype="bfloat16")
    for model, weight, eps in ((llama_fp32, "model.norm.weight", "1e-06"),
                               (kimi, "language_model.model.norm.weight", "1e-06")):
        code, plan = dry_run(capsys, model, demo_dataset, tmp_path / "out", "extract.layers=[1,2]")
        assert code == EXIT_OK and plan["final_state"] == "pre_norm"
        assert plan["exports"] == {
            "specforge": f"the final norm applied at export ({weight} of {model}, eps {eps})", "speculators": "as stored"}
    code, plan = dry_run(capsys, llama_fp32, demo_dataset, tmp_path / "out", "extract.last_hidden_state=post_norm")
    assert plan["exports"]["specforge"] == "as stored"
    assert plan["exports"]["speculators"].startswith("no: speculators reads the state before the final norm")
    assert main([f"model.path={llama_fp32}", f"data.path={demo_dataset}", f"output.dir={tmp_path / 'out'}", *SETTINGS,
                 "extract.last_hidden_state=post_norm"]) == EXIT_OK
    printed = capsys.readouterr().out
    assert "\nexports  specforge: as stored\n         speculators: no: speculators reads the state before" in printed


def test_a_resume_with_other_content_is_refused_before_ray_starts(capsys, monkeypatch, synthetic_model, demo_dataset,
                                                                  tmp_path):
    """output.dir holds a run of other layers; with model.device=auto (the default) the job once found that out
    only after starting Ray. The job and its dry run both refuse it before, naming the keys that differ; so is
    an output.dir that another run claims as its node directory."""
    from jobs.cluster.node_disk import LocalDisk
    from jobs.driver import job
    from jobs.planning.inputs import read_inputs
    from storage.manifest import Manifest

    out = tmp_path / "out"
    earlier = read_inputs(job_config(synthetic_model, demo_dataset, out, *SETTINGS, "model.device=auto"))
    out.mkdir()
    Manifest.open(out, earlier.content("cpu"), []).close()

    def no_ray(*args, **kwargs):
        raise AssertionError("Ray was started")

    monkeypatch.setattr(job, "ray_session", no_ray)
    again = job_config(synthetic_model, demo_dataset, out, *SETTINGS, "model.device=auto", "extract.layers=1,4,5")
    with pytest.raises(ConfigError, match=r"different content \(extract.layers: was \[2, 4, 5\], now \[1, 4, 5\]\)"):
        run(again)
    assert main([f"model.path={synthetic_model}", f"data.path={demo_dataset}", f"output.dir={out}", *SETTINGS,
                 "model.device=auto", "extract.layers=1,4,5"]) == EXIT_BAD_INPUT
    assert "different content (extract.layers: was [2, 4, 5], now [1, 4, 5])" in capsys.readouterr().err

    # output.dir is another run's node directory, claimed (and empty yet): refused before Ray too
    node_dir = tmp_path / "node"
    assert LocalDisk(node_dir).claim({"run_id": "other", "output_dir": "/elsewhere", "host": "h", "node": "n"},
                                     adopt_files=False) == {"labels": ["n"]}
    with pytest.raises(ConfigError, match=f"output.dir={node_dir} belongs to the run whose output.dir is /elsewhere"):
        run(job_config(synthetic_model, demo_dataset, node_dir, *SETTINGS))


def test_the_dry_run_prints_only_its_answer_and_asks_sglang_once(monkeypatch, capsys, llama_fp32, demo_dataset,
                                                                 tmp_path):
    """The layers come from SGLang's model class on the meta device, asked in a child process: the dry run's
    output is its report alone (no SGLang warnings), and a second dry run of the same model, release and layers
    reads the answer from the cache the job shares (the probe is not run again)."""
    cache = tmp_path / "cache"
    args = [f"model.path={llama_fp32}", f"data.path={demo_dataset}", f"output.dir={tmp_path / 'out'}"]
    first = subprocess.run([sys.executable, "-m", "jobs.plan", *args], cwd=REPO_ROOT,
                           env=python_env(EAGLE3_CACHE_DIR=str(cache)), capture_output=True, text=True, timeout=600)
    assert first.returncode == EXIT_OK and first.stderr == "", first.stderr[-3000:]
    assert first.stdout.startswith("dry run: ") and first.stdout.splitlines()[-1].startswith("fits     yes")
    assert "layers   [2, 4, 5] -> SGLang layers_to_capture [3, 5, 6]" in first.stdout

    from jobs.planning import capture

    def no_probe(*args, **kwargs):
        raise AssertionError("SGLang was asked again")

    monkeypatch.setenv("EAGLE3_CACHE_DIR", str(cache))
    monkeypatch.setattr(capture, "_probe", no_probe)
    assert main(args) == EXIT_OK
    layers = [line for line in first.stdout.splitlines() if line.startswith("layers ")]
    assert layers == [line for line in capsys.readouterr().out.splitlines() if line.startswith("layers ")]


def ended(capsys, command, args: list[str]) -> tuple[int, str]:
    """A command's exit code and the message of its refusal: the job's ``error:`` line, or the dry run's first
    ``WILL NOT FIT (exit N):`` line (a problem it reports beside its numbers) or ``error:`` line."""
    capsys.readouterr()
    code = command(args)
    captured = capsys.readouterr()
    lines = (captured.out + captured.err).splitlines()
    refusal = next((line.split(": ", 1)[1] for line in lines if line.startswith(("error: ", "WILL NOT FIT"))), "")
    return code, refusal


def resumable_manifest(model: Path, data: Path, out: Path) -> None:
    """output.dir as a run of this config left it (its manifest, no shard done), without running it."""
    config = job_config(model, data, out, *REFUSAL_SETTINGS)
    inputs = read_inputs(config)
    shards = plan_shards(inputs.dataset.lengths, config.data.shard_size, config.extract.max_tokens_per_batch,
                         config.extract.max_samples_per_batch)
    out.mkdir(parents=True)
    Manifest.open(out, inputs.content("cpu"), [(s.index, s.start, s.stop) for s in shards]).close()


def test_every_refusal_of_the_job_is_the_dry_runs(ray_cluster, capsys, synthetic_model, demo_dataset, tmp_path):
    cases: dict[str, tuple[list[str], str]] = {}  # name -> (overrides, a phrase of the message)

    data_dir = tmp_path / "inputs"
    data_dir.mkdir()
    data_file = data_dir / "tokens.parquet"
    data_file.write_bytes(demo_dataset.read_bytes())
    cases["a shard the plan does not have"] = (["shards=[999]", f"output.dir={tmp_path / 'new'}"],
                                               "shards=[999]: the plan has shards 0..2, not [999]")
    cases["output.dir inside a file:// data.path"] = (  # a URL to a local directory is read as the directory is
        [f"data.path=file://{data_dir}", f"output.dir={data_dir / 'states'}"], f"is inside data.path={data_dir}")
    cases["output.dir holding the data.path file"] = (
        [f"data.path={data_file}", f"output.dir={data_dir}"], "is the directory that holds data.path")
    (tmp_path / "tokens-a").mkdir()
    (tmp_path / "tokens-a" / "part.parquet").write_bytes(demo_dataset.read_bytes())
    cases["output.dir a data.path glob matches"] = (
        [f"data.path={tmp_path}/tokens-*/*.parquet", f"output.dir={tmp_path / 'tokens-states'}"],
        "is matched by the glob data.path")
    (tmp_path / "a-file").write_text("")
    cases["output.dir not writable"] = ([f"output.dir={tmp_path / 'a-file' / 'out'}"], "cannot write there")
    cases["a sink that takes no test write"] = (
        [f"output.sink=file://{tmp_path}/a-file/sink", f"output.dir={tmp_path / 'sunk'}"], "output.sink=")
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "shard-00000.parquet").write_bytes(b"someone else's")
    cases["shard files without a manifest"] = ([f"output.dir={foreign}"], "are not from a run of this job")
    resumed = tmp_path / "resumed"
    resumable_manifest(synthetic_model, demo_dataset, resumed)
    cases["a shard the resumed plan does not have"] = (["shards=[3]", f"output.dir={resumed}"],
                                                       "shards=[3]: the plan has shards 0..2, not [3]")
    cases["a manifest of other content"] = (["data.shard_size=4", f"output.dir={resumed}"],
                                            "a run with different content (data.shard_size: was 8, now 4")
    cases["more writers than the cluster's CPUs (once Ray is up)"] = (
        ["output.num_writers=64", f"output.dir={tmp_path / 'writers'}"],
        "output.num_writers=64, but node 127.0.0.1 has")

    base = [f"model.path={synthetic_model}", f"data.path={demo_dataset}", *REFUSAL_SETTINGS]
    for name, (overrides, phrase) in cases.items():
        args = base + overrides
        planned, job = ended(capsys, main, args), ended(capsys, extract, args)
        print(f"{name}: plan {planned[0]}, job {job[0]}: {job[1][:120]}")
        assert planned[0] == job[0] == EXIT_BAD_INPUT, (name, planned, job)
        assert phrase in planned[1] and phrase in job[1], (name, planned, job)
        if "once Ray is up" not in name:  # the cluster's CPUs (the session's) are not this host's (the plan's)
            assert planned[1] == job[1], name
    assert not read_manifest(resumed)["shards"][0]["attempts"], "a refused run touched the resumed run"

    holder = subprocess.Popen([sys.executable, "-c", LOCK_HOLDER.format(root=str(REPO_ROOT)), str(resumed)],
                              env=python_env(), stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        args = base + [f"output.dir={resumed}"]
        planned, job = ended(capsys, main, args), ended(capsys, extract, args)
        assert planned[0] == job[0] == EXIT_LOCKED and planned[1] == job[1], (planned, job)
        assert "Ray job raysubmit_holder" in job[1]
    finally:
        holder.kill()
        holder.wait()
    # And nothing refused: the plan's exit 0 is the job's
    assert ended(capsys, main, base + [f"output.dir={resumed}"]) == (EXIT_OK, "")
    assert not (tmp_path / "new" / MANIFEST_FILE).exists() and not (data_dir / MANIFEST_FILE).exists()


def test_the_plan_exits_as_the_job_for_a_shard_it_does_not_have(synthetic_model, demo_dataset, tmp_path):
    """The issue's own case, as a user types it: `jobs.plan 'shards=[999]'` on a 3-shard plan."""
    args = [f"model.path={synthetic_model}", f"data.path={demo_dataset}", f"output.dir={tmp_path / 'out'}", *REFUSAL_SETTINGS,
            "shards=[999]"]
    started = time.monotonic()
    result = subprocess.run([sys.executable, "-m", "jobs.plan", *args], cwd=REPO_ROOT, env=python_env(),
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == EXIT_BAD_INPUT, result.stdout + result.stderr[-2000:]
    assert result.stderr.strip().splitlines() == ["error: shards=[999]: the plan has shards 0..2, not [999]"]
    assert not (tmp_path / "out").exists()
    print(f"jobs.plan refused it in {time.monotonic() - started:.1f} s")


def test_plan_shards_covers_every_row_once():
    lengths = np.array([3, 4, 2, 10, 1, 1, 1, 5, 6, 7])
    shards = plan_shards(lengths, 4, max_tokens_per_batch=8, max_samples_per_batch=2)
    assert [(s.index, s.start, s.stop, s.tokens) for s in shards] == [(0, 0, 4, 19), (1, 4, 8, 8), (2, 8, 10, 13)]
    assert [s.batches for s in shards] == [((0, 2), (2, 3), (3, 4)), ((0, 2), (2, 4)), ((0, 1), (1, 2))]
    with pytest.raises(ValueError, match="shard_size"):
        plan_shards(lengths, 0, 8, 2)


def greedy_reference(lengths, max_tokens, max_samples):
    """The packing rule, one sample at a time."""
    batches, start, tokens = [], 0, 0
    for i, length in enumerate(lengths.tolist()):
        if i > start and (tokens + length > max_tokens or i - start >= max_samples):
            batches.append((start, i))
            start, tokens = i, 0
        tokens += length
    return batches + ([(start, len(lengths))] if len(lengths) else [])


def test_plan_packs_like_the_greedy_rule():
    rng = np.random.default_rng(0)
    for _ in range(300):
        lengths = rng.integers(1, 60, int(rng.integers(0, 80)))
        max_tokens, max_samples, shard_size = int(rng.integers(1, 200)), int(rng.integers(1, 9)), int(rng.integers(1, 30))
        shards = plan_shards(lengths, shard_size, max_tokens, max_samples)
        assert [(s.start, s.stop) for s in shards] == [
            (start, min(start + shard_size, len(lengths))) for start in range(0, len(lengths), shard_size)]
        for shard in shards:
            assert list(shard.batches) == greedy_reference(lengths[shard.start : shard.stop], max_tokens, max_samples)
            assert shard.tokens == int(lengths[shard.start : shard.stop].sum())


def test_pack_batches_keeps_order_and_budget():
    lengths = np.array([3, 4, 2, 10, 1, 1, 1])
    batches = pack_batches(lengths, max_tokens=8, max_samples=2)
    assert batches == [(0, 2), (2, 3), (3, 4), (4, 6), (6, 7)]
    # every sample exactly once, in order; the 10-token sample runs alone
    assert [i for start, stop in batches for i in range(start, stop)] == list(range(7))
    for start, stop in batches:
        assert lengths[start:stop].sum() <= 8 or stop - start == 1
    assert pack_batches(np.array([5, 5, 5]), max_tokens=100, max_samples=100) == [(0, 3)]


def test_a_model_class_whose_states_were_never_compared_with_hf_is_named(llama_fp32, demo_dataset, tmp_path, caplog):
    """The tests compare the captured states with HF's only for some model classes (``HF_PARITY_CHECKED``); for any
    other the run says so before it starts: its states are what SGLang serves a drafter, not proven to be HF's."""
    other = tmp_path / "model"
    other.mkdir()
    for path in llama_fp32.iterdir():
        (other / path.name).symlink_to(path)
    config = json.loads((llama_fp32 / "config.json").read_text())
    (other / "config.json").unlink()
    (other / "config.json").write_text(json.dumps(dict(config, architectures=["Qwen2ForCausalLM"])))
    with caplog.at_level("WARNING", logger="jobs.planning.inputs"):
        read_inputs(job_config(llama_fp32, demo_dataset, tmp_path / "a"))
        assert "have not been compared with HF" not in caplog.text
        read_inputs(job_config(other, demo_dataset, tmp_path / "b"))
    assert "Qwen2ForCausalLM: the states SGLang captures for this model class have not been compared with HF" in (
        caplog.text)
