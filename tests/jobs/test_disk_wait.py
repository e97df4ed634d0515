"""The wait for disk budget stops the run only after ``output.budget_wait_s`` in which nothing freed space.

A real ``DiskBudget`` over a temp dir, the real ``DiskWait``; the clock is the test's (``idle`` sleeps one rescan
at a time), so that a trainer slower than the wait can be played in no time.
"""

from __future__ import annotations

import types

import pytest

from jobs.driver.disk_wait import DiskWait
from jobs.outdir.budget import DiskBudget
from runtime.errors import BudgetExhausted

WAIT_S = 10.0
REFRESH_S = 2.0
SHARD = 30_000


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def sleep(self, seconds: float) -> None:
        self.now += seconds


@pytest.fixture
def clock(monkeypatch) -> Clock:
    clock = Clock()
    monkeypatch.setattr("jobs.driver.disk_wait.time.monotonic", lambda: clock.now)
    monkeypatch.setattr("jobs.driver.disk_wait.time.sleep", clock.sleep)
    return clock


def full_lane(directory) -> types.SimpleNamespace:
    """A lane whose budget holds three shards' reservations of the 100 KB it has: a shard of 50 KB fits nowhere."""
    directory.mkdir(parents=True, exist_ok=True)
    budget = DiskBudget(directory, 100_000, 0)
    for shard in range(3):
        budget.reserve(shard, SHARD)
    return types.SimpleNamespace(budget=budget)


class Progress:
    """What the wait tells the run's progress: the seconds it has counted in the metrics."""

    refresh_s = REFRESH_S

    def __init__(self) -> None:
        self.counted = 0.0

    def disk_wait_started(self) -> None:
        pass

    def disk_waited(self, seconds: float) -> None:
        self.counted += seconds

    def disk_wait_ended(self, seconds: float) -> None:
        self.disk_waited(seconds)


def waiting(lane: types.SimpleNamespace, rescan_s: float = 1.0, wait_s: float = WAIT_S,
            progress: Progress | None = None) -> DiskWait:
    wait = DiskWait(wait_s, rescan_s, progress or Progress(), lambda lane, state: f"stopped: {state}")
    wait.update((lane, 50_000), lane.budget.used)
    return wait


def idle_for(wait: DiskWait, lane: types.SimpleNamespace, seconds: float, clock: Clock,
             others: tuple[types.SimpleNamespace, ...] = ()) -> None:
    """The driver's loop while nothing is in flight: a look at every budget, then a rescan's sleep."""
    end = clock.now + seconds
    while clock.now < end:
        wait.update((lane, 50_000), sum(each.budget.used for each in (lane, *others)))
        wait.idle()


def test_nothing_freed_stops_after_the_wait(tmp_path, clock):
    lane = full_lane(tmp_path)
    wait = waiting(lane)
    idle_for(wait, lane, WAIT_S - 1, clock)
    with pytest.raises(BudgetExhausted, match="stopped: used 90.0 KB"):
        idle_for(wait, lane, 2, clock)
    assert clock.now == WAIT_S


def test_space_freed_that_is_still_too_little_restarts_the_wait(tmp_path, clock):
    """A trainer took a shard smaller than the next one needs: the run keeps waiting for it, a whole
    ``budget_wait_s`` from that moment, not from the wait's start."""
    lane = full_lane(tmp_path)
    wait = waiting(lane)
    idle_for(wait, lane, WAIT_S - 2, clock)
    lane.budget.release(0)  # 40 KB free, 50 KB needed
    idle_for(wait, lane, WAIT_S - 2, clock)
    assert wait.waiting
    with pytest.raises(BudgetExhausted):
        idle_for(wait, lane, 3, clock)
    assert clock.now == (WAIT_S - 2) + WAIT_S


def test_space_freed_on_another_node_restarts_the_wait(tmp_path, clock):
    """Two nodes, both full; the shard that fits nowhere is reported on the first. A trainer on the second takes
    a shard, too little for the next: the run keeps waiting for it, as for one on the first node."""
    lane, other = full_lane(tmp_path / "a"), full_lane(tmp_path / "b")
    wait = waiting(lane)
    idle_for(wait, lane, WAIT_S - 2, clock, others=(other,))
    other.budget.release(0)
    idle_for(wait, lane, WAIT_S - 2, clock, others=(other,))
    with pytest.raises(BudgetExhausted):
        idle_for(wait, lane, 3, clock, others=(other,))
    assert clock.now == (WAIT_S - 2) + WAIT_S


def test_a_rare_rescan_still_turns_the_loop_every_refresh(tmp_path, clock):
    """output.rescan_s=60: the idle turn still comes every progress refresh, which sets the metrics (Ray drops a
    gauge left unset for 20-30 s: the dashboard would lose the run while it waits)."""
    lane = full_lane(tmp_path)
    wait = waiting(lane, rescan_s=60.0)
    wait.idle()
    assert clock.now == REFRESH_S


def test_the_metrics_count_a_long_wait_while_it_lasts(tmp_path, clock):
    """ray_eagle3_disk_wait_seconds_total rises through a wait of hours (every 30 s), not only at its end; a wait
    still open when the run ends counts too."""
    lane = full_lane(tmp_path)
    progress = Progress()
    wait = waiting(lane, wait_s=7200, progress=progress)
    idle_for(wait, lane, 3600, clock)
    assert progress.counted >= 3600 - 30
    wait.close()
    assert progress.counted == 3600
