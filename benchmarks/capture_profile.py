"""What a captured forward costs on the device beyond the bare one, by kernel: torch.profiler over the same batches.

One engine in this process (TP=1, no Ray), the benchmark's model of ``--shape`` and its synthetic batches; five
ways over the same batches, each timed by the engine's CUDA events (the ``forward`` span: from the forward's
launch to its end on the compute stream, as the throughput table reports it):

  bare         SGLang's forward with the layers' capture off (the throughput table's (a))
  capture      the capture forward, then its states' check and copy to pinned host memory, one batch at a time
  overlapped   the same with ``host_buffers`` batches in flight, as the job runs it: a batch's copy to the host
               and its hand-on (a host memcpy, standing for Ray's object store) overlap the next forward
  overlapped-idle   as overlapped, the hand-on doing nothing (the copy's effect without the host memcpy's)
  forward-only the capture forward alone, its states dropped on the device (nothing checked or copied)

Each way also records the GPU's SM clock and power draw (nvidia-smi, every 100 ms). Then torch.profiler over a
few batches of ``bare`` and ``overlapped``: device time per kernel name and CUDA runtime calls per name, the
differences first, and the caching allocator's counters (device allocations, frees, retries) per way.

    python -m benchmarks.capture_profile --shape deepseek_v3_reduced --device cuda --out profile.json \\
        --set extract.last_hidden_state=none
"""

from __future__ import annotations

import argparse
import concurrent.futures
import hashlib
import logging
import subprocess
import time
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch

from benchmarks.throughput import benchmark_job_args, build_model, gpu_memory_bytes, refuse_shape_too_large
from benchmarks.workdir import work_dir, write_results
from extractor.actor import Extractor
from extractor.checkpoint import read_checkpoint_info
from extractor.layers import check_layer_ids
from extractor.types import CapturedBatch, EngineSpec
from inputs.dataset import open_tokenized_dataset
from inputs.demo import build_synthetic_dataset
from jobs.config import load_config
from jobs.planning.engine import build_engine_spec
from jobs.planning.shards import pack_batches
from testbeds.shapes import SHAPES

ALLOCATOR_COUNTERS = ("num_device_alloc", "num_device_free", "num_alloc_retries", "num_sync_all_streams")


def engine_spec(args: argparse.Namespace, work: Path) -> tuple[EngineSpec, list[list[np.ndarray]]]:
    """The engine the job would start for the benchmark's model, and the job's batches of its data."""
    model, load_format = build_model(args.shape, work)
    checkpoint = read_checkpoint_info(str(model))
    data = build_synthetic_dataset(work / "data.parquet", args.samples, vocab_size=checkpoint.vocab_size,
                                   min_len=args.tokens_per_sample, max_len=args.tokens_per_sample)
    job = argparse.Namespace(device=args.device, tp_size=1, max_tokens_per_batch=args.max_tokens_per_batch,
                             shard_size=16, set=args.set)
    config = load_config([*benchmark_job_args(job, model, load_format, data, checkpoint.num_layers),
                          f"output.dir={work / 'unused'}"])
    dataset = open_tokenized_dataset(str(data), checkpoint.vocab_size, 1 << 30)
    refuse_shape_too_large(args.shape, config.model, gpu_memory_bytes())
    layer_ids = check_layer_ids(config.extract.layers, checkpoint.num_layers)
    spec = build_engine_spec(config.model, config.extract, layer_ids, "cuda",
                             int(dataset.lengths.max()))
    batches = [dataset.rows(a, b)[0] for a, b in pack_batches(
        dataset.lengths, config.extract.max_tokens_per_batch, config.extract.max_samples_per_batch)]
    return spec, batches


class HandOn:
    """Copies a batch's host states into memory of its own, as a put into Ray's object store does."""

    def __init__(self, max_bytes: int) -> None:
        self._slots = [np.empty(max_bytes, dtype=np.uint8) for _ in range(4)]
        self._next = 0

    def __call__(self, batch: CapturedBatch) -> int:
        states = batch.aux_hidden_states.view(np.uint8).reshape(-1)
        slot = self._slots[self._next % len(self._slots)]
        self._next += 1
        slot[: states.size] = states
        return states.size


WAYS = ["bare", "forward-only", "capture", "overlapped", "overlapped-idle"]


