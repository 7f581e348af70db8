"""Validation metrics over n samples per prompt: mean@n, the unbiased pass@k estimator and majority vote maj@k.

- mean@n: the mean reward of all samples.
- pass@k: the probability that at least one of k samples drawn without replacement from a prompt's n is correct,
  1 - C(n-c, k) / C(n, k) with c correct of n (Chen et al., 2021), averaged over prompts. k <= n.
- maj@k: a prompt scores 1 when the most frequent extracted answer among its first k samples is correct. Ties go to
  the answer whose samples have the highest mean reward, then to the one seen first; an answer is correct when its
  samples' mean reward reaches the threshold. k <= n.

A sample is correct when its reward >= `threshold`. Answers are extracted by the caller (the run uses the exact-
match reward's rule: the last \\boxed{} content, else the whole response, normalised).
"""

from __future__ import annotations

from collections.abc import Sequence
from math import comb

import numpy as np


def pass_at_k(n: int, correct: int, k: int) -> float:
    """1 - C(n-c, k) / C(n, k): the chance that k of the n samples, drawn without replacement, hold a correct one."""
    if not 1 <= k <= n or not 0 <= correct <= n:
        raise ValueError(f"pass@k needs 1 <= k <= n and 0 <= c <= n, got n={n}, c={correct}, k={k}")
    return 1.0 - comb(n - correct, k) / comb(n, k)


def majority_correct(answers: Sequence[str], rewards: Sequence[float], k: int, threshold: float) -> float:
    """1.0 when the majority answer of the first k samples is correct (see the module docstring), else 0.0."""
    if not 1 <= k <= len(answers):
        raise ValueError(f"maj@k needs 1 <= k <= n, got k={k} with n={len(answers)}")
    votes: dict[str, list[float]] = {}
    for answer, reward in zip(answers[:k], rewards[:k]):
        votes.setdefault(answer, []).append(float(reward))
    # max() keeps the first of equal keys: dicts iterate in the order answers were first seen.
    _, winner = max(votes.items(), key=lambda item: (len(item[1]), float(np.mean(item[1]))))
    return 1.0 if float(np.mean(winner)) >= threshold else 0.0


def validation_metrics(
    prompt_ids: Sequence,
    sources: Sequence[str],
    rewards: Sequence[float],
    answers: Sequence[str],
    response_lengths: Sequence[int],
    pass_k: Sequence[int],
    maj_k: Sequence[int],
    threshold: float,
) -> dict[str, float]:
    """`val/<source>/...` and `val/all/...` metrics of samples given in prompt order (a prompt's samples together,
    in the order they were drawn): mean@n, pass@k, maj@k per prompt averaged over its source's prompts, and the mean
    response length."""
    by_prompt: dict = {}
    for index, prompt in enumerate(prompt_ids):
        by_prompt.setdefault(prompt, []).append(index)
    per_source: dict[str, dict[str, list[float]]] = {}
    for indices in by_prompt.values():
        n = len(indices)
        scores = [float(rewards[i]) for i in indices]
        correct = sum(score >= threshold for score in scores)
        row = {
            f"mean@{n}": float(np.mean(scores)),
            "response_length": float(np.mean([response_lengths[i] for i in indices])),
        }
        row |= {f"pass@{k}": pass_at_k(n, correct, k) for k in pass_k}
        row |= {f"maj@{k}": majority_correct([answers[i] for i in indices], scores, k, threshold) for k in maj_k}
        for source in (str(sources[indices[0]]), "all"):
            for name, value in row.items():
                per_source.setdefault(source, {}).setdefault(name, []).append(value)
    return {
        f"val/{source}/{name}": float(np.mean(values))
        for source, named in per_source.items()
        for name, values in named.items()
    }
