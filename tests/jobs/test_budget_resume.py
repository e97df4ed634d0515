"""Disk budget, sink, manifest, resume and rerun, through the real job on real files."""

from __future__ import annotations

import json
import re

import fsspec
import pytest

from common.checks import format_bytes
from jobs.cluster.node_disk import LocalDisk
from jobs.extract import run
from jobs.rundir.summary import read_summary
from jobs.status import status_report
from runtime.errors import BudgetExhausted, ConfigError
from storage.claim import CLAIM_FILE
from storage.manifest import DONE, MANIFEST_FILE, SINK, read_manifest
from storage.token_freq import count_tokens, read_token_freq
from storage.writer import shard_file_name, temp_file_name
from tests.helpers import DiskSampler, checksum_of, copy_of, job_config, own_files_bytes, read_all

SHARD_SIZE = 4
NUM_SAMPLES = 20
"""The demo dataset's samples (conftest), in five shards: the session's ``finished_run`` is of the same keys."""


@pytest.fixture(scope="module")
def shard_bytes(finished_run) -> int:
    """Largest shard file of an unconstrained run of the demo dataset (the session's finished run): the unit the
    budgets below are written in."""
    return max(path.stat().st_size for path in finished_run.glob("shard-*.parquet"))


def budget_config(model, data, out, budget, *extra):
    return job_config(
        model, data, out, f"data.shard_size={SHARD_SIZE}", f"output.disk_budget={budget}",
        "output.rescan_s=0.2", "output.max_inflight_batches=2", "extract.max_tokens_per_batch=200", *extra,
    )


def budget_of(model, data, out, shard_files_bytes, *extra) -> int:
    """A budget that holds ``shard_files_bytes`` of shard files beside the job's own files."""
    return own_files_bytes(budget_config(model, data, out, "1TB", *extra)) + shard_files_bytes


def assert_sample_ids_complete(samples, count=NUM_SAMPLES):
    """``samples`` (ids) are 0..count-1, each once."""
    assert sorted(samples) == list(range(count))


def test_budget_of_three_shards_with_a_sink(ray_cluster, llama_fp32, demo_dataset, shard_bytes, tmp_path, s3_server):
    """The budget holds with an S3 sink (moto's server): every shard uploaded, verified, then deleted locally. The
    same with a file:// sink, a budget per node: tests/jobs/test_multinode.py."""
    options, sink = s3_server, "s3://eagle3-test/run1"
    options_arg = [f"output.sink_options={json.dumps(options)}"]
    out = tmp_path / "out"
    budget = budget_of(llama_fp32, demo_dataset, out, 3 * shard_bytes, f"output.sink={sink}", *options_arg)
    with DiskSampler(out) as sampler:
        summary = run(budget_config(llama_fp32, demo_dataset, out, str(budget), f"output.sink={sink}", *options_arg))
    print(f"s3 sink: budget {budget} B, sampled peak {sampler.peak} B over {sampler.samples} samples, "
          f"accounted peak {summary['disk_budget']['peak']}, blocked {summary['disk_budget']['blocked_seconds']} s")
    assert sampler.peak <= budget
    assert summary["disk_budget"]["overshoot"] == 0
    assert summary["shards_done"] == NUM_SAMPLES // SHARD_SIZE and summary["shards_failed"] == {}

    manifest = read_manifest(out)
    fs, _ = fsspec.core.url_to_fs(sink, **options)
    for record in manifest["shards"]:
        assert record["state"] == DONE and record["location"] == SINK
        assert not (out / record["file"]).exists()  # verified, then deleted locally
        remote = fs.cat_file(fs._strip_protocol(record["sink_url"]))
        assert len(remote) == record["bytes"] and checksum_of(remote, "xxh3_128") == record["checksum"]
    # the uploaded shards hold every sample once
    local_copy = tmp_path / "downloaded"
    local_copy.mkdir()
    for record in manifest["shards"]:
        (local_copy / record["file"]).write_bytes(fs.cat_file(fs._strip_protocol(record["sink_url"])))
    assert_sample_ids_complete(read_all(local_copy))
    # the token counts for speculators' vocabulary were made at the end, from the shards in the sink
    assert read_token_freq(out) == count_tokens(local_copy) and sum(read_token_freq(out).values()) > 0
    # the sink is the run's: another run naming it is refused before it starts, and nothing there changes
    objects = {path: fs.cat_file(path) for path in fs.find("eagle3-test/run1")}
    claim = json.loads(objects[f"eagle3-test/run1/{CLAIM_FILE}"])
    assert (claim["run_id"], claim["output_dir"]) == (manifest["run_id"], str(out))
    second = budget_config(llama_fp32, demo_dataset, tmp_path / "second", "1TB", f"output.sink={sink}", *options_arg)
    with pytest.raises(ConfigError, match=f"output.sink={sink} belongs to the run whose output.dir is {out} on "):
        run(second)
    assert {path: fs.cat_file(path) for path in fs.find("eagle3-test/run1")} == objects


