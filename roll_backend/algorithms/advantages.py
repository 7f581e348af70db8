"""Advantage estimators: GAE, GRPO (and Dr.GRPO), RLOO, REINFORCE++ (with and without baseline), ReMax.

Inputs are token-level rewards [B, T] (an outcome reward sits on the last valid token). The group
estimators score a response by the sum of its rewards over all T positions (no mask). Advantages are
training targets, so every estimator runs under `torch.no_grad()`. `ADVANTAGE_ESTIMATORS` is the
only list of valid estimator names.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from roll_backend.algorithms.registry import lookup
from roll_backend.algorithms.stats import as_group_ids, group_stats, masked_whiten, zero_outside_mask

GRPO_EPS = 1e-6  # added to the group std (not inside a square root)


@torch.no_grad()
def gae(
    rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, gamma: float = 1.0, lam: float = 1.0
) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalised Advantage Estimation (Schulman et al. 2016) -> (advantages, returns), both [B, T].

    rewards, values, mask: [B, T] float. Departs from the paper in two ways: masked tokens (holes such
    as tool observations) are skipped, the recursion bridging across them with the last valid value;
    advantages are whitened over the whole batch (returns are not). Needs >= 2 valid tokens.
    """
    valid = mask.bool()
    next_value = torch.zeros_like(rewards[:, 0])  # [B]
    running = torch.zeros_like(rewards[:, 0])  # [B]
    raw_advantages = torch.empty_like(rewards)
    for t in reversed(range(rewards.shape[-1])):
        delta = rewards[:, t] + gamma * next_value - values[:, t]
        candidate = delta + gamma * lam * running
        next_value = torch.where(valid[:, t], values[:, t], next_value)
        running = torch.where(valid[:, t], candidate, running)
        raw_advantages[:, t] = running
    returns = raw_advantages + values
    return masked_whiten(raw_advantages, mask), returns


@torch.no_grad()
def grpo_advantage(
    rewards: torch.Tensor,
    mask: torch.Tensor,
    group_ids: torch.Tensor,
    eps: float = GRPO_EPS,
    norm_by_std: bool = True,
) -> torch.Tensor:
    """GRPO group-normalised outcome advantage (Shao et al. 2024) -> [B, T], 0 outside the mask.

    rewards, mask: [B, T] float; group_ids: [B] int64. `(score - mean) / (std + eps)` with the unbiased
    group std; departs from the paper with eps outside the sqrt and singleton groups kept as
    (mean 0, std 1). `norm_by_std=False` gives Dr.GRPO's `score - mean`. Equal scores give exactly 0.
    """
    scores = rewards.sum(dim=-1)  # [B]
    stats = group_stats(scores, group_ids)
    advantage = (scores - stats.mean) / (stats.std + eps) if norm_by_std else scores - stats.mean
    return advantage.unsqueeze(-1) * mask


@torch.no_grad()
def rloo_advantage(rewards: torch.Tensor, mask: torch.Tensor, group_ids: torch.Tensor) -> torch.Tensor:
    """RLOO leave-one-out advantage (Ahmadian et al. 2024) -> [B, T], 0 outside the mask.

    rewards, mask: [B, T] float; group_ids: [B] int64. `n/(n-1) * (score - group mean)`, i.e. the score
    minus the mean of the other n-1 scores; departs from the paper by giving a singleton group its raw score.
    """
    scores = rewards.sum(dim=-1)  # [B]
    stats = group_stats(scores, group_ids)
    size = stats.size.to(scores.dtype)
    # Operation order of the reference trainer: score*n/(n-1) - mean*n/(n-1).
    leave_one_out = scores * size / (size - 1) - stats.mean * size / (size - 1)
    advantage = torch.where(stats.size > 1, leave_one_out, scores)
    return advantage.unsqueeze(-1) * mask


