"""The whole job through real local Ray: files, rows, tokens, bytes, dtypes, TP=2, bad input."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest
import torch

from extractor.quantize import quantize_fp8
from inputs.dataset import open_tokenized_dataset
from jobs.driver.result import STEADY_MIN_SECONDS
from jobs.extract import final_message, run
from jobs.planning.shards import pack_batches
from jobs.rundir.summary import DRAFTER_CONFIG_FILE, SUMMARY_FILE, read_summary
from runtime.errors import EXIT_BAD_INPUT
from storage import ShardReader
from storage.manifest import read_manifest
from tests.conftest import REPO_ROOT, free_port
from tests.helpers import (
    FINISHED_RUN,
    HIDDEN,
    ExtractorHandle,
    assert_reads_as_parquet_dataset,
    engine_spec,
    imported_by,
    job_args,
    job_config,
    python_env,
    read_all,
    split_tokens,
)

BF16_PRE_NORM = ("model.dtype=bfloat16", "extract.last_hidden_state=pre_norm")
"""The model in bfloat16, the pre-norm final state (the defaults, named: the fp8 run below must match them)."""
SHARD_SIZE = 4
"""``FINISHED_RUN``'s shards (``data.shard_size``): batches are packed within a shard."""
ONE_WRITER = "output.num_writers=1"
"""For the runs whose states are compared, not how writers share the shards (the finished run has two): a second
writer is a second actor's start."""


@pytest.fixture(scope="module")
def bf16_run(finished_run) -> tuple[Path, dict]:
    """The session's finished run (the demo in bfloat16 with the pre-norm final state, five shards) and its summary:
    the tests only read it."""
    content = read_manifest(finished_run)["content"]
    assert (content["model.dtype"], content["extract.last_hidden_state"]) == ("bfloat16", "pre_norm"), content
    return finished_run, read_summary(finished_run)