def test_full_budget_without_sink_stops_then_resumes(ray_cluster, llama_fp32, demo_dataset, shard_bytes, tmp_path):
    out = tmp_path / "out"
    budget = budget_of(llama_fp32, demo_dataset, out, 3 * shard_bytes)
    with pytest.raises(BudgetExhausted, match=r"shards remain.*Raise output.disk_budget, set output.sink"):
        with DiskSampler(out) as sampler:
            run(budget_config(llama_fp32, demo_dataset, out, str(budget), "output.budget_wait_s=1"))
    assert sampler.peak <= budget
    manifest = read_manifest(out)
    done = [r for r in manifest["shards"] if r["state"] == DONE]
    assert 1 <= len(done) < NUM_SAMPLES // SHARD_SIZE
    assert sum(r["bytes"] for r in done) <= budget
    assert not list(out.glob("*.tmp"))
    # the summary is written at exit 3 too, with this run's numbers
    stopped = read_summary(out)
    assert (stopped["outcome"], stopped["exit_code"]) == ("budget_exhausted", 3)
    assert stopped["this_run"]["tokens"] == stopped["tokens"] == sum(r["tokens"] for r in done)
    assert "Raise output.disk_budget" in stopped["message"]
    # status: the run's own budget (not the default), planned samples and tokens of pending shards
    report = status_report(out)
    assert f"of budget {format_bytes(budget)} (" in report and "the run's" in report, report
    pending = [r for r in manifest["shards"] if r["state"] != DONE]
    planned = sum(stopped["plan"]["shard_tokens"][str(r["index"])] for r in pending)
    assert re.search(rf"pending +{len(pending)} +{sum(r['stop'] - r['start'] for r in pending)} +{planned}  \(planned\)",
                     report), report
    assert "job: not running; the last run ended" in report and "budget_exhausted (exit code 3)" in report
    (out / "notes.txt").write_text("not the job's")
    assert "not the job's: 1 entries this job did not write: notes.txt" in status_report(out)

    summary = run(budget_config(llama_fp32, demo_dataset, out, "1TB"))
    assert summary["shards_done"] == NUM_SAMPLES // SHARD_SIZE
    # this run's rate counts only what this run extracted
    assert summary["this_run"]["tokens"] == summary["tokens"] - stopped["tokens"] == planned
    assert summary["tokens_per_second"] == round(planned / summary["this_run"]["seconds"], 1)
    assert_sample_ids_complete(read_all(out))
    attempts = {r["index"]: r["attempts"] for r in read_manifest(out)["shards"]}
    assert all(attempts[r["index"]] == 1 for r in done), "done shards must not run again"


