"""How one run ends: the one owner of its outcome, its exit code and the summary that records them.

Every way a run ends goes through ``RunEnd``: every shard settled (complete, shards failed, uploads failed,
shards left unsettled: a fault), an error while it runs (a fault, a full disk, an input that changed: bad input),
a signal or the cluster lost (also while Ray starts or the nodes' directories are looked at, before the run's
summary started), and a rerun with nothing to do (``nothing_to_do``, before Ray). Each end is decided in one
place, from the error that ended the run or from the manifest, and written into ``.summary.json`` whole (a second
signal waits). A run that stops early is recorded at once (``ray job stop`` sends SIGKILL within seconds of its
SIGTERM) and again once its wind-down has recorded what it settled; a refusal before the run's summary started
(another run's directory, say) leaves the summary as it was.
"""

from __future__ import annotations

import contextlib
import logging
from pathlib import Path
from typing import Any, Iterator, NamedTuple

from jobs.rundir.resume import shard_list
from jobs.rundir.summary import (
    BAD_INPUT,
    COMPLETE,
    NOTHING_TO_DO,
    SHARDS_FAILED,
    UPLOADS_FAILED,
    RunSummary,
    manifest_totals,
)
from runtime.errors import (
    EXIT_BAD_INPUT,
    EXIT_FAULT,
    EXIT_NOT_PASSED,
    EXIT_OK,
    EXIT_UPLOADS_FAILED,
    RERUN,
    ClusterLost,
    DiskFull,
    JobFault,
    JobInterrupted,
    JobStopped,
    disk_full_stop,
    is_disk_full,
    stop_in,
)
from runtime.interrupts import signals_deferred
from storage.manifest import DONE, FAILED, LOCAL, Manifest

logger = logging.getLogger("jobs.extract")


class Ending(NamedTuple):
    """How a run ended, as its summary and its exit status say it."""

    outcome: str
    exit_code: int
    message: str


def nothing_to_do(output_dir: Path, manifest: Manifest) -> dict[str, Any]:
    """The end of a rerun that finds every shard done (and uploaded, with a sink): Ray is not started, and the
    summary of the run that did the work stays."""
    return {"outcome": NOTHING_TO_DO, "output_dir": str(output_dir), **manifest_totals(manifest)}


def disk_full(output_dir: Path, error: BaseException) -> DiskFull:
    """The stop a full disk under output.dir stands for (exit 3, not a fault), with what to do."""
    return disk_full_stop(
        f"output.dir={output_dir}", error,
        kept=". What is done stays done: the manifest keeps every change it recorded and no temp file is left",
        free="Free space there (or set output.sink, or lower output.disk_budget below the space the disk has)",
    )


class RunEnd:
    """The end of one run: which it is, and its summary, recorded against the manifest the run has got to."""

    def __init__(self, summary: RunSummary, manifest: Manifest, output_dir: Path, sink: str) -> None:
        """``manifest``: what output.dir holds before this run opens its own (``track`` hands that one over)."""
        self.summary = summary
        """The run's ``.summary.json``; the progress reports write into it while the run goes on."""
        self._manifest = manifest
        self._output_dir = output_dir
        self._sink = sink

    def track(self, manifest: Manifest) -> None:
        """The run's own manifest, once open: every end from here on is recorded against it."""
        self._manifest = manifest

    def start(self, to_run: list[int]) -> None:
        """The run starts with the shards it extracts: its running summary, and room set aside for its end."""
        self.summary.select(to_run)
        self.summary.start(self._manifest)

    def include(self, shards: tuple[int, ...]) -> None:
        """Shards this run wrote beyond those it set out to (done files lost meanwhile): its end counts them."""
        self.summary.include(shards)

    @contextlib.contextmanager
    def stops_recorded(self) -> Iterator[None]:
        """Around what comes before the run's summary starts (Ray starting, the looks at every node's directory):
        a signal or the cluster lost there ends the run as interrupted or cluster_lost all the same; any other
        error (a refusal) leaves the summary as it was. Already recorded ends stay as they are."""
        try:
            yield
        except BaseException as error:
            stop = stop_in(error)
            if not self.summary.ended and isinstance(stop, (JobInterrupted, ClusterLost)):
                self._record(Ending(stop.outcome, stop.exit_code, str(stop)))
            raise

    @contextlib.contextmanager
    def ends_recorded(self) -> Iterator[None]:
        """Around the run once its summary started: any error ends it, recorded as the end it stands for and
        raised as that stop (a signal seen through a Ray call, or a full disk, carries its own exit code)."""
        try:
            yield
        except BaseException as error:
            stop = self._as_stop(error)
            self._record(self._ending(stop))
            if stop is not error:
                raise stop from None
            raise

    def judge(self, ran: list[int]) -> Ending:
        """The end of a run whose loop settled every shard: exit 0 only when every shard this run was to write
        (``ran``) is done (and, with a sink, uploaded). Shards left neither done nor failed raise ``JobFault``."""
        records = [self._manifest.shards[index] for index in ran]
        unsettled = [r.index for r in records if r.state not in (DONE, FAILED)]
        if unsettled:  # the driver's loop ended with shards neither written nor failed: never call that complete
            raise JobFault(f"shards {shard_list(unsettled)} were to be written by this run but are neither done nor "
                           f"failed. {RERUN}")
        failed = [r.index for r in records if r.state == FAILED]
        if failed:
            return Ending(SHARDS_FAILED, EXIT_NOT_PASSED, (
                f"{len(failed)} of {len(records)} shards failed and wrote no file ({shard_list(failed)}); rerun them "
                "with the same command plus shards=failed"))
        local = [r.index for r in self._manifest.in_state(DONE) if self._sink and r.location == LOCAL]
        if local:
            return Ending(UPLOADS_FAILED, EXIT_UPLOADS_FAILED, (
                f"{len(local)} shards are written but not in {self._sink}: {shard_list(local)} (kept locally; the last "
                "error of each is in the manifest). Fix the sink, then rerun the same command: it uploads them"))
        return Ending(COMPLETE, EXIT_OK, "")

    def finish(self, ending: Ending, result: Any) -> dict[str, Any]:
        """Write and return the summary of a run that ran to its end, with what it measured (``RunResult``)."""
        return self.summary.finish(self._manifest, *ending, result)

    def _as_stop(self, error: BaseException) -> BaseException:
        """The stop ``error`` stands for: the ``JobInterrupted`` or ``ClusterLost`` behind it, ``DiskFull`` for a
        full disk, else itself."""
        stop = stop_in(error)
        if stop is error and is_disk_full(error):
            return disk_full(self._output_dir, error)
        return stop

    @staticmethod
    def _ending(stop: BaseException) -> Ending:
        """How a run that ``stop`` ended (``_as_stop``'s answer) ended."""
        if isinstance(stop, JobStopped):
            return Ending(stop.outcome, stop.exit_code, str(stop))
        if isinstance(stop, ValueError):  # an input file that changed under the running job: fix it, not a fault
            return Ending(BAD_INPUT, EXIT_BAD_INPUT, str(stop))
        return Ending(JobFault.outcome, EXIT_FAULT, f"{type(stop).__name__}: {stop}")

    def _record(self, ending: Ending) -> None:
        """The summary of a run that ended early, written whole (a second signal waits); failing to write it
        must not hide why the run ended."""
        try:
            with signals_deferred(reraise=False):
                self.summary.finish(self._manifest, *ending)
        except OSError as error:
            logger.error("could not write %s (outcome %s, exit code %d): %s", self.summary.path, ending.outcome,
                         ending.exit_code, error)
