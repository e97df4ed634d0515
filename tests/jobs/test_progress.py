"""Progress reporting: the snapshot the driver reports, its log line, the live line on a terminal (a real
run under a pseudo-terminal), and the Grafana dashboard's queries.

The metrics endpoint itself is read in tests/jobs/test_entry.py, while a submitted job runs; so are the
progress lines of a piped run and of `ray job logs`.
"""

from __future__ import annotations

import fcntl
import io
import json
import logging
import os
import re
import select
import shutil
import struct
import subprocess
import sys
import termios
import time

import pytest

from common.checks import format_bytes
from jobs.driver.progress import METRICS, ProgressSnapshot, RunProgress, format_count, format_duration
from jobs.outdir.budget import DiskBudget
from jobs.rundir.summary import read_summary
from jobs.status import status_report
from storage.manifest import DONE, FAILED, PENDING, Manifest
from tests.conftest import REPO_ROOT
from tests.helpers import user_env

DASHBOARD = REPO_ROOT / "dashboards" / "eagle3.json"


def test_dashboard_queries_name_exactly_the_metrics_the_job_exports():
    """Every panel queries a name the job exports (as Ray's exporter spells it), and every metric has a panel."""
    dashboard = json.loads(DASHBOARD.read_text())
    queries = [target["expr"] for panel in dashboard["panels"] for target in panel["targets"]]
    queries += [variable["query"]["query"] for variable in dashboard["templating"]["list"] if variable["type"] == "query"]
    used = {name for query in queries for name in re.findall(r"\bray_[a-z0-9_]+", query)}
    assert used == {spec.exported for spec in METRICS}
    # Ray's Grafana provisioning names its Prometheus datasource "Prometheus"; panels go through the variable.
    datasource = next(v for v in dashboard["templating"]["list"] if v["type"] == "datasource")
    assert (datasource["query"], datasource["current"]["value"]) == ("prometheus", "Prometheus")
    assert all(panel["datasource"] == "${" + datasource["name"] + "}" for panel in dashboard["panels"])
    titles = {panel["title"] for panel in dashboard["panels"]}
    assert {"Done", "Tokens/s", "ETA", "Disk used vs budget", "Waiting for disk", "Failed shards", "Bytes written"} <= titles


def test_counter_names_follow_rays_exporter():
    exported = {spec.name: spec.exported for spec in METRICS}
    assert exported["eagle3_shards_done"] == "ray_eagle3_shards_done"
    assert exported["eagle3_tokens_written_total"] == "ray_eagle3_tokens_written_total"  # not ..._total_total


class _Summary:
    def __init__(self) -> None:
        self.reports: list[dict] = []

    def update(self, manifest: Manifest, progress: dict) -> None:
        self.reports.append(progress)


