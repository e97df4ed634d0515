"""``python -m jobs.pipeline``: conversations to SpecForge's files in one command, as a real process on the demo's
conversations and tiny chat model (CPU, real SGLang, joining this session's Ray cluster). A SIGKILL in the middle of
the extraction (its driver, in the command's process) is resumed by the same command with every sample exported once,
no shard failed and no temp file left; the files of that run are the three
commands' (prepare, extract, export) bit for bit, one copy of the states is left, and a rerun has nothing to do."""

from __future__ import annotations

import dataclasses
import json
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from jobs import export as export_command
from jobs import extract as extract_command
from jobs import prepare as prepare_command
from jobs.pipeline import main as pipeline_main
from jobs.rundir.summary import read_summary
from storage.manifest import CONSUMED, DONE, read_manifest
from tests.conftest import REPO_ROOT
from tests.helpers import (
    python_env,
    read_all,
    same,
    session_ray_address,
    specforge_files,
    specforge_item,
)
from training import peer_formats
from training.dataset import HiddenStatesDataset

CONVERSATIONS = 48
"""The demo's conversations (demo.num_conversations), one sample each."""
SHARD_SIZE = 2
SHARDS = CONVERSATIONS // SHARD_SIZE
"""Enough shards that the kill lands with some done and some not."""
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


@dataclasses.dataclass
class Resumed:
    """The command SIGKILLed in the middle of its extraction, then run again as it was."""

    demo: Path
    out: Path
    done_before_kill: set[int]
    exported_before_resume: bool
    rerun: subprocess.CompletedProcess


@pytest.fixture(scope="module")
def killed_then_resumed(ray_cluster, tmp_path_factory) -> Resumed:
    """One run of the command, killed once a shard of its extraction is done and resumed by the same command: the
    resume's claims and the files' claims are both read off it (each run of the command is a model's start-up)."""
    demo = tmp_path_factory.mktemp("pipeline") / "demo"
    out = demo / f"pipeline-specforge-{CONVERSATIONS}"
    command = pipeline(demo, f"output.shard_size={SHARD_SIZE}")
    log = demo.parent / "killed.log"
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
    before = {r["index"] for r in read_manifest(out / "states")["shards"] if r["state"] == DONE}  # readable after it
    print(f"killed with {len(before)} of {SHARDS} shards done")
    exported = (out / "specforge").exists()
    return Resumed(demo, out, before, exported, run(command))


def test_killed_mid_extraction_the_same_command_resumes(killed_then_resumed):
    resumed = killed_then_resumed
    assert 0 < len(resumed.done_before_kill) < SHARDS, "the extraction finished before the kill reached it"
    assert not resumed.exported_before_resume  # nothing exported yet
    ran = resumed.rerun
    assert ran.returncode == 0, ran.stderr[-4000:]
    assert "\nprepare: nothing to do" in ran.stdout and "export: 48 samples" in ran.stdout, ran.stdout
    records = {r["index"]: r for r in read_manifest(resumed.out / "states")["shards"]}
    assert all(records[index]["attempts"] == 1 for index in resumed.done_before_kill), \
        "shards done before the kill ran again"
    assert read_summary(resumed.out / "states")["shards_failed"] == {}
    assert not list((resumed.out / "states").glob("*.tmp")), "a temp file of the killed driver was left"
    assert_only_the_export_holds_the_states(resumed.out, SHARDS)


def test_one_command_writes_what_the_three_commands_write(killed_then_resumed, tmp_path, capsys):
    """The command's files (its extraction resumed after a kill) are the three commands' run without a stop; that
    extraction holds, sample by sample, the tokens and loss masks jobs.prepare wrote."""
    demo, out, ran = killed_then_resumed.demo, killed_then_resumed.out, killed_then_resumed.rerun
    assert ran.returncode == 0, ran.stderr[-4000:]
    print(ran.stdout)
    dest = out / "specforge"
    assert "done in " in ran.stdout and f"--hidden-states-path {dest}" in ran.stdout
    assert "export: 48 samples, specforge" in ran.stdout and f"{SHARDS} shards consumed" in ran.stdout
    assert_only_the_export_holds_the_states(out, shards=SHARDS)

    # The three commands on the same model and conversations, the states kept (no consume).
    model, conversations = demo / "model-llama-chatml", demo / f"conversations-{CONVERSATIONS}.jsonl"
    tokens, states, three = tmp_path / "tokens", tmp_path / "states", tmp_path / "three-specforge"
    assert prepare_command.main([f"model.path={model}", f"data.path={conversations}", f"output.dir={tokens}",
                                 "output.shard_size=20"]) == 0  # three parts: the extraction reads across them
    assert extract_command.main([f"model.path={model}", f"data.path={tokens}", f"output.dir={states}",
                                 f"data.shard_size={SHARD_SIZE}"]) == 0
    assert export_command.main([f"output.dir={states}", "to=specforge", f"dest={three}"]) == 0
    capsys.readouterr()

    # The extraction read what jobs.prepare wrote: sample id = row across the parts = conversation_id, each
    # sample's tokens and loss mask as prepared, a state per token.
    parts = sorted(tokens.glob("part-*.parquet"))
    assert len(parts) == 3
    prepared = pa.concat_tables(pq.read_table(path) for path in parts)
    assert prepared.column("conversation_id").to_pylist() == list(range(CONVERSATIONS))
    samples = read_all(states)
    assert sorted(samples) == list(range(CONVERSATIONS))
    for sample_id, sample in samples.items():
        assert sample.input_ids.tolist() == prepared.column("input_ids")[sample_id].as_py()
        assert sample.loss_mask.tolist() == prepared.column("loss_mask")[sample_id].as_py()
        assert sample.aux_hidden_states.shape[0] == len(sample.input_ids)

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
    again = run(pipeline(demo, f"output.shard_size={SHARD_SIZE}"))
    assert again.returncode == 0, again.stderr[-4000:]
    for step in ("prepare", "extract", "export"):
        assert f"\n{step}: nothing to do" in again.stdout, again.stdout
    assert {path: Path(path).stat().st_mtime_ns for path in files} == before


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


def test_an_output_dir_inside_the_input_or_a_file_is_refused_before_any_step(demo_dir, tmp_path, capsys):
    """An output.dir inside data.path's directory: a rerun would read the command's own files as conversations and
    refuse to resume. One that is a file cannot be written. Both: exit 2 before the first step."""
    pipeline_main([f"demo.dir={demo_dir}", "to=specforge", "extract.layers=[2,99]"])  # the demo built, then refused
    capsys.readouterr()
    chats = tmp_path / "chats"
    chats.mkdir()
    shutil.copy(next(demo_dir.glob("conversations-*.jsonl")), chats / "part-0.jsonl")
    model = next(demo_dir.glob("model-*"))
    (tmp_path / "a-file").write_text("keep me")
    for out, message in [(chats / "run", f"output.dir={chats / 'run'} is inside data.path={chats}"),
                         (tmp_path / "a-file", f"output.dir={tmp_path / 'a-file'}: cannot write there")]:
        keys = ["to=specforge", f"model.path={model}", f"data.path={chats}", f"output.dir={out}"]
        assert pipeline_main(keys) == 2
        err = capsys.readouterr().err
        assert message in err, err
    assert sorted(path.name for path in chats.iterdir()) == ["part-0.jsonl"]
    assert (tmp_path / "a-file").read_text() == "keep me"
