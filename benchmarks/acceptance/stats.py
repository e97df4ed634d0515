"""Acceptance length per arm and training seed, with a bootstrap interval over prompts, pooled over seeds, and
paired differences between arms."""

from __future__ import annotations

from typing import Any, Mapping, Sequence

import numpy as np

from benchmarks.acceptance.serving import PromptResult

BOOTSTRAP_RESAMPLES = 10_000


def acceptance_length(verify_ct: np.ndarray, correct: np.ndarray) -> float:
    """1 + correct drafts per verify step: the tokens each target forward yields (the bonus token included)."""
    total = int(np.sum(verify_ct))
    if total == 0:
        raise ValueError("no verify step ran: speculative decoding was off, or every answer was one token")
    return 1.0 + float(np.sum(correct)) / total


def difference_name(first: str, second: str) -> str:
    """``A-B``; ``Q-(Q-bf16)`` where a name has a dash of its own."""
    return "-".join(f"({name})" if "-" in name else name for name in (first, second))


class Resampled:
    """One arm's results over the seeds it was served with: the point estimate and its bootstrap samples, the
    same resampled prompts for every arm and seed (so differences are paired)."""

    def __init__(self, by_seed: Mapping[int, Sequence[PromptResult]], index: np.ndarray) -> None:
        self.verify = {seed: np.array([r.verify_ct for r in results], dtype=np.int64)
                       for seed, results in by_seed.items()}
        self.correct = {seed: np.array([r.correct_drafts for r in results], dtype=np.int64)
                        for seed, results in by_seed.items()}
        self.tokens = {seed: int(sum(r.completion_tokens for r in results)) for seed, results in by_seed.items()}
        self.sums = {seed: (self.correct[seed][index].sum(axis=1), self.verify[seed][index].sum(axis=1))
                     for seed in by_seed}

    def estimate(self, seeds: Sequence[int]) -> float:
        return acceptance_length(sum(self.verify[s].sum() for s in seeds), sum(self.correct[s].sum() for s in seeds))

    def samples(self, seeds: Sequence[int]) -> np.ndarray:
        """Acceptance length on each resample, over the prompts of every seed in ``seeds`` (pooled: a ratio of sums)."""
        correct = sum(self.sums[s][0] for s in seeds)
        verify = sum(self.sums[s][1] for s in seeds)
        return 1.0 + correct / np.maximum(verify, 1)

    def stats(self, seeds: Sequence[int]) -> dict[str, Any]:
        low, high = np.percentile(self.samples(seeds), [2.5, 97.5])
        return {"acceptance_length": self.estimate(seeds), "ci95": [float(low), float(high)],
                "verify_steps": int(sum(self.verify[s].sum() for s in seeds)),
                "correct_drafts": int(sum(self.correct[s].sum() for s in seeds)),
                "completion_tokens": sum(self.tokens[s] for s in seeds)}


def bootstrap_acceptance(served: Mapping[str, Mapping[int, Sequence[PromptResult]]],
                         pairs: Sequence[tuple[str, str]] = (), main: Sequence[tuple[str, str]] = (), seed: int = 0,
                         resamples: int = BOOTSTRAP_RESAMPLES) -> dict[str, Any]:
    """Acceptance length per arm and seed with a percentile bootstrap 95% interval over prompts, pooled over the
    seeds when there are several; for each pair of arms served, their difference per seed and pooled, on the same
    resampled prompts (paired: every arm answered the same prompts). ``main`` pairs are marked as such."""
    counts = {f"{arm} seed {s}": len(results) for arm, by_seed in served.items() for s, results in by_seed.items()}
    if len(set(counts.values())) != 1:
        raise ValueError(f"arms served different numbers of prompts: {counts}")
    n = next(iter(counts.values()))
    index = np.random.default_rng(seed).integers(0, n, size=(resamples, n))
    resampled = {arm: Resampled(by_seed, index) for arm, by_seed in served.items()}
    all_seeds = sorted({s for by_seed in served.values() for s in by_seed})
    report: dict[str, Any] = {"prompts": n, "resamples": resamples, "seeds": all_seeds, "arms": {}, "differences": {}}
    for arm, arm_resampled in resampled.items():
        seeds = sorted(served[arm])
        entry: dict[str, Any] = {"seeds": {str(s): arm_resampled.stats([s]) for s in seeds}}
        if len(seeds) > 1:
            entry["pooled"] = arm_resampled.stats(seeds)
        report["arms"][arm] = entry
    for first, second in pairs:
        if first not in served or second not in served:
            continue
        common = sorted(set(served[first]) & set(served[second]))
        groups = {str(s): [s] for s in common} | ({"pooled": common} if len(common) > 1 else {})
        entry = {"pair": [first, second], "main": (first, second) in main, "seeds": {}}
        for label, seeds in groups.items():
            low, high = np.percentile(resampled[first].samples(seeds) - resampled[second].samples(seeds), [2.5, 97.5])
            value = {"estimate": resampled[first].estimate(seeds) - resampled[second].estimate(seeds),
                     "ci95": [float(low), float(high)]}
            if label == "pooled":
                entry["pooled"] = value
            else:
                entry["seeds"][label] = value
        report["differences"][difference_name(first, second)] = entry
    return report