def test_job_writes_every_sample_bit_exact(llama_fp32, demo_dataset, bf16_run):
    out, summary = bf16_run
    dataset = open_tokenized_dataset(str(demo_dataset), vocab_size=512, max_length=4096)
    input_ids, loss_masks = dataset.rows(0, len(dataset))

    # files, rows, tokens and bytes match the input and the summary
    files = sorted(out.glob("shard-*.parquet"))
    assert [f.name for f in files] == [f"shard-{index:05d}.parquet" for index in range(len(dataset) // SHARD_SIZE)]
    assert not list(out.glob("*.tmp"))
    assert summary["samples"] == len(dataset) == sum(pq.ParquetFile(f).metadata.num_rows for f in files)
    assert summary["tokens"] == int(dataset.lengths.sum())
    assert summary["bytes"] == sum(f.stat().st_size for f in files)
    assert summary["shards_failed"] == {}
    assert summary["writers"] == 2 and summary["peak_open_shards"] == 2  # both writers worked at once
    # output.writer_cpus=auto with a CPU engine (its threads take every core): writers not pinned
    assert [node["writer_cpus"] for node in summary["nodes"].values()] == ["all cores"]
    assert json.loads((out / SUMMARY_FILE).read_text())["tokens"] == summary["tokens"]
    drafter = json.loads((out / DRAFTER_CONFIG_FILE).read_text())
    assert drafter["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [2, 4, 5]
    assert summary["outcome"] == "complete" and summary["this_run"]["tokens"] == summary["tokens"]
    assert summary["tokens_per_second"] == round(summary["tokens"] / summary["this_run"]["seconds"], 1)
    # where the command's wall time went up to the run's end, phase by phase, adding up to the total
    wall = summary["wall_seconds"]
    assert [phase for phase, _ in wall["phases"]] == [
        "reading the inputs", "checking the layers SGLang captures", "starting Ray", "checking the run's directories",
        "loading the model and starting the writers", "warming the object store", "extracting the first batch",
        "extracting", "closing the last shards", "winding down"]
    assert sum(seconds for _, seconds in wall["phases"]) == pytest.approx(wall["total"], abs=0.05)
    # the steady state apart from what a run pays once: the first batch through the pipeline (a whole shard here:
    # its tokens are left out of the steady state's), the last shards' closing
    assert summary["tokens"] - summary["steady_tokens"] in summary["plan"]["shard_tokens"].values()
    parts = summary["first_batch_seconds"] + summary["steady_seconds"] + summary["drain_seconds"]
    assert parts == pytest.approx(summary["this_run"]["seconds"], abs=0.01) and summary["steady_seconds"] > 0
    if summary["steady_seconds"] >= STEADY_MIN_SECONDS:
        assert summary["steady_tokens_per_second"] == pytest.approx(
            summary["steady_tokens"] / summary["steady_seconds"], rel=0.01)  # the seconds are rounded to ms
    else:  # too short a window to time: no rate, and none in the last line
        assert summary["steady_tokens_per_second"] is None and "pipeline was full" not in final_message(summary)
    phases = dict(wall["phases"])
    assert phases["extracting the first batch"] == pytest.approx(summary["first_batch_seconds"], abs=0.05)
    assert phases["closing the last shards"] == pytest.approx(summary["drain_seconds"], abs=0.05)
    assert_reads_as_parquet_dataset(out, len(dataset))

    samples = read_all(out)
    assert sorted(samples) == list(range(len(dataset)))
    for sample_id, sample in samples.items():
        length = len(input_ids[sample_id])
        assert sample.input_ids.tolist() == input_ids[sample_id].tolist()
        assert sample.loss_mask.tolist() == loss_masks[sample_id].tolist()
        assert sample.aux_hidden_states.shape == (length, 3 * HIDDEN)
        assert sample.aux_hidden_states.dtype == torch.bfloat16
        assert sample.last_hidden_state.shape == (length, HIDDEN)
    metadata = ShardReader(files[0]).metadata
    assert (metadata.layer_ids, metadata.layers_to_capture, metadata.drafter_layer_ids) == ([2, 4, 5], [3, 5, 6], [2, 4, 5])
    assert metadata.sglang_version == "0.5.23" and metadata.dtype == "bfloat16"

    # the bytes on disk are bit for bit what SGLang returned for the same batches
    extractor = ExtractorHandle(engine_spec(llama_fp32, [2, 4, 5], dtype="bfloat16", last_hidden_state="pre_norm"))
    try:
        for shard_start in range(0, len(dataset), SHARD_SIZE):
            lengths = dataset.lengths[shard_start : shard_start + SHARD_SIZE]
            for start, stop in pack_batches(lengths, 300, 256):
                ids = input_ids[shard_start + start : shard_start + stop]
                captured = extractor.extract(ids)
                for offset, aux, last in zip(range(start, stop), split_tokens(captured.aux_hidden_states, lengths[start:stop]),
                                             split_tokens(captured.last_hidden_state, lengths[start:stop])):
                    stored = samples[shard_start + offset]
                    assert np.array_equal(stored.aux_hidden_states.view(torch.int16).numpy(), aux)
                    assert np.array_equal(stored.last_hidden_state.view(torch.int16).numpy(), last)
    finally:
        extractor.close()


def test_tp2_job_equals_tp1(ray_cluster, llama_fp32, demo_dataset, tmp_path):
    results = {}
    for tp in (1, 2):
        out = tmp_path / f"tp{tp}"
        summary = run(job_config(llama_fp32, demo_dataset, out, "model.dtype=float32", f"model.tp_size={tp}",
                                 "extract.layers=[0,3,6]", ONE_WRITER))
        assert summary["engine"]["tp_size"] == tp
        results[tp] = read_all(out)
    assert sorted(results[1]) == sorted(results[2])
    worst_aux = worst_last = largest_last = 0.0
    for sample_id, one in results[1].items():
        two = results[2][sample_id]
        worst_aux = max(worst_aux, (one.aux_hidden_states - two.aux_hidden_states).abs().max().item())
        worst_last = max(worst_last, (one.last_hidden_state - two.last_hidden_state).abs().max().item())
        largest_last = max(largest_last, one.last_hidden_state.abs().max().item())
    print(f"TP=2 vs TP=1 max abs diff: aux {worst_aux:.3g}, final {worst_last:.3g} (final max |x| {largest_last:.3g})")
    assert worst_aux <= 1e-6, worst_aux
    # The final state is post-norm with |x| up to ~10 here: compare at fp32 resolution of that scale.
    assert worst_last <= 1e-6 * largest_last, (worst_last, largest_last)


def test_fp8_job_stores_the_quantized_model_states(ray_cluster, llama_fp32, demo_dataset, bf16_run, tmp_path):
    """output.state_dtype=float8_e4m3fn with the pre-norm final state: the stored fp8 values and
    scales are exactly the quantization of what the bf16 run of the same batches stored, at about
    half the bytes; a resume with another state dtype is refused."""
    bf16_dir, bf16 = bf16_run
    fp8 = run(job_config(llama_fp32, demo_dataset, tmp_path / "fp8", *FINISHED_RUN, *BF16_PRE_NORM,
                         "output.state_dtype=float8_e4m3fn", ONE_WRITER))
    assert fp8["shards_failed"] == {} and fp8["tokens"] == bf16["tokens"]
    metadata = ShardReader(next((tmp_path / "fp8").glob("shard-*.parquet"))).metadata
    assert (metadata.state_dtype, metadata.dtype, metadata.last_hidden_state) == ("float8_e4m3fn", "bfloat16", "pre_norm")
    states_bf16 = (3 + 1) * HIDDEN * 2
    states_fp8 = (3 + 1) * HIDDEN + (3 + 1) * 4
    # the same token ids and masks, and file overhead, around half the state bytes
    overhead = bf16["bytes"] / bf16["tokens"] - states_bf16
    assert fp8["bytes"] / fp8["tokens"] == pytest.approx(states_fp8 + overhead, rel=0.02)

    reference, raw = read_all(bf16_dir), {}
    for path in sorted((tmp_path / "fp8").glob("shard-*.parquet")):
        raw.update((sample.sample_id, sample) for sample in ShardReader(path, raw_fp8=True))
    dequantized = read_all(tmp_path / "fp8")
    squared_error, squared_norm = torch.zeros(4), torch.zeros(4)
    for sample_id, expected in reference.items():
        stored = raw[sample_id]
        for name, groups in (("aux_hidden_states", 3), ("last_hidden_state", 1)):
            values, scales = quantize_fp8(getattr(expected, name), groups)
            assert torch.equal(getattr(stored, name).view(torch.uint8), values.view(torch.uint8)), (sample_id, name)
            assert torch.equal(getattr(stored, name + "_scales"), scales), (sample_id, name)
        both = [(s.aux_hidden_states.float(), s.last_hidden_state.float()) for s in (expected, dequantized[sample_id])]
        original = torch.cat(both[0], dim=1).view(-1, 4, HIDDEN)
        restored = torch.cat(both[1], dim=1).view(-1, 4, HIDDEN)
        squared_error += (restored - original).square().sum(dim=(0, 2))
        squared_norm += original.square().sum(dim=(0, 2))
    errors = (squared_error / squared_norm).sqrt().tolist()
    print("fp8 relative error per stored layer (layers 2, 4, 5, final pre-norm):", [f"{e:.4f}" for e in errors])
    assert all(0.005 < error < 0.05 for error in errors), errors

    with pytest.raises(ValueError, match="output.state_dtype: was 'float8_e4m3fn', now 'model'"):
        run(job_config(llama_fp32, demo_dataset, tmp_path / "fp8", *FINISHED_RUN, *BF16_PRE_NORM))


def test_bad_input_fails_before_any_work(ray_cluster, llama_fp32, tmp_path):
    data = tmp_path / "bad.jsonl"
    data.write_text('{"input_ids": [1, 2, 3]}\n{"input_ids": [4, 999999]}\n')
    out = tmp_path / "out"
    with pytest.raises(ValueError, match=rf"{data} row 1 \(line 2, sample id 1\): token id 999999 is outside the model.s vocabulary"):
        run(job_config(llama_fp32, data, out))
    assert not out.exists()


def test_output_dir_with_shards_is_not_overwritten(ray_cluster, llama_fp32, demo_dataset, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "shard-00001.parquet").write_bytes(b"earlier run")
    with pytest.raises(ValueError, match="holds 1 shard files .* but no .manifest.json"):
        run(job_config(llama_fp32, demo_dataset, out))
    assert (out / "shard-00001.parquet").read_bytes() == b"earlier run"


def test_uncapturable_layer_is_rejected_before_any_work(ray_cluster, llama_fp32, demo_dataset, tmp_path):
    with pytest.raises(ValueError, match=r"\[7\] cannot be captured from a 8-layer model"):
        run(job_config(llama_fp32, demo_dataset, tmp_path / "out", "extract.layers=[2,4,7]"))
    assert not (tmp_path / "out").exists()


def test_storage_and_jobs_do_not_import_sglang():
    assert imported_by("storage, jobs.extract, jobs.driver.run", ("sglang",)) == []


def test_the_driver_imports_neither_torch_nor_sglang_before_ray(llama_fp32, demo_dataset, tmp_path):
    """Everything the driver does before Ray starts (the inputs, the layer check, the lock, the plan, the disk
    budget) needs neither: the command reaches the start of Ray (here a cluster address nothing answers at) with
    neither imported, nor transformers (whose AutoTokenizer brings torch)."""
    code = ("import sys; from jobs.extract import main; code = main(sys.argv[1:]); "
            "print(code, sorted({m.split('.')[0] for m in sys.modules} & {'torch', 'sglang', 'transformers'}))")
    result = subprocess.run([sys.executable, "-c", code, *job_args(llama_fp32, demo_dataset, tmp_path / "out"),
                             f"ray.address=127.0.0.1:{free_port()}"],
                            cwd=REPO_ROOT, env=python_env(), capture_output=True, text=True, timeout=300)
    assert "no Ray cluster answers at ray.address=127.0.0.1:" in result.stderr, result.stderr[-2000:]
    assert result.stdout.splitlines()[-1] == f"{EXIT_BAD_INPUT} []", result.stdout + result.stderr[-2000:]


def test_writer_processes_do_not_import_torch():
    """Eight writers each importing torch would spend seconds and GBs before their first batch."""
    assert imported_by("jobs.actors.writer, jobs.actors.uploader", ("torch", "sglang")) == []


def test_dry_run_imports_sglang_and_torch_only_for_the_layer_check():
    """`python -m jobs.plan` with the synthetic source (no layer check to run) answers without either."""
    assert imported_by("jobs.plan, jobs.planning.dry_run", ("torch", "sglang")) == []


def test_status_starts_without_ray_or_torch():
    """`jobs.status` answers in about a second, even while a job holds the machine; `jobs.verify` runs on
    any machine that sees the files."""
    assert imported_by("jobs.status, jobs.verify", ("ray", "torch", "sglang")) == []
