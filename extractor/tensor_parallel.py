"""Runs one CaptureEngine per tensor-parallel rank: rank 0 here, the others in spawned processes.

Every rank needs the same batch (SGLang's TP forward is collective); only
rank 0's states are copied to the host, so they never cross a process
boundary before reaching the caller. Followers get the token ids through a
queue and drop their (identical) outputs. One lock keeps forwards in the same
order on every rank while a caller may still hold the previous batch's
states. A watchdog ends this process when a follower dies, since rank 0 would
otherwise wait in a collective forever; a follower whose rank 0 died ends itself.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import multiprocessing as mp
import os
import queue
import threading
import time
from typing import Iterable, Iterator, Optional

import numpy as np

from extractor.rendezvous import LoopbackStore
from extractor.types import CaptureActivity, CapturedBatch, EngineInfo, EngineSpec, LoadStage, unreported

logger = logging.getLogger(__name__)

READY_TIMEOUT_S = 1800  # a cold 8-GPU load of a 1T-parameter checkpoint takes many minutes
WATCHDOG_PERIOD_S = 2.0
COLLECTIVE_FAILURE_GRACE_S = 1.0


def cpu_thread_binding(tp_size: int, cores: list[int]) -> str:
    """SGLANG_CPU_OMP_THREADS_BIND value: this process's cores split into one group per rank."""
    if len(cores) < tp_size:
        groups = [[cores[rank % len(cores)]] for rank in range(tp_size)]
    else:
        per_rank = len(cores) // tp_size
        groups = [cores[rank * per_rank : (rank + 1) * per_rank] for rank in range(tp_size)]
    return "|".join(",".join(str(core) for core in group) for group in groups)


def _set_rank_environment(spec: EngineSpec) -> None:
    if spec.device == "cpu":
        cores = sorted(os.sched_getaffinity(0))
        os.environ.setdefault("SGLANG_CPU_OMP_THREADS_BIND", cpu_thread_binding(spec.tp_size, cores))
    if spec.tp_size > 1:
        # With TP, SGLang torch.compiles the vocab-parallel embedding mask: 8-12 s per
        # rank on first forward for a helper that is not worth compiling.
        os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")


def _follower_main(spec: EngineSpec, tp_rank: int, nccl_port: int, inbox: mp.Queue, status: mp.Queue) -> None:
    """Entry of a spawned rank: build the engine, then mirror every batch rank 0 runs."""
    logging.basicConfig(level=logging.INFO, format=f"[tp{tp_rank}] %(levelname)s %(name)s: %(message)s")
    try:
        from extractor.engine import CaptureEngine

        engine = CaptureEngine(spec, tp_rank, nccl_port)
    except BaseException as error:  # report, then die: rank 0 turns it into an error
        status.put((tp_rank, f"{type(error).__name__}: {error}"))
        raise
    status.put((tp_rank, None))
    parent = os.getppid()
    while True:
        try:
            message = inbox.get(timeout=WATCHDOG_PERIOD_S)
        except queue.Empty:
            if os.getppid() != parent:  # rank 0's process died (SIGKILL): nobody will send or close
                return
            continue
        if message is None:
            return
        method, input_ids = message
        getattr(engine, method)(input_ids)


def wait_for_ranks(status: mp.Queue, ranks: Iterable[int], timeout_s: float) -> None:
    """Until every follower in ``ranks`` reported it built its engine; raises the first failure, or
    a TimeoutError naming the ranks still loading."""
    deadline = time.monotonic() + timeout_s
    pending = set(ranks)
    while pending:
        try:
            rank, error = status.get(timeout=max(0.0, deadline - time.monotonic()))
        except queue.Empty:
            raise TimeoutError(
                f"tensor-parallel ranks {sorted(pending)} were not ready {timeout_s:.0f} s after start: their "
                "model load is stuck or very slow. Their log lines are in the extractor actor's log (Ray "
                "dashboard, or `ray logs actor --id ...`); rerun the same command once fixed: it resumes"
            ) from None
        if error is not None:
            raise RuntimeError(f"tensor-parallel rank {rank} failed to start: {error}")
        pending.discard(rank)


