"""Policy losses beyond PPO's clip, as verl names them (`actor.policy_loss.loss_mode`): CISPO's clipped, detached
importance weight on the log-prob (MiniMax-M1, arXiv 2506.13585), SAPO's soft gate in place of the clip (arXiv
2511.20347), GPG's plain policy gradient (arXiv 2504.02546) and GMPO's geometric mean of the token ratios
(arXiv 2507.20673). Each takes the uniform call of policy_loss.POLICY_LOSSES and returns a PolicyLossOutput.
Inputs at masked positions never reach a loss or its gradient.
"""

from __future__ import annotations

import torch

from roll_backend.algorithms.aggregation import agg_loss
from roll_backend.algorithms.stats import masked_mean, masked_sum, zero_outside_mask

LOG_RATIO_CLAMP = 20.0  # |log pi/pi_old| bound before exp, as for PPO


def _inputs(old_logp, logp, adv, mask):
    """The inputs zeroed outside the mask, and the clamped log-ratio."""
    old_logp, logp, adv = (zero_outside_mask(x, mask) for x in (old_logp, logp, adv))
    return old_logp, logp, adv, torch.clamp(logp - old_logp, min=-LOG_RATIO_CLAMP, max=LOG_RATIO_CLAMP)


def _weighted(token_loss, token_weights, mask):
    return token_loss if token_weights is None else token_loss * zero_outside_mask(token_weights.detach(), mask)


def cispo_policy_loss(old_logp, logp, adv, mask, clip_low, clip_high, agg_mode, token_weights=None, **agg_kwargs):
    """-sg(clip(r, 1 - clip_low, 1 + clip_high)) * A * log pi per token: every token keeps a gradient (none is
    clipped away), weighted by its clipped ratio -> (loss, clipfrac, approx_kl), 0-d. clipfrac: tokens whose ratio
    the clip changed."""
    old_logp, logp, adv, log_ratio = _inputs(old_logp, logp, adv, mask)
    ratio = torch.exp(log_ratio)
    clipped = torch.clamp(ratio, 1 - clip_low, 1 + clip_high)
    token_loss = _weighted(-clipped.detach() * adv * logp, token_weights, mask)
    loss = agg_loss(token_loss, mask, agg_mode, **agg_kwargs)
    return loss, masked_mean(torch.ne(ratio, clipped).float(), mask), masked_mean(-log_ratio, mask)


def sapo_policy_loss(old_logp, logp, adv, mask, tau_pos, tau_neg, token_weights=None, **agg_kwargs):
    """-f(r) * A per token, f(r) = sigmoid(tau (r - 1)) * 4 / tau (tau_pos where A > 0, else tau_neg): a gate whose
    gradient is r's near r = 1 and fades away from it, in place of a hard clip -> (loss, approx_kl), 0-d. Aggregated
    seq-mean-token-mean whatever the run's mode, as SAPO defines it."""
    old_logp, logp, adv, log_ratio = _inputs(old_logp, logp, adv, mask)
    tau_pos, tau_neg = (torch.as_tensor(tau, dtype=adv.dtype, device=adv.device) for tau in (tau_pos, tau_neg))
    tau = torch.where(adv > 0, tau_pos, tau_neg)
    gate = torch.sigmoid(tau * (torch.exp(log_ratio) - 1.0)) * (4.0 / tau)
    token_loss = _weighted(-gate * adv, token_weights, mask)
    return agg_loss(token_loss, mask, "seq-mean-token-mean", **agg_kwargs), masked_mean(-log_ratio, mask)


def gpg_policy_loss(old_logp, logp, adv, mask, agg_mode, token_weights=None, **agg_kwargs):
    """-A * log pi per token: the policy gradient with no ratio and no clip -> (loss, approx_kl), 0-d."""
    old_logp, logp, adv, log_ratio = _inputs(old_logp, logp, adv, mask)
    token_loss = _weighted(-adv * logp, token_weights, mask)
    return agg_loss(token_loss, mask, agg_mode, **agg_kwargs), masked_mean(-log_ratio, mask)


def geo_mean_policy_loss(old_logp, logp, adv, mask, clip_low, clip_high, token_weights=None, **agg_kwargs):
    """GMPO: per sequence -A_b * exp(mean_t clip'(log r_t)), each token's log-ratio clipped to [-clip_low,
    clip_high] on the side its advantage's sign makes pessimistic, A_b the row's mean advantage; the mean over
    sequences -> (loss, clipfrac (A > 0), approx_kl, clipfrac_lower (A < 0)), 0-d. `token_weights` enter as their
    geometric mean per row."""
    old_logp, logp, adv, log_ratio = _inputs(old_logp, logp, adv, mask)
    sign = torch.sign(adv)
    bounded = torch.clamp(log_ratio, -clip_low, clip_high)
    pessimistic = sign * torch.min(sign * log_ratio, sign * bounded)
    length = mask.sum(-1).clamp(min=1)
    ratio = torch.exp(masked_sum(pessimistic, mask, dim=-1) / length)  # [B]
    row_loss = -(masked_sum(adv, mask, dim=-1) / length) * ratio
    if token_weights is not None:
        logs = torch.log(zero_outside_mask(token_weights.detach(), mask) + 1e-10)
        row_loss = row_loss * torch.exp(masked_sum(logs, mask, dim=-1) / length)
    # each row's loss spread over its tokens, so that seq-mean-token-sum is the mean over rows (global batch aware)
    token_loss = row_loss.unsqueeze(-1) * mask / length.unsqueeze(-1)
    loss = agg_loss(token_loss, mask, "seq-mean-token-sum", **agg_kwargs)
    changed = torch.ne(log_ratio, bounded).float()
    return (
        loss,
        masked_mean(changed * (adv > 0), mask),
        masked_mean(-log_ratio, mask),
        masked_mean(changed * (adv < 0), mask),
    )
