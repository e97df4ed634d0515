"""The stages, in order: each runs its steps through the pipeline, which skips those already recorded."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable

import numpy as np

from benchmarks.acceptance.arms import ARMS, LAYERS, TRAINED_ARMS, extract_overrides, states_run
from benchmarks.acceptance.data import data_stats, prepare_command, prepared_data
from benchmarks.acceptance.drafters import check_drafters, served_config
from benchmarks.acceptance.hf_states import write_hf_features
from benchmarks.acceptance.pipeline import OutOfTime, Pipeline
from benchmarks.acceptance.prompts import split_prompts, write_conversations
from benchmarks.acceptance.report import markdown, versions
from benchmarks.acceptance.serving import (
    SERVE_MEMORY,
    SPEC_DRAFT_TOKENS,
    SPEC_STEPS,
    SPEC_TOPK,
    PromptResult,
    served_results,
    start_serving,
)
from benchmarks.acceptance.stats import bootstrap_acceptance
from benchmarks.acceptance.trainer import (
    last_train_metrics,
    specforge_command,
    specforge_env,
    specforge_run_config,
    write_untrained_checkpoint,
)
from testbeds.smollm2 import build_checkpoint


def stage_checkpoint(p: Pipeline) -> None:
    p.step("checkpoint", lambda: {"path": str(build_checkpoint(p.model, Path(p.args.gguf) if p.args.gguf else None))})


def stage_prompts(p: Pipeline) -> None:
    def make() -> dict[str, Any]:
        train, held_out = split_prompts(p.args.train_prompts, p.args.eval_prompts, p.args.seed)
        p.train_conversations.parent.mkdir(parents=True, exist_ok=True)
        write_conversations(train, p.train_conversations)
        p.eval_prompts.write_text("".join(json.dumps({"prompt": prompt}) + "\n" for prompt in held_out))
        return {"train": len(train), "held_out": len(held_out)}
    p.step("prompts", make)


def stage_prepare(p: Pipeline) -> None:
    def make() -> dict[str, Any]:
        p.command(prepare_command(p.model, p.train_conversations, p.data, p.args.max_new_tokens), "prepare")
        return data_stats(p.data, p.recipe.max_length)
    p.step("prepare", make)


def stage_extract(p: Pipeline) -> None:
    device = "auto" if p.args.device == "cuda" else p.args.device
    for arm in ("A", "B", "D"):
        def run(arm: str = arm) -> dict[str, Any]:
            p.command([sys.executable, "-m", "jobs.extract", f"model.path={p.model}", f"data.path={prepared_data(p.data)}",
                       f"output.dir={p.run_dir(arm)}", f"model.device={device}", "model.dtype=bfloat16",
                       *extract_overrides(arm, LAYERS)], f"extract-{arm}")
            return json.loads((p.run_dir(arm) / ".summary.json").read_text())["this_run"]
        p.step(f"extract-{arm}", run)


def stage_features(p: Pipeline) -> None:
    for arm in ("A", "B", "D"):
        p.step(f"export-{arm}", lambda arm=arm: {"log": p.command(
            [sys.executable, "-m", "jobs.export", f"output.dir={p.run_dir(arm)}", "to=specforge",
             f"dest={p.features(arm)}"], f"export-{arm}").strip().splitlines()[-1]})
    p.step("features-C", lambda: {"c_vs_a": write_hf_features(
        p.model, p.run_dir("A"), p.features("C"), p.args.device, "bfloat16")})


def stage_train(p: Pipeline) -> None:
    """The trained arms at once, one SpecForge process each on the one GPU (each is small and mostly waits
    on kernel launches), then arm E's untrained checkpoint."""
    pending = [arm for arm in TRAINED_ARMS if p.record(f"train-{arm}") is None]
    if pending and p.args.deadline_s and time.monotonic() - p.started > p.args.deadline_s:
        raise OutOfTime(f"train-{pending[0]}")
    import yaml

    processes, ports = {}, free_ports(len(pending))
    for arm, port in zip(pending, ports):
        directory = p.work / "train" / arm
        directory.mkdir(parents=True, exist_ok=True)
        config = specforge_run_config(arm, p.features(arm), p.model, p.draft_config(arm), directory / "out", p.recipe)
        (directory / "run.yaml").write_text(yaml.safe_dump(config, sort_keys=False))
        env = specforge_env({"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1",
                             "MASTER_PORT": str(port)})
        log = open(directory / "log.txt", "w")
        processes[arm] = (subprocess.Popen(specforge_command("train", "-c", str(directory / "run.yaml")), env=env,
                                           stdout=log, stderr=subprocess.STDOUT, text=True), log, time.perf_counter())
    failed = []
    while processes:  # polled, so each arm's wall time is its own
        for arm in [arm for arm, (process, _, _) in processes.items() if process.poll() is not None]:
            process, log, started = processes.pop(arm)
            log.close()
            text = (p.work / "train" / arm / "log.txt").read_text()
            if process.returncode != 0:
                failed.append(f"arm {arm} (exit {process.returncode}): {p.work / 'train' / arm / 'log.txt'}\n"
                              f"{text[-2000:]}")
                continue
            p.save(f"train-{arm}", {"metrics": last_train_metrics(text)}, time.perf_counter() - started)
        time.sleep(1)
    if failed:
        raise RuntimeError("SpecForge training failed for " + "\n".join(failed))
    p.step("train-E", lambda: {"checkpoint": str(write_untrained_checkpoint(
        p.draft_config("E"), p.work / "train" / "E", p.recipe.seed))})


