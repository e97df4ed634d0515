"""The pipeline's state: the work directory's layout, what a selection of arms and seeds serves, and steps
recorded under DIR/steps (skipped when recorded, so a rerun goes on where the last call stopped)."""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import subprocess
import time
from pathlib import Path
from typing import Any, Callable, Optional

from benchmarks.acceptance.arms import ARMS, UNTRAINED
from benchmarks.acceptance.files import write_json
from benchmarks.acceptance.prompts import fresh_training_distribution
from benchmarks.acceptance.trainer import Recipe, training_draft_config
from benchmarks.acceptance.warm_start import write_vocab_mapping, write_warm_start
from common.pythonpath import checkout_first

logger = logging.getLogger("benchmarks.acceptance")

EXIT_MORE_TO_DO = 75
"""--deadline-s stopped before a step: rerun the same command to go on."""
PROGRESS_FILE = "progress.json"
"""DIR/progress.json: the stage and step running now, for ``benchmarks.acceptance.background status``."""


def target_step(name: str, target: str) -> str:
    """A step's name for one quantized target: fp8's as it always was, another's with the target's name after it."""
    return name if target == "fp8" else f"{name}-{target}"


class OutOfTime(Exception):
    """--deadline-s passed before a step could start."""


@dataclasses.dataclass(frozen=True)
class Served:
    """One engine's worth of serving: an arm's drafter of one training seed (at the end of training, or at the
    end of an earlier epoch), over the held-out prompts (or fresh prompts of the training distribution)."""

    arm: str
    seed: int
    epoch: int = 0
    """0: the drafter at the end of training; e: its checkpoint at the end of epoch e."""
    training_distribution: bool = False
    """Over fresh prompts of the training distribution instead of the held-out ones (--training-distribution-eval)."""

    @property
    def name(self) -> str:
        return (f"{self.arm}-s{self.seed}" + (f"-e{self.epoch}" if self.epoch else "")
                + ("-train-dist" if self.training_distribution else ""))

    @property
    def final(self) -> bool:
        """The drafter at the end of training over the held-out prompts: what the arms' table and differences use."""
        return not self.epoch and not self.training_distribution

    @property
    def drafter(self) -> "Served":
        """The drafter it serves (Q-bf16 serves A's)."""
        return Served(ARMS[self.arm].drafter_of, self.seed, self.epoch)


@dataclasses.dataclass(frozen=True)
class Job:
    """A command run side by side with others (``Pipeline.run_jobs``); its output goes to DIR/logs/STEP.log."""

    command: list[str]
    env: Optional[dict[str, str]] = None
    result: Callable[[str, int], dict[str, Any]] = lambda output, code: {}
    """The step's record from the command's output and exit code."""
    ok: tuple[int, ...] = (0,)
    """Exit codes that are results (a checker's 1 is a verdict), not failures."""


