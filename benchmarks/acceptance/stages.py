"""The stages, in order: each runs its steps through the pipeline, which skips those already recorded."""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import shutil
import socket
import sys
import time
from pathlib import Path
from typing import Any, Callable, Sequence

import yaml

from benchmarks.acceptance.arms import (
    ARMS,
    LAYERS,
    MAIN_DIFFERENCES,
    OTHER_DIFFERENCES,
    QUANTIZED,
    UNTRAINED,
    extract_overrides,
    quantized_runs,
    quantized_targets,
    runs_needed,
    trained,
)
from benchmarks.acceptance.data import data_stats, prepare_command, prepared_data
from benchmarks.acceptance.drafters import (
    check_drafter_command,
    check_serving_command,
    drafter_verdicts,
    served_config,
    serving_verdict,
)
from benchmarks.acceptance.hf_states import write_hf_features
from benchmarks.acceptance.pipeline import Job, OutOfTime, Pipeline, Served, logger, target_step
from benchmarks.acceptance.prompts import split_prompts, write_conversations
from benchmarks.acceptance.report import markdown
from benchmarks.acceptance.serving import (
    SERVE_MEMORY,
    SPEC_DRAFT_TOKENS,
    SPEC_STEPS,
    SPEC_TOPK,
    ServeSpec,
    read_answers,
    read_results,
    read_versions,
    served_results,
    start_serving,
    versions,
)
from benchmarks.acceptance.stats import acceptance_length, bootstrap_acceptance
from benchmarks.acceptance.trainer import (
    Recipe,
    last_train_metrics,
    specforge_command,
    specforge_env,
    specforge_run_config,
    train_curve,
    write_untrained_checkpoint,
)
from testbeds.smollm2 import build_checkpoint

PROBE_PROMPTS = 16
"""Held-out prompts the probe serves: enough for verify steps to run, few enough to take seconds."""
DISK_HEADROOM = 1.1, 3 << 30
"""Free space the runs and exports still to write must leave: 10% over their states' bytes, and 3 GiB more (the
drafters' checkpoints, logs, the engines' files)."""
SIDE_BY_SIDE = 8
"""Exports and checks at once (each a process that mostly imports torch or SGLang)."""


def stage_checkpoint(p: Pipeline) -> None:
    """The bf16 checkpoint, and its INT4 one when an arm is served on the INT4 target (a process of its own)."""
    p.step("checkpoint", lambda: {"path": str(build_checkpoint(p.model, Path(p.args.gguf) if p.args.gguf else None))})
    if "int4" in quantized_targets(p.args.arms):
        def make() -> dict[str, Any]:
            p.command([sys.executable, "-m", "benchmarks.acceptance.quantize_int4", str(p.model), str(p.model_int4)],
                      "checkpoint-int4")
            config = json.loads((p.model_int4 / "config.json").read_text())["quantization_config"]
            return {"path": str(p.model_int4), "ignore": len(config["ignore"])}
        p.step("checkpoint-int4", make)


def stage_prompts(p: Pipeline) -> None:
    def make() -> dict[str, Any]:
        train, held_out = split_prompts(p.args.train_prompts, p.args.eval_prompts, p.args.prompt_seed)
        p.train_conversations.parent.mkdir(parents=True, exist_ok=True)
        write_conversations(train, p.train_conversations)
        held_out_text = "".join(json.dumps({"prompt": prompt}) + "\n" for prompt in held_out)
        p.eval_prompts.write_text(held_out_text)
        # the digest tells runs apart whose held-out prompts differ (a report pooling runs pairs them prompt by prompt)
        return {"train": len(train), "held_out": len(held_out), "prompt_seed": p.args.prompt_seed,
                "held_out_sha256": hashlib.sha256(held_out_text.encode()).hexdigest()}
    p.step("prompts", make)


