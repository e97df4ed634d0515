"""The entry point as users run it: real processes, the output.dir lock, the demo, Ray's own job tools.

Each test starts real driver processes (`python -m jobs.extract`, `ray job submit`) and checks
the files they leave: every sample exactly once, the manifest true to the disk.
"""

from __future__ import annotations

import dataclasses
import ipaddress
import os
import re
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Iterator

import psutil
import pytest
import ray

from inputs.demo import build_synthetic_dataset
from jobs.driver.progress import METRICS, RUN_LABEL
from jobs.rundir.summary import read_summary
from jobs.status import status_report
from runtime.errors import EXIT_BAD_INPUT, EXIT_LOCKED
from runtime.lock import LOCK_FILE
from storage.manifest import DONE, LOCAL, read_manifest
from storage.writer import TEMP_GLOB
from tests.conftest import REPO_ROOT, free_port, ray_temp_dir, readme_commands
from tests.helpers import assert_run_verifies, checksum_of, read_all, user_env

RAY = str(Path(sys.executable).parent / "ray")
ACTIVATED = f"{Path(sys.executable).parent}:{os.environ['PATH']}"
"""PATH in a shell with this virtualenv activated."""


def start_job(args: list[str], cwd: Path = REPO_ROOT, **env: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "jobs.extract", *args], cwd=cwd, env=user_env(**env),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def assert_manifest_matches_disk(out: Path, samples: int) -> None:
    """Every shard done, its file present with the recorded size and checksum; nothing else written."""
    manifest = read_manifest(out)
    for record in manifest["shards"]:
        assert record["state"] == DONE and record["location"] == LOCAL, record
        data = (out / record["file"]).read_bytes()
        assert len(data) == record["bytes"] and checksum_of(data, "xxh3_128") == record["checksum"]
    assert sorted(read_all(out)) == list(range(samples))
    assert not list(out.glob(TEMP_GLOB))
    report = status_report(out)
    assert "not the job's" not in report and "unrecorded" not in report and "temp files" not in report, report
    assert_run_verifies(out)


# -- the output.dir lock, between real jobs ---------------------------------------------------------------

@pytest.mark.extended
def test_one_output_dir_runs_one_job(ray_cluster, llama_fp32, tmp_path):
    """Two jobs started 2 s apart: exactly one runs. A third started the moment the runner publishes a
    shard (the rename a second job's clean-up once deleted) is refused before it touches anything,
    and the runner's result is complete and matches the disk."""
    samples = 120
    data = build_synthetic_dataset(tmp_path / "many.parquet", num_samples=samples, min_len=20, max_len=60, seed=11)
    out = tmp_path / "out"
    args = [f"model.path={llama_fp32}", f"data.path={data}", f"output.dir={out}", "data.shard_size=4",
            "model.device=cpu", "output.min_free=1GB", "output.max_inflight_batches=1",
            "extract.max_tokens_per_batch=64", f"ray.address={ray.get_runtime_context().gcs_address}"]
    first = start_job(args)
    time.sleep(2)
    second = start_job(args)

    deadline = time.monotonic() + 300
    while first.poll() is None and second.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    loser, runner = (first, second) if first.poll() is not None else (second, first)
    _, refusal = loser.communicate(timeout=60)
    assert loser.returncode == EXIT_LOCKED, refusal[-3000:]
    assert f"is in use by another job: pid {runner.pid} on " in refusal and "Traceback" not in refusal

    while not list(out.glob("shard-*.parquet")) and runner.poll() is None:
        time.sleep(0.002)
    assert runner.poll() is None, "the runner ended before it published a shard"
    third = start_job(args)
    _, refusal = third.communicate(timeout=300)
    assert third.returncode == EXIT_LOCKED, refusal[-3000:]
    assert f"pid {runner.pid} on " in refusal

    stdout, stderr = runner.communicate(timeout=600)
    assert runner.returncode == 0, stderr[-3000:]
    assert f"30 shards done in {out}: {samples} samples" in stdout
    assert_manifest_matches_disk(out, samples)


# -- joining a named cluster ---------------------------------------------------------------------------