class Pipeline:
    """One work directory: where each step's output goes, and the records of the steps done."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.work = Path(args.work).expanduser().absolute()
        self.started = time.monotonic()
        (self.work / "steps").mkdir(parents=True, exist_ok=True)

    def recipe(self, seed: int) -> Recipe:
        """What every arm trains with, for one seed (checkpoints at each epoch's end with --epoch-acceptance)."""
        steps_per_epoch = self.steps_per_epoch() if self.args.epoch_acceptance and self.args.epochs > 1 else 0
        return Recipe(epochs=self.args.epochs, batch_size=self.args.batch_size, learning_rate=self.args.learning_rate,
                      seed=seed, ttt_length=self.args.ttt_length, draft_vocab=self.args.draft_vocab,
                      warm_head=self.args.warm_head,
                      max_steps=self.args.max_steps, save_interval=steps_per_epoch)

    def steps_per_epoch(self) -> int:
        """SpecForge's optimizer steps per epoch: whole batches of the prepared samples."""
        prepared = self.record("prepare")
        if prepared is None:
            raise ValueError("the prepare step has not run: run the stages before train")
        return prepared["samples"] // self.args.batch_size

    def served(self) -> list[Served]:
        """Every engine's worth of serving the selection asks for, the quantized target's first (a failure of
        that path shows before the rest is served)."""
        units = [Served(arm, seed) for seed in self.args.seeds for arm in self.args.arms]
        if self.args.epoch_acceptance:
            units += [Served(arm, seed, epoch) for seed in self.args.seeds for arm in self.args.arms
                      for epoch in range(1, self.args.epochs) if ARMS[arm].drafter_of == arm and ARMS[arm].features]
        if self.args.training_distribution_eval and "A" in self.args.arms:
            units.append(Served("A", self.args.seeds[0], training_distribution=True))
        return sorted(units, key=lambda unit: not ARMS[unit.arm].quantized)

    def drafters(self) -> list[Served]:
        """The drafters the served units need, each once (Q-bf16 and A share A's)."""
        return list(dict.fromkeys(unit.drafter for unit in self.served()))

    @property
    def model(self) -> Path:
        return self.work / "model"

    @property
    def model_int4(self) -> Path:
        """The INT4 checkpoint of ``model`` (``benchmarks.acceptance.quantize_int4``)."""
        return self.work / "model-int4"

    def target_model(self, target: str) -> Path:
        """The checkpoint a target serves: the INT4 one for int4, the bf16 one otherwise (fp8 quantizes it as it
        loads)."""
        return self.model_int4 if target == "int4" else self.model

    def serving(self, target: str) -> tuple[str, ...]:
        """A target's serving command (``--quantized-serving``, ``--int4-serving``); the bf16 target's is empty."""
        return {"bf16": (), "fp8": self.args.quantized_serving, "int4": self.args.int4_serving}[target]

    @property
    def train_conversations(self) -> Path:
        return self.work / "prompts" / "train.jsonl"

    @property
    def eval_prompts(self) -> Path:
        return self.work / "prompts" / "eval.jsonl"

    def training_distribution_prompts(self) -> Path:
        """--eval-prompts fresh prompts of the training distribution (none a training prompt), made on first use."""
        path = self.work / "prompts" / "eval-training-distribution.jsonl"
        if not path.is_file():
            training = [json.loads(line)["messages"][0]["content"]
                        for line in self.train_conversations.read_text().splitlines()]
            fresh = fresh_training_distribution(training, self.args.eval_prompts, self.args.prompt_seed)
            path.write_text("".join(json.dumps({"prompt": prompt.text}) + "\n" for prompt in fresh))
        return path

    def served_file(self, unit: Served) -> Path:
        """What ``unit``'s engine served: its per-prompt results, settings, versions and first answers."""
        return self.work / "serve" / f"{unit.name}.json"

    def prompts(self, unit: Served) -> Path:
        """The prompts ``unit``'s engine serves."""
        return self.training_distribution_prompts() if unit.training_distribution else self.eval_prompts

    @property
    def data(self) -> Path:
        return self.work / "data"

    def run_dir(self, run: str) -> Path:
        return self.work / "runs" / run

    def features(self, name: str) -> Path:
        return self.work / "features" / name

    def train_dir(self, arm: str, seed: int) -> Path:
        return self.work / "train" / f"{arm}-s{seed}"

    def checkpoint(self, unit: Served) -> Path:
        """What SpecForge's exporter reads for a drafter: its last checkpoint, one kept at an epoch's end, or
        E's untrained state."""
        directory = self.train_dir(unit.arm, unit.seed)
        if unit.arm == UNTRAINED:
            return directory / "training_state.pt"
        if unit.epoch:
            return directory / "out" / f"arm-{unit.arm}-step{unit.epoch * self.steps_per_epoch()}"
        return directory / "out" / f"arm-{unit.arm}-latest"

    def drafter(self, unit: Served) -> Path:
        return self.work / "drafters" / unit.drafter.name

    def draft_config(self, arm: str) -> Path:
        """The drafter config the run of an arm's states wrote (the layer ids its drafter claims)."""
        return self.run_dir(ARMS[arm].draft_config_run) / ".drafter_config.json"

    def training_draft_config(self, arm: str) -> Path:
        """The drafter config an arm trains and exports with: ``draft_config`` with the recipe's draft vocabulary;
        arm E's untrained state keeps the run's own."""
        if arm == UNTRAINED:
            return self.draft_config(arm)
        return training_draft_config(self.draft_config(arm), self.args.draft_vocab, self.work / "train")

    def training_choices(self) -> dict[str, Any]:
        """What a drafter's weights depend on beyond its run's config and the recipe's numbers, as every training
        step records it."""
        return {"ttt_length": self.args.ttt_length, "draft_vocab": self.args.draft_vocab,
                "warm_head": self.args.warm_head}

    def check_training_choices(self) -> None:
        """Refuse to go on from drafters trained with another --ttt-length, --draft-vocab or --warm-head than this
        command's: their export, serving and report would describe the wrong drafters."""
        defaults = {"ttt_length": Recipe.ttt_length, "draft_vocab": Recipe.draft_vocab,  # records made before these
                    "warm_head": Recipe.warm_head}
        for path in sorted((self.work / "steps").glob("train-*.json")):
            record = json.loads(path.read_text())
            if "metrics" not in record:  # arm E's untrained checkpoint: no recipe
                continue
            trained = {key: record.get(key, default) for key, default in defaults.items()}
            if trained != self.training_choices():
                flags = " ".join(f"--{key.replace('_', '-')} {value}" for key, value in trained.items()
                                 if not isinstance(value, bool))
                flags += " with --warm-head" if trained["warm_head"] else " without --warm-head"
                raise ValueError(f"step {path.stem} was trained with {flags}: run with those, or remove "
                                 f"{self.work / 'steps'}/train-*.json to train every arm again")

    def vocab_mapping(self, features: str) -> Optional[Path]:
        """With --warm-head and --draft-vocab: the draft vocabulary's map from one arm's features, made once per
        export of them (the features stage removes it when it exports them again; the warm head's rows follow it);
        None otherwise (SpecForge derives its own, or the vocabulary is whole)."""
        if not (self.args.warm_head and self.args.draft_vocab):
            return None
        path = self.work / "train" / f"vocab-{features}-{self.args.draft_vocab}.pt"
        if not path.is_file():
            vocab_size = json.loads((self.model / "config.json").read_text())["vocab_size"]
            write_vocab_mapping(self.features(features), self.args.draft_vocab, vocab_size, Recipe.max_length, path)
        return path

    def warm_start(self, arm: str, seed: int) -> Optional[Path]:
        """With --warm-head: the checkpoint an arm's drafter starts from (per seed: the rest of it is SpecForge's
        seeded initialisation), made before its training; None otherwise."""
        if not self.args.warm_head:
            return None
        return write_warm_start(self.training_draft_config(arm), self.model, seed,
                                self.train_dir(arm, seed) / "warm-start", self.vocab_mapping(ARMS[arm].features))

    def record(self, name: str) -> Optional[dict[str, Any]]:
        path = self.work / "steps" / f"{name}.json"
        return json.loads(path.read_text()) if path.is_file() else None

    def out_of_time(self) -> bool:
        return bool(self.args.deadline_s) and time.monotonic() - self.started > self.args.deadline_s

    def progress(self, **fields: str) -> None:
        """Say what runs now (DIR/progress.json: the stage, the step, since when)."""
        path = self.work / PROGRESS_FILE
        current = json.loads(path.read_text()) if path.is_file() else {}
        write_json({**current, **fields, "since": time.time()}, path)

    def step(self, name: str, action: Callable[[], dict[str, Any]]) -> dict[str, Any]:
        """Run ``action`` unless its record exists; its result (and wall time) become the record."""
        if (done := self.record(name)) is not None:
            return done
        if self.out_of_time():
            raise OutOfTime(name)
        logger.info("step %s", name)
        self.progress(step=name)
        started = time.perf_counter()
        return self.save(name, action(), time.perf_counter() - started)

    def save(self, name: str, result: dict[str, Any], seconds: float) -> dict[str, Any]:
        """Record a finished step (also those run side by side, whose records are written as each ends)."""
        result = {**result, "seconds": round(seconds, 1)}
        write_json(result, self.work / "steps" / f"{name}.json")
        logger.info("step %s done in %.0f s", name, seconds)
        return result

    def log_path(self, name: str) -> Path:
        path = self.work / "logs" / f"{name}.log"
        path.parent.mkdir(parents=True, exist_ok=True)
        return path

    def command(self, command: list[str], log_name: str, env: Optional[dict[str, str]] = None) -> str:
        """Run a project command or a peer's tool; its output goes to DIR/logs; a failure names the log."""
        log = self.log_path(log_name)
        with open(log, "w") as handle:
            result = subprocess.run(command, stdout=handle, stderr=subprocess.STDOUT, text=True,
                                    env=env or project_env())
        if result.returncode != 0:
            raise RuntimeError(f"`{' '.join(command)}` exited {result.returncode}; its output: {log}\n"
                               + log.read_text()[-3000:])
        return log.read_text()

    def run_jobs(self, jobs: dict[str, Job], at_once: int) -> None:
        """Each job not yet recorded, up to ``at_once`` side by side (polled, so each one's wall time is its own;
        each is recorded as it ends). Past the deadline no job starts; those running finish first. Every failure
        is reported, once all have ended."""
        pending = [name for name in jobs if self.record(name) is None]
        running: dict[str, tuple[subprocess.Popen, Any, float]] = {}
        failed, stopped = [], None
        while pending or running:
            while pending and len(running) < max(1, at_once) and stopped is None and not failed:
                if self.out_of_time():
                    stopped = pending[0]
                    break
                name = pending.pop(0)
                logger.info("step %s", name)
                self.progress(step=name)
                log = open(self.log_path(name), "w")
                process = subprocess.Popen(jobs[name].command, env=jobs[name].env or project_env(), stdout=log,
                                           stderr=subprocess.STDOUT, text=True)
                running[name] = (process, log, time.perf_counter())
            for name in [name for name, (process, _, _) in running.items() if process.poll() is not None]:
                process, log, started = running.pop(name)
                log.close()
                output = self.log_path(name).read_text()
                if process.returncode not in jobs[name].ok:
                    failed.append(f"{name} (exit {process.returncode}): {self.log_path(name)}\n{output[-2000:]}")
                    continue
                self.save(name, jobs[name].result(output, process.returncode), time.perf_counter() - started)
            if running or (pending and stopped is None and not failed):
                time.sleep(0.5)
            if (stopped or failed) and not running:
                break
        if failed:
            raise RuntimeError("failed: " + "\n".join(failed))
        if stopped:
            raise OutOfTime(stopped)


def project_env() -> dict[str, str]:
    """Project commands import from the checkout, whatever the current directory."""
    return dict(os.environ, PYTHONPATH=checkout_first(Path(__file__).resolve().parents[2]))
