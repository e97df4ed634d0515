"""The output.dir lock with real processes: held, refused with who holds it, stale records taken over; and
the claim each run puts on the directories it writes shards to (output.node_dir)."""

from __future__ import annotations

import dataclasses
import json
import logging
import multiprocessing
import os
import subprocess
import sys

import psutil
import pytest

from jobs.cluster.node_disk import LocalDisk
from jobs.status import job_state
from runtime.errors import EXIT_LOCKED, OutputLocked
from runtime.lock import LOCK_FILE, LockOwner, OutputLock, read_owner, start_ticks
from storage.claim import CLAIM_FILE
from tests.conftest import REPO_ROOT
from tests.helpers import LOCK_HOLDER


@pytest.fixture
def holder(tmp_path):
    """Another process that holds tmp_path's lock until killed."""
    process = subprocess.Popen([sys.executable, "-c", LOCK_HOLDER.format(root=str(REPO_ROOT)), str(tmp_path)],
                               stdout=subprocess.PIPE, text=True)
    assert process.stdout.readline().strip() == "held"
    yield process
    process.kill()
    process.wait()


def test_a_second_job_is_told_who_holds_the_lock(tmp_path, holder):
    with pytest.raises(OutputLocked) as refused:
        OutputLock(tmp_path).acquire()
    message = str(refused.value)
    assert refused.value.exit_code == EXIT_LOCKED == 5
    assert f"pid {holder.pid} on " in message and "Ray job raysubmit_holder" in message
    assert "time.sleep(600)" in message  # the holder's command line
    assert "`ray job stop raysubmit_holder`" in message and "choose another output.dir" in message
    assert job_state(tmp_path, None).startswith(f"job: RUNNING, pid {holder.pid}")

    holder.kill()  # the kernel releases the lock with the process; the record stays behind
    holder.wait()
    assert job_state(tmp_path, None).startswith(f"job: STOPPED, pid {holder.pid}")


def test_stale_record_of_a_dead_process_is_taken_over_with_a_log_line(tmp_path, holder, caplog):
    holder.kill()
    holder.wait()
    with caplog.at_level(logging.WARNING, logger="runtime.lock"):
        with OutputLock(tmp_path) as lock:
            assert read_owner(tmp_path) == lock.owner
    assert f"taking over the lock on {tmp_path} from pid {holder.pid}" in caplog.text
    assert read_owner(tmp_path) is None  # released: an empty record
    assert job_state(tmp_path, None) == "job: not running (no run summary yet)"


def test_the_record_hides_sink_credentials(monkeypatch):
    argv = ["python", "-m", "jobs.extract", "output.sink=s3://b/p", 'output.sink_options={"secret": "s3cr3t"}']
    monkeypatch.setattr(psutil.Process, "cmdline", lambda self: argv)
    command = LockOwner.this_process(ray_job="").command
    assert "s3cr3t" not in command and "output.sink_options=<hidden>" in command and "output.sink=s3://b/p" in command


def record(tmp_path, owner: LockOwner) -> None:
    (tmp_path / LOCK_FILE).write_text(json.dumps(dataclasses.asdict(owner)))


def test_reused_pid_is_stale_but_a_live_owner_without_the_lock_is_not(tmp_path, caplog):
    me = LockOwner.this_process(ray_job="")
    record(tmp_path, dataclasses.replace(me, pid_start_ticks=me.pid_start_ticks - 1))  # same pid, other process
    with caplog.at_level(logging.WARNING, logger="runtime.lock"), OutputLock(tmp_path):
        pass
    assert "taking over the lock" in caplog.text

    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    try:
        record(tmp_path, dataclasses.replace(me, pid=sleeper.pid, pid_start_ticks=start_ticks(sleeper.pid)))
        with pytest.raises(OutputLocked, match=rf"which still runs although its lock on {LOCK_FILE} is gone"):
            OutputLock(tmp_path).acquire()
    finally:
        sleeper.kill()
        sleeper.wait()

    record(tmp_path, dataclasses.replace(me, host="other-host"))
    with pytest.raises(OutputLocked, match=r"That is another host, which this one cannot check.*delete .*.job.lock"):
        OutputLock(tmp_path).acquire()


