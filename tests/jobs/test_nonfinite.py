"""NaN states through SGLang itself: a checkpoint whose embedding row of one token is NaN, and
extract.on_nonfinite fail / skip / keep through the whole job, each run checked by jobs.verify."""

from __future__ import annotations

import json
import re
import shutil

import numpy as np
import pytest
import torch

from jobs.extract import run
from jobs.rundir.summary import NOTHING_TO_DO
from jobs.verify import main as verify_main
from runtime.errors import EXIT_OK, EXIT_VERIFY_FAILED
from storage import ShardReader, shard_file_name
from storage.manifest import read_manifest
from tests.helpers import flip_middle, job_config, read_all

NAN_TOKEN = 7
NUM_SAMPLES = 12
NAN_SAMPLES = {5: 3, 6: 20, 10: 0}
"""Sample id -> position of the NaN token in it: shards 1 and 2 (4 samples a shard) hold them."""
EVERY_STATE = "layer 2, layer 4, layer 5, last_hidden_state"


@pytest.fixture(scope="module")
def nan_model(llama_fp32, tmp_path_factory):
    """The tiny Llama with embedding row NAN_TOKEN set to NaN: SGLang's forward turns it into NaN states."""
    from safetensors.torch import load_file, save_file

    directory = tmp_path_factory.mktemp("nan") / "model"
    shutil.copytree(llama_fp32, directory)
    for path in directory.glob("*.safetensors"):
        tensors = load_file(path)
        if "model.embed_tokens.weight" in tensors:
            tensors["model.embed_tokens.weight"][NAN_TOKEN] = float("nan")
            save_file(tensors, path, metadata={"format": "pt"})
            return directory
    raise AssertionError(f"no model.embed_tokens.weight in {directory}")


@pytest.fixture(scope="module")
def nan_data(tmp_path_factory):
    rng = np.random.default_rng(3)
    rows = []
    for sample in range(NUM_SAMPLES):
        ids = rng.integers(10, 500, 24 + sample).tolist()  # never NAN_TOKEN...
        if sample in NAN_SAMPLES:
            ids[NAN_SAMPLES[sample]] = NAN_TOKEN  # ...except here
        rows.append(json.dumps({"input_ids": ids}))
    path = tmp_path_factory.mktemp("nan-data") / "data.jsonl"
    path.write_text("\n".join(rows) + "\n")
    return path


def nan_config(model, data, out, *extra):
    """Three shards of four samples; one writer (what is checked is each shard's samples, not how writers share
    them: a second writer is a second actor's start)."""
    return job_config(model, data, out, "data.shard_size=4", "model.dtype=bfloat16", "output.num_writers=1", *extra)


def verify(out, *extra, capsys) -> tuple[int, str]:
    code = verify_main([f"output.dir={out}", *extra])
    return code, capsys.readouterr().out


