"""Cross-field rules of the `algorithm` section: known names, settings in range, and what an estimator needs from
the rest of the run (a group of responses, a greedy baseline it can be measured against)."""

from __future__ import annotations

from roll_backend.config.schema import PipelineConfig


def algorithm_problems(config: PipelineConfig) -> list[str]:
    """The problems of an RL run's `algorithm` section, each saying what to change."""
    problems: list[str] = []
    _check_dynamic_sampling(config, problems)
    _check_algorithm(config, problems)
    return problems


def group_problems(config: PipelineConfig) -> list[str]:
    """Estimators with a group baseline compare each response with the others of its prompt: a group of one has
    no baseline (every advantage is 0, or undefined for rloo)."""
    from roll_backend.algorithms.advantages import ADVANTAGE_ESTIMATORS

    problems: list[str] = []
    estimator = ADVANTAGE_ESTIMATORS.get(config.algorithm.adv_estimator)
    n = config.num_return_sequences_in_group
    if estimator is not None and "group_ids" in estimator.needs and n < 2:
        problems.append(
            f"algorithm.adv_estimator={estimator.name} compares each response with the others sampled for its "
            f"prompt, and num_return_sequences_in_group={n} leaves each group without a baseline (no learning "
            "signal); set num_return_sequences_in_group >= 2 (4-16 is usual) or pick reinforce_plus_plus"
        )
    return problems


def _check_algorithm(config: PipelineConfig, problems: list[str]) -> None:
    from roll_backend import algorithms as alg

    algo = config.algorithm
    for field_name, value, known in (
        ("adv_estimator", algo.adv_estimator, alg.ADVANTAGE_ESTIMATOR_NAMES),
        ("policy_loss", algo.policy_loss, alg.POLICY_LOSS_NAMES),
        ("kl_estimator", algo.kl_estimator, alg.KL_ESTIMATOR_NAMES),
        ("loss_agg_mode", algo.loss_agg_mode, alg.AGG_MODE_NAMES),
        ("kl_ctrl.type", algo.kl_ctrl.type, alg.KL_CONTROLLER_NAMES),
    ):
        if value not in known:
            problems.append(f"algorithm.{field_name}={value!r} is unknown; known: {', '.join(known)}")
    if algo.reward_norm is not None and algo.reward_norm not in alg.REWARD_NORM_MODES:
        problems.append(
            f"algorithm.reward_norm={algo.reward_norm!r}; choose one of {', '.join(alg.REWARD_NORM_MODES)} or null"
        )
    if algo.adv_estimator == "remax":
        _check_remax(config, problems)
    if algo.adv_estimator == "gae" and config.critic is None:
        problems.append(
            "algorithm.adv_estimator=gae needs a critic: add a `critic:` role block or pick "
            "grpo/rloo/reinforce_plus_plus"
        )
    if (algo.use_kl_loss or algo.use_kl_in_reward) and not config.has_reference:
        problems.append(
            "KL (algorithm.use_kl_loss or use_kl_in_reward) needs a `reference:` role block (or, with LoRA, "
            "reference: {from_actor_base: true}); add one or turn both off"
        )
    for name in ("sapo_tau_pos", "sapo_tau_neg"):
        if not getattr(algo, name) > 0:
            problems.append(f"algorithm.{name}={getattr(algo, name)} must be > 0 (SAPO's gate temperature; 1.0-1.05)")
    if algo.value_clip is not None and not algo.value_clip > 0:
        problems.append(f"algorithm.value_clip={algo.value_clip} must be > 0 (0.2-0.5 is usual), or null: no clipping")
    if algo.ppo_epochs < 1:
        problems.append(f"algorithm.ppo_epochs={algo.ppo_epochs} must be >= 1")
    correction = algo.rollout_correction
    for field_name, value, known in (
        ("is_level", correction.is_level, alg.IS_LEVELS),
        ("rejection", correction.rejection, alg.REJECTION_LEVELS),
    ):
        if value is not None and value not in known:
            problems.append(
                f"algorithm.rollout_correction.{field_name}={value!r}; choose one of {', '.join(known)} or null"
            )
    if correction.is_level is not None and not correction.is_cap >= 1.0:
        problems.append(
            f"algorithm.rollout_correction.is_cap={correction.is_cap} must be >= 1 (IS weights are truncated at it; "
            "2.0 is usual)"
        )
    if correction.rejection is not None and not correction.rejection_threshold > 1.0:
        problems.append(
            f"algorithm.rollout_correction.rejection_threshold={correction.rejection_threshold} must be > 1 "
            "(ratios inside [1/C, C] are kept; 2.0 is usual)"
        )


def _check_remax(config: PipelineConfig, problems: list[str]) -> None:
    """ReMax's greedy baseline is generated beside each batch's samples (pipelines/loops/remax.py)."""
    streaming = config.async_generation.enabled and config.async_generation.mode == "streaming"
    for applies, why in (
        (config.agentic is not None, "multi-turn trajectories (the `agentic` section) have no greedy counterpart"),
        (streaming, "streaming generation admits prompts one group at a time; use async_generation.mode=one_step"),
        (
            config.algorithm.reward_norm is not None,
            "algorithm.reward_norm rescales the sampled scores but not the greedy baseline; set it to null",
        ),
        (
            config.reward_model is not None and config.reward.model_score_norm is not None,
            "reward.model_score_norm standardises each scored batch on its own, so the samples' and the greedy "
            "responses' reward-model scores would be on different scales; set it to null",
        ),
    ):
        if applies:
            problems.append(f"algorithm.adv_estimator=remax: {why} (or pick grpo, rloo or reinforce_plus_plus)")


def _check_dynamic_sampling(config: PipelineConfig, problems: list[str]) -> None:
    algo = config.algorithm
    if algo.max_generation_rounds < 1:
        problems.append(f"algorithm.max_generation_rounds={algo.max_generation_rounds} must be >= 1 (1: no refill)")
    if not algo.refill_oversample >= 1.0:
        problems.append(
            f"algorithm.refill_oversample={algo.refill_oversample} must be >= 1 (prompts per group missing)"
        )