@pytest.mark.parametrize("setting, message", [
    ("ray.address=127.0.0.1:{port}", "no Ray cluster answers at ray.address=127.0.0.1:{port}"),
    ("RAY_ADDRESS=127.0.0.1:{port}", "no Ray cluster answers at RAY_ADDRESS=127.0.0.1:{port}"),
    ("RAY_ADDRESS=http://127.0.0.1:{port}", "RAY_ADDRESS=http://127.0.0.1:{port} is a dashboard URL"),
])
def test_a_named_cluster_that_is_not_there_is_one_clear_line(llama_fp32, demo_dataset, tmp_path, setting, message):
    port = free_port()
    setting, message = setting.format(port=port), message.format(port=port)
    args = [f"model.path={llama_fp32}", f"data.path={demo_dataset}", f"output.dir={tmp_path / 'out'}"]
    env = {}
    if setting.startswith("RAY_ADDRESS="):
        env["RAY_ADDRESS"] = setting.split("=", 1)[1]
    else:
        args.append(setting)
    started = time.monotonic()
    result = subprocess.run([sys.executable, "-m", "jobs.extract", *args], cwd=REPO_ROOT, env=user_env(**env),
                            capture_output=True, text=True, timeout=300)
    elapsed = time.monotonic() - started
    assert result.returncode == EXIT_BAD_INPUT, result.stderr[-3000:]
    # progress lines (INFO) may come first; the mistake itself is one line
    lines = [line for line in result.stderr.splitlines() if line.strip() and " INFO " not in line]
    assert len(lines) == 1 and message in lines[0], result.stderr
    assert "unset" in lines[0] and "Traceback" not in result.stderr
    print(f"{setting}: refused after {elapsed:.1f} s")


# -- the demo: loopback only, resumes, never deletes what the user named --------------------------------

