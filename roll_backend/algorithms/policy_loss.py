"""Policy-gradient losses: dual-clip PPO and GSPO (sequence-level ratio); CISPO, SAPO, GPG and GMPO in
policy_loss_variants.py.

Both take log-probabilities of the sampled tokens under the behaviour (old) and current policy.
Inputs at masked positions never reach the loss or its gradient, even when they are NaN/inf.
`POLICY_LOSSES` is the only list of valid policy-loss names.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch

from roll_backend.algorithms import policy_loss_variants as variants
from roll_backend.algorithms.aggregation import agg_loss
from roll_backend.algorithms.registry import lookup
from roll_backend.algorithms.stats import masked_mean, masked_sum, zero_outside_mask

LOG_RATIO_CLAMP = 20.0  # PPO: |log pi/pi_old| bound before exp (ratios up to e^20 stay finite)
GSPO_LOG_RATIO_MAX = 10.0  # GSPO: upper bound on the sequence log-ratio before exp


def ppo_policy_loss(
    old_logp: torch.Tensor,
    logp: torch.Tensor,
    adv: torch.Tensor,
    mask: torch.Tensor,
    clip_low: float = 0.2,
    clip_high: float | None = None,
    clip_c: float = 3.0,
    agg_mode: str = "token-mean",
    token_weights: torch.Tensor | None = None,
    **agg_kwargs,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Clipped PPO surrogate (Schulman et al. 2017) with dual clip (Ye et al. 2020) ->
    (loss, clipfrac, approx_kl, clipfrac_lower), all 0-d.

    old_logp, logp, adv, mask: [B, T] float. Departs from the paper: asymmetric clip range
    [1 - clip_low, 1 + clip_high] (DAPO; clip_high defaults to clip_low), log-ratio clamped to
    [-20, 20], and for adv < 0 the loss is capped at -adv * clip_c (clip_c > 1). clipfrac counts
    tokens where the clipped term is strictly larger; approx_kl is the masked mean of -log-ratio
    (clamped). `token_weights` [B, T] (detached; rollout correction) multiply each token's loss before
    aggregation. `agg_kwargs` (dp_size, batch_num_tokens, ...) go to `agg_loss`.
    """
    if clip_high is None:
        clip_high = clip_low
    if not clip_c > 1.0:
        raise ValueError(f"dual-clip PPO needs clip_c > 1, got clip_c={clip_c}; the usual value is 3.0.")
    old_logp, logp, adv = (zero_outside_mask(x, mask) for x in (old_logp, logp, adv))

    log_ratio = torch.clamp(logp - old_logp, min=-LOG_RATIO_CLAMP, max=LOG_RATIO_CLAMP)
    ratio = torch.exp(log_ratio)
    loss_unclipped = -adv * ratio
    loss_clipped = -adv * torch.clamp(ratio, 1 - clip_low, 1 + clip_high)
    loss_ppo = torch.maximum(loss_unclipped, loss_clipped)
    loss_dual_cap = -adv * clip_c
    # torch.min / torch.where as the reference trainer writes them: ties share the gradient equally.
    token_loss = torch.where(adv < 0, torch.min(loss_dual_cap, loss_ppo), loss_ppo)
    token_loss = _weighted(token_loss, token_weights, mask)

    loss = agg_loss(token_loss, mask, agg_mode, **agg_kwargs)
    clipfrac = masked_mean(torch.gt(loss_clipped, loss_unclipped).float(), mask)
    approx_kl = masked_mean(-log_ratio, mask)
    clipfrac_lower = masked_mean((torch.gt(loss_ppo, loss_dual_cap) & (adv < 0)).float(), mask)
    return loss, clipfrac, approx_kl, clipfrac_lower


