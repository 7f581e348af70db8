"""Build the run's actor groups from the config: one Cluster per role, colocated where the config says."""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
from typing import Any

from roll_backend.config.schema import PipelineConfig, RoleConfig
from roll_backend.distributed.cluster import Cluster, RankResources, create_placement_group

logger = logging.getLogger(__name__)


def _actor_loss_config(config: PipelineConfig):
    from roll_backend.workers.actor import ActorLossConfig

    algo = config.algorithm
    return ActorLossConfig(
        policy_loss=algo.policy_loss,
        clip_low=algo.clip_ratio_low,
        clip_high=algo.clip_ratio_high,
        clip_c=algo.dual_clip_c,
        entropy_coef=algo.entropy_coef,
        kl_loss_coef=algo.kl_loss_coef if algo.use_kl_loss else 0.0,
        kl_estimator=algo.kl_estimator,
        agg_mode=algo.loss_agg_mode,
    )


def _with_run_settings(config: PipelineConfig, role: RoleConfig) -> Any:
    """The role's strategy config with what the run decides: sampling n / max tokens, train horizon."""
    strategy = role.strategy.config
    if role.strategy.name == "vllm_rollout":
        sampling = dataclasses.replace(
            strategy.sampling, n=config.num_return_sequences_in_group, max_tokens=config.response_length
        )
        validation = dataclasses.replace(strategy.validation, max_tokens=config.response_length)
        return dataclasses.replace(strategy, sampling=sampling, validation=validation)
    if role.strategy.name == "megatron_train":
        updates_per_step = config.algorithm.ppo_epochs * (
            config.rollout_batch_size * config.num_return_sequences_in_group
            // (config.algorithm.ppo_mini_batch_size or config.rollout_batch_size * config.num_return_sequences_in_group)
        )
        return dataclasses.replace(strategy, total_steps=max(1, config.max_steps * updates_per_step))
    return strategy


@dataclass
class RoleGroups:
    """The running groups of one pipeline; `reference` and `critic` may be None."""

    actor: Cluster
    rollout: Cluster
    reward: Cluster
    reference: Cluster | None = None
    critic: Cluster | None = None

    def all(self) -> list[Cluster]:
        return [g for g in (self.actor, self.rollout, self.reward, self.reference, self.critic) if g is not None]

    def shutdown(self) -> None:
        for group in self.all():
            group.shutdown()


def build_role_groups(config: PipelineConfig) -> RoleGroups:
    """Start every role's actors (models loaded, engines up). Colocated roles share one placement group."""
    from roll_backend.workers.actor import ActorConfig, ActorWorker
    from roll_backend.workers.critic import CriticConfig, CriticLossConfig, CriticWorker
    from roll_backend.workers.reference import ReferenceConfig, ReferenceWorker
    from roll_backend.workers.reward import RewardWorker, RewardWorkerConfig
    from roll_backend.workers.rollout import RolloutWorker, RolloutWorkerConfig

    placement_groups: dict[str, Any] = {}
    roles = {"actor_train": config.actor_train, "actor_infer": config.actor_infer,
             "reference": config.reference, "critic": config.critic}

    def placement_for(name: str, role: RoleConfig):
        """A shared group for a colocation set (sized for all its members), else None: the Cluster reserves its own."""
        anchor = role.colocate_with or next((n for n, r in roles.items() if r is not None and r.colocate_with == name), None)
        if anchor is None:
            return None
        key = role.colocate_with or name
        if key not in placement_groups:
            members = [r for n, r in roles.items() if r is not None and (n == key or r.colocate_with == key)]
            placement_groups[key] = create_placement_group(
                role.world_size, sum(m.num_cpus_per_rank for m in members), sum(m.num_gpus_per_rank for m in members),
                timeout_s=config.fault_tolerance.timeouts.placement)
        return placement_groups[key]

    ft = config.fault_tolerance
    health = {"start_timeout_s": ft.timeouts.startup, "placement_timeout_s": ft.timeouts.placement,
              "settle_s": ft.settle_s, "fault": ft.inject}

    def start(worker_cls, name: str, role: RoleConfig, worker_config) -> Cluster:
        resources = RankResources(num_cpus=role.num_cpus_per_rank, num_gpus=role.num_gpus_per_rank)
        return Cluster(worker_cls, name, role.world_size, role.strategy.layout, resources,
                       placement_group=placement_for(name, role), worker_config=worker_config, **health)

    groups: dict[str, Cluster] = {}
    try:
        groups["actor"] = start(ActorWorker, "actor_train", config.actor_train, ActorConfig(
            strategy=_with_run_settings(config, config.actor_train), strategy_name=config.actor_train.strategy.name,
            loss=_actor_loss_config(config)))
        groups["rollout"] = start(RolloutWorker, "actor_infer", config.actor_infer, RolloutWorkerConfig(
            strategy=_with_run_settings(config, config.actor_infer), strategy_name=config.actor_infer.strategy.name))
        if config.reference is not None:
            groups["reference"] = start(ReferenceWorker, "reference", config.reference, ReferenceConfig(
                strategy=config.reference.strategy.config, strategy_name=config.reference.strategy.name))
        if config.critic is not None:
            critic_strategy = dataclasses.replace(_with_run_settings(config, config.critic), value_head=True)
            groups["critic"] = start(CriticWorker, "critic", config.critic, CriticConfig(
                strategy=critic_strategy, strategy_name=config.critic.strategy.name,
                loss=CriticLossConfig(clip_range=config.algorithm.value_clip)))
        groups["reward"] = Cluster(
            RewardWorker, "reward", config.reward.world_size,
            resources=RankResources(num_cpus=config.reward.num_cpus_per_rank),
            worker_config=RewardWorkerConfig(
                rewards=config.reward.builtin_weights(), functions=tuple(config.reward.functions),
                on_function_error=config.reward.on_function_error, function_timeout_s=config.reward.function_timeout_s),
            **health,
        )
        # Model loading in parallel: the groups are independent.
        pending = [groups["actor"].init_model.submit(), groups["rollout"].initialize.submit()]
        pending += [groups[n].init_model.submit() for n in ("reference", "critic") if n in groups]
        for future in pending:
            future.get()
    except BaseException:
        for group in groups.values():
            group.shutdown()
        raise
    return RoleGroups(**groups)