def listening_sockets(root: psutil.Process) -> Iterator[tuple[str, str, int]]:
    """(process name and command line, ip, port) of every listening TCP socket of ``root`` and its descendants."""
    try:
        processes = [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return
    for process in processes:
        try:
            command = f"{process.name()}: {' '.join(process.cmdline())}"
            for connection in process.net_connections(kind="tcp"):
                if connection.status == psutil.CONN_LISTEN:
                    yield command, connection.laddr.ip, connection.laddr.port
        except psutil.Error:
            continue


def is_loopback(ip: str) -> bool:
    return ipaddress.ip_address(ip.removeprefix("::ffff:")).is_loopback


def test_demo_is_private_loopback_resumable_and_keeps_user_files(ray_head, tmp_path):
    """`python -m jobs.extract` with no paths, no address and no loopback setting in the environment,
    while a head started with `ray start --head --node-ip-address=127.0.0.1` runs (a plain run once
    retried for minutes to join it at the host's other address): a private Ray cluster whose processes
    (GCS, raylet, agents, workers, the TP=2 extractor and its follower rank) listen on loopback only;
    absolute paths in the final message; a rerun does nothing without starting Ray; a user-named
    output.dir holding something else is refused and kept."""
    args = ["demo.dir=demo", "demo.num_samples=12", "model.tp_size=2"]  # relative: resolved on the driver
    # A user's shell without RAY_AUTH_MODE, with a home of its own: the private cluster must not leave a token there.
    home = tmp_path / "home"
    (home / ".cache").mkdir(parents=True)
    (home / ".cache" / "eagle3-extract").symlink_to(Path.home() / ".cache" / "eagle3-extract")
    env = {key: value for key, value in user_env(HOME=str(home)).items() if key != "RAY_AUTH_MODE"}
    driver = subprocess.Popen([sys.executable, "-m", "jobs.extract", *args], cwd=tmp_path, env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    seen: dict[tuple[str, str, int], None] = {}
    root = psutil.Process(driver.pid)
    while driver.poll() is None:
        seen.update(dict.fromkeys(listening_sockets(root)))
        time.sleep(0.25)
    stdout, stderr = driver.communicate()
    assert driver.returncode == 0, stderr[-3000:]
    assert "started a private Ray cluster on 127.0.0.1 for this run" in stderr  # its GCS: sampled below
    assert not (home / ".ray").exists()
    sglang = [line for line in stderr.splitlines() if re.search(r"\b(INFO|WARNING) sglang\.", line)]
    assert not sglang, "\n".join(sglang)  # its notices about this platform and its INFO lines are filtered
    dashboard = re.search(r"its dashboard on http://127\.0\.0\.1:(\d+)", stderr)
    assert dashboard and any(port == int(dashboard.group(1)) for _, _, port in seen), stderr[-3000:]
    print(f"{len(seen)} listening sockets sampled: {sorted({(ip, port) for _, ip, port in seen})}")
    assert any("gcs_server" in command for command, _, _ in seen)
    assert any("spawn_main" in command for command, _, _ in seen), "the TP follower rank was never sampled"
    outside = [socket for socket in seen if not is_loopback(socket[1])]
    assert not outside, f"listening beyond loopback: {outside}"

    out = tmp_path / "demo" / "hidden_states-llama-12-seed0"
    assert f"1 shards done in {out}: 12 samples" in stdout  # the absolute path
    # Piped, not a terminal: progress as log lines, from the first batch to the end.
    logged = [match.group(0) for match in PROGRESS_LINE.finditer(stderr)]
    assert len(logged) >= 2 and logged[0].startswith("shards 0/1, samples 0/12, "), stderr[-3000:]
    assert logged[-1].startswith("shards 1/1, samples 12/12, tokens ") and "(100%)" in logged[-1]
    assert sorted(read_all(out)) == list(range(12))
    assert read_summary(out)["samples"] == 12 and read_summary(out)["engine"]["tp_size"] == 2

    rerun = subprocess.run([sys.executable, "-m", "jobs.extract", *args], cwd=tmp_path, env=user_env(),
                           capture_output=True, text=True, timeout=300)
    assert rerun.returncode == 0, rerun.stderr[-3000:]
    assert f"nothing to do: all 1 shards in {out} are done" in rerun.stdout and "Ray was not started" in rerun.stdout
    assert "Started a local Ray instance" not in rerun.stderr

    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("keep me")
    refused = subprocess.run(
        [sys.executable, "-m", "jobs.extract", f"demo.dir={tmp_path / 'demo'}", f"output.dir={mine}"],
        cwd=tmp_path, env=user_env(), capture_output=True, text=True, timeout=300,
    )
    assert refused.returncode == EXIT_BAD_INPUT and "Did you forget --config?" in refused.stderr
    assert (mine / "notes.txt").read_text() == "keep me" and sorted(p.name for p in mine.iterdir()) == ["notes.txt"]


# -- `ray job submit` to a head on loopback -------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class RayHead:
    gcs_address: str
    dashboard_url: str
    metrics_port: int
    temp_dir: Path

    def cli(self, *args: str, timeout: float = 120) -> subprocess.CompletedProcess:
        """A `ray` command pointed at this head's Jobs API, the way the README shows it."""
        return subprocess.run([RAY, *args], env=user_env(RAY_ADDRESS=self.dashboard_url), capture_output=True,
                              text=True, timeout=timeout)


def _head_processes(temp_dir: Path) -> list[psutil.Process]:
    """This head's processes (those naming its temp dir) and all their descendants (workers, job drivers)."""
    found: dict[int, psutil.Process] = {}
    for process in psutil.process_iter(["cmdline"]):
        if str(temp_dir) in " ".join(process.info["cmdline"] or []):
            found[process.pid] = process
            try:
                found.update({child.pid: child for child in process.children(recursive=True)})
            except psutil.NoSuchProcess:
                pass
    return list(found.values())


@pytest.fixture(scope="module")
def ray_head() -> Iterator[RayHead]:
    """A Ray head of its own (`ray start --head`) on 127.0.0.1 with free ports and its own temp dir.

    `ray stop` would stop every Ray on the machine: teardown kills only this head's processes.
    """
    with ray_temp_dir("rh") as temp_dir:
        ports = {name: free_port() for name in ("gcs", "dashboard", "metrics", "agent", "client")}
        started = subprocess.run(
            [RAY, "start", "--head", "--node-ip-address=127.0.0.1", f"--port={ports['gcs']}",
             "--dashboard-host=127.0.0.1", f"--dashboard-port={ports['dashboard']}",
             f"--metrics-export-port={ports['metrics']}", f"--dashboard-agent-listen-port={ports['agent']}",
             f"--ray-client-server-port={ports['client']}", f"--temp-dir={temp_dir}", "--num-cpus=3",
             "--disable-usage-stats"],
            # Metrics reach the endpoint every second (Ray's floor) rather than every 10 s: the job is short.
            # Started from the activated virtualenv, as docs/install.md's user would.
            env=user_env(RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER="0", RAY_metrics_report_interval_ms="1000", PATH=ACTIVATED),
            capture_output=True, text=True, timeout=180,
        )
        try:
            assert started.returncode == 0, started.stdout[-2000:] + started.stderr[-2000:]
            yield RayHead(f"127.0.0.1:{ports['gcs']}", f"http://127.0.0.1:{ports['dashboard']}", ports["metrics"], temp_dir)
        finally:
            processes = _head_processes(temp_dir)
            for process in processes:
                try:
                    process.terminate()
                except psutil.NoSuchProcess:
                    pass
            _, alive = psutil.wait_procs(processes, timeout=15)
            for process in alive:
                process.kill()


def submit(head: RayHead, submission_id: str, args: list[str]) -> None:
    result = head.cli("job", "submit", "--no-wait", f"--submission-id={submission_id}", f"--working-dir={REPO_ROOT}",
                      "--", sys.executable, "-m", "jobs.extract", *args)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]


def wait_for_status(client, submission_id: str, wanted: set[str], timeout: float = 600) -> str:
    deadline = time.monotonic() + timeout
    while (status := client.get_job_status(submission_id).value) not in wanted:
        logs = client.get_job_logs(submission_id)
        assert time.monotonic() < deadline, f"{submission_id} still {status}: {logs[-3000:]}"
        time.sleep(0.5)
    return status


def done_shards(out: Path) -> int:
    try:
        return sum(record["state"] == DONE for record in read_manifest(out)["shards"])  # snapshot + journal
    except (FileNotFoundError, ValueError, KeyError):
        return 0


_SAMPLE = re.compile(r'^(\w+)\{(.*)\} (\S+)$')
_LABEL = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')
# The log line of jobs.driver.progress:
# "shards 12/50, samples 2.4k/10k, tokens 1.2M/5.0M (24%), 31k tok/s, ETA 2m10s, disk 40.0 GB/1.3 TB".
PROGRESS_LINE = re.compile(
    r"shards (\d+)/(\d+), samples \S+/\S+, tokens \S+/\S+ \((\d+)%\), \S+ tok/s, ETA \S+, disk [^,\n]+")


def scrape(port: int) -> list[tuple[str, dict[str, str], float]]:
    """(name, labels, value) of every eagle3 sample on a metrics endpoint."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as response:
        text = response.read().decode()
    samples = []
    for line in text.splitlines():
        match = _SAMPLE.match(line)
        if match and match.group(1).startswith("ray_eagle3_"):
            samples.append((match.group(1), dict(_LABEL.findall(match.group(2))), float(match.group(3))))
    return samples


def readme_submit() -> str:
    """The README's `ray job submit --working-dir . --runtime-env conf/runtime-env.yaml -- python -m jobs.extract`,
    as printed up to the job's keys."""
    submit_line = next(command for command in readme_commands() if command.startswith("ray job submit"))
    printed = submit_line[:submit_line.index("python -m jobs.extract") + len("python -m jobs.extract")]
    assert "--runtime-env conf/runtime-env.yaml" in printed
    return printed


def test_the_readme_runtime_env_naming_a_missing_virtualenv_fails_at_once(ray_head, llama_fp32, demo_dataset,
                                                                          tmp_path):
    """The README's `ray job submit` with a runtime env naming a virtualenv that is not there, on a head whose
    `python` lacks the project: it fails at once with one line naming the missing path. (The README's env as
    printed, on a head started from the activated virtualenv: test_ray_job_submit_stop_and_resubmit's resubmission.)"""
    printed = readme_submit()
    env = user_env(RAY_ADDRESS=ray_head.dashboard_url, PATH=ACTIVATED)
    keys = f"model.path={llama_fp32} data.path={demo_dataset} output.dir={tmp_path / 'out'} data.shard_size=10"
    # A Python without the project first on the entrypoint's PATH, as on a head that another Python started.
    other = tmp_path / "other"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(other)], check=True)
    missing = tmp_path / "missing-venv"
    wrong = tmp_path / "runtime-env.yaml"
    wrong.write_text(f"env_vars:\n  EAGLE3_JOB_VENV: {missing}\n  PATH: {missing}/bin:{other}/bin:${{PATH}}\n")
    started = time.monotonic()
    failed = subprocess.run(["bash", "-c", f"{printed.replace('conf/runtime-env.yaml', str(wrong))} {keys}"],
                            cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=300)
    print(f"a runtime env naming a missing virtualenv: `ray job submit` ended after {time.monotonic() - started:.0f} s")
    assert failed.returncode != 0, failed.stdout[-3000:]
    errors = sorted({line for line in failed.stdout.splitlines() if line.startswith("error: ")})
    assert len(errors) == 1 and f"{missing}/bin/python does not exist on this node" in errors[0], failed.stdout[-3000:]
    assert "Traceback" not in failed.stdout


