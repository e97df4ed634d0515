"""The run's progress, told three ways: Ray metrics, ``.summary.json``, and a line on the terminal or in the log.

Before the first batch the job's stages (``runtime.display.stages``) hold the line; from the first batch the
driver tells ``RunProgress`` what happens (tokens written, batch by batch; a shard settled; a wait for disk
budget) and calls ``tick()`` from its loops. A tick reads the manifest and the disk budget (the
truth, owned by the driver) into a ``ProgressSnapshot`` and reports it: Ray metrics every
``METRICS_REFRESH_S`` (or ``progress.interval_s`` if shorter) from set-up to the end (every series
from the start, every gauge set again each time: Ray drops one not set for 20-30 s), the ``progress``
block of ``.summary.json`` every ``progress.interval_s`` (what ``jobs.status`` reads), and a log line,
or one live line with a bar redrawn every ``LIVE_REFRESH_S`` on a terminal. The rate and the ETA follow
``RateMeter``. The metrics, the line and why Ray's Jobs API cannot carry it: docs/operations.md.
"""

from __future__ import annotations

import dataclasses
import datetime
import logging
import math
import sys
import threading
import time
from typing import Any, Callable, Optional, Protocol, Sequence, TextIO

from common.checks import format_bytes
from jobs.outdir.budget import DiskBudget
from runtime.display.live import LIVE_REFRESH_S, LiveLine, format_duration
from runtime.display.stages import StageLine
from storage.manifest import DONE, FAILED, Manifest

logger = logging.getLogger(__name__)

EXPORTED_PREFIX = "ray_"
"""What Ray's Prometheus exporter puts before every metric name (its namespace, checked on Ray 2.60)."""
RUN_LABEL = "run"
"""The label naming the run: its output.dir."""
METRICS_REFRESH_S = 5.0
"""How often gauges are set again: Ray 2.60 exports a gauge every 10 s and forgets one not set for 20-30 s."""
ETA_MAX_S = 3e7
"""An ETA beyond about a year is reported unknown (-1): a rate decaying over a long pause would otherwise give one
with hundreds of digits, then an infinite one."""
RATE_WINDOW_S = 30.0
"""The time constant of the rate shown (and of the ETA): long against a batch (a second or so on a GPU) and a
shard's publication, so that neither moves it much; short enough that a lasting change of speed shows within a
minute."""
BAR_CHARS = 20
"""The live line's bar, in characters."""


@dataclasses.dataclass(frozen=True)
class MetricSpec:
    name: str
    description: str
    field: str = ""
    """A gauge set from this ProgressSnapshot field at every report; empty for a counter."""

    @property
    def exported(self) -> str:
        """The name on the metrics endpoint: Ray's namespace in front, ``_total`` after a counter."""
        suffix = "_total" if not self.field and not self.name.endswith("_total") else ""
        return EXPORTED_PREFIX + self.name + suffix


METRICS: tuple[MetricSpec, ...] = (
    MetricSpec("eagle3_shards_done", "Shards done in output.dir (every run's)", "shards_done"),
    MetricSpec("eagle3_shards_failed", "Shards whose last attempt failed", "shards_failed"),
    MetricSpec("eagle3_shards_total", "Shards in the plan", "shards_total"),
    MetricSpec("eagle3_tokens_done", "Tokens in done shards and written into shards being written", "tokens_done"),
    MetricSpec("eagle3_tokens_planned", "Tokens in the plan", "tokens_planned"),
    MetricSpec("eagle3_bytes_written", "Bytes of the done shard files (local or in the sink)", "bytes_written"),
    MetricSpec("eagle3_tokens_per_second", "This run's tokens written per second, over about the last 30 s",
               "tokens_per_second"),
    MetricSpec("eagle3_eta_seconds", "Seconds until this run's shards are written at this run's rate, or at its whole "
               "pace once it has waited for disk (-1: unknown)",
               "eta_seconds"),
    MetricSpec("eagle3_disk_used_bytes", "Committed local shard bytes + reservations", "disk_used"),
    MetricSpec("eagle3_disk_budget_bytes", "output.disk_budget", "disk_budget"),
    MetricSpec("eagle3_waiting_for_disk", "1 while the driver waits for disk budget", "waiting_for_disk"),
    MetricSpec("eagle3_disk_wait_seconds_total", "Time spent waiting for disk budget"),
    MetricSpec("eagle3_tokens_written_total", "Tokens whose states were written"),
)


