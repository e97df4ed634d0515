"""A soak at the full size (1.29 TB): one job writes --target-bytes of states through a disk budget that a trainer
drains, its driver is killed (SIGKILL) in the middle, and the same command resumes it on another Ray cluster
whose node has another name.

In order, on one machine: (a) bare prefill and the states of a few shards from an uninterrupted run (the
reference), on one warm extractor, on a Ray head whose node is labelled ``soak-a``; consumers start
(``benchmarks.soak_consumer``: read and check every sample, declare the file consumed, delete it); the job
(``python -m jobs.extract``) runs on that head until --kill-at of the samples are consumed, then its driver
is killed; that head is stopped and another started, labelled ``soak-b``; the same command runs to the end.
Meanwhile output.dir's bytes are sampled every second and every process's memory every few seconds. Then:
every sample consumed exactly once, the reference shards' states bit-identical, the budget's peak, the
throughput against (a), each process's memory over the run, the manifest's and journal's sizes.

    python -m benchmarks.soak --shape tiny --device cpu --target-bytes 30MB --budget 4MB      # CI smoke test
    python -m benchmarks.soak --shape deepseek_v3_reduced --device cuda --output-root /dev/shm --budget 32GB

docs/benchmarks.md says what each figure means and how to run it on a GPU machine.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import logging
import math
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, Optional

import numpy as np
import psutil
import pyarrow as pa
import pyarrow.parquet as pq

from benchmarks.soak_consumer import sample_digests
from benchmarks.throughput import (
    WarmExtractor,
    benchmark_job_args,
    build_model,
    gpu_memory_bytes,
    jobs_on,
    measure_extractor,
    refuse_shape_too_large,
)
from benchmarks.workdir import work_dir, write_results
from common.checks import format_bytes, parse_bytes
from extractor.checkpoint import read_checkpoint_info
from jobs.cluster.nodes import NODE_LABEL
from jobs.config import JobConfig, load_config
from jobs.driver.job import run
from jobs.rundir.summary import SUMMARY_FILE
from runtime.cluster.session import ray_session
from storage.consumed import RECORD_GLOB
from storage.manifest import MANIFEST_FILE, MANIFEST_JOURNAL_FILE
from testbeds.shapes import SHAPES

logger = logging.getLogger("benchmarks.soak")

MISSION_BYTES = 1_290_000_000_000
"""The target run's states: ~15K samples of ~2K tokens, 3 layers of 7,168 in bf16."""
BASELINE_TOKENS_ON_CUDA = 2_000_000
LABELS = ("soak-a", "soak-b")
"""The node's name in the first and the second cluster: the relabel the resume must survive."""
BUDGET_SAMPLE_S = 1.0
MEMORY_SAMPLE_S = 5.0
"""How often every process's memory is read by default (--memory-sample-s): a process sampled fewer than three
times has no row."""
PROGRESS_LOG_S = 30.0
MEMORY_WARMUP = 0.25
"""A process's memory is compared from this fraction of its life on: its start-up (a model's load, the
extractor's pinned host buffers, about 30 s of a 4-minute run on the H200) is not growth."""
MEMORY_SERIES_POINTS = 40
HEAD_START_ATTEMPTS = 3
"""A loaded machine can miss Ray's fixed 30 s for its raylet to register."""
RAY_CLI = "from ray.scripts.scripts import main; main()"


@dataclasses.dataclass
class Phase:
    """One run of the job's command: on which node name, from when to when, how it ended."""

    label: str
    started: float
    ended: float = 0.0
    exit_code: Optional[int] = None
    killed: bool = False