def test_snapshot_counts_this_run_and_earlier_runs(tmp_path, caplog):
    """Done and planned cover the whole plan; the rate and ETA only this run's shards; a failed shard's
    tokens leave the done count and the work still to do."""
    manifest = Manifest.open(tmp_path, {"k": 1}, [(0, 0, 4), (1, 4, 8), (2, 8, 12), (3, 12, 16)])
    manifest.update(0, state=DONE, rows=4, tokens=100, bytes=5000)  # an earlier run's
    budget = DiskBudget(tmp_path, 10**6, 0)
    budget.reserve(1, 2000)
    summary = _Summary()
    progress = RunProgress(manifest, budget, {0: 100, 1: 200, 2: 300, 3: 400}, [1, 2, 3], run=str(tmp_path),
                           interval_s=3600, sink=summary, interactive=False)
    with caplog.at_level(logging.INFO, logger="jobs.driver.progress"):
        progress.begin()
        progress.tokens_written(1, 200)
        progress.tokens_written(2, 120)
        manifest.update(1, state=DONE, rows=4, tokens=200, bytes=9000)
        progress.shard_settled(1)
        middle = progress.snapshot()
        progress.tokens_written(3, 50)
        manifest.update(3, state=FAILED, error="boom")
        progress.shard_settled(3)
        progress.close()
    assert (middle.shards_done, middle.shards_failed, middle.shards_total) == (2, 0, 4)
    assert (middle.tokens_done, middle.tokens_planned, middle.bytes_written) == (100 + 200 + 120, 1000, 14000)
    assert (middle.disk_used, middle.disk_budget, middle.waiting_for_disk) == (2000, 10**6, 0)
    # This run still has 300 - 120 + 400 tokens to write.
    assert middle.tokens_to_go == 580 and middle.tokens_per_second > 0
    assert middle.eta_seconds == pytest.approx(580 / middle.tokens_per_second, abs=0.1)
    end = ProgressSnapshot(**summary.reports[-1])
    assert (end.shards_done, end.shards_failed, end.tokens_done, end.tokens_to_go) == (2, 1, 100 + 200 + 120, 180)
    # Two reports, begin and close (the interval is an hour): one log line each, the close one the last.
    assert len(summary.reports) == 2
    lines = [record.getMessage() for record in caplog.records if record.name == "jobs.driver.progress"]
    assert lines[-1] == end.describe() and lines[-1].startswith("shards 2/4, samples 8/16, tokens 420/1.0k (42%), ")
    assert lines[-1].endswith(", disk 2.0 KB/1.0 MB, 1 failed")


def test_a_budget_beyond_the_free_space_shows_the_free_space(tmp_path):
    """The default budget (1.3 TB) on a smaller disk: the line shows what the disk can take, and the budget."""
    manifest = Manifest.open(tmp_path, {"k": 1}, [(0, 0, 4)])
    budget = DiskBudget(tmp_path, 10**18, 10**6)
    budget.reserve(0, 3000)
    progress = RunProgress(manifest, budget, {0: 100}, [0], run="r", interval_s=3600, interactive=False)
    progress.begin()
    snapshot = progress.snapshot()
    free = shutil.disk_usage(tmp_path).free
    assert snapshot.disk_budget == 10**18 and snapshot.disk_room < free + 3000
    assert snapshot.disk_room == pytest.approx(3000 + free - 3000 - 10**6, rel=0.01)  # the reservation is unwritten
    assert snapshot.describe().endswith(f", disk 3.0 KB/{format_bytes(snapshot.disk_room)} (free space; budget "
                                        f"{format_bytes(10**18)})")


def test_a_failed_shard_rerun_is_work_still_to_do(tmp_path):
    """shards=failed: the manifest says failed until the shard is opened again; its tokens are still to do."""
    manifest = Manifest.open(tmp_path, {"k": 1}, [(0, 0, 4), (1, 4, 8)])
    manifest.update(0, state=FAILED, error="earlier")
    manifest.update(1, state=FAILED, error="earlier")
    progress = RunProgress(manifest, DiskBudget(tmp_path, 10**6, 0), {0: 100, 1: 100}, [0, 1], run="r",
                           interval_s=3600, interactive=False)
    progress.begin()
    manifest.update(0, state=PENDING)
    progress.tokens_written(0, 40)
    snapshot = progress.snapshot()
    assert (snapshot.shards_failed, snapshot.tokens_done) == (1, 40)
    assert snapshot.tokens_to_go == 160


def test_a_batch_reported_after_its_shard_was_published_counts_once(tmp_path):
    """Seen under ray job submit on a loaded machine: the final report said 101%."""
    manifest = Manifest.open(tmp_path, {"k": 1}, [(0, 0, 4)])
    progress = RunProgress(manifest, DiskBudget(tmp_path, 10**6, 0), {0: 100}, [0], run="r", interval_s=3600,
                           interactive=False)
    progress.begin()
    progress.tokens_written(0, 60)
    manifest.update(0, state=DONE, rows=4, tokens=100, bytes=5000)
    progress.shard_settled(0)
    progress.tokens_written(0, 40)  # the last batch's completion, handled after the shard's
    snapshot = progress.snapshot()
    assert (snapshot.tokens_done, snapshot.tokens_planned, snapshot.tokens_to_go) == (100, 100, 0)
    assert snapshot.describe().startswith("shards 1/1, samples 4/4, tokens 100/100 (100%)")