@dataclasses.dataclass(frozen=True)
class ProgressSnapshot:
    """Where the run stands; the ``progress`` block of ``.summary.json``."""

    updated_at: str
    shards_done: int
    shards_failed: int
    shards_total: int
    samples_done: int
    """Samples of the done shards (every run's; those a run skipped as NaN/Inf included)."""
    samples_planned: int
    tokens_done: int
    tokens_planned: int
    bytes_written: int
    tokens_to_go: int
    """This run's shards' tokens not written yet (a failed shard's are no longer to go)."""
    tokens_per_second: float
    """This run's tokens a second, over about the last ``RATE_WINDOW_S`` (``RateMeter``; earlier runs' shards
    excluded)."""
    eta_seconds: float
    """This run's tokens still to write at that rate, or at the run's whole pace once it has waited for disk (the
    waits included); -1 until known and past ``ETA_MAX_S``."""
    disk_used: int
    disk_budget: int
    waiting_for_disk: int
    disk_room: int = 0
    """What the shard files can take: disk_budget, or less where the disk has less free (above output.min_free);
    0 in a summary written before it was reported."""

    def describe(self) -> str:
        """``shards 12/50, samples 2.4k/10k, tokens 1.2M/5.0M (24%), 31k tok/s, ETA 2m10s, disk 40.0 GB/1.3 TB``
        (``disk 40.0 GB/75.0 GB (free space; budget 1.3 TB)`` where the disk holds less than the budget)."""
        share = 100 * self.tokens_done / self.tokens_planned if self.tokens_planned else 100.0
        parts = [
            f"shards {self.shards_done}/{self.shards_total}",
            f"samples {format_count(self.samples_done)}/{format_count(self.samples_planned)}",
            f"tokens {format_count(self.tokens_done)}/{format_count(self.tokens_planned)} ({share:.0f}%)",
            f"{format_count(self.tokens_per_second)} tok/s",
            f"ETA {format_duration(self.eta_seconds) if self.eta_seconds >= 0 else '?'}",
            self._disk(),
        ]
        return ", ".join(parts + self._notes())

    def live(self) -> str:
        """The live line on a terminal: a bar and what it takes to judge it first (tokens, rate, ETA), as in
        ``[####----------------]  24% tokens 1.2M/5.0M, 31k tok/s, ETA 2m10s, samples 2.4k/10k, shards 12/50, disk
        40.0 GB/1.3 TB``, so that a narrow terminal cuts the least of it."""
        share = self.tokens_done / self.tokens_planned if self.tokens_planned else 1.0
        filled = min(BAR_CHARS, int(share * BAR_CHARS))
        parts = [
            f"[{'#' * filled}{'-' * (BAR_CHARS - filled)}] {100 * share:3.0f}% "
            f"tokens {format_count(self.tokens_done)}/{format_count(self.tokens_planned)}",
            f"{format_count(self.tokens_per_second)} tok/s",
            f"ETA {format_duration(self.eta_seconds) if self.eta_seconds >= 0 else '?'}",
            f"samples {format_count(self.samples_done)}/{format_count(self.samples_planned)}",
            f"shards {self.shards_done}/{self.shards_total}",
            self._disk(),
        ]
        return ", ".join(parts + self._notes())

    def _disk(self) -> str:
        room = self.disk_room or self.disk_budget
        return (f"disk {format_bytes(self.disk_used)}/{format_bytes(room)}"
                + (f" (free space; budget {format_bytes(self.disk_budget)})" if room < self.disk_budget else ""))

    def _notes(self) -> list[str]:
        notes = ["waiting for disk budget"] if self.waiting_for_disk else []
        return notes + ([f"{self.shards_failed} failed"] if self.shards_failed else [])


