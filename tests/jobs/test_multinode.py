"""Data parallel across nodes: a real two-node Ray cluster on this machine (``ray.cluster_utils.Cluster``).

Each node has its own CPUs, a custom resource, an ``eagle3-node`` label and its own output directory
(``output.node_dir=.../{node}``); the job runs as its own process joined to the cluster, as under
``ray job submit``. The file shares one cluster, its head node ``a``; a test that needs the second node ``b``
adds it and removes it after.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from inputs.demo import build_synthetic_dataset
from jobs.cluster.nodes import NodeGroup
from jobs.config import JobConfig
from jobs.driver.job import _prepare_directories
from jobs.rundir.summary import read_summary
from storage import shard_file_name
from storage.claim import CLAIM_FILE
from storage.manifest import DONE, LOCAL, SINK, Manifest, read_manifest
from storage.token_freq import count_tokens, read_token_freq
from tests.conftest import REPO_ROOT, ray_temp_dir
from tests.helpers import DiskSampler, assert_every_sample_once, assert_run_verifies, python_env

NUM_SAMPLES = 24
SHARD_SIZE = 4
BUDGET = 800_000  # about two shards of this dataset: each node must wait on its own uploads


@pytest.fixture(scope="module")
def head_a():
    """A one-node cluster (its head, labelled ``a``) and its temp dir."""
    from ray.cluster_utils import Cluster

    with ray_temp_dir("rc") as temp:
        cluster = Cluster(initialize_head=True, head_node_args=dict(
            num_cpus=2, node_ip_address="127.0.0.1", temp_dir=str(temp), resources={"node_a": 1},
            labels={"eagle3-node": "a"}, include_dashboard=False))
        try:
            yield cluster, temp
        finally:
            cluster.shutdown()


@pytest.fixture
def two_nodes(head_a):
    """The head ``a`` and a second node ``b``, for the test: ``b`` is removed after it."""
    cluster, temp = head_a
    worker = cluster.add_node(num_cpus=2, node_ip_address="127.0.0.1", temp_dir=str(temp), resources={"node_b": 1},
                              labels={"eagle3-node": "b"})
    try:
        cluster.wait_for_nodes()
        yield cluster, {"a": cluster.head_node.node_id, "b": worker.node_id}
    finally:
        cluster.remove_node(worker)


def test_two_nodes_each_extract_and_write_locally_under_their_own_budget(two_nodes, llama_fp32, tmp_path):
    """Each node extracts and writes under its own budget on its own directory, uploading to a file:// sink (the same
    with an S3 sink on one node: tests/jobs/test_budget_resume.py)."""
    cluster, node_ids = two_nodes
    data = build_synthetic_dataset(tmp_path / "data.parquet", num_samples=NUM_SAMPLES, min_len=40, max_len=90, seed=5)
    out, sink = tmp_path / "out", tmp_path / "sink"
    node_dirs = {name: tmp_path / "nodes" / name for name in node_ids}
    args = [
        f"model.path={llama_fp32}", f"data.path={data}", f"output.dir={out}", f"output.node_dir={tmp_path}/nodes/{{node}}",
        f"ray.address={cluster.address}", f"data.shard_size={SHARD_SIZE}", "extract.max_tokens_per_batch=100",
        "model.device=cpu", "model.dtype=float32", "output.min_free=0", f"output.disk_budget={BUDGET}",
        "output.rescan_s=0.2", f"output.sink=file://{sink}",
    ]
    env = python_env()
    samplers = {name: DiskSampler(directory) for name, directory in node_dirs.items()}
    for sampler in samplers.values():
        sampler.__enter__()
    try:
        job = subprocess.run([sys.executable, "-m", "jobs.extract", *args], cwd=REPO_ROOT, env=env,
                             capture_output=True, text=True, timeout=600)
    finally:
        for sampler in samplers.values():
            sampler.__exit__(None, None, None)
    assert job.returncode == 0, job.stderr[-3000:]

    summary = read_summary(out)
    # one extractor group per node; _check_node made sure its extractor and writers ran there
    assert {name: node["node_id"] for name, node in summary["nodes"].items()} == node_ids
    records = read_manifest(out)["shards"]
    assert all(r["state"] == DONE and r["location"] == SINK for r in records)
    per_node = {name: [r["index"] for r in records if r["node"] == name] for name in node_ids}
    assert all(per_node.values()), f"a node wrote no shard: {per_node}"  # both extractors worked
    assert sorted(sum(per_node.values(), [])) == list(range(NUM_SAMPLES // SHARD_SIZE))
    # each node's own budget held, on its own directory
    for name, sampler in samplers.items():
        assert 0 < sampler.peak <= BUDGET, (name, sampler.peak)
        assert summary["nodes"][name]["budget_overshoot"] == 0
        assert summary["nodes"][name]["directory"] == str(node_dirs[name])
    assert not list(out.glob("shard-*.parquet"))  # nothing was written on the driver's own output.dir
    assert_every_sample_once(sink, data)
    assert_run_verifies(out)
    # the token counts for speculators' vocabulary were made at the end, from the shards in the sink
    assert read_token_freq(out) == count_tokens(sink) and sum(read_token_freq(out).values()) > 0

    # status shows each node
    status = subprocess.run([sys.executable, "-m", "jobs.status", f"output.dir={out}"], cwd=REPO_ROOT, env=env,
                            capture_output=True, text=True, timeout=60)
    for name in node_ids:
        assert f"node {name}" in status.stdout, status.stdout


@pytest.mark.extended
def test_resume_and_named_reruns_work_across_node_directories(two_nodes, llama_fp32, tmp_path):
    """Without a sink the files stay on their nodes; a rerun of named shards may place them on the
    other node, and the copy the manifest does not vouch for is removed."""
    cluster, node_ids = two_nodes
    data = build_synthetic_dataset(tmp_path / "data.parquet", num_samples=NUM_SAMPLES, min_len=40, max_len=90, seed=6)
    out = tmp_path / "out"
    node_dirs = [tmp_path / "nodes" / name for name in node_ids]
    args = [
        f"model.path={llama_fp32}", f"data.path={data}", f"output.dir={out}", f"output.node_dir={tmp_path}/nodes/{{node}}",
        f"ray.address={cluster.address}", f"data.shard_size={SHARD_SIZE}", "extract.max_tokens_per_batch=100",
        "model.device=cpu", "model.dtype=float32", "output.min_free=0",
    ]
    env = python_env()

    def job(*extra: str) -> None:
        done = subprocess.run([sys.executable, "-m", "jobs.extract", *args, *extra], cwd=REPO_ROOT, env=env,
                              capture_output=True, text=True, timeout=600)
        assert done.returncode == 0, done.stderr[-3000:]

    job()
    job("shards=[0,1,2,3]")
    records = read_manifest(out)["shards"]
    assert [r["attempts"] for r in records] == [2, 2, 2, 2, 1, 1]
    for record in records:  # each file is where the manifest says, and only there
        holders = [d.name for d in node_dirs if (d / record["file"]).exists()]
        assert holders == [record["node"]], (record["index"], holders, record["node"])
    assert_every_sample_once(node_dirs, data)
    assert_run_verifies(out)  # finds each file in its node's directory


@pytest.mark.parametrize("cpus, groups, writers", [(2, 1, 1), (16, 1, 8), (32, 1, 16), (128, 1, 32), (128, 2, 16)])
def test_automatic_writers_follow_the_node(cpus, groups, writers):
    """output.num_writers=0: half the node's CPUs, 8 to 32 per node, never more than it has spare."""
    from jobs.cluster.nodes import _writers

    assert _writers({"Resources": {"CPU": cpus}, "NodeManagerAddress": "10.0.0.1"}, groups, 0) == writers


