"""The results table (Markdown, for benchmarks/RESULTS.md) and the versions that produced it."""

from __future__ import annotations

import contextlib
import importlib.metadata
from typing import Any

from benchmarks.acceptance.arms import ARM_STATES
from benchmarks.acceptance.serving import SPEC_DRAFT_TOKENS, SPEC_STEPS, SPEC_TOPK


def versions() -> dict[str, str]:
    found = {}
    for name in ("sglang", "torch", "transformers", "flashinfer-python", "specforge", "ray"):
        with contextlib.suppress(importlib.metadata.PackageNotFoundError):
            found[name] = importlib.metadata.version(name)
    return found


def markdown(results: dict[str, Any]) -> str:
    """The table for benchmarks/RESULTS.md: acceptance with its interval per arm, training, differences."""
    arms, train = results["acceptance"]["arms"], results.get("training", {})
    lines = [
        f"Acceptance length = 1 + correct drafts / verify steps over {results['acceptance']['prompts']} held-out "
        f"prompts (SGLang EAGLE3, {SPEC_STEPS} steps, top-k {SPEC_TOPK}, {SPEC_DRAFT_TOKENS} draft tokens, "
        "temperature 0), bootstrap 95% interval over prompts.", "",
    ]
    if "data" in results and "recipe" in results:
        data, recipe = results["data"], results["recipe"]
        epochs = recipe["epochs"]  # a --max-steps cap below the epochs' steps trains fewer
        if recipe.get("max_steps"):
            epochs = min(epochs, recipe["max_steps"] * recipe["batch_size"] / data["samples"])
        lines += [f"Training data (every arm): {data['samples']} samples, {data['tokens']} tokens, "
                  f"{data['loss_tokens_per_epoch']} loss tokens per epoch x {epochs:.2f} epochs = "
                  f"{round(data['loss_tokens_per_epoch'] * epochs)} tokens trained; batch {recipe['batch_size']}, "
                  f"learning rate {recipe['learning_rate']}, seed {recipe['seed']}"
                  + (f", capped at {recipe['max_steps']} steps." if recipe.get("max_steps") else "."), ""]
    lines += [
        "| arm | states | acceptance length (95% CI) | final train loss / acc | steps | check_drafter |",
        "|---|---|---|---|---|---|",
    ]
    for arm, stats in arms.items():
        metrics = train.get(arm, {}).get("metrics", {})
        fit = (f"{metrics['loss']:.3f} / {metrics['acc']:.3f}" if "loss" in metrics else "(untrained)")
        check = results.get("check_drafter", {}).get(arm, {})
        verdict = "PASS" if check.get("passed") else ("FAIL" if check else "")
        low, high = stats["ci95"]
        lines.append(f"| {arm} | {ARM_STATES[arm]} | **{stats['acceptance_length']:.3f}** ({low:.3f}-{high:.3f}) "
                     f"| {fit} | {metrics.get('step', 0)} | {verdict} |")
    lines += ["", "| difference | estimate (95% CI) |", "|---|---|"]
    for name, diff in results["acceptance"]["differences"].items():
        lines.append(f"| {name} | {diff['estimate']:+.3f} ({diff['ci95'][0]:+.3f} to {diff['ci95'][1]:+.3f}) |")
    if "c_vs_a" in results:
        lines += ["", "| C vs A, per-token relative difference | mean | max |", "|---|---|---|"]
        lines += [f"| {name} | {d['mean']:.4f} | {d['max']:.4f} |" for name, d in results["c_vs_a"].items()]
    lines += ["", "Step wall times: " + ", ".join(f"{k} {v:.0f} s" for k, v in results.get("seconds", {}).items()),
              "Versions: " + ", ".join(f"{k} {v}" for k, v in results.get("versions", {}).items())]
    return "\n".join(lines) + "\n"