def stage_prepare(p: Pipeline) -> None:
    def make() -> dict[str, Any]:
        p.command(prepare_command(p.model, p.train_conversations, p.data, p.args.max_new_tokens,
                                  p.args.regenerate_cuda_graph), "prepare")
        return data_stats(p.data, Recipe.max_length)
    p.step("prepare", make)


def extract_command(p: Pipeline, run: str) -> list[str]:
    """``jobs.extract`` for one run. A quantized target's run takes the target's checkpoint, its serving command as
    ``model.serving`` (in a config file: a command's JSON values do not survive an override's YAML) and its dtype
    from it (SGLang's auto, the checkpoint's bf16, without --dtype); the others ``--dtype``."""
    device = "auto" if p.args.device == "cuda" else p.args.device
    command = [sys.executable, "-m", "jobs.extract"]
    target = next((target for target, own in QUANTIZED.items() if own == run), "bf16")
    if target != "bf16":
        config = p.work / "serving" / f"{run}.yaml"
        config.parent.mkdir(parents=True, exist_ok=True)
        config.write_text(yaml.safe_dump({"model": {"serving": list(p.serving(target))}}))
        command += ["--config", str(config)]
    else:
        command.append(f"model.dtype={p.args.dtype}")
    return [*command, f"model.path={p.target_model(target)}", f"data.path={prepared_data(p.data)}",
            f"output.dir={p.run_dir(run)}", f"model.device={device}", *extract_overrides(run, LAYERS),
            *p.args.extract_set]


def stage_extract(p: Pipeline) -> None:
    """Every run the arms need, the quantized ones first (once the disk is known to hold them and their exports)."""
    check_disk(p)
    for run in runs_needed(p.args.arms):
        def make(run: str = run) -> dict[str, Any]:
            p.command(extract_command(p, run), f"extract-{run}")
            return json.loads((p.run_dir(run) / ".summary.json").read_text())["this_run"]
        p.step(f"extract-{run}", make)


def check_disk(p: Pipeline) -> None:
    """Refuse, naming the sizes, when the runs and SpecForge exports still to write do not fit in --work: each holds
    every training token's states, and a disk full half-way through costs the run's whole device time."""
    tokens = (p.record("prepare") or {}).get("tokens", 0)
    hidden = json.loads((p.model / "config.json").read_text())["hidden_size"]
    per_copy = tokens * (len(LAYERS) + 1) * hidden * 2  # bf16 states of the layers and the final state
    runs = [run for run in runs_needed(p.args.arms) if p.record(f"extract-{run}") is None]
    exports = features_to_export(p)
    needed = (len(runs) + len(exports)) * per_copy
    free = shutil.disk_usage(p.work).free
    margin, spare = DISK_HEADROOM
    if needed and needed * margin + spare > free:
        raise ValueError(
            f"runs {', '.join(runs) or '-'} and exports {', '.join(exports) or '-'} need about "
            f"{needed / 1e9:.1f} GB ({per_copy / 1e9:.1f} GB each: {tokens:,} tokens) and {p.work} has "
            f"{free / 1e9:.1f} GB free: run with fewer --train-prompts or fewer arms, or --work on a larger disk")


def stage_probe(p: Pipeline) -> None:
    """Before any training, for each quantized target an arm is served on: an untrained drafter (SpecForge's
    initialisation, with the target's run's drafter config) served on that target over a few held-out prompts,
    so that a failure of the quantized serving path shows now, not after the training."""
    for target in quantized_targets(p.args.arms):
        p.step(target_step("probe", target), lambda target=target: probe(p, target))