def gspo_policy_loss(
    old_logp: torch.Tensor,
    logp: torch.Tensor,
    adv: torch.Tensor,
    mask: torch.Tensor,
    clip_low: float = 3e-4,
    clip_high: float | None = 4e-4,
    agg_mode: str = "seq-mean-token-mean",
    token_weights: torch.Tensor | None = None,
    **agg_kwargs,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """GSPO clipped surrogate with a sequence-level ratio (Zheng et al. 2025) -> (loss, clipfrac, approx_kl), 0-d.

    old_logp, logp, adv, mask: [B, T] float. Every token of row b uses ratio exp(s_b), s_b the mean
    log-ratio of the row, with the per-token gradient of the GSPO-token variant (d r / d logp[b,t] = r).
    Departs from the paper: log-ratio clamped at 10 (gradient 0 beyond); no dual clip; any agg_mode
    (the paper's seq-mean-token-mean is the default). approx_kl uses the unclamped log-ratio.
    `token_weights` [B, T] (detached; rollout correction) multiply each token's loss before aggregation.
    """
    if clip_high is None:
        clip_high = clip_low
    old_logp, logp, adv = (zero_outside_mask(x, mask) for x in (old_logp, logp, adv))

    log_ratio = logp - old_logp  # [B, T]
    seq_len = mask.sum(dim=-1).clamp(min=1)  # [B]
    seq_log_ratio = masked_sum(log_ratio, mask, dim=-1) / seq_len  # [B]
    # Value s_b, gradient 1 w.r.t. logp[b, t]: the straight-through form of the GSPO-token objective.
    token_log_ratio = logp - logp.detach() + seq_log_ratio.detach().unsqueeze(-1)
    ratio = torch.exp(torch.clamp(token_log_ratio, max=GSPO_LOG_RATIO_MAX))
    loss_unclipped = -adv * ratio
    loss_clipped = -adv * torch.clamp(ratio, 1 - clip_low, 1 + clip_high)
    token_loss = _weighted(torch.maximum(loss_unclipped, loss_clipped), token_weights, mask)

    loss = agg_loss(token_loss, mask, agg_mode, **agg_kwargs)
    clipfrac = masked_mean(torch.gt(loss_clipped, loss_unclipped).float(), mask)
    approx_kl = masked_mean(-log_ratio, mask)
    return loss, clipfrac, approx_kl


def _weighted(token_loss: torch.Tensor, token_weights: torch.Tensor | None, mask: torch.Tensor) -> torch.Tensor:
    """token_loss * token_weights (detached), the weights zeroed outside the mask; unchanged without weights."""
    if token_weights is None:
        return token_loss
    return token_loss * zero_outside_mask(token_weights.detach(), mask)


class PolicyLossOutput(NamedTuple):
    """What every registered policy loss returns (0-d tensors)."""

    loss: torch.Tensor
    clipfrac: torch.Tensor
    approx_kl: torch.Tensor
    clipfrac_lower: torch.Tensor  # dual-clip fraction; 0 for losses without a dual clip


PolicyLossFn = Callable[..., PolicyLossOutput]


def _ppo_entry(
    old_logp, logp, adv, mask, *, clip_low, clip_high, clip_c, agg_mode, tau_pos=1.0, tau_neg=1.05, **agg_kwargs
):
    outputs = ppo_policy_loss(old_logp, logp, adv, mask, clip_low, clip_high, clip_c, agg_mode, **agg_kwargs)
    return PolicyLossOutput(*outputs)


def _gspo_entry(
    old_logp, logp, adv, mask, *, clip_low, clip_high, clip_c, agg_mode, tau_pos=1.0, tau_neg=1.05, **agg_kwargs
):
    loss, clipfrac, approx_kl = gspo_policy_loss(old_logp, logp, adv, mask, clip_low, clip_high, agg_mode, **agg_kwargs)
    return PolicyLossOutput(loss, clipfrac, approx_kl, torch.zeros_like(clipfrac))


def _cispo_entry(
    old_logp, logp, adv, mask, *, clip_low, clip_high, clip_c, agg_mode, tau_pos=1.0, tau_neg=1.05, **agg_kwargs
):
    loss, clipfrac, approx_kl = variants.cispo_policy_loss(
        old_logp, logp, adv, mask, clip_low, clip_high, agg_mode, **agg_kwargs
    )
    return PolicyLossOutput(loss, clipfrac, approx_kl, torch.zeros_like(clipfrac))


def _sapo_entry(
    old_logp, logp, adv, mask, *, clip_low, clip_high, clip_c, agg_mode, tau_pos=1.0, tau_neg=1.05, **agg_kwargs
):
    loss, approx_kl = variants.sapo_policy_loss(old_logp, logp, adv, mask, tau_pos, tau_neg, **agg_kwargs)
    return PolicyLossOutput(loss, torch.zeros_like(loss), approx_kl, torch.zeros_like(loss))


def _gpg_entry(
    old_logp, logp, adv, mask, *, clip_low, clip_high, clip_c, agg_mode, tau_pos=1.0, tau_neg=1.05, **agg_kwargs
):
    loss, approx_kl = variants.gpg_policy_loss(old_logp, logp, adv, mask, agg_mode, **agg_kwargs)
    return PolicyLossOutput(loss, torch.zeros_like(loss), approx_kl, torch.zeros_like(loss))


def _geo_mean_entry(
    old_logp, logp, adv, mask, *, clip_low, clip_high, clip_c, agg_mode, tau_pos=1.0, tau_neg=1.05, **agg_kwargs
):
    return PolicyLossOutput(
        *variants.geo_mean_policy_loss(old_logp, logp, adv, mask, clip_low, clip_high, **agg_kwargs)
    )


# Every entry has the same call: (old_logp, logp, adv, mask, *, clip_low, clip_high, clip_c, agg_mode, tau_pos,
# tau_neg, **agg_kwargs) -> PolicyLossOutput; settings a loss does not use (clip_c for gspo, the taus but for sapo,
# agg_mode for sapo and geo_mean, which aggregate per sequence by definition) are ignored. Names as verl's loss_mode.
POLICY_LOSSES: dict[str, PolicyLossFn] = {
    "ppo": _ppo_entry,  # (verl's "vanilla")
    "gspo": _gspo_entry,
    "cispo": _cispo_entry,
    "sapo": _sapo_entry,
    "gpg": _gpg_entry,
    "geo_mean": _geo_mean_entry,
}
POLICY_LOSS_NAMES: tuple[str, ...] = tuple(POLICY_LOSSES)


def get_policy_loss(name: str) -> PolicyLossFn:
    """The policy loss registered as `name` (uniform call above); ValueError listing the known names otherwise."""
    return lookup(POLICY_LOSSES, "policy loss", name)
