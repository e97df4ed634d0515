"""The manifest journal: O(1) updates, compaction, torn lines, and kill -9 in the middle of a stream."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap

import pytest

from storage import manifest as manifest_module
from storage.manifest import DONE, MANIFEST_FILE, MANIFEST_JOURNAL_FILE, Manifest, ShardRecord, read_manifest
from tests.conftest import REPO_ROOT
from tests.helpers import python_env

CONTENT = {"data.fingerprint": "abc", "data.shard_size": 4}
PLAN = [(i, 4 * i, 4 * i + 4) for i in range(40)]


def state(manifest_dict):
    return {record["index"]: record for record in manifest_dict["shards"]}


def apply(updates, shards=len(PLAN)):
    """The records after ``updates`` (update i sets shard i % shards), computed without the manifest."""
    records = {i: ShardRecord(i, start, stop).__dict__.copy() for i, start, stop in PLAN}
    for i in updates:
        records[i % shards].update(attempts=i, error=f"update {i}")
    return records


def test_an_update_appends_one_line_and_leaves_the_snapshot_alone(tmp_path):
    manifest = Manifest.open(tmp_path, CONTENT, PLAN)
    snapshot = (tmp_path / MANIFEST_FILE).stat()
    for i in range(3):
        manifest.update(i, state=DONE, rows=4)
    lines = (tmp_path / MANIFEST_JOURNAL_FILE).read_bytes().splitlines()
    assert len(lines) == 3 and json.loads(lines[2]) == {"seq": 3, "index": 2, "fields": {"state": DONE, "rows": 4}}
    after = (tmp_path / MANIFEST_FILE).stat()
    assert (after.st_ino, after.st_mtime_ns) == (snapshot.st_ino, snapshot.st_mtime_ns)
    assert state(read_manifest(tmp_path))[2]["state"] == DONE  # readers see the journal too
    manifest.close()
    assert (tmp_path / MANIFEST_JOURNAL_FILE).read_bytes() == b""
    assert state(json.loads((tmp_path / MANIFEST_FILE).read_text()))[2]["state"] == DONE
    with pytest.raises(TypeError, match="no fields"):
        manifest.update(0, colour="red")


def test_many_updates_with_compactions_replay_to_the_last_state(tmp_path):
    manifest = Manifest.open(tmp_path, CONTENT, PLAN)
    for i in range(1, 611):
        manifest.update(i % 40, attempts=i, error=f"update {i}")
        # compacted once the journal holds as many bytes as the snapshot: it never outgrows it by more than a line
        assert (tmp_path / MANIFEST_JOURNAL_FILE).stat().st_size < (tmp_path / MANIFEST_FILE).stat().st_size + 100
    journal = (tmp_path / MANIFEST_JOURNAL_FILE).read_bytes().splitlines()
    assert 0 < len(journal) < 300  # compacted along the way, the rest still in the journal
    assert state(read_manifest(tmp_path)) == apply(range(1, 611))
    reopened = Manifest.open(tmp_path, CONTENT, PLAN)
    assert {i: r.__dict__ for i, r in reopened.shards.items()} == apply(range(1, 611))
    with pytest.raises(ValueError, match=r"different content \(data.shard_size: was 4, now 8\)"):
        Manifest.open(tmp_path, {**CONTENT, "data.shard_size": 8}, PLAN)


def test_a_torn_last_line_is_ignored_and_never_continued(tmp_path):
    manifest = Manifest.open(tmp_path, CONTENT, PLAN)
    for i in range(1, 6):
        manifest.update(i, attempts=i, error=f"update {i}")
    line = json.dumps({"seq": 6, "index": 6, "fields": {"attempts": 6, "error": "update 6"}}).encode()
    with open(tmp_path / MANIFEST_JOURNAL_FILE, "ab") as journal:  # a crash half-way through an append
        journal.write(line[: len(line) // 2])
    assert state(read_manifest(tmp_path)) == apply(range(1, 6))
    reopened = Manifest.open(tmp_path, CONTENT, PLAN)
    assert {i: r.__dict__ for i, r in reopened.shards.items()} == apply(range(1, 6))
    reopened.update(7, attempts=7, error="update 7")
    assert state(read_manifest(tmp_path)) == apply([1, 2, 3, 4, 5, 7])


def test_a_failed_append_does_not_swallow_the_next_update(tmp_path, monkeypatch):
    manifest = Manifest.open(tmp_path, CONTENT, PLAN)
    manifest.update(1, attempts=1, error="update 1")
    real_write = os.write

    def short_write_then_fail(fd, data):  # a disk that fills half-way through a line
        real_write(fd, bytes(data[:10]))
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(manifest_module.os, "write", short_write_then_fail)
    with pytest.raises(OSError):
        manifest.update(2, attempts=2, error="update 2")
    monkeypatch.setattr(manifest_module.os, "write", real_write)
    manifest.update(3, attempts=3, error="update 3")
    assert state(read_manifest(tmp_path)) == apply([1, 3])


def test_lines_already_in_the_snapshot_are_not_applied_again(tmp_path):
    """A crash between the snapshot's rename and the journal's reset leaves old lines behind."""
    manifest = Manifest.open(tmp_path, CONTENT, PLAN)
    manifest.update(3, state=DONE, attempts=1, file="shard-00003.parquet")
    old_journal = (tmp_path / MANIFEST_JOURNAL_FILE).read_bytes()
    manifest.shards[3] = ShardRecord(3, 12, 16, attempts=1)  # a rerun resets the record, as resume does
    manifest.save()
    (tmp_path / MANIFEST_JOURNAL_FILE).write_bytes(old_journal)
    assert state(read_manifest(tmp_path))[3]["state"] == "pending"
    assert Manifest.open(tmp_path, CONTENT, PLAN).shards[3].file == ""


UPDATER = textwrap.dedent("""
    import sys
    from storage.manifest import Manifest
    manifest = Manifest.open(sys.argv[1], {content!r}, {plan!r})
    for i in range(int(sys.argv[2]), 10**9):
        manifest.update(i % {shards}, attempts=i, error=f"update {{i}}")
        print(i, flush=True)
""")


@pytest.mark.parametrize("kill_after", [150, 333])
def test_kill_9_in_a_stream_of_updates_loses_no_completed_update(tmp_path, kill_after):
    script = UPDATER.format(content=CONTENT, plan=PLAN, shards=len(PLAN))
    first = 1
    for _ in range(2):  # killed, reopened, killed again
        child = subprocess.Popen([sys.executable, "-c", script, str(tmp_path), str(first)], cwd=REPO_ROOT,
                                 stdout=subprocess.PIPE, env=python_env())
        seen = 0
        for _ in child.stdout:
            seen += 1
            if seen >= kill_after:
                os.kill(child.pid, signal.SIGKILL)
                break
        rest = child.stdout.read().split()  # updates that returned before the kill landed
        child.wait()
        assert child.returncode == -signal.SIGKILL
        last = first + seen - 1 + len(rest)
        stored = state(read_manifest(tmp_path))
        # every update that returned is there; the one in flight may or may not be
        assert stored in (apply(range(1, last + 1)), apply(range(1, last + 2)))
        first = max(r["attempts"] for r in stored.values()) + 1