@torch.no_grad()
def reinforce_pp_advantage(
    rewards: torch.Tensor, mask: torch.Tensor, gamma: float = 1.0
) -> tuple[torch.Tensor, torch.Tensor]:
    """REINFORCE++ (Hu 2025): discounted return-to-go, whitened over the batch -> (advantages, returns) [B, T].

    rewards, mask: [B, T] float. Masked tokens are skipped (the discounted sum bridges holes) and get
    return 0; advantages are 0 outside the mask. No KL term here: add it to the rewards beforehand.
    """
    valid = mask.bool()
    running = torch.zeros_like(rewards[:, 0])  # [B]
    returns = torch.empty_like(rewards)
    for t in reversed(range(rewards.shape[-1])):
        new = rewards[:, t] + gamma * running
        returns[:, t] = torch.where(valid[:, t], new, torch.zeros_like(new))
        running = torch.where(valid[:, t], new, running)
    return masked_whiten(returns, mask) * mask, returns


@torch.no_grad()
def reinforce_pp_baseline_advantage(rewards: torch.Tensor, mask: torch.Tensor, group_ids: torch.Tensor) -> torch.Tensor:
    """REINFORCE++-baseline (Hu 2025): score minus its group mean, whitened over the batch -> [B, T].

    rewards, mask: [B, T] float; group_ids: [B] int64. No division by the group std (the batch
    whitening rescales); a singleton group keeps its raw score. 0 outside the mask.
    """
    scores = rewards.sum(dim=-1)  # [B]
    centred = scores - group_stats(scores, group_ids).mean
    token_centred = centred.unsqueeze(-1) * mask  # [B, T]
    return masked_whiten(token_centred, mask) * mask