def test_a_node_relabelled_between_runs_keeps_its_done_files(head_a, llama_fp32, tmp_path):
    """A run on a cluster whose one node, its head, is labelled ``a`` (as under ``ray job submit`` to a head),
    resumed by the same command on a private cluster (its node: 127.0.0.1): the done files stay (not one removed
    or written again), their records name the new node, and the one damaged in between is extracted again."""
    data = build_synthetic_dataset(tmp_path / "data.parquet", num_samples=NUM_SAMPLES, min_len=40, max_len=90, seed=8)
    out = tmp_path / "out"
    args = [
        f"model.path={llama_fp32}", f"data.path={data}", f"output.dir={out}", f"data.shard_size={SHARD_SIZE}",
        "extract.max_tokens_per_batch=100", "model.device=cpu", "model.dtype=float32", "output.min_free=0",
    ]
    env = python_env()

    def job(*extra: str) -> subprocess.CompletedProcess:
        done = subprocess.run([sys.executable, "-m", "jobs.extract", *args, *extra], cwd=REPO_ROOT, env=env,
                              capture_output=True, text=True, timeout=600)
        assert done.returncode == 0, done.stderr[-3000:]
        return done

    cluster, _ = head_a
    job(f"ray.address={cluster.address}", "shards=[0,1,2,3,4]")  # on the head alone: b is not in the cluster
    records = read_manifest(out)["shards"]
    assert [r["node"] for r in records[:5]] == ["a"] * 5 and records[5]["state"] == "pending"
    damaged = out / records[2]["file"]
    damaged.write_bytes(damaged.read_bytes()[:-100])  # truncated between the runs
    kept = {path.name: (path.stat().st_ino, path.stat().st_mtime_ns) for path in out.glob("shard-*.parquet")
            if path != damaged}

    resumed = job()  # no ray.address: a private cluster, whose node is named by its address
    records = read_manifest(out)["shards"]
    assert all(r["state"] == DONE and r["node"] == "127.0.0.1" for r in records), records
    assert [r["attempts"] for r in records] == [1, 1, 2, 1, 1, 1]  # the damaged one and the pending one, once each
    assert {name: (out / name).stat().st_ino for name in kept} == {name: ino for name, (ino, _) in kept.items()}
    assert all((out / name).stat().st_mtime_ns == mtime for name, (_, mtime) in kept.items())
    assert not [name for name in kept if f"removing {name}" in resumed.stderr]
    assert_every_sample_once(out, data)  # each sample once, jobs.verify --deep passes
    claim = json.loads((out / CLAIM_FILE).read_text())
    assert claim["node"] == "127.0.0.1" and claim["nodes"] == ["a", "127.0.0.1"]