def test_ray_job_submit_stop_and_resubmit(ray_head, tmp_path):
    """The README's path: submit the demo with absolute paths, watch its progress on the metrics endpoint,
    in .summary.json (jobs.status) and in the job's logs (Jobs API), stop it with `ray job stop`, submit
    it again with the README's `ray job submit --working-dir . --runtime-env conf/runtime-env.yaml -- python -m
    jobs.extract` as printed up to the job's keys, to this head started from the activated virtualenv on a machine
    without ~/eagle3-venv (cluster.yaml's): the job runs in the head's Python and completes, every sample exactly
    once. A relative path is refused (it would land in Ray's per-upload copy of the working dir)."""
    from ray.job_submission import JobSubmissionClient

    client = JobSubmissionClient(ray_head.dashboard_url)
    submit(ray_head, "eagle3-relative", ["demo.dir=eagle3-demo"])
    assert wait_for_status(client, "eagle3-relative", {"FAILED", "SUCCEEDED"}) == "FAILED"
    logs = client.get_job_logs("eagle3-relative")
    assert "demo.dir=eagle3-demo: relative paths under `ray job submit`" in logs and "pass absolute paths" in logs

    samples, demo = 100, tmp_path / "demo"
    out = demo / f"hidden_states-llama-{samples}-seed0"
    args = [f"demo.dir={demo}", f"demo.num_samples={samples}", "data.shard_size=4",
            "output.max_inflight_batches=1", "extract.max_tokens_per_batch=64", "progress.interval_s=0.5"]
    submit(ray_head, "eagle3-first", args)
    # Watch until the metrics endpoint has shown shards done rising, then stop the job.
    deadline = time.monotonic() + 600
    reported: list[int] = []  # shards_done of each new progress report in .summary.json
    exported: dict[str, dict[str, str]] = {}  # metric -> labels of this run's sample
    shown: list[float] = []  # shards_done on the endpoint, one per scrape
    while len(set(shown)) < 2 or done_shards(out) == 0:
        assert time.monotonic() < deadline and client.get_job_status("eagle3-first").value in ("PENDING", "RUNNING"), \
            client.get_job_logs("eagle3-first")[-3000:]
        progress = (read_summary(out) or {}).get("progress") if out.exists() else None
        if progress and (not reported or progress["shards_done"] != reported[-1]):
            reported.append(progress["shards_done"])
        for name, labels, value in scrape(ray_head.metrics_port):
            if labels.get(RUN_LABEL) == str(out):
                exported[name] = labels
                if name == "ray_eagle3_shards_done":
                    shown.append(value)
        time.sleep(0.1)
    print(f"shards done on the metrics endpoint: {sorted(set(shown))}; in .summary.json: {reported}")
    assert shown == sorted(shown) and reported == sorted(reported) and reported[-1] > reported[0]
    # Every series the dashboard plots, the disk-wait counter of a run that never waited included.
    assert {spec.exported for spec in METRICS} <= set(exported), sorted(exported)
    assert all(labels["NodeAddress"] == "127.0.0.1" and "SessionName" in labels for labels in exported.values())
    assert "job: RUNNING" in status_report(out) and "\nprogress: shards " in status_report(out)
    stop = ray_head.cli("job", "stop", "eagle3-first")
    assert stop.returncode == 0, stop.stderr[-2000:]
    assert wait_for_status(client, "eagle3-first", {"STOPPED", "SUCCEEDED", "FAILED"}) == "STOPPED"
    report = status_report(out)
    assert "job: RUNNING" not in report  # the driver is gone and holds nothing
    print("after `ray job stop`:", next(line for line in report.splitlines() if line.startswith("job:")))
    assert read_summary(out)["outcome"] == "interrupted"  # within the 3 s before Ray's SIGKILL
    first_done = {r["index"] for r in read_manifest(out)["shards"] if r["state"] == DONE}
    print(f"stopped with {len(first_done)} of {samples // 4} shards done")
    assert 0 < len(first_done) < samples // 4, "the job finished before `ray job stop` reached it"

    assert not (Path.home() / "eagle3-venv").exists()
    again = subprocess.run(["bash", "-c", f"{readme_submit()} {' '.join(args)}"], cwd=REPO_ROOT,
                           env=user_env(RAY_ADDRESS=ray_head.dashboard_url, PATH=ACTIVATED), capture_output=True,
                           text=True, timeout=900)
    assert again.returncode == 0, again.stdout[-3000:] + again.stderr[-2000:]
    submitted = re.search(r"Job '(raysubmit_\w+)' submitted successfully", again.stdout)
    assert submitted and client.get_job_status(submitted.group(1)).value == "SUCCEEDED", again.stdout[-3000:]
    records = {r["index"]: r for r in read_manifest(out)["shards"]}
    assert all(records[index]["attempts"] == 1 for index in first_done), "done shards must not run again"
    assert_manifest_matches_disk(out, samples)
    logs = client.get_job_logs(submitted.group(1))
    assert re.search(rf"{samples // 4} shards done in {out}: {samples} samples", logs)
    # The Jobs API's logs: progress lines, no bar redraws, no SGLang import noise.
    lines = [match.groups() for match in PROGRESS_LINE.finditer(logs)]
    assert lines and lines[-1] == (str(samples // 4), str(samples // 4), "100"), logs[-3000:]
    assert "__magic_token__" not in logs and "Ignore import error" not in logs and "UserWarning" not in logs
    assert read_summary(out)["progress"]["shards_done"] == samples // 4


def test_ray_job_stop_while_writers_wait_tells_one_story(ray_head, tmp_path):
    """`ray job stop` while every writer waits for its next batch (states at 300 tokens/s). Ray's job
    supervisor sends SIGTERM to the driver's process tree, then SIGKILL 3 s later (Ray 2.60's
    JobSupervisor, RAY_JOB_STOP_WAIT_TIME_S). Within that the driver records the stop, drops the open
    shards, records the published ones and releases output.dir: .summary.json, jobs.status and the files
    say the same, and no shard file is left unrecorded."""
    from ray.job_submission import JobSubmissionClient

    client = JobSubmissionClient(ray_head.dashboard_url)
    demo = tmp_path / "demo"
    out = demo / "hidden_states-llama-80-seed0"
    submit(ray_head, "eagle3-stop-mid-shard", [
        f"demo.dir={demo}", "demo.num_samples=80", "data.shard_size=8", "model.engine=synthetic",
        "model.synthetic_tokens_per_s=300", "extract.max_tokens_per_batch=600",
    ])
    deadline = time.monotonic() + 600
    while not (done_shards(out) >= 1 and list(out.glob(TEMP_GLOB))):  # a shard done, the next ones open
        assert time.monotonic() < deadline and client.get_job_status("eagle3-stop-mid-shard").value in (
            "PENDING", "RUNNING"), client.get_job_logs("eagle3-stop-mid-shard")[-3000:]
        time.sleep(0.1)
    stop = ray_head.cli("job", "stop", "eagle3-stop-mid-shard")
    assert stop.returncode == 0, stop.stderr[-2000:]
    assert wait_for_status(client, "eagle3-stop-mid-shard", {"STOPPED", "SUCCEEDED", "FAILED"}) == "STOPPED"
    summary = read_summary(out)
    assert (summary["outcome"], summary["exit_code"]) == ("interrupted", 143)
    assert not (out / LOCK_FILE).exists()
    report = status_report(out)
    assert "interrupted (exit code 143)" in report, report
    assert "killed?" not in report and "unrecorded" not in report and "temp files" not in report, report
    records = read_manifest(out)["shards"]
    recorded = sorted(record["file"] for record in records if record["state"] == DONE)
    assert sorted(path.name for path in out.glob("shard-*.parquet")) == recorded
    assert not list(out.glob(TEMP_GLOB))
    assert summary["shards_done"] == done_shards(out) < len(records)