def probe(p: Pipeline, target: str) -> dict[str, Any]:
    """``stage_probe``'s step for one target."""
    directory = p.work / target_step("probe", target)
    config = p.run_dir(QUANTIZED[target]) / ".drafter_config.json"
    checkpoint = write_untrained_checkpoint(config, directory, seed=0)
    p.command(specforge_command("export", "--to", "sglang", "--checkpoint", str(checkpoint), "--draft-config",
                                str(config), "--output-dir", str(directory / "drafter")),
              f"specforge-export-{target_step('probe', target)}", env=specforge_env())
    served_config(directory / "drafter", json.loads(config.read_text())["eagle_config"])
    prompts = directory / "prompts.jsonl"
    prompts.write_text("".join(p.eval_prompts.read_text().splitlines(keepends=True)[:PROBE_PROMPTS]))
    spec = ServeSpec(p.target_model(target), directory / "drafter", prompts, directory / "served.json",
                     p.args.max_new_tokens, p.args.attention_backend,
                     SERVE_MEMORY / max(1, p.args.serve_parallel), p.serving(target))
    results = served_results(start_serving(spec), spec.out)
    return {"prompts": len(results), "acceptance_length": acceptance_length(
        [r.verify_ct for r in results], [r.correct_drafts for r in results])}


def features_to_export(p: Pipeline) -> list[str]:
    """The trained arms' features not yet written (jobs.export of a run, or arm C's from HF), sorted."""
    return sorted(name for name in {ARMS[arm].features for arm in trained(p.args.arms)}
                  if p.record(f"export-{name}") is None and p.record(f"features-{name}") is None)


def stage_features(p: Pipeline) -> None:
    """SpecForge's features of every trained arm (jobs.export of its run, side by side; arm C's from HF)."""
    wanted = {ARMS[arm].features for arm in trained(p.args.arms)}
    for name in features_to_export(p):
        for stale in (p.work / "train").glob(f"vocab-{name}-*.pt"):  # a map of the features exported before
            stale.unlink()
    p.run_jobs({f"export-{run}": Job(
        [sys.executable, "-m", "jobs.export", f"output.dir={p.run_dir(run)}", "to=specforge",
         f"dest={p.features(run)}"],
        result=lambda output, code: {"log": (output.strip().splitlines() or [""])[-1]})
        for run in sorted(wanted - {"C"})}, at_once=SIDE_BY_SIDE)
    if "C" in wanted:
        p.step("features-C", lambda: {"c_vs_a": write_hf_features(
            p.model, p.run_dir("A"), p.features("C"), p.args.device, "bfloat16")})


def state_difference(p: Pipeline) -> dict[str, Job]:
    """With Q-bf16 (Q4-bf16): how far our bf16 states (A's run) are from the quantized target's (Q's, Q4's), per
    layer; CPU work in a process of its own each, run beside the trainings."""
    jobs = {}
    for arm in ("Q-bf16", "Q4-bf16"):
        if arm not in p.args.arms:
            continue
        run = QUANTIZED[ARMS[arm].target]
        key = f"{arm}_vs_{run}".lower().replace("-", "_")
        out = p.work / "differences" / f"{key}.json"
        out.parent.mkdir(parents=True, exist_ok=True)
        jobs[f"states-{arm}-vs-{run}"] = Job(
            [sys.executable, "-m", "benchmarks.acceptance.differences", str(p.run_dir(run)), str(p.run_dir("A")),
             str(out)],
            result=lambda output, code, key=key, out=out: {key: json.loads(out.read_text())})
    return jobs


