"""The dry run ends as the job would: for each refusal jobs.extract makes before it extracts anything, jobs.plan
exits with the same code and the same message.

Both commands run through their own ``main`` on real files (the job on the session's Ray cluster, which only
the refusal made once Ray is up reaches). The synthetic states source needs config.json alone: no model is built.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from jobs.errors import EXIT_BAD_INPUT, EXIT_LOCKED, EXIT_OK
from jobs.extract import main as extract
from jobs.plan import main as plan
from jobs.planning.inputs import read_inputs
from jobs.planning.shards import plan_shards
from storage.manifest import MANIFEST_FILE, Manifest, read_manifest
from tests.conftest import REPO_ROOT
from tests.helpers import LOCK_HOLDER, job_config, python_env

SETTINGS = ("model.engine=synthetic", "data.shard_size=8", "extract.max_tokens_per_batch=300", "model.device=cpu",
            "output.min_free=0")


@pytest.fixture(scope="module")
def synthetic_model(tmp_path_factory) -> Path:
    """A checkpoint as the synthetic source reads it: config.json only."""
    model = tmp_path_factory.mktemp("synthetic-model")
    (model / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "num_hidden_layers": 8, "hidden_size": 32, "num_attention_heads": 4,
        "intermediate_size": 64, "vocab_size": 512, "max_position_embeddings": 4096,
    }))
    return model


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
    config = job_config(model, data, out, *SETTINGS)
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

    base = [f"model.path={synthetic_model}", f"data.path={demo_dataset}", *SETTINGS]
    for name, (overrides, phrase) in cases.items():
        args = base + overrides
        planned, job = ended(capsys, plan, args), ended(capsys, extract, args)
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
        planned, job = ended(capsys, plan, args), ended(capsys, extract, args)
        assert planned[0] == job[0] == EXIT_LOCKED and planned[1] == job[1], (planned, job)
        assert "Ray job raysubmit_holder" in job[1]
    finally:
        holder.kill()
        holder.wait()
    # And nothing refused: the plan's exit 0 is the job's
    assert ended(capsys, plan, base + [f"output.dir={resumed}"]) == (EXIT_OK, "")
    assert not (tmp_path / "new" / MANIFEST_FILE).exists() and not (data_dir / MANIFEST_FILE).exists()


def test_the_plan_exits_as_the_job_for_a_shard_it_does_not_have(synthetic_model, demo_dataset, tmp_path):
    """The issue's own case, as a user types it: `jobs.plan 'shards=[999]'` on a 3-shard plan."""
    args = [f"model.path={synthetic_model}", f"data.path={demo_dataset}", f"output.dir={tmp_path / 'out'}", *SETTINGS,
            "shards=[999]"]
    started = time.monotonic()
    result = subprocess.run([sys.executable, "-m", "jobs.plan", *args], cwd=REPO_ROOT, env=python_env(),
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == EXIT_BAD_INPUT, result.stdout + result.stderr[-2000:]
    assert result.stderr.strip().splitlines() == ["error: shards=[999]: the plan has shards 0..2, not [999]"]
    assert not (tmp_path / "out").exists()
    print(f"jobs.plan refused it in {time.monotonic() - started:.1f} s")