def test_disk_wait_shows_while_it_lasts(tmp_path):
    manifest = Manifest.open(tmp_path, {"k": 1}, [(0, 0, 4)])
    summary = _Summary()
    progress = RunProgress(manifest, DiskBudget(tmp_path, 1000, 0), {0: 10}, [0], run="r", interval_s=3600,
                           sink=summary, interactive=False)
    progress.begin()
    progress.disk_wait_started()
    waiting = ProgressSnapshot(**summary.reports[-1])
    progress.disk_wait_ended(2.5)
    assert (waiting.waiting_for_disk, summary.reports[-1]["waiting_for_disk"]) == (1, 0)
    assert waiting.describe().endswith("waiting for disk budget") and waiting.eta_seconds == -1
    assert "ETA ?" in waiting.describe()


def test_formats():
    assert [format_count(n) for n in (950, 31_000, 1_234_567, 5_000_000)] == ["950", "31k", "1.2M", "5.0M"]
    assert [format_duration(s) for s in (42, 130, 3900)] == ["42s", "2m10s", "1h05m"]


def test_status_shows_the_runs_last_progress(tmp_path):
    """`jobs.status` reads the progress block of .summary.json (written here by a real RunSummary)."""
    from jobs.config import JobConfig
    from jobs.rundir.summary import RunSummary

    manifest = Manifest.open(tmp_path, {"k": 1}, [(0, 0, 4), (1, 4, 8)])
    summary = RunSummary(JobConfig(), tmp_path, {0: 60, 1: 40}, [0, 1])
    summary.start(manifest)
    progress = RunProgress(manifest, DiskBudget(tmp_path, 10**9, 0), {0: 60, 1: 40}, [0, 1], run=str(tmp_path),
                           interval_s=3600, sink=summary, interactive=False)
    progress.begin()
    progress.tokens_written(0, 60)
    manifest.update(0, state=DONE, rows=4, tokens=60, bytes=1000)
    progress.shard_settled(0)
    progress.close()
    assert read_summary(tmp_path)["progress"]["shards_done"] == 1
    report = status_report(tmp_path)
    assert "last progress: shards 1/2, samples 4/8, tokens 60/100 (60%), " in report  # nobody holds the lock: not running


def test_live_line_on_a_terminal(tmp_path):
    """interactive: the snapshot redrawn in place on the stream (no log line), a log record of the driver
    printed on a line of its own, the last line kept when the run closes."""
    manifest = Manifest.open(tmp_path, {"k": 1}, [(0, 0, 4), (1, 4, 8)])
    screen = io.StringIO()
    handler = logging.StreamHandler(screen)
    logging.getLogger().addHandler(handler)
    try:
        progress = RunProgress(manifest, DiskBudget(tmp_path, 10**6, 0), {0: 60, 1: 40}, [0, 1], run="r",
                               interval_s=3600, interactive=True, stream=screen)
        progress.begin()
        logging.getLogger("jobs.driver.scheduler").warning("a record while the line shows")
        progress.tokens_written(0, 60)
        manifest.update(0, state=DONE, rows=4, tokens=60, bytes=1000)
        progress.shard_settled(0)
        progress.close()
    finally:
        logging.getLogger().removeHandler(handler)
    text = screen.getvalue()
    first = "shards 0/2, samples 0/8, tokens 0/100 (0%), 0 tok/s, ETA ?, disk 0 B/1.0 MB"
    assert text.startswith(f"\r{first}\x1b[K\r")  # drawn, the cursor back at its start
    assert f"\r\x1b[Ka record while the line shows\n" in text  # erased first: the record prints whole
    # kept, the cursor on the next line
    assert re.search(r"\rshards 1/2, samples 4/8, tokens 60/100 \(60%\), \S+ tok/s, ETA 0s, disk 0 B/1.0 MB\x1b\[K\n$", text)