def stage_train(p: Pipeline) -> None:
    """Every trained arm once per seed, ``--train-parallel`` SpecForge processes at once on the one GPU (each is
    small and mostly waits on kernel launches) with Q-bf16's state comparison beside them, then arm E's
    untrained checkpoints."""
    p.check_training_choices()
    pending = [(arm, seed) for seed in p.args.seeds for arm in trained(p.args.arms)
               if p.record(f"train-{arm}-s{seed}") is None]
    steps_per_epoch = p.steps_per_epoch() if pending else 0
    beside = state_difference(p)
    jobs = dict(beside)
    for (arm, seed), port in zip(pending, free_ports(len(pending))):
        directory = p.train_dir(arm, seed)
        directory.mkdir(parents=True, exist_ok=True)
        config = specforge_run_config(arm, p.features(ARMS[arm].features), p.model, p.training_draft_config(arm),
                                      directory / "out", p.recipe(seed), p.warm_start(arm, seed),
                                      p.vocab_mapping(ARMS[arm].features))
        (directory / "run.yaml").write_text(yaml.safe_dump(config, sort_keys=False))
        env = specforge_env({"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1",
                             "MASTER_PORT": str(port)})
        jobs[f"train-{arm}-s{seed}"] = Job(
            specforge_command("train", "-c", str(directory / "run.yaml")), env,
            lambda output, code: {"metrics": last_train_metrics(output), "curve": train_curve(output, steps_per_epoch),
                                  **p.training_choices()})
    p.run_jobs(jobs, at_once=p.args.train_parallel + len(beside))
    if UNTRAINED in {unit.arm for unit in p.drafters()}:
        for seed in p.args.seeds:
            p.step(f"train-{UNTRAINED}-s{seed}", lambda seed=seed: {"checkpoint": str(write_untrained_checkpoint(
                p.draft_config(UNTRAINED), p.train_dir(UNTRAINED, seed), seed))})


def free_ports(count: int) -> list[int]:
    """Ports for each trainer's torch.distributed rendezvous, all held at once so they differ."""
    with contextlib.ExitStack() as stack:
        sockets = [stack.enter_context(socket.socket()) for _ in range(count)]
        for sock in sockets:
            sock.bind(("127.0.0.1", 0))
        return [sock.getsockname()[1] for sock in sockets]


def stage_drafters(p: Pipeline) -> None:
    """Each drafter exported for SGLang (side by side), its eagle_config set to its arm's claim; then, side by
    side, jobs.check_drafter on the served drafters against the run each arm's states came from, and
    jobs.check_serving of each quantized target's serving command against the run of every arm served on it."""
    p.check_training_choices()

    def exported(unit: Served) -> Callable[[str, int], dict[str, Any]]:
        claimed = json.loads(p.draft_config(unit.arm).read_text())["eagle_config"]
        return lambda output, code: {"eagle_config": served_config(p.drafter(unit), claimed)["eagle_config"]}

    p.run_jobs({f"drafter-{unit.name}": Job(
        specforge_command("export", "--to", "sglang", "--checkpoint", str(p.checkpoint(unit)), "--draft-config",
                          str(p.training_draft_config(unit.arm)), "--output-dir", str(p.drafter(unit))),
        specforge_env(), exported(unit)) for unit in p.drafters()}, at_once=SIDE_BY_SIDE)
    p.run_jobs({**drafter_checks(p), **serving_checks(p)}, at_once=SIDE_BY_SIDE)


def drafter_checks(p: Pipeline) -> dict[str, Job]:
    """Per seed and run, jobs.check_drafter on the drafters served for arms whose states came from that run."""
    jobs = {}
    for seed in p.args.seeds:
        units = [unit for unit in p.served() if unit.seed == seed]
        for run in sorted({ARMS[unit.arm].run for unit in units}):
            drafters = list(dict.fromkeys(p.drafter(unit) for unit in units if ARMS[unit.arm].run == run))
            jobs[f"check-drafter-{run}-s{seed}"] = Job(
                check_drafter_command(drafters, p.run_dir(run)), ok=(0, 1),
                result=lambda output, code, drafters=drafters: {
                    str(path): verdict for path, verdict in zip(drafters, drafter_verdicts(output, drafters))})
    return jobs


def serving_checks(p: Pipeline) -> dict[str, Job]:
    """jobs.check_serving of each quantized target's serving command against the run of every arm served on it."""
    return {target_step(f"check-serving-{run}", target): Job(
        check_serving_command(p.run_dir(run), p.serving(target)), ok=(0, 1), result=serving_verdict)
        for target in quantized_targets(p.args.arms) for run in quantized_runs(p.args.arms, target)}