def run_way(extractor: Extractor, way: str, batches: list[list[np.ndarray]], hand_on: HandOn, in_flight: int) -> None:
    engine = extractor._engine._engine  # benchmark: the rank-0 CaptureEngine itself, for the ways the job never runs
    if way == "bare":
        for batch in batches:
            extractor.bare_prefill(batch)
    elif way == "forward-only":
        for batch in batches:
            engine.capture_forward(batch, spans=_spans(engine))
        torch.cuda.synchronize()
    elif way == "capture":
        for batch in batches:
            extractor.capture(batch, hand_on)
    elif way in ("overlapped", "overlapped-idle"):
        with concurrent.futures.ThreadPoolExecutor(in_flight) as pool:
            take = (lambda batch: 0) if way == "overlapped-idle" else hand_on
            for future in [pool.submit(extractor.capture, batch, take) for batch in batches]:
                future.result()
    else:
        raise ValueError(way)


def states_digests(extractor: Extractor, batches: list[list[np.ndarray]], in_flight: int) -> list[str]:
    """sha256 of each batch's states as the job would hand them on, ``in_flight`` batches at a time (1: one after
    another)."""
    def digest(batch: CapturedBatch) -> str:
        hashed = hashlib.sha256(batch.aux_hidden_states.view(np.uint8).reshape(-1))
        if batch.last_hidden_state is not None:
            hashed.update(batch.last_hidden_state.view(np.uint8).reshape(-1))
        return hashed.hexdigest()

    with concurrent.futures.ThreadPoolExecutor(in_flight) as pool:
        return [future.result() for future in [pool.submit(extractor.capture, batch, digest) for batch in batches]]


def device_digests(extractor: Extractor, batches: list[list[np.ndarray]]) -> list[str]:
    """sha256 of each batch's states read straight from the device after the capture forward (``.cpu()``, the host
    copier bypassed): the bytes ``states_digests`` must find, whole copy or pieces."""
    engine = extractor._engine._engine  # benchmark: the rank-0 CaptureEngine itself

    def raw(states: torch.Tensor) -> np.ndarray:
        return states.contiguous().cpu().view(torch.uint8).numpy().reshape(-1)

    digests = []
    for batch in batches:
        aux, last = engine.capture_forward(batch)
        hashed = hashlib.sha256(raw(aux))
        if last is not None:
            hashed.update(raw(last))
        digests.append(hashed.hexdigest())
    return digests


def _spans(engine: Any) -> Any:
    """Device spans that land in the engine's stage times once the forward ends (as bare_prefill's do)."""
    from extractor.timing import maybe_device_spans

    spans = maybe_device_spans("cuda")

    class Landing:
        def mark(self, name: Any, stream: Any = None) -> None:
            spans.mark(name, stream)
            if name == "forward":
                torch.cuda.synchronize()
                spans.add_to(engine.times)

    return Landing()


class GpuClocks:
    """The GPU's SM clock (MHz) and power draw (W) sampled by ``nvidia-smi`` every 100 ms while the block runs: a
    forward that is slower only while the GPU runs without pause could be a clock held down by its power limit.
    Empty where there is no ``nvidia-smi``."""

    def __enter__(self) -> "GpuClocks":
        self.samples: list[tuple[float, float]] = []
        command = ["nvidia-smi", "--query-gpu=clocks.sm,power.draw", "--format=csv,noheader,nounits", "-lms", "100"]
        try:
            self._process: subprocess.Popen | None = subprocess.Popen(command, stdout=subprocess.PIPE, text=True)
        except OSError:
            self._process = None
        return self

    def __exit__(self, *exc: object) -> None:
        if self._process is None:
            return
        self._process.terminate()
        output, _ = self._process.communicate(timeout=10)
        for line in output.splitlines():
            try:
                clock, power = (float(field) for field in line.split(","))
            except ValueError:
                continue
            self.samples.append((clock, power))

    def summary(self) -> dict:
        if not self.samples:
            return {}
        clocks, powers = zip(*self.samples)
        return {"sm_mhz_mean": round(sum(clocks) / len(clocks)), "sm_mhz_min": min(clocks),
                "power_w_mean": round(sum(powers) / len(powers), 1), "samples": len(self.samples)}


