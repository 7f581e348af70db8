"""Example reward functions for `reward.functions` (README: "Rewards you bring").

reward:
  rewards: {format_boxed: 0.1}                       # built-in names still work, summed with the functions
  functions:
    - {path: examples/reward_functions.py, name: compute_score, weight: 1.0}
    - {path: examples/reward_functions.py, name: length_penalty, weight: 1.0, batched: true}
"""

from __future__ import annotations


def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    """verl's signature, one row per call. The dict's `score` is the reward; its other keys become metrics
    (reward/reward_functions.compute_score/acc, .../response_chars)."""
    response = solution_str.strip()
    correct = response.startswith(ground_truth.strip())
    return {"score": 1.0 if correct else 0.0, "acc": float(correct), "response_chars": float(len(response))}


def length_penalty(data_sources, solution_strs, ground_truths, extra_infos):
    """Batched (`batched: true`): lists in, one score per row out. -0.01 per character beyond the answer's length."""
    return [
        -0.01 * max(0, len(solution.strip()) - len(truth.strip()))
        for solution, truth in zip(solution_strs, ground_truths)
    ]