def stage_serve(p: Pipeline) -> None:
    """Each drafter served over the held-out prompts, ``--serve-parallel`` engines at once on the one GPU
    (135M parameters each: the GPU's memory is shared out, each gets an equal fraction), the quantized target's
    first."""
    pending = [unit for unit in p.served() if p.record(f"serve-{unit.name}") is None]
    (p.work / "serve").mkdir(parents=True, exist_ok=True)
    for batch in serving_batches(pending, max(1, p.args.serve_parallel)):
        if p.out_of_time():
            raise OutOfTime(f"serve-{batch[0].name}")
        started = time.perf_counter()
        p.progress(step=" ".join(f"serve-{unit.name}" for unit in batch))
        processes = {unit: start_serving(ServeSpec(
            p.target_model(ARMS[unit.arm].target), p.drafter(unit), p.prompts(unit),
            p.served_file(unit), p.args.max_new_tokens, p.args.attention_backend,
            SERVE_MEMORY / len(batch), p.serving(ARMS[unit.arm].target))) for unit in batch}
        for unit, process in processes.items():
            results = served_results(process, p.served_file(unit))
            p.save(f"serve-{unit.name}", {"prompts": len(results), "engines_at_once": len(batch)},
                   time.perf_counter() - started)


def serving_batches(units: Sequence[Served], parallel: int) -> list[list[Served]]:
    """Engines side by side, ``parallel`` at a time in the order given (the quantized target's first), each
    started once the one before holds its memory (``start_serving``)."""
    return [list(units[start : start + parallel]) for start in range(0, len(units), parallel)]


def stage_report(p: Pipeline) -> dict[str, Any]:
    p.check_training_choices()
    planned = p.served()
    units = [unit for unit in planned if p.served_file(unit).is_file()]
    not_served = [unit.name for unit in planned if unit not in units]
    if not units:
        raise ValueError(f"no engine's results under {p.work / 'serve'}: run the serve stage first")
    if not_served:
        logger.warning("the report leaves out the engines not served: %s", ", ".join(not_served))
    served = {unit: read_results(p.served_file(unit)) for unit in units}
    finals = {}
    for unit in (unit for unit in units if unit.final):
        finals.setdefault(unit.arm, {})[unit.seed] = served[unit]
    acceptance = bootstrap_acceptance(finals, pairs=MAIN_DIFFERENCES + OTHER_DIFFERENCES, main=MAIN_DIFFERENCES)

    def alone(unit: Served) -> dict[str, Any]:
        """One engine's acceptance and its interval, outside the arms' table."""
        return bootstrap_acceptance({unit.name: {unit.seed: served[unit]}})["arms"][unit.name]["seeds"][str(unit.seed)]

    results: dict[str, Any] = {
        "arms": list(p.args.arms),
        "not_served": not_served,
        "acceptance": acceptance,
        "epoch_acceptance": {unit.name: alone(unit) for unit in units if unit.epoch},
        "training_distribution_acceptance": {unit.drafter.name: {"arm": unit.arm, "seed": unit.seed, **alone(unit)}
                                             for unit in units if unit.training_distribution},
        "same_output": same_output({unit: results for unit, results in served.items()
                                    if not unit.training_distribution}),
        "answers": target_answers(p, units),
        "training": {name.removeprefix("train-"): p.record(name) for name in
                     (f"train-{arm}-s{seed}" for seed in p.args.seeds for arm in (*trained(p.args.arms), UNTRAINED))
                     if p.record(name) is not None},
        "check_drafter": {unit.name: verdicts.get(str(p.drafter(unit)), {}) for unit in units
                          if (verdicts := p.record(f"check-drafter-{ARMS[unit.arm].run}-s{unit.seed}"))},
        "check_serving": {target_step(run, target): {**record, "command": list(p.serving(target))}
                          for target in quantized_targets(p.args.arms) for run in quantized_runs(p.args.arms, target)
                          if (record := p.record(target_step(f"check-serving-{run}", target)))},
        "data": {**p.record("prompts"), **p.record("prepare")},
        "recipe": {**{k: v for k, v in dataclasses.asdict(p.recipe(p.args.seeds[0])).items() if k != "seed"},
                   "seeds": list(p.args.seeds)},
        "serving": {"speculative_num_steps": SPEC_STEPS, "speculative_eagle_topk": SPEC_TOPK,
                    "speculative_num_draft_tokens": SPEC_DRAFT_TOKENS, "temperature": 0,
                    "max_new_tokens": p.args.max_new_tokens, "attention_backend": p.args.attention_backend,
                    "quantized_serving": list(p.args.quantized_serving), "int4_serving": list(p.args.int4_serving),
                    "engines": {unit.name: json.loads(p.served_file(unit).read_text())
                                .get("engine") for unit in units}},
        "seconds": {path.stem: json.loads(path.read_text())["seconds"]
                    for path in sorted((p.work / "steps").glob("*.json"))},
        "versions": next((found for unit in units if (found := read_versions(p.served_file(unit)))),
                         versions()),  # where the engines served (a report built elsewhere from collected records)
        "command": " ".join(sys.argv),
    }
    for step, key in (("features-C", "c_vs_a"), ("states-Q-bf16-vs-Q", "q_bf16_vs_q"),
                      ("states-Q4-bf16-vs-Q4", "q4_bf16_vs_q4")):
        if (record := p.record(step)) is not None:
            results[key] = record[key]
    for target in QUANTIZED:
        if (probe := p.record(target_step("probe", target))) is not None:
            results[target_step("probe", target)] = probe
    out = Path(p.args.out) if p.args.out else p.work / "results.json"
    out.write_text(json.dumps(results, indent=2) + "\n")
    out.with_suffix(".md").write_text(markdown(results))
    print(markdown(results))
    return results