def timed(extractor: Extractor, way: str, batches: list[list[np.ndarray]], hand_on: HandOn, in_flight: int,
          tokens: int) -> dict:
    """One way over every batch: wall, the forward's device seconds per million tokens, the allocator's counters,
    the GPU's clock and power."""
    before_times = extractor._engine._engine.times.snapshot()
    before_memory = torch.cuda.memory_stats()
    torch.cuda.synchronize()
    started = time.perf_counter()
    with GpuClocks() as clocks:
        run_way(extractor, way, batches, hand_on, in_flight)
        torch.cuda.synchronize()
    wall = time.perf_counter() - started
    after_times = extractor._engine._engine.times.snapshot()
    after_memory = torch.cuda.memory_stats()
    device = {stage: after_times.get("device", {}).get(stage, 0.0) - before_times.get("device", {}).get(stage, 0.0)
              for stage in after_times.get("device", {})}
    return {
        "wall_s": round(wall, 3), "tokens_per_s": round(tokens / wall, 1),
        "device_s_per_mtok": {stage: round(s / tokens * 1e6, 3) for stage, s in device.items() if s > 0},
        "allocator": {name: after_memory.get(name, 0) - before_memory.get(name, 0) for name in ALLOCATOR_COUNTERS},
        "peak_allocated_gb": round(after_memory.get("allocated_bytes.all.peak", 0) / 1e9, 2),
        "gpu": clocks.summary(),
    }


def profiled(run: Callable[[], None], trace: Path | None) -> dict[str, dict]:
    """Device microseconds and calls per kernel name, and CPU microseconds and calls per CUDA runtime call."""
    activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=activities) as prof:
        run()
        torch.cuda.synchronize()
    if trace is not None:
        prof.export_chrome_trace(str(trace))
    kernels: dict[str, dict] = {}
    runtime: dict[str, dict] = {}
    for event in prof.key_averages():
        device_us = getattr(event, "self_device_time_total", 0) or 0
        if device_us > 0:
            kernels[event.key] = {"us": round(device_us, 1), "calls": event.count}
        elif event.key.startswith(("cuda", "cu")):
            runtime[event.key] = {"us": round(event.self_cpu_time_total, 1), "calls": event.count}
    return {"kernels": kernels, "runtime": runtime}


def differences(bare: dict[str, dict], other: dict[str, dict], top: int) -> list[dict]:
    """Names whose time differs most between two profiles (other - bare), largest first."""
    rows = []
    for name in set(bare) | set(other):
        a, b = bare.get(name, {"us": 0.0, "calls": 0}), other.get(name, {"us": 0.0, "calls": 0})
        rows.append({"name": name[:120], "bare_us": a["us"], "other_us": b["us"], "delta_us": round(b["us"] - a["us"], 1),
                     "bare_calls": a["calls"], "other_calls": b["calls"]})
    return sorted(rows, key=lambda row: -abs(row["delta_us"]))[:top]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", choices=[*SHAPES], required=True)
    parser.add_argument("--device", choices=["cuda"], default="cuda")
    parser.add_argument("--samples", type=int, default=256, help="samples per way (timed); 256 x 2,048 = 524K tokens")
    parser.add_argument("--tokens-per-sample", type=int, default=2048)
    parser.add_argument("--max-tokens-per-batch", type=int, default=16384)
    parser.add_argument("--rounds", type=int, default=2, help="timed rounds of every way, interleaved")
    parser.add_argument("--profile-batches", type=int, default=4)
    parser.add_argument("--trace-dir", default="", help="write a chrome trace of each profiled way here")
    parser.add_argument("--check-batches", type=int, default=8,
                        help="first compare these batches' states, one at a time against overlapped (sha256)")
    parser.add_argument("--ways", nargs="*", default=WAYS, choices=WAYS, help="the ways to time (default: all)")
    parser.add_argument("--out", default="", help="write the results as JSON here")
    parser.add_argument("--set", nargs="*", default=[], help="extra job key=value overrides")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    with work_dir("", "eagle3-profile-") as work:
        spec, batches = engine_spec(args, work)
        extractor = Extractor(spec)
        try:
            results = measure(extractor, spec, batches, args)
        finally:
            extractor.close()
    print_report(results)
    write_results(results, args.out)