@torch.no_grad()
def remax_advantage(
    rewards: torch.Tensor, baselines: torch.Tensor, mask: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """ReMax (Li et al. 2023): return-to-go minus the greedy response's reward -> (advantages, returns) [B, T].

    rewards, mask: [B, T] float; baselines: [B] float, the reward of each prompt's greedy response.
    Undiscounted; masked tokens add nothing and get advantage 0 - 0.
    """
    kept = zero_outside_mask(rewards, mask) * mask
    returns = kept.flip(dims=[-1]).cumsum(dim=-1).flip(dims=[-1])
    return returns - baselines.unsqueeze(-1) * mask, returns


@torch.no_grad()
def gpg_advantage(rewards: torch.Tensor, mask: torch.Tensor, group_ids: torch.Tensor) -> torch.Tensor:
    """GPG (Chu et al. 2025): `alpha * (score - group mean)`, alpha = B / (responses with a non-zero score) ->
    [B, T], 0 outside the mask. alpha rescales a batch where few responses score to the full batch's gradient;
    no std division (verl's `gpg`: f_norm 1). A singleton group keeps its raw score (mean 0)."""
    scores = rewards.sum(dim=-1)  # [B]
    alpha = len(scores) / torch.count_nonzero(scores).clamp(min=1)
    return (alpha * (scores - group_stats(scores, group_ids).mean)).unsqueeze(-1) * mask


@torch.no_grad()
def opo_advantage(rewards: torch.Tensor, mask: torch.Tensor, group_ids: torch.Tensor) -> torch.Tensor:
    """OPO (Hao et al. 2025): score minus its group's length-weighted mean score (the baseline that minimises the
    gradient's variance for an on-policy sequence-level loss) -> [B, T], 0 outside the mask. A singleton group's
    baseline is 0."""
    scores, lengths = rewards.sum(dim=-1), mask.sum(dim=-1)
    stats = group_stats(scores, group_ids)
    _, inverse = torch.unique(as_group_ids(group_ids, scores.device), return_inverse=True)
    weighted = torch.zeros(int(inverse.max()) + 1, dtype=scores.dtype).index_add_(0, inverse, scores * lengths)
    length_sums = torch.zeros_like(weighted).index_add_(0, inverse, lengths)
    baseline = torch.where(stats.size > 1, weighted[inverse] / length_sums[inverse].clamp(min=1e-8), 0.0)
    return (scores - baseline).unsqueeze(-1) * mask


@torch.no_grad()
def grpo_passk_advantage(
    rewards: torch.Tensor, mask: torch.Tensor, group_ids: torch.Tensor, eps: float = GRPO_EPS, norm_by_std: bool = True
) -> torch.Tensor:
    """Pass@k training (Chen et al. 2025, verl's `grpo_passk`): only each group's best response gets an advantage,
    `max - second max` of the group's scores (divided by the group's std + eps with norm_by_std) -> [B, T], 0
    outside the mask. Needs groups of at least 2; ties for the best go to the first of them."""
    scores = rewards.sum(dim=-1)
    stats = group_stats(scores, group_ids)
    if bool((stats.size < 2).any()):
        raise ValueError("grpo_passk needs at least 2 responses per group (num_return_sequences_in_group >= 2)")
    advantage = torch.zeros_like(scores)
    ids = as_group_ids(group_ids, scores.device)
    for group in torch.unique(ids).tolist():
        rows = torch.nonzero(ids == group).squeeze(1)
        top = torch.topk(scores[rows], 2)
        best = rows[top.indices[0]]
        gap = top.values[0] - top.values[1]
        advantage[best] = gap / (stats.std[best] + eps) if norm_by_std else gap
    return advantage.unsqueeze(-1) * mask


# The inputs an estimator may read beyond (rewards, mask), as keyword arguments.
BATCH_INPUTS = ("values", "group_ids", "baselines")
SETTINGS = ("gamma", "lam", "eps", "norm_by_std")


@dataclass(frozen=True)
class AdvantageEstimator:
    """A registered estimator: its function and the batch inputs and settings it reads."""

    name: str
    fn: Callable[..., torch.Tensor | tuple[torch.Tensor, torch.Tensor]]
    needs: tuple[str, ...] = ()  # required batch inputs, a subset of BATCH_INPUTS
    settings: tuple[str, ...] = ()  # optional scalar settings, a subset of SETTINGS

    @property
    def needs_critic(self) -> bool:
        return "values" in self.needs

    def __call__(self, rewards: torch.Tensor, mask: torch.Tensor, **inputs) -> tuple[torch.Tensor, torch.Tensor]:
        """(advantages, returns) [B, T]; outcome-only estimators return their advantages as returns.

        `inputs` may hold every batch input and setting a pipeline has; those this estimator does
        not read are ignored, unknown names are an error.
        """
        unknown = sorted(set(inputs) - set(BATCH_INPUTS) - set(SETTINGS))
        if unknown:
            raise TypeError(f"unknown advantage input(s) {unknown}; known: {', '.join(BATCH_INPUTS + SETTINGS)}.")
        missing = [key for key in self.needs if inputs.get(key) is None]
        if missing:
            raise ValueError(f"advantage estimator {self.name!r} needs {', '.join(missing)}; got None.")
        kwargs = {key: inputs[key] for key in self.needs + self.settings if inputs.get(key) is not None}
        out = self.fn(rewards=rewards, mask=mask, **kwargs)
        return out if isinstance(out, tuple) else (out, out)


ADVANTAGE_ESTIMATORS: dict[str, AdvantageEstimator] = {
    estimator.name: estimator
    for estimator in (
        AdvantageEstimator("gae", gae, needs=("values",), settings=("gamma", "lam")),
        AdvantageEstimator("grpo", grpo_advantage, needs=("group_ids",), settings=("eps", "norm_by_std")),
        AdvantageEstimator("rloo", rloo_advantage, needs=("group_ids",)),
        AdvantageEstimator("reinforce_plus_plus", reinforce_pp_advantage, settings=("gamma",)),
        AdvantageEstimator("reinforce_plus_plus_baseline", reinforce_pp_baseline_advantage, needs=("group_ids",)),
        AdvantageEstimator("remax", remax_advantage, needs=("baselines",)),
        AdvantageEstimator("gpg", gpg_advantage, needs=("group_ids",)),
        AdvantageEstimator("opo", opo_advantage, needs=("group_ids",)),
        AdvantageEstimator("grpo_passk", grpo_passk_advantage, needs=("group_ids",), settings=("eps", "norm_by_std")),
    )
}
ADVANTAGE_ESTIMATOR_NAMES: tuple[str, ...] = tuple(ADVANTAGE_ESTIMATORS)


def get_advantage_estimator(name: str) -> AdvantageEstimator:
    """The estimator registered as `name`; ValueError listing the known names otherwise."""
    return lookup(ADVANTAGE_ESTIMATORS, "advantage estimator", name)
