"""Acceptance length per arm, with a bootstrap interval over prompts and the paired differences from A."""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np

from benchmarks.acceptance.serving import PromptResult

BOOTSTRAP_RESAMPLES = 10_000


def acceptance_length(verify_ct: np.ndarray, correct: np.ndarray) -> float:
    """1 + correct drafts per verify step: the tokens each target forward yields (the bonus token included)."""
    total = int(np.sum(verify_ct))
    if total == 0:
        raise ValueError("no verify step ran: speculative decoding was off, or every answer was one token")
    return 1.0 + float(np.sum(correct)) / total


def bootstrap_acceptance(arms: dict[str, Sequence[PromptResult]], seed: int = 0,
                         resamples: int = BOOTSTRAP_RESAMPLES) -> dict[str, Any]:
    """Acceptance length per arm with a percentile bootstrap 95% interval over prompts, and each arm's
    difference from A on the same resampled prompts (paired: every arm answered the same prompts)."""
    counts = {arm: len(results) for arm, results in arms.items()}
    if len(set(counts.values())) != 1:
        raise ValueError(f"arms served different numbers of prompts: {counts}")
    n = next(iter(counts.values()))
    index = np.random.default_rng(seed).integers(0, n, size=(resamples, n))
    samples, report = {}, {"arms": {}, "differences": {}, "resamples": resamples, "prompts": n}
    for arm, results in arms.items():
        verify = np.array([r.verify_ct for r in results], dtype=np.int64)
        correct = np.array([r.correct_drafts for r in results], dtype=np.int64)
        samples[arm] = 1.0 + correct[index].sum(axis=1) / np.maximum(verify[index].sum(axis=1), 1)
        low, high = np.percentile(samples[arm], [2.5, 97.5])
        report["arms"][arm] = {"acceptance_length": acceptance_length(verify, correct), "ci95": [low, high],
                               "verify_steps": int(verify.sum()), "correct_drafts": int(correct.sum()),
                               "completion_tokens": int(sum(r.completion_tokens for r in results))}
    if "A" in arms:
        for arm in (a for a in arms if a != "A"):
            estimate = report["arms"]["A"]["acceptance_length"] - report["arms"][arm]["acceptance_length"]
            low, high = np.percentile(samples["A"] - samples[arm], [2.5, 97.5])
            report["differences"][f"A-{arm}"] = {"estimate": estimate, "ci95": [low, high]}
    return report