class RayHead:
    """A Ray head of its own (``ray start --head``) on 127.0.0.1, its node labelled ``label``, with its own temp
    dir; ``stop`` ends only its processes (``ray stop`` would end every Ray cluster of the machine)."""

    def __init__(self, label: str, num_cpus: int) -> None:
        self.label = label
        self.temp_dir = Path(tempfile.mkdtemp(prefix="soak-", dir="/tmp"))  # short: Ray's socket paths live under it
        self.port = free_port()
        command = [
            sys.executable, "-c", RAY_CLI, "start", "--head", "--node-ip-address=127.0.0.1", f"--port={self.port}",
            "--include-dashboard=false", f"--temp-dir={self.temp_dir}", "--disable-usage-stats",
            f"--labels={json.dumps({NODE_LABEL: label})}", f"--ray-client-server-port={free_port()}",
            f"--metrics-export-port={free_port()}", f"--dashboard-agent-listen-port={free_port()}",
            *([f"--num-cpus={num_cpus}"] if num_cpus else []),
        ]
        env = {**os.environ, "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}
        env.pop("RAY_ADDRESS", None)
        for attempt in range(1, HEAD_START_ATTEMPTS + 1):
            started = subprocess.run(command, env=env, capture_output=True, text=True, timeout=180)
            if started.returncode == 0:
                break
            self.stop(keep_temp_dir=True)
            if attempt == HEAD_START_ATTEMPTS:
                raise RuntimeError(f"ray start --head failed: {started.stdout[-2000:]}{started.stderr[-2000:]}")
            logger.warning("ray start --head failed (attempt %d; Ray waits 30 s for its raylet): again", attempt)
        self.address = f"127.0.0.1:{self.port}"
        logger.info("Ray head %s, its node labelled %s=%s", self.address, NODE_LABEL, label)

    def processes(self) -> list[psutil.Process]:
        """This head's processes (those naming its temp dir) and all their descendants (workers, actors)."""
        found: dict[int, psutil.Process] = {}
        for process in psutil.process_iter(["cmdline"]):
            if str(self.temp_dir) in " ".join(process.info["cmdline"] or []):
                found[process.pid] = process
                with contextlib.suppress(psutil.Error):
                    found.update({child.pid: child for child in process.children(recursive=True)})
        return list(found.values())

    def stop(self, keep_temp_dir: bool = False) -> None:
        processes = self.processes()
        for process in processes:
            with contextlib.suppress(psutil.Error):
                process.terminate()
        _, alive = psutil.wait_procs(processes, timeout=20)
        for process in alive:
            with contextlib.suppress(psutil.Error):
                process.kill()
        if not keep_temp_dir:
            shutil.rmtree(self.temp_dir, ignore_errors=True)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class Sampler(threading.Thread):
    """Calls ``sample`` every ``period_s`` seconds until stopped (and once more then)."""

    def __init__(self, period_s: float, sample: Any) -> None:
        super().__init__(daemon=True)
        self.period_s, self.sample = period_s, sample
        self.stopping = threading.Event()

    def run(self) -> None:
        while not self.stopping.wait(self.period_s):
            self.sample()
        self.sample()

    def stop(self) -> None:
        self.stopping.set()
        self.join()


class DirectoryBytes:
    """output.dir's bytes, everything in it (shards, temp files, the manifest, journal, summary, records)."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self.samples = 0
        self.peak = 0
        self.peak_shards = 0
        """Of the peak's sample: the shard files' and temp files' bytes alone."""

    def sample(self) -> None:
        total = shards = 0
        for root, _, files in os.walk(self.directory):
            for name in files:
                with contextlib.suppress(FileNotFoundError):
                    size = os.lstat(os.path.join(root, name)).st_size
                    total += size
                    shards += size if name.startswith(("shard-", ".shard-")) and not name.endswith(".consumed") else 0
        self.samples += 1
        if total > self.peak:
            self.peak, self.peak_shards = total, shards


class ProcessMemory:
    """Every process of the soak's (its consumers, the job's driver) and of each Ray head (GCS, raylet, the
    extractor, writers): resident memory over time, by pid."""

    def __init__(self, heads: list[RayHead]) -> None:
        self.heads = heads
        self.series: dict[int, dict[str, Any]] = {}

    def sample(self) -> None:
        now = time.time()
        processes = psutil.Process().children(recursive=True)
        for head in list(self.heads):
            processes += head.processes()
        for process in {p.pid: p for p in processes}.values():
            try:
                memory = process.memory_info()
                name = process_name(process)
            except psutil.Error:
                continue
            entry = self.series.setdefault(process.pid, {"name": name, "samples": []})
            entry["samples"].append((now, memory.rss, memory.rss - memory.shared))
            if name.startswith("ray::"):  # a worker takes its actor's title once the actor is placed
                entry["name"] = name

    def report(self) -> list[dict[str, Any]]:
        """Per process (MB): RSS and its private part (RSS less pages shared with other processes: the object
        store's, libraries) once started up, at its last sample, at their peaks; the private part's growth
        between; and the whole series, thinned to at most ``MEMORY_SERIES_POINTS`` points."""
        rows = []
        for pid, entry in self.series.items():
            samples = entry["samples"]
            if len(samples) < 3:
                continue
            start, end = samples[0][0], samples[-1][0]
            _, rss, private = next(s for s in samples if s[0] >= start + MEMORY_WARMUP * (end - start))
            _, last_rss, last_private = samples[-1]
            step = max(1, len(samples) // MEMORY_SERIES_POINTS)
            rows.append({
                "name": entry["name"], "pid": pid, "seconds": round(end - start), "samples": len(samples),
                "rss_mb_after_startup": round(rss / 1e6), "rss_mb_last": round(last_rss / 1e6),
                "rss_mb_peak": round(max(s[1] for s in samples) / 1e6),
                "private_mb_after_startup": round(private / 1e6), "private_mb_last": round(last_private / 1e6),
                "private_mb_peak": round(max(s[2] for s in samples) / 1e6),
                "private_growth_mb": round((last_private - private) / 1e6),
                "series_s_rss_private_mb": [(round(at - start), round(r / 1e6), round(p / 1e6))
                                            for at, r, p in samples[::step]],
            })
        return sorted(rows, key=lambda row: -row["rss_mb_peak"])


def process_name(process: psutil.Process) -> str:
    """A process's role: a Ray worker's title (``ray::ExtractorActor``), else its program and module."""
    cmdline = process.cmdline()
    if cmdline and cmdline[0].startswith("ray::"):
        return cmdline[0].split(".")[0].split()[0]
    if "-m" in cmdline:
        return f"python -m {cmdline[cmdline.index('-m') + 1]}"
    return os.path.basename(cmdline[0]) if cmdline else process.name()


def write_dataset(path: Path, samples: int, tokens: int, vocab_size: int) -> Path:
    """``samples`` rows of ``tokens`` random ids each (a loss mask on the second half), written in one go."""
    rng = np.random.default_rng(0)
    offsets = np.arange(samples + 1, dtype=np.int64) * tokens
    lists = pa.LargeListArray.from_arrays if offsets[-1] >= 2**31 else pa.ListArray.from_arrays
    ids = rng.integers(0, vocab_size, samples * tokens, dtype=np.int32)
    mask = np.tile(np.repeat(np.array([0, 1], np.uint8), [tokens // 2, tokens - tokens // 2]), samples)
    pq.write_table(pa.table({"input_ids": lists(offsets, ids), "loss_mask": lists(offsets, mask)}), path)
    return path


def state_bytes_per_token(config: JobConfig, hidden_size: int) -> int:
    """States stored per token: the captured layers and the final state, at the stored dtype's width."""
    extract, output = config.extract, config.output
    states = len(extract.layers) + (extract.last_hidden_state != "none")
    return states * hidden_size * (1 if "float8" in output.state_dtype else 2)


def reference_shards(shard_count: int, picks: int) -> list[int]:
    """Shards spread over the plan (the first, the last, between): written before the kill, around it, after."""
    return sorted({round(i * (shard_count - 1) / max(picks - 1, 1)) for i in range(picks)})


def measure_reference(address: str, job_args: list[str], data: Path, baseline_samples: int, shards: list[int],
                      directory: Path) -> tuple[dict, dict[int, str]]:
    """(a) and (a2) on ``baseline_samples`` samples, then ``shards`` extracted by an uninterrupted run of the same
    plan into ``directory``, all on one warm extractor; (a)'s results and the reference digest of each sample."""
    warm = WarmExtractor()
    with ray_session(address):
        try:
            baseline = measure_extractor(warm, job_args, data, baseline_samples, False)
            with jobs_on(warm):
                run(load_config([*job_args, f"output.dir={directory}", f"shards={shards}"]))
        finally:
            warm.close()
    digests: dict[int, str] = {}
    for path in sorted(directory.glob("shard-*.parquet")):
        ids, sample_digest, _ = sample_digests(path)
        digests.update(zip(ids, sample_digest))
    return baseline, digests


class Consumers:
    """``count`` trainer processes (``benchmarks.soak_consumer``) draining output.dir, each with its ledger."""

    def __init__(self, count: int, output_dir: Path, work: Path, shard_size: int, samples: int,
                 pause_s: float = 0.0) -> None:
        self.stop_file = work / "consumers.stop"
        self.ledgers = [work / f"ledger-{i}.jsonl" for i in range(count)]
        self.processes = [
            subprocess.Popen([sys.executable, "-m", "benchmarks.soak_consumer", "--dir", str(output_dir),
                              "--ledger", str(ledger), "--stop", str(self.stop_file), "--shard-size", str(shard_size),
                              "--samples", str(samples), "--index", str(i), "--of", str(count),
                              "--pause-s", str(pause_s)],
                             stderr=open(work / f"consumer-{i}.log", "w"))
            for i, ledger in enumerate(self.ledgers)
        ]

    def entries(self) -> list[dict]:
        entries = []
        for ledger in self.ledgers:
            if ledger.exists():
                entries += [json.loads(line) for line in ledger.read_text().splitlines() if line.endswith("}")]
        return entries

    def failed(self) -> Optional[str]:
        for i, process in enumerate(self.processes):
            if process.poll() not in (None, 0):
                return f"consumer {i} exited {process.returncode}: see consumer-{i}.log"
        return None

    def finish(self, timeout_s: float) -> None:
        self.stop_file.touch()
        for process in self.processes:
            process.wait(timeout=timeout_s)

    def kill(self) -> None:
        for process in self.processes:
            if process.poll() is None:
                process.kill()


def consumed_samples(entries: list[dict]) -> int:
    return sum(entry.get("count", 0) for entry in entries)


def run_phase(command: list[str], address: str, label: str, log: Path, consumers: Consumers,
              kill_at_samples: Optional[int]) -> Phase:
    """The job's command on the cluster at ``address``; with ``kill_at_samples``, its driver is SIGKILLed once
    the consumers have taken that many samples."""
    phase = Phase(label, time.time())
    env = {**os.environ, "RAY_ADDRESS": address}
    logged = phase.started
    with open(log, "w") as output:
        driver = subprocess.Popen(command, env=env, stdout=output, stderr=subprocess.STDOUT)
        while driver.poll() is None:
            time.sleep(1.0)
            if (failure := consumers.failed()) is not None:
                driver.kill()
                raise RuntimeError(failure)
            consumed = consumed_samples(consumers.entries())
            if time.time() - logged >= PROGRESS_LOG_S:
                logged = time.time()
                logger.info("%s: %d samples consumed after %.0f s", label, consumed, logged - phase.started)
            if kill_at_samples is not None and consumed >= kill_at_samples:
                driver.send_signal(signal.SIGKILL)
                driver.wait()
                phase.killed = True
    phase.ended, phase.exit_code = time.time(), driver.returncode
    logger.info("%s: the job's driver %s after %.0f s (exit %s)", label, "was killed" if phase.killed else "ended",
                phase.ended - phase.started, phase.exit_code)
    if not phase.killed and phase.exit_code != 0:
        last = log.read_text().strip().splitlines()[-1:] or ["(its log is empty)"]
        raise RuntimeError(f"{label}: the job exited {phase.exit_code}: {last[0]} (whole log: {log})")
    return phase


def ledger_report(entries: list[dict], samples: int, shard_size: int, reference: dict[int, str]) -> dict:
    """Every sample consumed exactly once (from the ledgers), and the reference samples' states compared."""
    counts = np.zeros(samples, np.int64)
    digests: dict[int, list[str]] = {}
    for entry in entries:
        if entry.get("vanished"):
            continue
        first, count = entry["first"], entry["count"]
        counts[first : first + count] += 1
        for offset, digest in enumerate(entry["digests"]):
            if first + offset in reference:
                digests.setdefault(first + offset, []).append(digest)
    differ = sorted(i for i, seen in digests.items() if any(d != reference[i] for d in seen))
    return {
        "samples_consumed_once": int((counts == 1).sum()), "samples_never_consumed": int((counts == 0).sum()),
        "samples_consumed_twice_or_more": int((counts > 1).sum()),
        "shards_consumed": sum(1 for e in entries if not e.get("vanished")),
        "shards_vanished_before_consumption": sum(1 for e in entries if e.get("vanished")),
        "reference_samples": len(reference), "reference_samples_compared": len(digests),
        "reference_samples_differing": len(differ), "reference_differing_ids": differ[:20],
    }


def run_record(output_dir: Path) -> dict:
    """The manifest's and journal's sizes, the shards' states and node names, and the last run's summary.
    Files consumed after the job's last rescan are still done/local in the manifest, their consumers'
    declarations beside them: the next run of the command (or its rescan) records them as consumed."""
    manifest = json.loads((output_dir / MANIFEST_FILE).read_text())
    journal = output_dir / MANIFEST_JOURNAL_FILE
    states: dict[str, int] = {}
    nodes: dict[str, int] = {}
    for record in manifest["shards"]:
        key = f"{record['state']}/{record['location']}"
        states[key] = states.get(key, 0) + 1
        nodes[record.get("node") or "-"] = nodes.get(record.get("node") or "-", 0) + 1
    summary = json.loads((output_dir / SUMMARY_FILE).read_text())
    return {"manifest_bytes": (output_dir / MANIFEST_FILE).stat().st_size,
            "declarations_not_yet_recorded": len(list(output_dir.glob(RECORD_GLOB))),
            "journal_bytes": journal.stat().st_size if journal.exists() else 0,
            "shard_states": states, "shard_nodes": nodes, "summary": {
                key: summary.get(key) for key in ("outcome", "seconds", "tokens", "bytes", "tokens_per_second",
                                                  "startup_seconds", "drain_seconds", "this_run", "writers")}}


def measure(args: argparse.Namespace, work: Path) -> dict:
    model, load_format = build_model(args.shape, work)
    checkpoint = read_checkpoint_info(str(model))
    output_dir = Path(tempfile.mkdtemp(prefix="soak-out-", dir=args.output_root or work))
    data = work / "data.parquet"
    job_args = benchmark_job_args(args, model, load_format, data, checkpoint.num_layers)
    config = load_config(job_args)
    refuse_shape_too_large(args.shape, config.model, gpu_memory_bytes())
    per_token = state_bytes_per_token(config, checkpoint.hidden_size)
    samples = args.samples or math.ceil(args.target_bytes / (per_token * args.tokens_per_sample))
    write_dataset(data, samples, args.tokens_per_sample, checkpoint.vocab_size)
    shard_count = math.ceil(samples / args.shard_size)
    references = reference_shards(shard_count, args.reference_shards)
    baseline_samples = args.baseline_samples or (
        math.ceil(BASELINE_TOKENS_ON_CUDA / args.tokens_per_sample) if args.device == "cuda" else min(samples, 32))
    command = [sys.executable, "-m", "jobs.extract", "output.rescan_s=0.5", *job_args, f"output.dir={output_dir}",
               f"output.disk_budget={args.budget}"]
    results: dict[str, Any] = {
        "shape": args.shape, "device": args.device, "samples": samples, "tokens_per_sample": args.tokens_per_sample,
        "shard_size": args.shard_size, "shards": shard_count, "state_bytes_per_token": per_token,
        "state_bytes": samples * args.tokens_per_sample * per_token, "budget": args.budget,
        "budget_bytes": parse_bytes(args.budget, "--budget"), "output_dir": str(output_dir), "cpus": len(os.sched_getaffinity(0)),
        "command": " ".join(command[1:]), "reference_shards": references,
    }
    heads: list[RayHead] = []
    memory = ProcessMemory(heads)
    disk = DirectoryBytes(output_dir)
    samplers = [Sampler(BUDGET_SAMPLE_S, disk.sample), Sampler(args.memory_sample_s, memory.sample)]
    consumers: Optional[Consumers] = None
    phases: list[Phase] = []
    try:
        heads.append(RayHead(LABELS[0], args.num_cpus))
        baseline, reference = measure_reference(heads[0].address, job_args, data, baseline_samples, references,
                                                work / "reference")
        results.update({key: baseline[key] for key in ("tokens", "bare_prefill_tokens_per_s",
                                                       "extractor_alone_tokens_per_s", "extractor_alone_over_bare")})
        results["baseline_tokens"] = results.pop("tokens")
        consumers = Consumers(args.consumers, output_dir, work, args.shard_size, samples, args.consumer_pause_s)
        for sampler in samplers:
            sampler.start()
        phases.append(run_phase(command, heads[0].address, LABELS[0], work / "driver-1.log", consumers,
                                math.ceil(args.kill_at * samples)))
        heads.pop().stop()  # the cluster goes; another, whose node has another name, takes its place
        heads.append(RayHead(LABELS[1], args.num_cpus))
        phases.append(run_phase(command, heads[0].address, LABELS[1], work / "driver-2.log", consumers, None))
        consumers.finish(timeout_s=600)
        drained = time.time()
    finally:
        for sampler in samplers:
            if sampler.is_alive():
                sampler.stop()
        if consumers is not None:
            consumers.kill()
        for head in heads:
            head.stop()
    entries = consumers.entries()
    results["phases"] = [dataclasses.asdict(phase) | {"seconds": round(phase.ended - phase.started, 1)}
                         for phase in phases]
    removed = [line for line in (work / "driver-2.log").read_text().splitlines()
               if "(not recorded as done there)" in line]
    results["shard_files_removed_by_resume"] = sum(" removing shard-" in line for line in removed)
    results["temp_files_removed_by_resume"] = sum(" removing .shard-" in line for line in removed)
    results.update(ledger_report(entries, samples, args.shard_size, reference))
    tokens = sum(entry.get("tokens", 0) for entry in entries)
    seconds = drained - phases[0].started
    results.update({
        "consumed_tokens": tokens, "consumed_file_bytes": sum(entry.get("bytes", 0) for entry in entries),
        "consumed_state_bytes": tokens * per_token, "whole_run_seconds": round(seconds, 1),
        "whole_run_tokens_per_s": round(tokens / seconds, 1),
        "whole_run_over_bare": round(tokens / seconds / results["bare_prefill_tokens_per_s"], 3),
        "budget_samples": disk.samples, "budget_peak_bytes": disk.peak, "budget_peak_shard_bytes": disk.peak_shards,
        "memory": memory.report(), **run_record(output_dir),
    })
    second = results["summary"]
    if second.get("tokens_per_second"):
        results["resumed_run_over_bare"] = round(second["tokens_per_second"] / results["bare_prefill_tokens_per_s"], 3)
    if not args.keep_output:
        shutil.rmtree(output_dir, ignore_errors=True)
    return results


def print_table(results: dict) -> None:
    def line(name: str, value: str) -> None:
        print(f"  {name:<56} {value}")

    print(f"\n{results['shape']} on {results['device']}: {results['samples']:,} samples of "
          f"{results['tokens_per_sample']:,} tokens in {results['shards']:,} shards, "
          f"{format_bytes(results['state_bytes'])} of states, budget {results['budget']}, {results['cpus']} CPUs")
    for phase in results["phases"]:
        how = "driver SIGKILLed" if phase["killed"] else f"exit {phase['exit_code']}"
        line(f"run on node {phase['label']}", f"{phase['seconds']:,.0f} s, {how}")
    line("samples consumed exactly once", f"{results['samples_consumed_once']:,} of {results['samples']:,}")
    line("samples never consumed / consumed twice or more",
         f"{results['samples_never_consumed']} / {results['samples_consumed_twice_or_more']}")
    line("shard files the resume removed / its temp files", f"{results['shard_files_removed_by_resume']} / "
                                                            f"{results['temp_files_removed_by_resume']}")
    line("reference samples bit-identical to an uninterrupted run",
         f"{results['reference_samples_compared'] - results['reference_samples_differing']} of "
         f"{results['reference_samples_compared']} compared ({results['reference_samples']} in the reference)")
    line("states consumed", f"{format_bytes(results['consumed_state_bytes'])} "
                            f"({format_bytes(results['consumed_file_bytes'])} of files)")
    line("output.dir's peak, sampled every second", f"{results['budget_peak_bytes']:,} B of {results['budget_bytes']:,} B "
         f"({results['budget_samples']:,} samples; shard files {results['budget_peak_shard_bytes']:,} B)")
    line("(a) bare prefill", f"{results['bare_prefill_tokens_per_s']:,.0f} tok/s")
    line("whole run, kill and restart included", f"{results['whole_run_tokens_per_s']:,.0f} tok/s, "
         f"{results['whole_run_over_bare']} of (a), {results['whole_run_seconds']:,.0f} s")
    if "resumed_run_over_bare" in results:
        line("the resumed run alone (its own summary)", f"{results['summary']['tokens_per_second']:,.0f} tok/s, "
             f"{results['resumed_run_over_bare']} of (a)")
    line("manifest / journal at the end", f"{results['manifest_bytes']:,} B / {results['journal_bytes']:,} B")
    line("shards by state / node", f"{results['shard_states']} / {results['shard_nodes']}")
    line("consumed after the job's last rescan (declared, not yet recorded)", str(results["declarations_not_yet_recorded"]))
    print("  memory (MB) of every process sampled: RSS after start-up, last, peak; private (RSS less shared) after "
          "start-up, last, growth")
    for row in results["memory"]:
        print(f"    {row['name']:<36} pid {row['pid']:>7} {row['seconds']:>5} s {row['rss_mb_after_startup']:>7} "
              f"{row['rss_mb_last']:>7} {row['rss_mb_peak']:>7} {row['private_mb_after_startup']:>7} "
              f"{row['private_mb_last']:>7} {row['private_growth_mb']:>+6}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", choices=["tiny", "small", *SHAPES], default="tiny")
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--tp-size", type=int, default=1)
    parser.add_argument("--target-bytes", type=lambda value: parse_bytes(value, "--target-bytes"), default=MISSION_BYTES,
                        help="states to write (samples are added until they hold this much; default the target run's 1.29TB)")
    parser.add_argument("--samples", type=int, default=0, help="samples to write instead of --target-bytes")
    parser.add_argument("--tokens-per-sample", type=int, default=2048)
    parser.add_argument("--max-tokens-per-batch", type=int, default=16384)
    parser.add_argument("--shard-size", type=int, default=16, help="samples per shard file")
    parser.add_argument("--budget", default="32GB", help="output.disk_budget that the consumers drain")
    parser.add_argument("--output-root", default="", help="where output.dir goes (e.g. /dev/shm); default --work-dir")
    parser.add_argument("--kill-at", type=float, default=0.5, help="fraction of the samples consumed at the kill")
    parser.add_argument("--consumers", type=int, default=4, help="consumer processes")
    parser.add_argument("--consumer-pause-s", type=float, default=0.0,
                        help="each consumer's pause after a shard (a trainer slower than the job: the job waits for disk)")
    parser.add_argument("--reference-shards", type=int, default=4, help="shards an uninterrupted run extracts too")
    parser.add_argument("--baseline-samples", type=int, default=0,
                        help=f"(a) on this many samples; 0: {BASELINE_TOKENS_ON_CUDA:,} tokens' worth on CUDA, 32 on CPU")
    parser.add_argument("--num-cpus", type=int, default=0, help="CPUs of each Ray head; 0: Ray's own count")
    parser.add_argument("--memory-sample-s", type=float, default=MEMORY_SAMPLE_S,
                        help="seconds between reads of every process's memory (a short run needs them often)")
    parser.add_argument("--work-dir", default="", help="kept afterwards; default: a temp dir, removed")
    parser.add_argument("--keep-output", action="store_true", help="keep output.dir (its manifest) afterwards")
    parser.add_argument("--out", default="", help="also write the results as JSON here")
    parser.add_argument("--set", nargs="*", default=[], help="extra job key=value overrides")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    with work_dir(args.work_dir, "eagle3-soak-") as work:
        results = measure(args, work)
    print_table(results)
    write_results(results, args.out)
    passed = (results["samples_consumed_once"] == results["samples"]
              and results["reference_samples_differing"] == 0 and results["budget_peak_bytes"] <= results["budget_bytes"])
    sys.exit(0 if passed else 1)


if __name__ == "__main__":
    main()