def test_a_live_owner_stays_alive_across_a_clock_step_and_a_later_boot_is_not_its(tmp_path, holder, monkeypatch,
                                                                                  caplog):
    """The wall clock set an hour forward while a job runs (NTP stepping it, a VM resumed): the kernel moves the
    boot's wall-clock time (/proc/stat btime) with it, and a start time read as wall-clock seconds (psutil's
    create_time: ticks since boot + btime) with it. The owner is the same process all the same: judged by its
    start in ticks since boot, it is alive. A record of this pid and start tick from another boot is not."""
    owner = read_owner(tmp_path)
    assert owner is not None and owner.pid == holder.pid and owner.is_alive()
    before = psutil.Process(holder.pid).create_time()
    stepped = psutil.boot_time() + 3600
    monkeypatch.setattr(psutil._pslinux, "boot_time", lambda: stepped)
    assert psutil.Process(holder.pid).create_time() - before == pytest.approx(3600, abs=1), "the clock step is seen"
    assert owner.is_alive()
    assert job_state(tmp_path, None).startswith(f"job: RUNNING, pid {holder.pid}")
    with pytest.raises(OutputLocked, match=f"pid {holder.pid} on "):
        OutputLock(tmp_path).check_free()

    holder.kill()
    holder.wait()
    record(tmp_path, dataclasses.replace(owner, pid=os.getpid(), pid_start_ticks=start_ticks(os.getpid()),
                                         boot_id="00000000-0000-0000-0000-000000000000"))
    assert read_owner(tmp_path).is_alive() is False
    with caplog.at_level(logging.WARNING, logger="runtime.lock"), OutputLock(tmp_path):
        pass
    assert f"taking over the lock on {tmp_path} from pid {os.getpid()}" in caplog.text


def owner(run_id: str) -> dict[str, str]:
    return {"run_id": run_id, "output_dir": f"/runs/{run_id}", "host": "h", "node": "n1"}


def test_a_directory_is_one_runs_and_unclaimed_shard_files_are_not_adopted(tmp_path):
    disk = LocalDisk(tmp_path / "node")
    assert disk.claim(owner("a"), adopt_files=False) == {"labels": ["n1"]}
    assert disk.claim(owner("a"), adopt_files=False) == {"labels": ["n1"]}, "a run's resume finds its own claim"
    assert disk.claim(owner("b"), adopt_files=True) == {"owner": owner("a")}
    assert json.loads((tmp_path / "node" / CLAIM_FILE).read_text()) == owner("a")
    # the node's name changed (another address, a cluster created again): the claim keeps both; the answer names
    # those the files there can carry (none the new one yet)
    assert disk.claim(dict(owner("a"), node="n2"), adopt_files=False) == {"labels": ["n1"]}
    assert json.loads((tmp_path / "node" / CLAIM_FILE).read_text()) == dict(owner("a"), node="n2", nodes=["n1", "n2"])
    assert disk.claim(dict(owner("a"), node="n2"), adopt_files=False) == {"labels": ["n1", "n2"]}

    foreign = LocalDisk(tmp_path / "foreign")
    (tmp_path / "foreign").mkdir()
    (tmp_path / "foreign" / "shard-00003.parquet").write_bytes(b"x")
    assert foreign.claim(owner("a"), adopt_files=False) == {"files": ["shard-00003.parquet"]}
    assert not (tmp_path / "foreign" / CLAIM_FILE).exists()
    # a run's own output.dir (under its lock) is adopted with what it holds
    assert "labels" in foreign.claim(owner("a"), adopt_files=True)
    assert sorted(p.name for p in (tmp_path / "foreign").iterdir()) == [CLAIM_FILE, "shard-00003.parquet"]


def _claim_in_a_process(args: tuple[str, str]) -> bool:
    directory, run_id = args
    return "labels" in LocalDisk(directory).claim(owner(run_id), adopt_files=False)


def test_of_runs_claiming_one_directory_at_once_exactly_one_gets_it(tmp_path):
    runs = [str(i) for i in range(8)]
    with multiprocessing.get_context("spawn").Pool(4) as pool:
        won = pool.map(_claim_in_a_process, [(str(tmp_path / "node"), run) for run in runs])
    assert sum(won) == 1
    assert json.loads((tmp_path / "node" / CLAIM_FILE).read_text()) == owner(runs[won.index(True)])
    assert sorted(p.name for p in (tmp_path / "node").iterdir()) == [CLAIM_FILE], "no temp claim left"


def test_a_hard_link_planted_at_the_lock_gets_no_record(tmp_path):
    """A hard link at ``.job.lock`` to a file outside output.dir: a job (a real process) takes the lock on a new
    file of its own; the file the link shared is never written, and no link is left."""
    victim = tmp_path / "victim"
    victim.write_text("not the job's\n")
    out = tmp_path / "out"
    out.mkdir()
    os.link(victim, out / LOCK_FILE)
    process = subprocess.Popen([sys.executable, "-c", LOCK_HOLDER.format(root=str(REPO_ROOT)), str(out)],
                               stdout=subprocess.PIPE, text=True)
    try:
        assert process.stdout.readline().strip() == "held"
        assert victim.read_text() == "not the job's\n" and os.stat(victim).st_nlink == 1
        assert os.stat(out / LOCK_FILE).st_nlink == 1 and read_owner(out).pid == process.pid
        with pytest.raises(OutputLocked, match=f"pid {process.pid} on "):  # the new file is the lock
            OutputLock(out).acquire()
    finally:
        process.kill()
        process.wait()
