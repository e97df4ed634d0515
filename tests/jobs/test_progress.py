"""Progress reporting: the snapshot the driver reports, its log line, the rate and its ETA, the job's stages
before the first batch, the live line on a terminal (a real run under a pseudo-terminal, and the export's bar
on its output), and the Grafana dashboard's queries.

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
from jobs.driver.progress import (
    METRICS,
    RATE_WINDOW_S,
    ProgressSnapshot,
    RateMeter,
    RunProgress,
    format_count,
)
from jobs.outdir.budget import DiskBudget
from jobs.rundir.summary import read_summary
from jobs.status import status_report
from runtime.display import timeline as timeline_module
from runtime.display.live import LiveLine, format_duration
from runtime.display.stages import StageLine
from runtime.display.timeline import Timeline
from storage.manifest import DONE, FAILED, PENDING, Manifest
from tests.conftest import REPO_ROOT
from tests.helpers import session_ray_address, user_env

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


def test_hours_of_waiting_for_disk_keep_an_eta_at_the_runs_whole_pace(tmp_path, monkeypatch, caplog):
    """A run paced by its consumer, on the test's clock: an hour of batches at 30k tok/s, then eight hours waiting
    for disk with the loop's idle turn every 10 s, then batches again. The 30 s rate decays towards nothing over
    the wait; the ETA follows the run's whole pace instead (its tokens over its time, the wait included), stays a
    number and every report renders (an ETA from the decayed rate overflowed after 5.8 hours: the run stopped on
    it), and after the wait it does not swing with the rate climbing back (it read 720 h a second after)."""
    clock = [0.0]
    monkeypatch.setattr("jobs.driver.progress.time.monotonic", lambda: clock[0])
    manifest = Manifest.open(tmp_path, {"k": 1}, [(i, 100 * i, 100 * (i + 1)) for i in range(150)])
    summary = _Summary()
    progress = RunProgress(manifest, DiskBudget(tmp_path, 10**12, 0), {i: 20_000_000 for i in range(150)},
                           list(range(150)), run="r", interval_s=10, sink=summary, interactive=False)
    progress.begin()
    for second in range(3600):
        clock[0] += 1
        progress.tokens_written(second % 8, 30_000)
        progress.tick()
    progress.disk_wait_started()
    with caplog.at_level(logging.INFO, logger="jobs.driver.progress"):
        while clock[0] < 9 * 3600:
            clock[0] += 10
            progress.tick()
    last = ProgressSnapshot(**summary.reports[-1])
    assert last.waiting_for_disk and last.tokens_per_second < 1e-6
    pace = 3600 * 30_000 / clock[0]
    assert last.eta_seconds == pytest.approx(last.tokens_to_go / pace, rel=1e-3)
    assert all(0 < report["eta_seconds"] < 3e7 for report in summary.reports[-2880:])
    assert caplog.records[-1].getMessage() == last.describe() and "ETA 10d01h" in last.describe()
    # The trainer frees space: batches again. The 30 s rate climbs back from nothing; the ETA keeps the run's pace.
    progress.disk_wait_ended(8 * 3600)
    for second in range(10):
        clock[0] += 1
        progress.tokens_written(second % 8, 30_000)
        resumed = progress.snapshot()
        pace = (3601 + second) * 30_000 / clock[0]
        assert resumed.eta_seconds == pytest.approx(resumed.tokens_to_go / pace, rel=1e-3)


def test_formats():
    assert [format_count(n) for n in (950, 31_000, 1_234_567, 5_000_000)] == ["950", "31k", "1.2M", "5.0M"]
    assert [format_duration(s) for s in (42, 130, 3900, 200_000)] == ["42s", "2m10s", "1h05m", "2d07h"]
    assert format_duration(float("inf")) == format_duration(float("nan")) == "?"


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
    first = "[--------------------]   0% tokens 0/100, 0 tok/s, ETA ?, samples 0/8, shards 0/2, disk 0 B/1.0 MB"
    assert text.startswith(f"\r{first}\x1b[K\r")  # drawn, the cursor back at its start
    assert "\r\x1b[Ka record while the line shows\n" in text  # erased first: the record prints whole
    # kept, the cursor on the next line
    assert re.search(r"\r\[#{12}-{8}\]  60% tokens 60/100, \S+ tok/s, ETA 0s, samples 4/8, shards 1/2, disk 0 B/1.0 MB"
                     r"\x1b\[K\n$", text)


@pytest.mark.parametrize("columns", [0, 120])
def test_the_bar_fits_any_terminal(tmp_path, columns):
    """The live line on a real pseudo-terminal of 0 columns (drawn in 80) and of 120: cut after its last whole
    part that fits, the bar, the tokens, the rate and the ETA in it either way."""
    main, child = os.openpty()
    if columns:
        fcntl.ioctl(child, termios.TIOCSWINSZ, struct.pack("HHHH", 40, columns, 0, 0))
    stream = os.fdopen(child, "w")
    try:
        snapshot = ProgressSnapshot(
            updated_at="", shards_done=12, shards_failed=1, shards_total=50, samples_done=2400, samples_planned=10000,
            tokens_done=1_200_000, tokens_planned=5_000_000, bytes_written=0, tokens_to_go=3_800_000,
            tokens_per_second=31_000, eta_seconds=130, disk_used=40 * 10**9, disk_budget=13 * 10**11,
            waiting_for_disk=1, disk_room=75 * 10**9)
        LiveLine(stream).show(snapshot.live())
        drawn = os.read(main, 4096).decode()
    finally:
        stream.close()
        os.close(main)
    whole = snapshot.live()
    frame = drawn.removeprefix("\r").removesuffix("\x1b[K\r")
    assert len(frame) <= (columns or 80) - 1 and whole.startswith(frame), (frame, whole)
    assert frame.startswith("[####----------------]  24% tokens 1.2M/5.0M, 31k tok/s, ETA 2m10s"), frame
    assert whole[len(frame):].startswith(", ") or frame == whole  # whole parts only
    assert frame.endswith("shards 12/50" if columns == 120 else "ETA 2m10s"), frame


def test_the_rate_follows_steady_batches_without_swinging():
    """RateMeter on a simulated run (its own clock, no waiting): 2,000-token batches every 0.5 s after a first
    batch 3 s in, 10 minutes of work, the line redrawn every second. The ETA is known from the first batch on; once
    10 s of batches are in, the end it predicts (now + ETA) stays within 5% of the true end (the first batch's
    wait is not taken for the pace) and never rises by more than 5% from one redraw to the next (a batch moves the
    rate by its share of the window). Then the speed halves: within three windows the rate is within 10% of
    the new one. Then nothing comes for a minute: the rate falls, so the ETA grows instead of standing still."""
    planned, batch, period = 2_400_000, 2000, 0.5
    meter = RateMeter(RATE_WINDOW_S, started=0.0)
    done, arrivals = 0, [3.0 + period * i for i in range(planned // batch)]
    true_end, ends, etas = arrivals[-1], [], []
    for second in range(1, 301):
        while arrivals and arrivals[0] <= second:
            meter.add(batch, arrivals.pop(0))
            done += batch
        rate = meter.rate(second)
        if second >= 3:
            assert rate > 0, second
            etas.append((planned - done) / rate)
            if second >= 13:
                ends.append(second + etas[-1])
    assert all(abs(end - true_end) / true_end < 0.05 for end in ends), (min(ends), max(ends), true_end)
    assert all(later <= earlier * 1.05 for earlier, later in zip(etas[10:], etas[11:]))
    clock = 300.0
    for _ in range(90):  # half the speed: 2,000 tokens a second
        clock += 1
        meter.add(batch, clock)
    assert meter.rate(clock) == pytest.approx(2000, rel=0.1)
    assert meter.rate(clock + 60) < 0.5 * meter.rate(clock)


def test_stages_show_from_the_start_then_hand_over_to_the_runs_line(tmp_path, caplog):
    """Before the first batch: without a terminal, each stage is logged as it begins, with its detail; on a
    terminal it is the live line, which the run's own line (the bar) replaces at the first batch; a log record
    meanwhile prints whole; nothing is shown once the stages are closed."""
    with caplog.at_level(logging.INFO, logger="runtime.display.stages"):
        stages = StageLine(interval_s=3600, interactive=False)
        stages.show("starting Ray")
        stages.show("loading the model", lambda: "0 of 2 extractors ready (node a: importing SGLang)")
        stages.close()
        stages.show("too late")
    assert [r.getMessage() for r in caplog.records if r.name == "runtime.display.stages"] == [
        "starting Ray (0s)", "loading the model (0s): 0 of 2 extractors ready (node a: importing SGLang)"]

    screen = io.StringIO()
    handler = logging.StreamHandler(screen)
    logging.getLogger().addHandler(handler)
    try:
        stages = StageLine(interval_s=3600, stream=screen, interactive=True)
        stages.show("starting Ray")
        logging.getLogger("runtime.cluster.session").warning("a record while the stage shows")
        manifest = Manifest.open(tmp_path, {"k": 1}, [(0, 0, 4)])
        progress = RunProgress(manifest, DiskBudget(tmp_path, 10**6, 0), {0: 60}, [0], run="r", interval_s=3600,
                               interactive=True, stream=screen, stages=stages)
        progress.stage("loading the model", lambda: "1 of 1 extractors ready")
        progress.begin()
        progress.close()
    finally:
        logging.getLogger().removeHandler(handler)
    text = screen.getvalue()
    assert text.startswith("\rstarting Ray (0s)\x1b[K\r\r\x1b[Ka record while the stage shows\n"), text
    loading = text.index("\rloading the model (0s): 1 of 1 extractors ready\x1b[K\r\r\x1b[K")  # shown, then erased
    assert text.index("\r[--------------------]   0% tokens 0/60, 0 tok/s, ETA ?") > loading


def test_a_phase_known_only_afterwards_begins_where_it_began(monkeypatch):
    """The run's phases around its batches: the first batch, the steady state from the first batch written, the
    last shards' closing from the last batch written (known once the run is over: entered with ``seconds_ago``,
    never before the phase before it began); the phases still add up to the total."""
    now = [100.0]
    monkeypatch.setattr(timeline_module.time, "monotonic", lambda: now[0])
    timeline = Timeline()
    timeline.enter("extracting the first batch")
    now[0] = 101.5
    timeline.enter("extracting")
    now[0] = 130.0
    timeline.enter("closing the last shards", seconds_ago=0.75)  # the last batch was written at 129.25
    timeline.enter("winding down", seconds_ago=99.0)  # not before "closing the last shards" began
    now[0] = 131.0
    assert timeline.seconds() == {"phases": [["extracting the first batch", 1.5], ["extracting", 27.75],
                                             ["closing the last shards", 0.0], ["winding down", 1.75]],
                                  "total": 31.0}


# -- a real run on a terminal ------------------------------------------------------------------------

BAR = re.compile(
    r"\[[#-]{20}\] +(\d+)% tokens (\S+)/(\S+), \S+ tok/s, ETA (\S+), samples \S+/\S+, shards (\d+)/(\d+)")
"""The run's live line on a terminal, as far as any width that shows the shards has it."""


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