class ActivityClock:
    """Time covered by at least one batch between its forward's start and its states on the host, and the
    process's CPU time from the end of the first batch to the end of the last."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._busy_until = 0.0
        self._first_cpu: Optional[float] = None
        self._value = CaptureActivity(batches=0, tokens=0, busy_seconds=0.0)

    def record(self, started: float, ended: float, tokens: int) -> None:
        cpu = time.process_time()
        with self._lock:
            value = self._value
            busy = max(0.0, ended - max(started, self._busy_until))
            self._busy_until = max(self._busy_until, ended)
            self._first_cpu = cpu if self._first_cpu is None else self._first_cpu
            self._value = dataclasses.replace(
                value, batches=value.batches + 1, tokens=value.tokens + tokens, busy_seconds=value.busy_seconds + busy,
                process_cpu_seconds=cpu - self._first_cpu,
            )

    def snapshot(self, stage_seconds: dict[str, dict[str, float]]) -> CaptureActivity:
        with self._lock:
            return dataclasses.replace(self._value, stage_seconds=stage_seconds)


class TensorParallelEngine:
    """The whole TP group behind one ``capture`` call; owned by the extractor actor."""

    def __init__(self, spec: EngineSpec, stage: LoadStage = unreported) -> None:
        """``stage``: told what rank 0's load does now."""
        _set_rank_environment(spec)
        self._store = LoopbackStore(spec.tp_size)  # before the followers spawn: they inherit where it is
        nccl_port = self._store.port
        context = mp.get_context("spawn")
        self._status: mp.Queue = context.Queue()
        self._inboxes: list[mp.Queue] = []
        self._followers: list[mp.Process] = []
        for rank in range(1, spec.tp_size):
            inbox = context.Queue()
            process = context.Process(
                target=_follower_main,
                args=(spec, rank, nccl_port, inbox, self._status),
                name=f"extractor-tp{rank}",
                daemon=True,
            )
            process.start()
            self._inboxes.append(inbox)
            self._followers.append(process)
        self._closing = False
        self._forward_lock = threading.Lock()
        self._activity = ActivityClock()
        if self._followers:
            threading.Thread(target=self._watch_followers, name="tp-watchdog", daemon=True).start()

        from extractor.engine import CaptureEngine

        self._engine = CaptureEngine(spec, 0, nccl_port, stage)
        if self._followers:
            stage(f"waiting for TP ranks 1-{len(self._followers)}")
        self._wait_for_followers()

    @property
    def info(self) -> EngineInfo:
        return self._engine.info

    @property
    def max_batch_bytes(self) -> int:
        return self._engine.max_batch_bytes

    def _wait_for_followers(self) -> None:
        wait_for_ranks(self._status, range(1, len(self._followers) + 1), READY_TIMEOUT_S)

    def _watch_followers(self) -> None:
        while not self._closing:
            self._end_if_a_rank_died(grace_s=0.0)
            time.sleep(WATCHDOG_PERIOD_S)

    def _end_if_a_rank_died(self, grace_s: float) -> None:
        """End this process (the extractor actor) when a follower is gone: rank 0 cannot go on without
        it, and the job starts a new extractor. A failed collective waits ``grace_s`` for the
        follower's death to show."""
        for rank, process in enumerate(self._followers, start=1):
            process.join(timeout=grace_s)
            if not process.is_alive() and not self._closing:
                logger.error(
                    "tensor-parallel rank %d exited with code %s; ending the extractor "
                    "(rank 0 cannot run a forward without it)", rank, process.exitcode
                )
                logging.shutdown()
                os._exit(1)

    def _broadcast(self, method: str, input_ids: list[np.ndarray]) -> None:
        for inbox in self._inboxes:
            inbox.put((method, input_ids))

    @contextlib.contextmanager
    def capture(self, input_ids: list[np.ndarray]) -> Iterator[CapturedBatch]:
        """States of one batch, views of a host buffer that is reused once the block ends.

        Safe to call from several threads: while one caller hands its batch on,
        the next batch's forward runs; the batch's requests are built before its turn.
        """
        reqs = self._engine.requests(input_ids)
        with self._engine.forward_turn(), self._forward_lock:
            started = time.perf_counter()
            self._broadcast("capture_forward", input_ids)
            try:
                pending = self._engine.start_capture(input_ids, reqs)
            except BaseException:
                # On CPU a dead rank fails the collective at once (connection reset): that is the
                # fault the watchdog handles, not an error of this batch.
                self._end_if_a_rank_died(grace_s=COLLECTIVE_FAILURE_GRACE_S)
                raise
        with pending as batch:
            self._activity.record(started, time.perf_counter(), int(batch.lengths.sum()))
            yield batch

    def activity(self) -> CaptureActivity:
        return self._activity.snapshot(self._engine.times.snapshot())

    def fp8_relative_errors(self, input_ids: list[np.ndarray]) -> list[float]:
        """Benchmark: fp8 round-trip error per captured layer (then the final state), on rank 0's device."""
        with self._forward_lock:
            self._broadcast("capture_forward", input_ids)
            return self._engine.fp8_relative_errors(input_ids)

    def bare_prefill(self, input_ids: list[np.ndarray]) -> float:
        """Seconds of the same forward without capture (benchmark baseline)."""
        with self._forward_lock:
            self._broadcast("bare_prefill", input_ids)
            return self._engine.bare_prefill(input_ids)

    def close(self) -> None:
        with self._forward_lock:
            self._closing = True
            for inbox in self._inboxes:
                inbox.put(None)
        for process in self._followers:
            process.join(timeout=30)
            if process.is_alive():
                process.kill()
        self._store.close()