def format_count(count: float) -> str:
    """1234567 -> 1.2M, 31000 -> 31k, 950 -> 950."""
    for threshold, unit in ((1e9, "G"), (1e6, "M"), (1e3, "k")):
        if count >= threshold:
            value = count / threshold
            return f"{value:.1f}{unit}" if value < 10 else f"{value:.0f}{unit}"
    return f"{count:.0f}"


class RateMeter:
    """Tokens a second: an exponential moving average over time with the time constant ``window_s``.

    The first batch's wait (the pipeline filling, the first forward's set-up) is no measure of the pace: until a
    second batch comes the rate is the first batch's tokens over the time since ``started``, and from then on it
    is measured from the first batch's arrival. Both the tokens and the time since then are weighted by
    exp(-age / window_s): while that time is shorter than the window this is the plain average, later mostly the
    last ``window_s`` or so. A batch moves the rate by its share of the window, not by its own instant rate: under
    steady work the rate stays within a batch's share of it (one batch a second in a window of 30 s: about 3%).
    """

    def __init__(self, window_s: float, started: float) -> None:
        self.window_s = window_s
        self.started = started
        self._first: Optional[tuple[float, int]] = None
        """When the first batch came, and its tokens."""
        self._weighted = 0.0
        """The later batches' tokens, each weighted by exp(-its age / window_s), as of ``_at``."""
        self._at = started
        self._total = 0

    def add(self, tokens: int, now: float) -> None:
        self._total += tokens
        if self._first is None:
            self._first = (now, tokens)
        else:
            self._weighted = self._weighted * math.exp(-(now - self._at) / self.window_s) + tokens
        self._at = now

    def rate(self, now: float) -> float:
        """Tokens a second as of ``now``; 0 before the first batch."""
        if self._first is None:
            return 0.0
        since, tokens = self._first
        if not self._weighted:
            return tokens / max(now - self.started, 1e-9)
        weighted_time = self.window_s * -math.expm1(-(now - since) / self.window_s)  # the integral of the weights
        return self._weighted * math.exp(-(now - self._at) / self.window_s) / weighted_time

    def average(self, now: float) -> float:
        """Tokens a second since ``started``, every pause included: the pace of a run that waits on a consumer."""
        return self._total / max(now - self.started, 1e-9)


class ProgressSink(Protocol):
    """Where the snapshot goes besides metrics and logs (``RunSummary``: ``.summary.json``)."""

    def update(self, manifest: Manifest, progress: dict[str, Any]) -> None: ...


class _RunMetrics:
    """The METRICS on Ray's metrics endpoint, labelled with the run; every series exists from ``start``."""

    def __init__(self, run: str) -> None:
        # Imported here: jobs.status reads snapshots without loading Ray.
        from ray.util import metrics

        self.tags = {RUN_LABEL: run}
        self.gauges = {
            spec.field: metrics.Gauge(spec.name, description=spec.description, tag_keys=(RUN_LABEL,))
            for spec in METRICS if spec.field
        }
        self.counters = {
            spec.name: metrics.Counter(spec.name, description=spec.description, tag_keys=(RUN_LABEL,))
            for spec in METRICS if not spec.field
        }
        self.wait_seconds = self.counters["eagle3_disk_wait_seconds_total"]
        self.tokens = self.counters["eagle3_tokens_written_total"]
        self._hold: Optional[threading.Event] = None

    def start(self, snapshot: ProgressSnapshot) -> None:
        """Every gauge at ``snapshot``'s value and every counter at 0, then kept so until ``stop_holding``:
        the driver sits in Ray calls while the models load (minutes for a large model), longer than Ray
        keeps a gauge nobody sets."""
        self.report(snapshot)
        for counter in self.counters.values():
            # Counter.inc refuses 0 (Ray 2.60); its _record takes it and exports the series at 0.
            record = getattr(counter, "_record", None)
            if record is not None:
                record(0.0, tags=self.tags)
        self._hold = threading.Event()
        threading.Thread(target=self._keep, args=(snapshot, self._hold), name="eagle3-metrics", daemon=True).start()

    def _keep(self, snapshot: ProgressSnapshot, hold: threading.Event) -> None:
        while not hold.wait(METRICS_REFRESH_S):
            self.report(snapshot)

    def stop_holding(self) -> None:
        """The driver sets the metrics itself from now on."""
        if self._hold is not None:
            self._hold.set()
            self._hold = None

    def report(self, snapshot: ProgressSnapshot) -> None:
        for field, gauge in self.gauges.items():
            gauge.set(getattr(snapshot, field), tags=self.tags)

    def add(self, counter: Any, value: float) -> None:
        if value > 0:  # Ray counters refuse increments of 0
            counter.inc(value, tags=self.tags)