def target_answers(p: Pipeline, units: Sequence[Served]) -> dict[str, list[dict[str, str]]]:
    """Per target served (bf16 first, then fp8, int4), the first held-out prompts' answers at the first seed, from
    its own arm (A, Q, Q4) where that was served, else from another arm on it: whether a quantized target still
    answers."""
    answers = {}
    for target in ("bf16", *QUANTIZED):
        on_target = [unit for unit in units if ARMS[unit.arm].target == target and unit.final
                     and unit.seed == p.args.seeds[0]]
        on_target.sort(key=lambda unit: unit.arm != QUANTIZED.get(target, "A"))
        if on_target and (found := read_answers(p.served_file(on_target[0]))):
            answers[target] = found
    return answers


def same_output(served: dict[Served, list]) -> dict[str, float]:
    """Per served drafter, the share of prompts whose output ids equal those of the same target's reference arm
    (A on the bf16 target, Q or Q4 on a quantized one) of the same seed: greedy speculative decoding is meant to give
    the target's own answers."""
    by_name = {unit.name: results for unit, results in served.items()}
    shares = {}
    for unit, results in served.items():
        reference = Served(QUANTIZED.get(ARMS[unit.arm].target, "A"), unit.seed).name
        if reference in by_name and reference != unit.name:
            same = sum(r.output_sha == a.output_sha for r, a in zip(results, by_name[reference]))
            shares[unit.name] = same / len(results)
    return shares


STAGE_FUNCTIONS: dict[str, Callable[[Pipeline], Any]] = {
    "checkpoint": stage_checkpoint, "prompts": stage_prompts, "prepare": stage_prepare, "extract": stage_extract,
    "probe": stage_probe, "features": stage_features, "train": stage_train, "drafters": stage_drafters,
    "serve": stage_serve, "report": stage_report,
}
STAGES = tuple(STAGE_FUNCTIONS)
"""The stages in the order they run."""
