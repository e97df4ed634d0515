"""``python -m jobs.pipeline``: conversations to SpecForge's files in one command, as a real process on the demo's
conversations and tiny chat model (CPU, real SGLang, joining this session's Ray cluster). Its files are the three
commands' (prepare, extract, export) bit for bit, one copy of the states is left, a rerun has nothing to do, and a
SIGKILL in the middle of the extraction is resumed by the same command with every sample exported once."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from jobs import export as export_command
from jobs import extract as extract_command
from jobs import prepare as prepare_command
from jobs.pipeline import main as pipeline_main
from storage.manifest import CONSUMED, DONE, read_manifest
from tests.conftest import REPO_ROOT
from tests.helpers import python_env, same, session_ray_address, specforge_files, specforge_item
from training import peer_formats
from training.dataset import HiddenStatesDataset

CONVERSATIONS = 48
"""The demo's conversations (demo.num_conversations), one sample each."""
TIMEOUT_S = 600


def pipeline(demo: Path, *extra: str) -> list[str]:
    """The command as the docs give it (the demo, to=specforge), with the demo's directory and this session's cluster."""
    return [sys.executable, "-m", "jobs.pipeline", "to=specforge", f"demo.dir={demo}",
            f"ray.address={session_ray_address()}", *extra]


def run(command: list[str]) -> subprocess.CompletedProcess:
    return subprocess.run(command, cwd=REPO_ROOT, env=python_env(), capture_output=True, text=True, timeout=TIMEOUT_S)


def done_shards(states: Path) -> int:
    try:
        return sum(record["state"] == DONE for record in read_manifest(states)["shards"])
    except (ValueError, KeyError, OSError):  # no manifest yet
        return 0


def relative_files(dest: Path) -> list[str]:
    return sorted(str(Path(path).relative_to(dest)) for path in specforge_files(dest))


def assert_only_the_export_holds_the_states(out: Path, shards: int) -> None:
    """Every shard of the run consumed into out/specforge, no shard file left: one copy of the states."""
    states, dest = out / "states", out / "specforge"
    records = read_manifest(states)["shards"]
    assert len(records) == shards
    assert all(r["state"] == DONE and r["location"] == CONSUMED and r["consumed_into"] == f"specforge:{dest}"
               for r in records), records
    assert not list(states.glob("*.parquet"))
    state = json.loads((dest / ".export_state.json").read_text())
    assert state["complete"] and state["samples"] == CONVERSATIONS
    ids = [i for shard in state["shards"] for start, stop in shard["sample_ids"] for i in range(start, stop)]
    assert sorted(ids) == list(range(CONVERSATIONS))  # every sample once
    assert relative_files(dest) == sorted(str(peer_formats.specforge_path(i)) for i in range(CONVERSATIONS))


def test_one_command_writes_what_the_three_commands_write(ray_cluster, tmp_path, capsys):
    demo = tmp_path / "demo"
    out = demo / f"pipeline-specforge-{CONVERSATIONS}"
    ran = run(pipeline(demo, "output.shard_size=8"))
    assert ran.returncode == 0, ran.stderr[-4000:]
    print(ran.stdout)
    dest = out / "specforge"
    assert "done in " in ran.stdout and f"--hidden-states-path {dest}" in ran.stdout
    assert "export: 48 samples, specforge" in ran.stdout and "6 shards consumed" in ran.stdout
    assert_only_the_export_holds_the_states(out, shards=6)

    # The three commands on the same model and conversations, the states kept (no consume).
    model, conversations = demo / "model-llama-chatml", demo / f"conversations-{CONVERSATIONS}.jsonl"
    tokens, states, three = tmp_path / "tokens", tmp_path / "states", tmp_path / "three-specforge"
    assert prepare_command.main([f"model.path={model}", f"data.path={conversations}", f"output.dir={tokens}"]) == 0
    assert extract_command.main([f"model.path={model}", f"data.path={tokens}", f"output.dir={states}",
                                 "data.shard_size=8"]) == 0
    assert export_command.main([f"output.dir={states}", "to=specforge", f"dest={three}"]) == 0
    capsys.readouterr()

    # The same files, bit for bit, and what SpecForge's loader makes of them is the run's shards' view.
    assert relative_files(dest) == relative_files(three)
    for name in relative_files(dest):
        mine, theirs = (torch.load(root / name, weights_only=False) for root in (dest, three))
        assert list(mine) == list(theirs) and all(same(mine[key], theirs[key]) for key in mine), name
    view = HiddenStatesDataset(states, view="specforge")
    files = specforge_files(dest)
    assert len(view) == len(files) == CONVERSATIONS
    for index, path in enumerate(files):
        item, loaded = view[index], specforge_item(path, peer_formats.SPECFORGE_MAX_LEN)
        assert list(item) == list(loaded) and all(same(item[key], loaded[key]) for key in item), path

    # Rerun: every step has nothing to do, nothing is written again.
    before = {path: Path(path).stat().st_mtime_ns for path in files}
    again = run(pipeline(demo, "output.shard_size=8"))
    assert again.returncode == 0, again.stderr[-4000:]
    for step in ("prepare", "extract", "export"):
        assert f"\n{step}: nothing to do" in again.stdout, again.stdout
    assert {path: Path(path).stat().st_mtime_ns for path in files} == before


