"""Which cores a node's writer actors run on: off the cores the extractors' threads need.

A GPU forward of a mixture-of-experts model is bound by its CPU thread launching kernels; when
writers (Parquet encoding, writes, checksums: 1-2 CPU seconds per GB of states) run on the
core that thread is on, the forward slows. With ``output.writer_cpus=auto`` and CUDA
extractors, every writer process is pinned to the node's cores past the first
``reserved_cores`` (``ENGINE_CORES_PER_GPU`` per GPU of the node's extractors, plus
``NODE_CORES`` for the driver and Ray's own processes) and their hyperthread siblings (two
threads of one physical core share its execution units) and runs at a lower priority
(``WRITER_NICENESS``). The extractors are not pinned: their threads (the forward, the
object-store puts with Ray's copy threads, Ray's own) go to idle cores, which the reserved
ones stay. A node with fewer than ``MIN_WRITER_CORES`` cores beyond the reserve is not
pinned (the priority still applies); on CPU the engine's own threads take every core
(SGLang binds them), so nothing is changed there.
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

from jobs.outdir.config import AUTO, parse_cpu_list

ENGINE_CORES_PER_GPU = 2
"""Per GPU of an extractor: its rank's forward thread, and room for its CUDA, NCCL and Ray threads."""
NODE_CORES = 2
"""Per node: the driver (on the head) and Ray's raylet and GCS."""
MIN_WRITER_CORES = 4
WRITER_NICENESS = 5
"""Writers yield a contended core to the engine's threads (and never starve: nice 5 still gets ~30% of a core)."""


@dataclasses.dataclass(frozen=True)
class WriterCpus:
    """What a node's writers are told (picklable): ``output.writer_cpus`` and the cores its extractors keep."""

    setting: str
    """auto | all | a core list such as 4-15 or 2,3,8-11 (``output.writer_cpus``)."""
    reserved_cores: int
    """auto: the first this many cores of the node are left to the extractors, the driver and Ray (0: no pinning)."""


def writer_cpus(setting: str, gpus_on_node: int) -> WriterCpus:
    """The writers' placement for a node whose extractors hold ``gpus_on_node`` GPUs (0 on CPU)."""
    reserved = ENGINE_CORES_PER_GPU * gpus_on_node + NODE_CORES if gpus_on_node else 0
    return WriterCpus(setting, reserved)


def place_this_process(cpus: WriterCpus) -> str:
    """Pin every thread of this process (and so the threads it starts later) as ``cpus`` says, and lower its
    priority under ``auto``; returns what was done, for the run's summary. ValueError for a core list that
    names cores this process may not use."""
    available = sorted(os.sched_getaffinity(0))
    if cpus.setting == "all" or (cpus.setting == AUTO and not cpus.reserved_cores):
        return "all cores"
    if cpus.setting == AUTO:
        _for_every_thread(lambda tid: os.setpriority(os.PRIO_PROCESS, tid, WRITER_NICENESS))
        reserved = {sibling for cpu in available[:cpus.reserved_cores] for sibling in thread_siblings(cpu)}
        cores = [cpu for cpu in available if cpu not in reserved]
        if len(cores) < MIN_WRITER_CORES:
            return f"all cores, nice {WRITER_NICENESS} ({len(available)} cores: too few to keep some for the extractors)"
        priority = f", nice {WRITER_NICENESS}"
    else:
        cores = parse_cpu_list(cpus.setting, "output.writer_cpus")
        missing = sorted(set(cores) - set(available))
        if missing:
            raise ValueError(f"output.writer_cpus={cpus.setting}: cores {format_cores(missing)} are not among the "
                             f"cores {format_cores(available)} this node lets the writers use; name cores of those")
        priority = ""
    _for_every_thread(lambda tid: os.sched_setaffinity(tid, cores))
    return f"cores {format_cores(cores)}{priority}"


def thread_siblings(cpu: int) -> list[int]:
    """The logical CPUs of ``cpu``'s physical core (itself too), as Linux lists them; just ``cpu`` where it does not."""
    try:
        listed = (Path("/sys/devices/system/cpu") / f"cpu{cpu}" / "topology" / "thread_siblings_list").read_text()
        return parse_cpu_list(listed.strip(), "thread_siblings_list")
    except (OSError, ValueError):
        return [cpu]


def _for_every_thread(action) -> None:
    """Linux keeps a thread's affinity and priority per thread (new threads inherit the creator's): every thread
    this process runs now, Ray's own included."""
    for tid in os.listdir("/proc/self/task"):
        try:
            action(int(tid))
        except ProcessLookupError:  # the thread ended meanwhile
            pass


def format_cores(cores: list[int]) -> str:
    """[4, 5, 6, 7, 9] -> "4-7,9"."""
    ranges: list[list[int]] = []
    for core in sorted(cores):
        if ranges and core == ranges[-1][1] + 1:
            ranges[-1][1] = core
        else:
            ranges.append([core, core])
    return ",".join(f"{a}-{b}" if b > a else f"{a}" for a, b in ranges)
