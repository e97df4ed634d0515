"""What the driver reports while it runs: Ray metrics (dashboard / --metrics-export-port) and progress bars.

Every update goes through one named method, so that the rest of the driver
never touches a gauge, a counter or a bar itself.
"""

from __future__ import annotations

from ray.experimental.tqdm_ray import tqdm
from ray.util import metrics


class RunMetrics:
    def __init__(self, shards: int, tokens: int, disk_budget: int) -> None:
        self._disk_used = metrics.Gauge("eagle3_disk_used_bytes", description="Committed local shard bytes + reservations")
        self._disk_budget = metrics.Gauge("eagle3_disk_budget_bytes", description="output.disk_budget")
        self._waiting = metrics.Gauge("eagle3_waiting_for_disk", description="1 while the driver waits for disk budget")
        self._wait_seconds = metrics.Counter("eagle3_disk_wait_seconds_total", description="Time spent waiting for disk budget")
        self._tokens = metrics.Counter("eagle3_tokens_written_total", description="Tokens whose states were written")
        self._disk_budget.set(disk_budget)
        self._shard_bar = tqdm(total=shards, desc="shards")
        self._token_bar = tqdm(total=tokens, desc="tokens")

    def disk_used(self, nbytes: int) -> None:
        self._disk_used.set(nbytes)

    def waiting(self, waiting: bool) -> None:
        self._waiting.set(1 if waiting else 0)

    def waited(self, seconds: float) -> None:
        if seconds > 0:  # Ray counters refuse increments of 0
            self._wait_seconds.inc(seconds)

    def tokens_written(self, tokens: int) -> None:
        self._token_bar.update(tokens)
        if tokens:
            self._tokens.inc(tokens)

    def shard_done(self) -> None:
        self._shard_bar.update(1)

    def shard_failed(self) -> None:
        self._shard_bar.update(1)

    def close(self) -> None:
        self._shard_bar.close()
        self._token_bar.close()
