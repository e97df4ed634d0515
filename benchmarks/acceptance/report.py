"""The results tables (Markdown, for benchmarks/RESULTS.md)."""

from __future__ import annotations

from typing import Any

from benchmarks.acceptance.arms import ARMS
from benchmarks.acceptance.serving import SPEC_DRAFT_TOKENS, SPEC_STEPS, SPEC_TOPK


def _interval(stats: dict[str, Any], bold: bool = True) -> str:
    value = f"{stats['acceptance_length']:.3f}"
    return f"{f'**{value}**' if bold else value} ({stats['ci95'][0]:.3f}-{stats['ci95'][1]:.3f})"


def _signed(diff: dict[str, Any]) -> str:
    return f"{diff['estimate']:+.3f} ({diff['ci95'][0]:+.3f} to {diff['ci95'][1]:+.3f})"


def _data_line(results: dict[str, Any]) -> list[str]:
    if "data" not in results or "recipe" not in results:
        return []
    data, recipe = results["data"], results["recipe"]
    epochs = recipe["epochs"]  # a --max-steps cap below the epochs' steps trains fewer
    if recipe.get("max_steps"):
        epochs = min(epochs, recipe["max_steps"] * recipe["batch_size"] / data["samples"])
    seeds = ", ".join(map(str, recipe.get("seeds", [recipe.get("seed", 0)])))
    vocabulary = recipe.get("draft_vocab") or "the target's"
    head = "started from the target's" if recipe.get("warm_head") else "initialised at random"
    return [f"Training data (every arm): {data['samples']} samples, {data['tokens']} tokens, "
            f"{data['loss_tokens_per_epoch']} loss tokens per epoch x {epochs:.2f} epochs = "
            f"{round(data['loss_tokens_per_epoch'] * epochs)} tokens trained; batch {recipe['batch_size']}, "
            f"learning rate {recipe['learning_rate']}, {recipe.get('ttt_length', 7)} draft steps unrolled, draft "
            f"vocabulary {vocabulary}, head {head}, training seeds {seeds}"
            + (f", capped at {recipe['max_steps']} steps." if recipe.get("max_steps") else "."), ""]


def _arm_rows(results: dict[str, Any]) -> list[str]:
    acceptance, train = results["acceptance"], results.get("training", {})
    lines = ["| arm | states | target | seed | acceptance length (95% CI) | final train loss / acc | steps "
             "| check_drafter |", "|---|---|---|---|---|---|---|---|"]
    for arm, entry in acceptance["arms"].items():
        spec = ARMS[arm]
        target = spec.target
        for seed, stats in entry["seeds"].items():
            metrics = train.get(f"{spec.drafter_of}-s{seed}", {}).get("metrics", {})
            fit = f"{metrics['loss']:.3f} / {metrics['acc']:.3f}" if "loss" in metrics else "(untrained)"
            if spec.drafter_of != arm:
                fit += f" ({spec.drafter_of}'s)"
            check = results.get("check_drafter", {}).get(f"{arm}-s{seed}", {})
            verdict = "PASS" if check.get("passed") else ("FAIL" if check else "")
            lines.append(f"| {arm} | {spec.states} | {target} | {seed} | {_interval(stats)} | {fit} "
                         f"| {metrics.get('step', 0)} | {verdict} |")
        if "pooled" in entry:
            lines.append(f"| {arm} | | {target} | pooled | {_interval(entry['pooled'])} | | | |")
    return lines


def _difference_rows(results: dict[str, Any]) -> list[str]:
    differences = results["acceptance"]["differences"]
    if not differences:
        return []
    lines = ["", "| difference (paired, same prompts) | seed | estimate (95% CI) |", "|---|---|---|"]
    ordered = sorted(differences.items(), key=lambda item: not item[1].get("main"))
    for name, entry in ordered:
        shown = f"**{name}**" if entry.get("main") else name
        lines += [f"| {shown} | {seed} | {_signed(diff)} |" for seed, diff in entry["seeds"].items()]
        if "pooled" in entry:
            lines.append(f"| {shown} | pooled | {_signed(entry['pooled'])} |")
    return lines


def _checks(results: dict[str, Any]) -> list[str]:
    checks = results.get("check_serving", {})
    if not checks:
        return []
    lines = ["", "| jobs.check_serving: a quantized target's command against run (-int4: the INT4 target's) | verdict "
             "| settings that differ |",
             "|---|---|---|"]
    for run, check in checks.items():
        lines.append(f"| {run} | {'PASS' if check['passed'] else 'FAIL'} | {' '.join(check['differences']) or '-'} |")
    return lines


def _layer_table(title: str, report: dict[str, Any]) -> list[str]:
    tokens = next(iter(report.values()), {}).get("tokens")
    head = f"{title}, per-token relative difference" + (f" ({tokens:,} tokens)" if tokens else "")
    return ["", f"| {head} | mean | max |", "|---|---|---|",
            *[f"| {name} | {d['mean']:.4f} | {d['max']:.4f} |" for name, d in report.items()]]


def _quantized_states(results: dict[str, Any]) -> list[str]:
    """Our bf16 states (A's run) against each quantized target's own (Q's fp8, Q4's INT4), per layer, side by
    side."""
    reports = {name: results[key] for name, key in (("fp8 (Q)", "q_bf16_vs_q"), ("INT4 (Q4)", "q4_bf16_vs_q4"))
               if key in results}
    if not reports:
        return []
    tokens = ", ".join(f"{name} {next(iter(report.values()))['tokens']:,}" for name, report in reports.items())
    head = " | ".join(f"{name} mean | {name} max" for name in reports)
    lines = ["", f"| our bf16 states (A) vs the quantized target's, per-token relative difference ({tokens} tokens) "
                 f"| {head} |", "|---|" + "---|---|" * len(reports)]
    for layer in next(iter(reports.values())):
        cells = " | ".join(f"{report[layer]['mean']:.4f} | {report[layer]['max']:.4f}" if layer in report else " | "
                           for report in reports.values())
        lines.append(f"| {layer} | {cells} |")
    return lines