def test_fail_names_sample_shard_and_layer_then_skip_completes_the_run(ray_cluster, nan_model, nan_data, tmp_path, capsys):
    out = tmp_path / "out"
    summary = run(nan_config(nan_model, nan_data, out))  # extract.on_nonfinite=fail: the default
    assert sorted(summary["shards_failed"]) == ["1", "2"]
    assert re.search(rf"shard 1 \(samples .*\): NonFiniteStates: shard-00001.parquet: sample 5 has NaN/Inf in "
                     rf"{EVERY_STATE} \(and 1 more samples of this batch\)", summary["shards_failed"]["1"])
    assert "sample 10 has NaN/Inf in" in summary["shards_failed"]["2"]
    assert sorted(p.name for p in out.glob("*.parquet")) == [shard_file_name(0)] and not list(out.glob(".*.tmp"))
    code, report = verify(out, capsys=capsys)
    assert code == EXIT_VERIFY_FAILED and "shard 1 failed after 1 attempts" in report and "shards=[1,2]" in report

    # the same command, the failed shards only, leaving such samples out
    summary = run(nan_config(nan_model, nan_data, out, "shards=failed", "extract.on_nonfinite=skip"))
    assert summary["shards_failed"] == {} and summary["samples"] == NUM_SAMPLES - len(NAN_SAMPLES)
    kept_lengths = [24 + sample for sample in range(NUM_SAMPLES) if sample not in NAN_SAMPLES]
    assert summary["tokens"] == sum(kept_lengths)
    assert summary["bytes"] == sum(p.stat().st_size for p in out.glob("*.parquet"))
    nonfinite = summary["nonfinite_samples"]
    assert (nonfinite["on_nonfinite"], nonfinite["skipped"], nonfinite["kept"]) == ("skip", 3, 0)
    assert [(s["shard"], s["sample_id"], s["reason"]) for s in nonfinite["first"]] == [
        (1, 5, f"NaN/Inf in {EVERY_STATE}"), (1, 6, f"NaN/Inf in {EVERY_STATE}"), (2, 10, f"NaN/Inf in {EVERY_STATE}")]
    records = read_manifest(out)["shards"]
    assert [sorted(s["sample_id"] for s in r["nonfinite"]) for r in records] == [[], [5, 6], [10]]
    samples = read_all(out)
    assert sorted(samples) == sorted(set(range(NUM_SAMPLES)) - set(NAN_SAMPLES))
    assert all(torch.isfinite(s.aux_hidden_states.float()).all() and torch.isfinite(s.last_hidden_state.float()).all()
               for s in samples.values())
    code, report = verify(out, "--deep", capsys=capsys)
    assert code == EXIT_OK, report
    assert "note: shard 1: 2 samples with NaN/Inf states left out (extract.on_nonfinite=skip): [5, 6]" in report

    # a skipped sample is not a missing one: the rerun has nothing to do
    assert run(nan_config(nan_model, nan_data, out, "extract.on_nonfinite=skip"))["outcome"] == NOTHING_TO_DO

    # 4 KB flipped in the middle of a shard: verify names the file's checksum, the reader raises
    flip_middle(out / shard_file_name(0))
    code, report = verify(out, capsys=capsys)
    assert code == EXIT_VERIFY_FAILED
    assert re.search(rf"{out / shard_file_name(0)}: checksum xxh3_128:\w+ differs from the manifest's", report), report
    with pytest.raises(ValueError, match=r"CRC checksum verification failed.*shards=\[0\]"):
        list(ShardReader(out / shard_file_name(0)))


def test_keep_writes_and_flags_them_fp8_included(ray_cluster, nan_model, nan_data, tmp_path, capsys):
    """fp8 finds them from the scales (amax propagates NaN); the raw NaN values and scales are stored."""
    out = tmp_path / "out"
    summary = run(nan_config(nan_model, nan_data, out, "extract.on_nonfinite=keep", "output.state_dtype=float8_e4m3fn"))
    assert summary["shards_failed"] == {} and summary["samples"] == NUM_SAMPLES
    assert (summary["nonfinite_samples"]["skipped"], summary["nonfinite_samples"]["kept"]) == (0, 3)
    records = read_manifest(out)["shards"]
    assert [sorted(s["sample_id"] for s in r["nonfinite"] if s["action"] == "kept") for r in records] == [[], [5, 6], [10]]
    raw = {}
    for path in sorted(out.glob("shard-*.parquet")):
        raw.update((sample.sample_id, sample) for sample in ShardReader(path, raw_fp8=True))
    for sample_id, sample in raw.items():
        scales_finite = torch.isfinite(sample.aux_hidden_states_scales).all(dim=1)
        if sample_id in NAN_SAMPLES:  # never finite from the NaN token on
            assert not scales_finite[NAN_SAMPLES[sample_id]:].any(), sample_id
        else:
            assert scales_finite.all() and torch.isfinite(sample.last_hidden_state_scales).all(), sample_id
    code, report = verify(out, "--deep", capsys=capsys)
    assert code == EXIT_OK, report
    assert "note: shard 2: 1 samples with NaN/Inf states written, flagged (extract.on_nonfinite=keep): [10]" in report