def live_frames(screen: str) -> list[str]:
    """Each drawing of the live line: ``\\r<text>\\x1b[K`` then ``\\r`` (redrawn) or a line end (kept)."""
    return [frame for frame in re.findall(r"\r([^\r\n]*)\x1b\[K(?=\r)", screen) if frame]


def seconds_of(duration: str) -> float:
    """``2m10s`` -> 130 (``format_duration``'s forms)."""
    parts = dict((unit, int(value)) for value, unit in re.findall(r"(\d+)([hms])", duration))
    return parts.get("h", 0) * 3600 + parts.get("m", 0) * 60 + parts.get("s", 0)


def test_extract_and_export_show_progress_on_a_terminal(ray_cluster, tmp_path):
    """`python -m jobs.extract` on the demo (batches of at most 512 tokens: shards of several batches) under a
    pseudo-terminal of 120 columns, as docs/operations.md shows it, joined to this session's Ray cluster (what the
    line shows is the point, not where the cluster comes from): from the start a live line says the stage
    (reading the inputs, starting Ray, loading the model with what the extractor's load does), then a bar with
    tokens counted batch by batch (seen between 0 and the total while the first shard is still open), the ETA
    known from the first batch on and never twice the one before (the rate averages since the first batch, over 30 s
    windows). Every frame fits the 120 columns; the last one stays; no progress log lines. The same command again
    under a terminal that reports no size: its stage within 80 columns, nothing to do. Then `jobs.export` of that
    run under a terminal that reports no size (80 columns), and one of 120: its bar, within the width."""
    command = [sys.executable, "-m", "jobs.extract", f"demo.dir={tmp_path / 'demo'}", "progress.interval_s=0.2",
               "extract.max_tokens_per_batch=512", f"ray.address={session_ray_address()}"]
    code, screen = run_under_a_terminal(command, tmp_path, columns=120)
    assert code == 0, screen[-3000:]
    stages = ("reading the inputs (", "checking the layers SGLang captures (", "starting Ray (",
              "checking the run's directories (", "loading the model and starting the writers (",
              "warming the object store (")
    # Ray prints its workers' lines from a thread of its own, between the line's redraws: only the line's own frames
    drawn = [frame for frame in live_frames(screen[:screen.index("3 of 3 shards done in")])
             if frame.startswith(stages) or BAR.match(frame)]
    assert all(len(frame) <= 119 for frame in drawn), max(drawn, key=len)
    bars = [(frame, BAR.match(frame)) for frame in drawn if BAR.match(frame)]
    assert bars and bars[-1][1].group(1, 5, 6) == ("100", "3", "3"), screen[-3000:]
    first_tokens = next(i for i, frame in enumerate(drawn) if (m := BAR.match(frame)) and m.group(2) != "0")
    before = "\n".join(drawn[:first_tokens])
    for stage in (*stages, "0 of 1 extractors ready (node ", ": importing SGLang)"):
        assert stage in before, (stage, before[-3000:])
    assert any(m.group(5) == "0" and m.group(2) != "0" for _, m in bars), bars  # within the first shard
    etas = [m.group(4) for frame, m in bars if m.group(2) != "0"]
    assert "?" not in etas, etas
    assert all(seconds_of(later) <= 2 * seconds_of(earlier) + 1 for earlier, later in zip(etas, etas[1:])), etas
    assert screen.index(bars[-1][0]) < screen.index("3 of 3 shards done in")
    assert re.search(re.escape(bars[-1][0]) + r"\x1b\[K\r\n", screen)  # the last line stays (the pty: \n -> \r\n)
    assert not re.search(r"INFO jobs\.driver\.(progress|stages): ", screen)
    # The same command again, on a terminal that reports no size: its stage in 80 columns, then nothing to do.
    code, screen = run_under_a_terminal(command, tmp_path, columns=0)
    assert code == 0 and "nothing to do: all 3 shards" in screen, screen[-3000:]
    drawn = [frame for frame in live_frames(screen) if frame.startswith(stages)]
    assert drawn and drawn[0].startswith("reading the inputs (") and max(map(len, drawn)) <= 79, drawn

    run = next((tmp_path / "demo").glob("hidden_states-*"))
    for columns in (0, 120):
        dest = tmp_path / f"specforge-{columns}"
        code, screen = run_under_a_terminal(
            [sys.executable, "-m", "jobs.export", f"output.dir={run}", "to=specforge", f"dest={dest}"], tmp_path,
            columns=columns)
        assert code == 0, screen[-3000:]
        bars = [frame for line in screen.split("\n") for frame in line.split("\r") if frame.startswith("export: ")]
        assert bars and "100%" in bars[-1] and "48/48" in bars[-1], screen[-3000:]
        widths = {len(frame.rstrip()) for frame in bars}
        assert max(widths) <= (columns or 80) and (columns or max(widths) == 80), widths