def test_killed_mid_extraction_the_same_command_resumes(ray_cluster, tmp_path):
    demo = tmp_path / "demo"
    out, shards = demo / f"pipeline-specforge-{CONVERSATIONS}", CONVERSATIONS // 2
    command = pipeline(demo, "output.shard_size=2")
    log = tmp_path / "killed.log"
    with open(log, "w") as sink:  # a file, not a pipe: the command's log never waits for a reader
        process = subprocess.Popen(command, cwd=REPO_ROOT, env=python_env(), stdout=sink, stderr=sink)
    deadline = time.monotonic() + TIMEOUT_S
    while done_shards(out / "states") == 0:
        assert process.poll() is None, f"the command ended (exit {process.returncode}) before a shard was done:\n" \
                                       f"{log.read_text()[-3000:]}"
        assert time.monotonic() < deadline
        time.sleep(0.05)
    process.send_signal(signal.SIGKILL)
    process.wait(timeout=60)
    before = {r["index"] for r in read_manifest(out / "states")["shards"] if r["state"] == DONE}
    print(f"killed with {len(before)} of {shards} shards done")
    assert 0 < len(before) < shards, "the extraction finished before the kill reached it"
    assert not (out / "specforge").exists()  # nothing exported yet

    ran = run(command)
    assert ran.returncode == 0, ran.stderr[-4000:]
    assert "\nprepare: nothing to do" in ran.stdout and "export: 48 samples" in ran.stdout, ran.stdout
    records = {r["index"]: r for r in read_manifest(out / "states")["shards"]}
    assert all(records[index]["attempts"] == 1 for index in before), "shards done before the kill ran again"
    assert_only_the_export_holds_the_states(out, shards)


@pytest.fixture(scope="module")
def demo_dir(tmp_path_factory) -> Path:
    """A demo directory whose model and conversations the refusals share (built by the first of them)."""
    return tmp_path_factory.mktemp("refusals") / "demo"


@pytest.mark.parametrize("keys, message", [
    (["to=vllm"], "to='vllm': name the trainer, to=specforge or to=speculators"),
    (["to=specforge", "export.fp8=true"], "export.fp8=true: SpecForge reads model-dtype states only"),
    (["to=speculators", "extract.last_hidden_state=post_norm"],
     "to=speculators with extract.last_hidden_state=post_norm: speculators reads the state before the final norm"),
    (["to=specforge", "export.exact=true"], "export.exact=true: specforge's files hold the post_norm final state"),
    (["to=specforge", "extract.layers=[2,99]"], "extract.layers=[2, 99]: [99] cannot be captured from a 8-layer model"),
    (["to=specforge", "model.path=/nowhere"], "set both model.path"),
])
def test_refused_before_any_step(demo_dir, capsys, keys, message):
    """Whatever would stop a later step is one line and exit 2 before the first writes anything."""
    assert pipeline_main([f"demo.dir={demo_dir}", *keys]) == 2
    err = capsys.readouterr().err.strip().splitlines()  # the demo's first use builds its model (a progress bar)
    assert [line for line in err if line.startswith("error: ")] == err[-1:] and message in err[-1], err
    assert not list(demo_dir.glob("pipeline*"))


def test_an_output_dir_holding_other_files_is_refused(demo_dir, tmp_path, capsys):
    out = tmp_path / "mine"
    out.mkdir()
    (out / "notes.txt").write_text("keep me")
    assert pipeline_main(["to=specforge", f"demo.dir={demo_dir}", f"output.dir={out}"]) == 2
    assert "holds notes.txt, which this command did not write" in capsys.readouterr().err
    assert sorted(path.name for path in out.iterdir()) == ["notes.txt"]