class RunProgress:
    """Counts what this run wrote and reports where the run stands every ``interval_s``.

    Reads ``manifest`` and ``budget`` (owned by the driver) at each report; changes neither.
    The metrics exist from construction on, at their initial values.
    """

    def __init__(
        self, manifest: Manifest, budget: DiskBudget, shard_tokens: dict[int, int], to_run: list[int],
        run: str, interval_s: float, sink: Optional[ProgressSink] = None, interactive: Optional[bool] = None,
        stream: Optional[TextIO] = None, stages: Optional[StageLine] = None,
    ) -> None:
        """``interactive``: a live line on ``stream`` (default stderr) rather than log lines; default: whether
        stderr is a terminal. ``stages``: the job's stages, shown until the first batch (``stage``)."""
        self.manifest = manifest
        self.budgets = [budget]
        """Budgets whose bytes the run reports: output.dir's, then every node directory's (``begin``)."""
        self.shard_tokens = shard_tokens
        self.to_run = list(to_run)
        self.interval_s = interval_s
        self.stream = stream if stream is not None else sys.stderr
        self.interactive = self.stream.isatty() if interactive is None else interactive
        self.refresh_s = min(interval_s, METRICS_REFRESH_S, *((LIVE_REFRESH_S,) if self.interactive else ()))
        self.sink = sink
        self.stages = stages
        self.meter: Optional[RateMeter] = None
        """This run's rate, from its first batch on."""
        self.open_tokens: dict[int, int] = {}
        """Tokens written into shards not yet settled (done or failed)."""
        self.settled: set[int] = set()
        """Shards of this run that are done or failed (a rerun shard may be either in the manifest until opened)."""
        self.waiting = False
        self.waited = False
        """The run has waited for disk: its consumer sets its pace."""
        self.last_metrics: Optional[float] = None
        self.last_report: Optional[float] = None
        self.live: Optional[LiveLine] = None
        self.metrics = _RunMetrics(run)
        self.metrics.start(self.snapshot())

    def stage(self, stage: str, detail: Optional[Callable[[], str]] = None) -> None:
        """What the run does before its first batch (``StageLine.show``)."""
        if self.stages is not None:
            self.stages.show(stage, detail)

    def begin(self, budgets: Sequence[DiskBudget] = ()) -> None:
        """The first batch is about to go out: the rate's clock starts; the live line on a terminal.

        ``budgets``: one per node directory of the run, once the data-parallel groups stand.
        """
        if budgets:
            self.budgets = list(budgets)
        self.metrics.stop_holding()
        if self.stages is not None:
            self.stages.close()
            self.stages.timeline.enter("extracting the first batch")  # the run's own end places what follows
        self.meter = RateMeter(RATE_WINDOW_S, time.monotonic())
        if self.interactive:
            self.live = LiveLine(self.stream)
        self.tick(force=True)

    def tokens_written(self, shard: int, tokens: int) -> None:
        """A batch of ``shard`` was written: ``tokens`` more (failed shards' count in the rate too)."""
        if self.meter is not None:
            self.meter.add(tokens, time.monotonic())
        # A batch's completion may reach the driver after its shard's publication did (Ray reports the
        # writer's two results independently): the manifest's record already counts those tokens.
        if shard not in self.settled:
            self.open_tokens[shard] = self.open_tokens.get(shard, 0) + tokens
        self.metrics.add(self.metrics.tokens, tokens)

    def shard_settled(self, shard: int) -> None:
        """The shard is done or failed, and the manifest says which."""
        self.open_tokens.pop(shard, None)
        self.settled.add(shard)

    def shard_reopened(self, shard: int) -> None:
        """A done shard is to be written again in this run (its file was lost)."""
        self.settled.discard(shard)
        if shard not in self.to_run:
            self.to_run.append(shard)

    def shard_discarded(self, shard: int) -> None:
        """A fault cut the shard's attempt short: what it wrote is gone, the shard runs again."""
        self.open_tokens.pop(shard, None)

    def disk_wait_started(self) -> None:
        self.waiting = self.waited = True
        self.tick(force=True)

    def disk_waited(self, seconds: float) -> None:
        """``seconds`` more of the wait for disk, counted while it lasts: the counter rises through a wait of hours."""
        self.metrics.add(self.metrics.wait_seconds, seconds)

    def disk_wait_ended(self, seconds: float) -> None:
        """The wait is over; ``seconds``: its part not counted yet."""
        self.waiting = False
        self.disk_waited(seconds)
        self.tick(force=True)

    def tick(self, force: bool = False) -> Optional[ProgressSnapshot]:
        """Set the metrics (and redraw the live line) every ``refresh_s``, write the summary and log every
        ``interval_s`` (``force``: now); returns the snapshot it reported, if any."""
        now = time.monotonic()
        report = force or _due(self.last_report, self.interval_s, now)
        if not (report or _due(self.last_metrics, self.refresh_s, now)):
            return None
        snapshot = self.snapshot()
        self.metrics.report(snapshot)
        self.last_metrics = now
        if self.live is not None:
            self.live.show(snapshot.live())
        if not report:
            return snapshot
        self.last_report = now
        if self.sink is not None:
            try:
                self.sink.update(self.manifest, dataclasses.asdict(snapshot))
            except OSError as error:  # a full disk must not stop the run over its progress report
                logger.warning("could not write the progress to .summary.json: %s", error)
        if not self.interactive and self.meter is not None:
            logger.info("%s", snapshot.describe())
        return snapshot

    def close(self) -> None:
        """The last report of this run; the live line stays on the screen with it."""
        self.metrics.stop_holding()
        if self.stages is not None:
            self.stages.close()
        last = self.tick(force=True)
        if self.live is not None and last is not None:
            self.live.end(last.live())
            self.live = None

    def snapshot(self) -> ProgressSnapshot:
        records = self.manifest.shards
        done = [record for record in records.values() if record.state == DONE]
        in_flight = sum(self.open_tokens.values())
        now = time.monotonic()
        rate = self.meter.rate(now) if self.meter is not None else 0.0
        # Once the run has waited for disk, the last 30 s say nothing of when it ends (their rate decays to nothing
        # over a wait and climbs back after it): the run's whole pace does, the waits for its consumer included.
        pace = (self.meter.average(now) if self.waited else rate) if self.meter is not None else 0.0
        remaining = max(0, sum(self.shard_tokens[i] for i in self.to_run if i not in self.settled) - in_flight)
        eta = remaining / pace if pace > 0 else math.inf
        return ProgressSnapshot(
            updated_at=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            shards_done=len(done),
            shards_failed=sum(record.state == FAILED for record in records.values()),
            shards_total=len(records),
            samples_done=sum(record.stop - record.start for record in done),
            samples_planned=sum(record.stop - record.start for record in records.values()),
            tokens_done=sum(record.tokens for record in done) + in_flight,
            tokens_planned=sum(self.shard_tokens.values()),
            bytes_written=sum(record.bytes for record in done),
            tokens_to_go=remaining,
            tokens_per_second=round(rate, 1),
            eta_seconds=round(eta, 1) if eta <= ETA_MAX_S else (0.0 if remaining == 0 else -1.0),
            disk_used=sum(budget.used for budget in self.budgets),
            disk_budget=sum(budget.limit for budget in self.budgets),
            disk_room=sum(budget.room() for budget in self.budgets),
            waiting_for_disk=int(self.waiting),
        )


def _due(last: Optional[float], period: float, now: float) -> bool:
    return last is None or now - last >= period