def test_rerun_failed_shard_only(ray_cluster, llama_fp32, demo_dataset, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    # A real failure: shard 1's temp file cannot be created.
    blocker = out / temp_file_name("shard-00001.parquet")
    blocker.mkdir()
    summary = run(budget_config(llama_fp32, demo_dataset, out, "1TB"))
    assert list(summary["shards_failed"]) == ["1"]
    error = summary["shards_failed"]["1"]
    assert "Is a directory" in error and ".shard-00001.parquet.tmp" in error, error
    assert not (out / "shard-00001.parquet").exists()
    assert "shard 1 (failed, 1 attempts)" in status_report(out, 10**12)
    before = {p.name: p.stat().st_mtime_ns for p in out.glob("shard-*.parquet")}
    assert len(before) == NUM_SAMPLES // SHARD_SIZE - 1

    blocker.rmdir()
    summary = run(budget_config(llama_fp32, demo_dataset, out, "1TB", "shards=failed"))
    assert summary["shards_failed"] == {} and summary["shards_done"] == NUM_SAMPLES // SHARD_SIZE
    after = {p.name: p.stat().st_mtime_ns for p in out.glob("shard-*.parquet")}
    assert {name: after[name] for name in before} == before, "only the failed shard may be rewritten"
    records = {r["index"]: r for r in read_manifest(out)["shards"]}
    assert records[1]["attempts"] == 2 and records[1]["state"] == DONE
    assert all(records[i]["attempts"] == 1 for i in records if i != 1)
    assert_sample_ids_complete(read_all(out))
    # named shards (shards=[...]) rerun those and nothing else: tests/jobs/test_multinode.py, across nodes


def test_resume_with_other_content_or_into_another_runs_directory_is_refused(
    ray_cluster, llama_fp32, demo_dataset, finished_run, tmp_path,
):
    out = copy_of(finished_run, tmp_path)  # every refusal below leaves it as it is (checked at the end)
    files = {path.name: path.read_bytes() for path in out.glob("shard-*.parquet")}
    with pytest.raises(ValueError, match=r"different content \(extract.layers: was \[2, 4, 5\], now \[1, 4, 5\]"):
        run(budget_config(llama_fp32, demo_dataset, out, "1TB", "extract.layers=[1,4,5]"))
    with pytest.raises(ValueError, match=r"model.dtype: was 'bfloat16', now 'float32'"):
        run(budget_config(llama_fp32, demo_dataset, out, "1TB", "model.dtype=float32"))
    # A second run whose node directory is this run's output.dir: its start-up clean-up would remove
    # every shard there as "not recorded"; the directory's claim refuses it before anything is touched.
    # the copy's claim names the run it was copied from (its own output.dir until a rerun claims the copy)
    with pytest.raises(ValueError, match=f"belongs to the run whose output.dir is {finished_run} .*nothing there was "
                                         "touched"):
        run(budget_config(llama_fp32, demo_dataset, tmp_path / "other", "1TB", f"output.node_dir={out}"))
    assert {path.name: path.read_bytes() for path in out.glob("shard-*.parquet")} == files
    records = read_manifest(out)["shards"]
    assert all(r["state"] == DONE and r["attempts"] == 1 for r in records)
    assert_sample_ids_complete(read_all(out))


def test_status_counts_the_shards_in_a_node_directory_of_its_own(ray_cluster, llama_fp32, demo_dataset, tmp_path):
    """One node whose shards go to output.node_dir, not output.dir: jobs.status counts them there and names it."""
    out, nodes = tmp_path / "out", tmp_path / "nvme"
    summary = run(job_config(llama_fp32, demo_dataset, out, "data.shard_size=4", "output.min_free=0",
                             f"output.node_dir={nodes}"))
    assert summary["outcome"] == "complete" and not list(out.glob("shard-*.parquet"))
    stored = format_bytes(sum(record["bytes"] for record in read_manifest(out)["shards"]))
    report = status_report(out)
    assert f"on local disk: {stored} of budget" in report, report
    assert re.search(rf"node \S+: 5 shards done, {re.escape(stored)} on its disk, .* free in {nodes}\n", report), report


def test_shard_larger_than_budget_is_refused(ray_cluster, llama_fp32, demo_dataset, tmp_path):
    """Refused from config.json and the dataset's lengths, before Ray or the model: no manifest yet."""
    with pytest.raises(ValueError, match="a shard must fit the budget whole"):
        run(budget_config(llama_fp32, demo_dataset, tmp_path / "out", "10KB"))
    assert not (tmp_path / "out" / MANIFEST_FILE).exists()


def test_free_space_counts_what_each_open_shard_has_written(tmp_path):
    """A reservation shrinks by its own temp file's bytes; a temp file renamed into place between two
    checks (its writer committed it) leaves the whole reservation, and the check does not fail."""
    disk = LocalDisk(tmp_path)
    reserved = {3: 1000, 4: 500}
    (tmp_path / temp_file_name(shard_file_name(3))).write_bytes(b"x" * 400)
    (tmp_path / temp_file_name(shard_file_name(9))).write_bytes(b"x" * 300)  # no reservation: not counted
    assert disk.free_and_unwritten(reserved)[1] == 600 + 500
    (tmp_path / temp_file_name(shard_file_name(3))).rename(tmp_path / shard_file_name(3))
    assert disk.free_and_unwritten(reserved)[1] == 1000 + 500
