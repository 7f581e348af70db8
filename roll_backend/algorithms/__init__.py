"""Pure torch math of PPO/GRPO: advantages, policy/value losses, KL, aggregation (no Ray, no backend)."""

from roll_backend.algorithms.advantages import (
    ADVANTAGE_ESTIMATOR_NAMES,
    ADVANTAGE_ESTIMATORS,
    AdvantageEstimator,
    gae,
    get_advantage_estimator,
    grpo_advantage,
    reinforce_pp_advantage,
    reinforce_pp_baseline_advantage,
    remax_advantage,
    rloo_advantage,
)
from roll_backend.algorithms.aggregation import AGG_MODE_NAMES, AGG_MODES, agg_loss, get_agg_mode, token_mean_share
from roll_backend.algorithms.controllers import (
    KL_CONTROLLER_NAMES,
    KL_CONTROLLERS,
    AdaptiveKLController,
    FixedKLController,
    KLController,
    make_kl_controller,
)
from roll_backend.algorithms.kl import (
    KL_ESTIMATOR_NAMES,
    KL_ESTIMATORS,
    get_kl_estimator,
    kl_estimate,
    kl_penalized_rewards,
)
from roll_backend.algorithms.policy_loss import (
    POLICY_LOSS_NAMES,
    POLICY_LOSSES,
    PolicyLossOutput,
    get_policy_loss,
    gspo_policy_loss,
    ppo_policy_loss,
)
from roll_backend.algorithms.rewards_postprocess import (
    REWARD_NORM_MODES,
    REWARD_NORMALIZERS,
    clip_rewards,
    normalize_rewards,
    postprocess_rewards,
)
from roll_backend.algorithms.rollout_correction import (
    IS_LEVELS,
    REJECTION_LEVELS,
    RolloutCorrection,
    rollout_correction,
)
from roll_backend.algorithms.stats import (
    GroupStats,
    as_group_ids,
    group_stats,
    masked_mean,
    masked_sum,
    masked_var,
    masked_whiten,
    zero_outside_mask,
)
from roll_backend.algorithms.tokens import (
    entropy_from_logits,
    entropy_loss,
    logprobs_from_logits,
    response_mask_from_eos,
)
from roll_backend.algorithms.value_loss import value_loss

__all__ = [
    # masked statistics
    "masked_sum",
    "masked_mean",
    "masked_var",
    "masked_whiten",
    "zero_outside_mask",
    "group_stats",
    "GroupStats",
    "as_group_ids",
    # token utilities
    "response_mask_from_eos",
    "logprobs_from_logits",
    "entropy_from_logits",
    "entropy_loss",
    # KL
    "kl_estimate",
    "kl_penalized_rewards",
    "get_kl_estimator",
    "KL_ESTIMATORS",
    "KL_ESTIMATOR_NAMES",
    # aggregation
    "agg_loss",
    "token_mean_share",
    "get_agg_mode",
    "AGG_MODES",
    "AGG_MODE_NAMES",
    # advantages
    "gae",
    "grpo_advantage",
    "rloo_advantage",
    "reinforce_pp_advantage",
    "reinforce_pp_baseline_advantage",
    "remax_advantage",
    "get_advantage_estimator",
    "AdvantageEstimator",
    "ADVANTAGE_ESTIMATORS",
    "ADVANTAGE_ESTIMATOR_NAMES",
    # losses
    "ppo_policy_loss",
    "gspo_policy_loss",
    "value_loss",
    "get_policy_loss",
    "PolicyLossOutput",
    "POLICY_LOSSES",
    "POLICY_LOSS_NAMES",
    # rollout-mismatch correction
    "rollout_correction",
    "RolloutCorrection",
    "IS_LEVELS",
    "REJECTION_LEVELS",
    # KL controllers
    "FixedKLController",
    "AdaptiveKLController",
    "KLController",
    "make_kl_controller",
    "KL_CONTROLLERS",
    "KL_CONTROLLER_NAMES",
    # reward post-processing
    "clip_rewards",
    "normalize_rewards",
    "postprocess_rewards",
    "REWARD_NORMALIZERS",
    "REWARD_NORM_MODES",
]