def test_a_node_directory_left_behind_by_a_new_label_is_refused_until_moved(head_a, llama_fp32, tmp_path):
    """With ``{node}`` in output.node_dir a node's directory follows its name: a run on the head labelled ``a`` wrote
    shards 0 and 1 into nodes/a; the same command on a private cluster (its node: 127.0.0.1, its directory
    nodes/127.0.0.1) would have ended complete with those shards in a directory no node of it has (jobs.verify: not
    found). It is refused, exit 2, naming that directory, before it writes or removes anything; once the files are
    moved as the message says, the run records them on the new node and completes."""
    data = build_synthetic_dataset(tmp_path / "data.parquet", num_samples=NUM_SAMPLES, min_len=40, max_len=90, seed=9)
    out, nodes = tmp_path / "out", tmp_path / "nodes"
    args = [
        f"model.path={llama_fp32}", f"data.path={data}", f"output.dir={out}", f"output.node_dir={nodes}/{{node}}",
        f"data.shard_size={SHARD_SIZE}", "extract.max_tokens_per_batch=100", "model.device=cpu", "model.dtype=float32",
        "output.min_free=0",
    ]

    def job(*extra: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "jobs.extract", *args, *extra], cwd=REPO_ROOT, env=python_env(),
                              capture_output=True, text=True, timeout=600)

    cluster, _ = head_a
    first = job(f"ray.address={cluster.address}", "shards=[0,1]")
    assert first.returncode == 0, first.stderr[-3000:]
    written = {path.name: path.stat().st_mtime_ns for path in (nodes / "a").glob("shard-*.parquet")}
    assert sorted(written) == ["shard-00000.parquet", "shard-00001.parquet"]
    records = read_manifest(out)["shards"]

    refused = job()  # no ray.address: a private cluster, whose node is named by its address
    assert refused.returncode == 2, refused.stderr[-3000:]
    assert f"shards 0, 1 are recorded done on node a, in {nodes / 'a'}" in refused.stderr, refused.stderr[-3000:]
    assert read_manifest(out)["shards"] == records
    assert {path.name: path.stat().st_mtime_ns for path in (nodes / "a").glob("shard-*.parquet")} == written
    assert not list((nodes / "127.0.0.1").glob("shard-*.parquet"))

    for name in written:  # as the message says
        (nodes / "a" / name).rename(nodes / "127.0.0.1" / name)
    resumed = job()
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    records = read_manifest(out)["shards"]
    assert all(r["state"] == DONE and r["node"] == "127.0.0.1" for r in records), records
    assert [r["attempts"] for r in records] == [1] * len(records)
    assert_every_sample_once(nodes / "127.0.0.1", data)
    assert_run_verifies(out)