def measure(extractor: Extractor, spec: EngineSpec, batches: list[list[np.ndarray]], args: argparse.Namespace) -> dict:
    """Every way over every batch, ``args.rounds`` times interleaved; then the profiles of a few batches."""
    tokens = sum(int(sum(len(ids) for ids in batch)) for batch in batches)
    hand_on = HandOn(extractor.max_batch_bytes())
    ways = args.ways
    for way in ways:  # warm-up: kernels, allocator, pinned buffers
        run_way(extractor, way, batches[:2], hand_on, spec.host_buffers)
    results: dict[str, Any] = {"shape": args.shape, "tokens": tokens, "batches": len(batches),
                               "host_buffers": spec.host_buffers, "copy_piece_bytes": spec.copy_piece_bytes,
                               "layer_ids": list(spec.layer_ids),
                               "last_hidden_state": spec.last_hidden_state, "rounds": {}}
    if args.check_batches:
        checked = batches[: args.check_batches]
        one_at_a_time = states_digests(extractor, checked, 1)
        overlapped = states_digests(extractor, checked, spec.host_buffers)
        results["overlapped_states_equal"] = one_at_a_time == overlapped
        if one_at_a_time != overlapped:
            raise SystemExit(f"the states of overlapped batches differ from one-at-a-time's: {one_at_a_time} vs {overlapped}")
        results["host_states_equal_the_devices"] = one_at_a_time == device_digests(extractor, checked)
        if not results["host_states_equal_the_devices"]:
            raise SystemExit("the states the host copy delivered differ from the device's own (.cpu())")
    for _ in range(args.rounds):
        for way in ways:
            results["rounds"].setdefault(way, []).append(timed(extractor, way, batches, hand_on, spec.host_buffers, tokens))
    if not args.profile_batches:
        return results
    few = batches[: args.profile_batches]
    trace_dir = Path(args.trace_dir) if args.trace_dir else None
    if trace_dir is not None:
        trace_dir.mkdir(parents=True, exist_ok=True)
    profiles = {way: profiled(lambda way=way: run_way(extractor, way, few, hand_on, spec.host_buffers),
                              trace_dir / f"{args.shape}-{way}.json" if trace_dir else None)
                for way in ("bare", "forward-only", "overlapped")}
    results["kernel_differences"] = {
        way: differences(profiles["bare"]["kernels"], profiles[way]["kernels"], 25) for way in ("forward-only", "overlapped")}
    results["runtime_differences"] = differences(profiles["bare"]["runtime"], profiles["overlapped"]["runtime"], 15)
    results["kernel_totals_us"] = {way: round(sum(k["us"] for k in p["kernels"].values()), 1)
                                   for way, p in profiles.items()}
    return results

def print_report(results: dict) -> None:
    print(f"shape {results['shape']}: {results['tokens']:,} tokens in {results['batches']} batches a way, "
          f"layers {results['layer_ids']}, final state {results['last_hidden_state']}")
    if "overlapped_states_equal" in results:
        print(f"states of overlapped batches equal one-at-a-time's: {results['overlapped_states_equal']}, "
              f"and the device's own: {results.get('host_states_equal_the_devices')}")
    print(f"{'way':<14}{'tok/s':>12}{'forward dev s/Mtok':>20}  allocator (alloc/free/retries/syncs)")
    for way, rounds in results["rounds"].items():
        for r in rounds:
            counters = "/".join(str(r["allocator"][name]) for name in ALLOCATOR_COUNTERS)
            print(f"{way:<14}{r['tokens_per_s']:>12,.0f}{r['device_s_per_mtok'].get('forward', 0):>20.3f}  {counters}"
                  f"  peak {r['peak_allocated_gb']} GB  {r['device_s_per_mtok']}  {r.get('gpu', {})}")
    if "kernel_totals_us" not in results:
        return
    print("kernel device time over the profiled batches (us):", results["kernel_totals_us"])
    for way, rows in results["kernel_differences"].items():
        print(f"kernels, {way} - bare:")
        for row in rows[:15]:
            print(f"  {row['delta_us']:>+12.1f}  {row['bare_calls']:>6}->{row['other_calls']:<6} {row['name']}")
    print("CUDA runtime calls, overlapped - bare (CPU us):")
    for row in results["runtime_differences"][:10]:
        print(f"  {row['delta_us']:>+12.1f}  {row['bare_calls']:>6}->{row['other_calls']:<6} {row['name']}")


if __name__ == "__main__":
    main()
