"""What the benchmarks that run the project's own commands share: the model they run (SmolLM2 by default, from
a carried GGUF on a machine without a registry), one command run on the benchmark's Ray cluster, and SGLang's own
engine alone in a Ray actor like the project's, for the same work."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import ray

from common.pythonpath import checkout_first
from conversations.regenerate import REGENERATOR_CPUS
from extractor.generator import GeneratorSpec
from testbeds.smollm2 import build_checkpoint, checkpoint_dir, default_dir

REPO_ROOT = Path(__file__).resolve().parent.parent


def add_model_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--model", default="", help="checkpoint (default: SmolLM2-135M-Instruct)")
    parser.add_argument("--gguf", default="", help="build the default model from this SmolLM2 GGUF (no registry)")


def add_run_arguments(parser: argparse.ArgumentParser, work_dir: str, command: str) -> None:
    parser.add_argument("--work-dir", default=work_dir)
    parser.add_argument("--out", default="", help="write the results here as JSON")
    parser.add_argument("--set", nargs="*", default=[], metavar="key=value", help=f"more {command} keys")


def resolve_model(args: argparse.Namespace) -> Path:
    """``--model``, else SmolLM2-135M-Instruct (built from ``--gguf`` when given)."""
    if args.model:
        return Path(args.model)
    return build_checkpoint(default_dir(), Path(args.gguf)) if args.gguf else checkpoint_dir()


def run_on_cluster(module: str, keys: list[str], log: Path) -> float:
    """``python -m MODULE KEYS`` joined to this process's Ray cluster (``ray.address``; its auth settings are in
    the environment), with the checkout first on the caller's PYTHONPATH; its output goes to ``log``. Returns its
    wall time seen from outside; a failure ends the benchmark naming the log."""
    env = dict(os.environ, PYTHONPATH=checkout_first(REPO_ROOT),
               RAY_AUTH_MODE=os.environ.get("RAY_AUTH_MODE", "disabled"))
    env.pop("RAY_ADDRESS", None)
    command = [sys.executable, "-m", module, *keys, f"ray.address={ray.get_runtime_context().gcs_address}"]
    started = time.perf_counter()
    result = subprocess.run(command, cwd=REPO_ROOT, env=env, capture_output=True, text=True)
    seconds = time.perf_counter() - started
    log.write_text(result.stdout + result.stderr)
    if result.returncode != 0:
        raise SystemExit(f"{module} failed (exit {result.returncode}); its output is in {log}:\n"
                         f"{result.stderr[-3000:]}")
    return seconds


class OfflineEngine:
    """SGLang's own offline path in a Ray actor like the project's: one ``Engine.generate`` over every prompt."""

    def __init__(self, spec: GeneratorSpec) -> None:
        from extractor.generator import Generator

        self.generator = Generator(spec)

    def generate(self, prompts: list[list[int]], params: list[dict[str, Any]]) -> tuple[float, list[list[int]]]:
        started = time.perf_counter()
        completions = self.generator.generate(prompts, params)
        return time.perf_counter() - started, [completion.output_ids for completion in completions]

    def close(self) -> None:
        self.generator.close()


def sglang_alone(spec: GeneratorSpec, prompts: list[list[int]], params: list[dict[str, Any]]) -> dict[str, Any]:
    """SGLang alone on this process's Ray cluster: an actor starts its engine, runs one ``Engine.generate`` over
    ``prompts`` and shuts it down. ``seconds``: the generate call; ``wall_seconds``: the actor's start to the
    engine's shutdown; ``outputs``: each prompt's generated ids."""
    started = time.perf_counter()
    actor = ray.remote(OfflineEngine).options(
        num_gpus=spec.tp_size if spec.device == "cuda" else 0, num_cpus=REGENERATOR_CPUS).remote(spec)
    try:
        seconds, outputs = ray.get(actor.generate.remote(prompts, params))
        ray.get(actor.close.remote(), timeout=60)
    finally:
        ray.kill(actor)
    return {"seconds": seconds, "wall_seconds": time.perf_counter() - started, "outputs": outputs}