@pytest.mark.parametrize("columns", [0, 120])
def test_prepare_draws_its_bar_on_any_terminal(tmp_path, columns):
    """`python -m jobs.prepare` (the demo) under a pseudo-terminal that reports 0 columns, and one of 120: from the
    start a live line with the stage (reading the inputs, its seconds), then a tqdm bar each time, drawn to the
    whole of 80 columns where the terminal reports none, within the width it reports."""
    code, screen = run_under_a_terminal(
        [sys.executable, "-m", "jobs.prepare", f"demo.dir={tmp_path / 'demo'}", "demo.num_conversations=40"], tmp_path,
        columns=columns)
    assert code == 0, screen[-3000:]
    bars = [frame for line in screen.split("\n") for frame in line.split("\r") if frame.startswith("tokenize: ")]
    assert bars and "100%" in bars[-1] and "40/40" in bars[-1], screen[-3000:]
    widths = {len(frame.rstrip()) for frame in bars}
    assert max(widths) <= (columns or 80) and (columns or max(widths) == 80), widths
    stage = [frame for frame in live_frames(screen) if frame.startswith("reading the inputs (")]
    assert stage and screen.index(stage[0]) < screen.index(bars[0]), screen[:3000]
    assert all(len(frame) < (columns or 80) for frame in stage), stage