def _curves(results: dict[str, Any]) -> list[str]:
    rows = [(name, point) for name, record in results.get("training", {}).items() for point in record.get("curve", [])]
    if not rows:
        return []
    lines = ["", "| training (SpecForge's logged steps) | epoch | steps | mean loss | mean acc | mean acc_0 "
                 "| last acc |",
             "|---|---|---|---|---|---|---|"]
    for name, point in rows:
        steps = f"{point['steps'][0]}-{point['steps'][1]}"
        values = " | ".join(f"{point[key]:.3f}" if key in point else "" for key in
                            ("mean_loss", "mean_acc", "mean_acc_0", "acc"))
        lines.append(f"| {name} | {point['epoch']} | {steps} | {values} |")
    return lines


def _epoch_acceptance(results: dict[str, Any]) -> list[str]:
    served = results.get("epoch_acceptance", {})
    if not served:
        return []
    lines = ["", "| drafter at the end of an earlier epoch | acceptance length (95% CI) |", "|---|---|"]
    return lines + [f"| {name} | {_interval(stats, bold=False)} |" for name, stats in served.items()]


def _training_distribution(results: dict[str, Any]) -> list[str]:
    served = results.get("training_distribution_acceptance", {})
    if not served:
        return []
    arms = results["acceptance"]["arms"]
    lines = ["", "| drafter | held-out prompts (another distribution) | fresh prompts of the training distribution |",
             "|---|---|---|"]
    for name, stats in served.items():
        held_out = arms.get(stats["arm"], {}).get("seeds", {}).get(str(stats["seed"]))
        lines.append(f"| {name} | {_interval(held_out, bold=False) if held_out else '-'} | "
                     f"{_interval(stats, bold=False)} |")
    return lines


ANSWER_CHARS = 160
"""An answer's text in the report is cut at this many characters."""


def _answers(results: dict[str, Any]) -> list[str]:
    """The first held-out prompts' answers on each target served, side by side: a quantized target still answers
    (or does not)."""
    answers = results.get("answers", {})
    if not answers:
        return []
    targets = list(answers)
    lines = ["", f"| held-out prompt | {' | '.join(f'answer on the {target} target' for target in targets)} |",
             "|---|" + "---|" * len(targets)]
    for index, first in enumerate(answers[targets[0]]):
        cells = [_cell(answers[target][index]["answer"]) if index < len(answers[target]) else ""
                 for target in targets]
        lines.append(f"| {_cell(first['prompt'])} | {' | '.join(cells)} |")
    return lines


def _cell(text: str) -> str:
    text = " ".join(text.split())
    text = text if len(text) <= ANSWER_CHARS else text[:ANSWER_CHARS] + "..."
    return text.replace("|", "\\|")


def markdown(results: dict[str, Any]) -> str:
    """The tables for benchmarks/RESULTS.md: acceptance with its interval per arm and seed, pooled, the paired
    differences (the main ones first), the serving check, the state differences, the training curve."""
    acceptance = results["acceptance"]
    lines = [
        f"Acceptance length = 1 + correct drafts / verify steps over {acceptance['prompts']} held-out "
        f"prompts (SGLang EAGLE3, {SPEC_STEPS} steps, top-k {SPEC_TOPK}, {SPEC_DRAFT_TOKENS} draft tokens, "
        "temperature 0), bootstrap 95% interval over prompts; pooled: every seed's prompts together.", "",
    ]
    if results.get("not_served"):
        lines += [f"Not served (the run ended before them): {', '.join(results['not_served'])}.", ""]
    serving = results.get("serving", {})
    targets = {ARMS[arm].target for arm in acceptance["arms"]}
    if serving.get("quantized_serving") and "fp8" in targets:
        lines += [f"Quantized target fp8: the bf16 checkpoint served with `{' '.join(serving['quantized_serving'])}` "
                  "(SGLang quantizes the drafter the same way unless the command sets "
                  "--speculative-draft-model-quantization).", ""]
    if serving.get("int4_serving") and "int4" in targets:
        lines += [f"Quantized target int4: the INT4 checkpoint (RTN, group 32, compressed-tensors W4A16) served with "
                  f"`{' '.join(serving['int4_serving'])}`.", ""]
    lines += _data_line(results) + _arm_rows(results) + _difference_rows(results) + _checks(results)
    if "c_vs_a" in results:
        lines += _layer_table("C vs A", results["c_vs_a"])
    lines += _quantized_states(results) + _answers(results) + _curves(results) + _epoch_acceptance(results)
    lines += _training_distribution(results)
    for key, target in (("probe", "fp8"), ("probe-int4", "int4")):
        if key in results:
            probe = results[key]
            lines += ["", f"Probe of the {target} path before training: an untrained drafter served on the {target} "
                          f"target over {probe['prompts']} prompts, acceptance {probe['acceptance_length']:.3f}, "
                          f"{probe['seconds']:.0f} s."]
    lines += ["", "Step wall times: " + ", ".join(f"{k} {v:.0f} s" for k, v in results.get("seconds", {}).items()),
              "Versions: " + ", ".join(f"{k} {v}" for k, v in results.get("versions", {}).items())]
    return "\n".join(lines) + "\n"