# -- a real run on a terminal ------------------------------------------------------------------------

PROGRESS_TEXT = re.compile(
    r"shards (\d+)/(\d+), samples \S+/\S+, tokens \S+/\S+ \(\d+%\), \S+ tok/s, ETA \S+, disk [\d.]+ [KMGT]?B/[\d.]+ [KMGT]?B"
    r"(?: \(free space; budget [\d.]+ [KMGT]?B\))?")


def run_under_a_terminal(args: list[str], cwd, timeout: float = 600, columns: int = 0) -> tuple[int, str]:
    """The command's exit code and everything it wrote to its terminal: a pseudo-terminal is its stdin, stdout
    and stderr. Its size is ``columns`` wide (40 rows); 0 leaves it unset, as a bare pty's (and some terminals',
    `script`'s without one) is."""
    main, child_side = os.openpty()
    if columns:
        fcntl.ioctl(child_side, termios.TIOCSWINSZ, struct.pack("HHHH", 40, columns, 0, 0))
    process = subprocess.Popen(args, cwd=cwd, env=user_env(), stdin=child_side, stdout=child_side,
                               stderr=child_side, start_new_session=True)
    os.close(child_side)
    output = bytearray()
    deadline = time.monotonic() + timeout
    try:
        while time.monotonic() < deadline:
            if select.select([main], [], [], 1.0)[0]:
                try:
                    chunk = os.read(main, 65536)
                except OSError:  # EIO: every process holding the terminal is gone
                    break
                if not chunk:
                    break
                output += chunk
            elif process.poll() is not None:
                break
        else:
            process.kill()
            raise AssertionError(f"still running after {timeout} s: {output[-3000:].decode(errors='replace')}")
        return process.wait(timeout=60), output.decode(errors="replace")
    finally:
        os.close(main)


def test_extract_shows_live_progress_on_a_terminal(tmp_path):
    """`python -m jobs.extract` on the demo under a pseudo-terminal: between its start line and `N of N shards
    done`, a live progress line (shards, samples, tokens/s, ETA, disk budget) redrawn in place, the last one
    kept; no progress log lines on the terminal."""
    code, screen = run_under_a_terminal(
        [sys.executable, "-m", "jobs.extract", f"demo.dir={tmp_path / 'demo'}", "progress.interval_s=0.2"], tmp_path)
    assert code == 0, screen[-3000:]
    start = screen.index("this run extracts 3 of them")
    end = screen.index("3 of 3 shards done in")
    between = screen[start:end]
    drawn = [match.groups() for match in PROGRESS_TEXT.finditer(between)]
    assert drawn and drawn[-1] == ("3", "3"), between[-3000:]
    assert "\rshards " in between  # redrawn in place, not logged
    assert not re.search(r"INFO jobs\.driver\.progress: shards", screen)
    last = list(PROGRESS_TEXT.finditer(between))[-1]
    assert between[last.end():].startswith("\x1b[K\r\n")  # the last line stays (the pty turns \n into \r\n)


@pytest.mark.parametrize("columns", [0, 120])
def test_prepare_draws_its_bar_on_any_terminal(tmp_path, columns):
    """`python -m jobs.prepare` (the demo) under a pseudo-terminal that reports 0 columns, and one of 120: a tqdm bar
    each time, drawn to the whole of 80 columns where the terminal reports none, within the width it reports."""
    code, screen = run_under_a_terminal(
        [sys.executable, "-m", "jobs.prepare", f"demo.dir={tmp_path / 'demo'}", "demo.num_conversations=40"], tmp_path,
        columns=columns)
    assert code == 0, screen[-3000:]
    bars = [frame for line in screen.split("\n") for frame in line.split("\r") if frame.startswith("tokenize: ")]
    assert bars and "100%" in bars[-1] and "40/40" in bars[-1], screen[-3000:]
    widths = {len(frame.rstrip()) for frame in bars}
    assert max(widths) <= (columns or 80) and (columns or max(widths) == 80), widths