def free_ports(count: int) -> list[int]:
    """Ports for each trainer's torch.distributed rendezvous, all held at once so they differ."""
    with contextlib.ExitStack() as stack:
        sockets = [stack.enter_context(socket.socket()) for _ in range(count)]
        for sock in sockets:
            sock.bind(("127.0.0.1", 0))
        return [sock.getsockname()[1] for sock in sockets]


def stage_drafters(p: Pipeline) -> None:
    """Each arm's SpecForge checkpoint exported for SGLang, its eagle_config set to the arm's claim, then
    jobs.check_drafter on the served configs, grouped by the run each arm's states came from."""
    for arm in ARMS:
        def make(arm: str = arm) -> dict[str, Any]:
            checkpoint = (p.work / "train" / "E" / "training_state.pt" if arm == "E"
                          else p.work / "train" / arm / "out" / f"arm-{arm}-latest")
            p.command(specforge_command("export", "--to", "sglang", "--checkpoint", str(checkpoint), "--draft-config",
                                        str(p.draft_config(arm)), "--output-dir", str(p.drafter(arm))),
                      f"specforge-export-{arm}", env=specforge_env())
            claimed = json.loads(p.draft_config(arm).read_text())["eagle_config"]
            return {"eagle_config": served_config(p.drafter(arm), claimed)["eagle_config"]}
        p.step(f"drafter-{arm}", make)
    for run in sorted(set(map(states_run, ARMS))):
        arms = [arm for arm in ARMS if states_run(arm) == run]
        p.step(f"check-run-{run}", lambda arms=arms, run=run: dict(zip(
            arms, check_drafters([p.drafter(arm) for arm in arms], p.run_dir(run)))))


def stage_serve(p: Pipeline) -> None:
    """Each arm's drafter served over the held-out prompts, ``--serve-parallel`` engines at once on the one
    GPU (135M parameters each: the GPU's memory is shared out, each gets an equal fraction)."""
    pending = [arm for arm in ARMS if p.record(f"serve-{arm}") is None]
    (p.work / "serve").mkdir(parents=True, exist_ok=True)
    parallel = max(1, p.args.serve_parallel)
    for start in range(0, len(pending), parallel):
        if p.args.deadline_s and time.monotonic() - p.started > p.args.deadline_s:
            raise OutOfTime(f"serve-{pending[start]}")
        started = time.perf_counter()
        batch = {arm: start_serving(p.model, p.drafter(arm), p.eval_prompts, p.work / "serve" / f"{arm}.json",
                                    p.args.max_new_tokens, p.args.attention_backend, SERVE_MEMORY / parallel)
                 for arm in pending[start : start + parallel]}
        for arm, process in batch.items():
            results = served_results(process, p.work / "serve" / f"{arm}.json")
            p.save(f"serve-{arm}", {"prompts": len(results), "engines_at_once": len(batch)},
                   time.perf_counter() - started)


def stage_report(p: Pipeline) -> dict[str, Any]:
    served = {arm: [PromptResult(**r) for r in json.loads((p.work / "serve" / f"{arm}.json").read_text())["prompts"]]
              for arm in ARMS}
    acceptance = bootstrap_acceptance(served, seed=p.args.seed)
    reference = [r.output_sha for r in served["A"]]
    results = {
        "acceptance": acceptance,
        "same_output_as_A": {arm: float(np.mean([r.output_sha == a for r, a in zip(served[arm], reference)]))
                             for arm in ARMS},
        "training": {arm: p.record(f"train-{arm}") for arm in ARMS},
        "check_drafter": {arm: p.record(f"check-run-{states_run(arm)}")[arm] for arm in ARMS},
        "c_vs_a": p.record("features-C")["c_vs_a"],
        "data": {**p.record("prompts"), **p.record("prepare")},
        "recipe": dataclasses.asdict(p.recipe),
        "serving": {"speculative_num_steps": SPEC_STEPS, "speculative_eagle_topk": SPEC_TOPK,
                    "speculative_num_draft_tokens": SPEC_DRAFT_TOKENS, "temperature": 0,
                    "max_new_tokens": p.args.max_new_tokens, "attention_backend": p.args.attention_backend},
        "seconds": {path.stem: json.loads(path.read_text())["seconds"] for path in sorted((p.work / "steps").glob("*.json"))},
        "versions": versions(),
        "command": " ".join(sys.argv),
    }
    out = Path(p.args.out) if p.args.out else p.work / "results.json"
    out.write_text(json.dumps(results, indent=2) + "\n")
    out.with_suffix(".md").write_text(markdown(results))
    print(markdown(results))
    return results


STAGE_FUNCTIONS: dict[str, Callable[[Pipeline], Any]] = {
    "checkpoint": stage_checkpoint, "prompts": stage_prompts, "prepare": stage_prepare, "extract": stage_extract,
    "features": stage_features, "train": stage_train, "drafters": stage_drafters, "serve": stage_serve,
    "report": stage_report,
}
STAGES = tuple(STAGE_FUNCTIONS)
"""The stages in the order they run."""