def test_a_label_another_node_went_by_keeps_each_directorys_done_files(ray_cluster, tmp_path):
    """A cluster created again, each node's output.node_dir the same path on its own disk: node A's disk comes back
    on the address that was B's (10.0.0.2), B's on a new one. Each done file is checked in the directory whose claim
    lists its recorded label, not in the directory of the node that goes by that label now: not one is removed or
    written again, the records name the nodes' new labels, a file lost in between is written again, and a third
    run on the same nodes changes nothing. (Both directories are on this machine: the claims, not the nodes, are
    what this shows.)"""
    import ray

    out, disks = tmp_path / "out", {name: tmp_path / name for name in ("A", "B")}
    out.mkdir()
    node_id = ray.get_runtime_context().get_node_id()
    plan = [(index, index, index + 1) for index in range(5)]

    def prepare(labels: dict[str, str], record: dict[int, str]) -> list[int]:
        """One run's start on nodes labelled ``labels`` (disk -> label); then ``record``'s shards (index -> disk) are
        written there and recorded done, as that run's writers would."""
        manifest = Manifest.open(out, {"test": True}, plan)
        groups = [NodeGroup(node_id, label, disks[disk], 1) for disk, label in labels.items()]
        to_run = [r.index for r in _prepare_directories(manifest, groups, out, JobConfig(), None)]
        for index, disk in record.items():
            name = shard_file_name(index)
            (disks[disk] / name).write_bytes(bytes(100 + index))
            manifest.update(index, state=DONE, file=name, bytes=100 + index, checksum="", location=LOCAL,
                            node=labels[disk])
        manifest.close()
        return to_run

    def files() -> dict[str, tuple[int, int]]:
        return {f"{disk}/{path.name}": (path.stat().st_ino, path.stat().st_mtime_ns)
                for disk in disks for path in disks[disk].glob("shard-*.parquet")}

    assert prepare({"A": "10.0.0.1", "B": "10.0.0.2"}, {0: "A", 1: "B", 2: "A", 3: "B"}) == [0, 1, 2, 3, 4]
    (disks["B"] / shard_file_name(3)).unlink()  # lost between the runs
    kept = files()

    assert prepare({"A": "10.0.0.2", "B": "10.0.0.3"}, {}) == [3, 4]
    assert files() == kept
    nodes = [record["node"] for record in read_manifest(out)["shards"][:3]]
    assert nodes == ["10.0.0.2", "10.0.0.3", "10.0.0.2"]  # A's files on A's new label, B's on B's
    assert prepare({"A": "10.0.0.2", "B": "10.0.0.3"}, {}) == [3, 4]  # both claims list 10.0.0.2 now: A holds its files
    assert files() == kept and [r["node"] for r in read_manifest(out)["shards"][:3]] == nodes
