"""Build the run's actor groups from the config: one WorkerGroup per role, named by the role, colocated where the
config says."""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
from typing import Any

from roll_backend import roles
from roll_backend.config.run_facts import hybrid_roles, run_facts, synced_adapter_rank
from roll_backend.config.schema import OverlongBufferConfig, PipelineConfig, RoleConfig
from roll_backend.distributed.placement import create_placement_group
from roll_backend.distributed.worker_group import RankResources, WorkerGroup, start_together
from roll_backend.workers.actor import ActorConfig, ActorLossConfig, ActorWorker
from roll_backend.workers.critic import CriticConfig, CriticLossConfig, CriticWorker
from roll_backend.workers.hybrid import HybridConfig, HybridFacet, HybridWorker
from roll_backend.workers.reference import ReferenceConfig, ReferenceWorker
from roll_backend.workers.reward import RewardWorker, RewardWorkerConfig
from roll_backend.workers.reward_model import RewardModelConfig, RewardModelWorker
from roll_backend.workers.rollout import RolloutWorker, RolloutWorkerConfig

logger = logging.getLogger(__name__)


def _actor_loss_config(config: PipelineConfig) -> ActorLossConfig:
    algo = config.algorithm
    if config.offline:
        return ActorLossConfig(objective="sft" if config.pipeline == "sft" else "pairwise")
    distill = config.distillation
    return ActorLossConfig(
        distill_loss_coef=distill.coef if config.teacher is not None and distill.mode == "loss" else 0.0,
        policy_loss=algo.policy_loss,
        clip_low=algo.clip_ratio_low,
        clip_high=algo.clip_ratio_high,
        clip_c=algo.dual_clip_c,
        tau_pos=algo.sapo_tau_pos,
        tau_neg=algo.sapo_tau_neg,
        entropy_coef=algo.entropy_coef,
        kl_loss_coef=algo.kl_loss_coef if algo.use_kl_loss else 0.0,
        kl_estimator=algo.kl_estimator,
        agg_mode=algo.loss_agg_mode,
    )


def _strategy_for_run(config: PipelineConfig, name: str) -> dict[str, Any]:
    """A role worker config's `strategy` (the strategy config with what the run decides: its own `for_run`) and
    `strategy_name`."""
    section = getattr(config, name).strategy
    return {"strategy": section.config.for_run(run_facts(config, name)), "strategy_name": section.name}


@dataclass
class RoleGroups:
    """The running groups of one pipeline, each named by its role (roll_backend.roles); all but actor_train may be
    None (the offline pipelines start no rollout and no reward)."""

    actor_train: WorkerGroup
    actor_infer: WorkerGroup | None = None
    reward: WorkerGroup | None = None
    reference: WorkerGroup | None = None
    critic: WorkerGroup | None = None
    reward_model: WorkerGroup | None = None
    teacher: WorkerGroup | None = None
    hybrid: WorkerGroup | None = None  # the hybrid engine's group, whose facets the hybrid roles above are
    reference_from_actor: bool = False  # reference log-probs: actor_train's with the LoRA adapters off
    adapter_sync: bool = False  # the weight sync sends actor_train's LoRA adapters, which the rollout serves

    @property
    def has_reference(self) -> bool:
        return self.reference is not None or self.reference_from_actor

    def all(self) -> list[WorkerGroup]:
        members = (
            self.actor_train,
            self.actor_infer,
            self.reward,
            self.reference,
            self.critic,
            self.reward_model,
            self.teacher,
        )
        hosted = [g for g in members if g is not None and getattr(g, "host", None) is None]
        return hosted + ([self.hybrid] if self.hybrid is not None else [])  # (a facet is its host's)

    def shutdown(self) -> None:
        for group in self.all():
            group.shutdown()


class _GroupStarter:
    """Starts one role's group at a time: its resources, the run's deadlines and health settings, and a placement
    group shared by roles that colocate (sized for all of them)."""

    def __init__(self, config: PipelineConfig):
        self.config = config
        self.roles = {name: getattr(config, name) for name in roles.MODEL_ROLES}
        self.placement_groups: dict[str, Any] = {}
        ft = config.fault_tolerance
        self.health = {
            "start_timeout_s": ft.timeouts.startup,
            "placement_timeout_s": ft.timeouts.placement,
            "settle_s": ft.settle_s,
            "fault": ft.inject,
        }

    def placement_for(self, name: str, role: RoleConfig):
        """A shared group for a colocation set, else None: the WorkerGroup reserves its own."""
        members_of = {n: r for n, r in self.roles.items() if r is not None}
        anchor = role.colocate_with or next((n for n, r in members_of.items() if r.colocate_with == name), None)
        if anchor is None:
            return None
        key = role.colocate_with or name
        if key not in self.placement_groups:
            members = [r for n, r in members_of.items() if n == key or r.colocate_with == key]
            self.placement_groups[key] = create_placement_group(
                role.world_size,
                sum(m.num_cpus_per_rank for m in members),
                sum(m.num_gpus_per_rank for m in members),
                timeout_s=self.config.fault_tolerance.timeouts.placement,
            )
        return self.placement_groups[key]

    def start(self, worker_cls, name: str, worker_config, group_name: str | None = None) -> WorkerGroup:
        """Role `name`'s group on its resources (`group_name`: the group's own name where it differs, the hybrid
        engine's)."""
        role: RoleConfig = self.roles[name]
        resources = RankResources(num_cpus=role.num_cpus_per_rank, num_gpus=role.num_gpus_per_rank)
        return WorkerGroup(
            worker_cls,
            group_name or name,
            role.world_size,
            role.strategy.layout,
            resources,
            placement_group=self.placement_for(name, role),
            worker_config=worker_config,
            wait=False,
            **self.health,
        )

    def start_reward(self) -> WorkerGroup:
        reward = self.config.reward
        agentic = self.config.agentic is not None
        worker_config = RewardWorkerConfig(
            rewards=reward.builtin_weights(self.config.other_rewards()),
            env_weight=reward.env_weight if agentic else None,
            functions=tuple(reward.functions),
            on_function_error=reward.on_function_error,
            function_timeout_s=reward.function_timeout_s,
            by_source=reward.by_source,
            overlong_buffer=overlong_buffer(self.config),
        )
        return WorkerGroup(
            RewardWorker,
            roles.REWARD,
            reward.world_size,
            resources=RankResources(num_cpus=reward.num_cpus_per_rank),
            worker_config=worker_config,
            wait=False,
            **self.health,
        )


def overlong_buffer(config: PipelineConfig) -> OverlongBufferConfig | None:
    """reward.overlong_buffer with its max_length resolved (the run's response_length unless set)."""
    overlong = config.reward.overlong_buffer
    if overlong is None or overlong.max_length is not None:
        return overlong
    return dataclasses.replace(overlong, max_length=config.response_length)


def _role_workers(config: PipelineConfig) -> dict[str, tuple[type, Any]]:
    """Each model role of the run: (its worker class, its worker config)."""
    workers: dict[str, tuple[type, Any]] = {
        roles.ACTOR_TRAIN: (
            ActorWorker,
            ActorConfig(**_strategy_for_run(config, roles.ACTOR_TRAIN), loss=_actor_loss_config(config)),
        )
    }
    if config.actor_infer is not None:
        workers[roles.ACTOR_INFER] = (
            RolloutWorker,
            RolloutWorkerConfig(**_strategy_for_run(config, roles.ACTOR_INFER), agentic=config.agentic),
        )
    if config.reference is not None:
        workers[roles.REFERENCE] = (ReferenceWorker, ReferenceConfig(**_strategy_for_run(config, roles.REFERENCE)))
    if config.critic is not None:
        loss = CriticLossConfig(clip_range=config.algorithm.value_clip)
        workers[roles.CRITIC] = (CriticWorker, CriticConfig(**_strategy_for_run(config, roles.CRITIC), loss=loss))
    if config.reward_model is not None:
        workers[roles.REWARD_MODEL] = (
            RewardModelWorker,
            RewardModelConfig(**_strategy_for_run(config, roles.REWARD_MODEL), retemplate=_retemplates(config)),
        )
    if config.teacher is not None:  # log-probs of the student's samples, as a reference computes them
        workers[roles.TEACHER] = (ReferenceWorker, ReferenceConfig(**_strategy_for_run(config, roles.TEACHER)))
    return workers


def _retemplates(config: PipelineConfig) -> bool:
    """A reward model whose tokenizer is not the policy's reads decoded responses in its own chat template."""
    from roll_backend.config.model_folders import same_tokenizer

    other = not same_tokenizer(config.actor_train.model_path, config.reward_model.model_path)
    if other:
        logger.info("reward_model: its tokenizer is not the policy's; it scores the decoded responses re-templated")
    return other


def _hybrid_config(config: PipelineConfig, workers: dict[str, tuple[type, Any]]) -> HybridConfig:
    hosted = (roles.ACTOR_TRAIN, *hybrid_roles(config))
    facets = tuple(HybridFacet(name, *workers[name], getattr(config, name).strategy.layout) for name in hosted)
    adapter_sync = synced_adapter_rank(config) is not None
    return HybridConfig(
        facets,
        adapter_sync=adapter_sync,
        engine_copy=config.weight_sync_delta and not adapter_sync,
        bucket_bytes=config.weight_sync_bucket_bytes,
    )


def _start_groups(config: PipelineConfig, groups: dict[str, WorkerGroup]) -> HybridConfig | None:
    """Start every role's group into `groups` (so a failure part-way can shut down what started), all at once. The
    hybrid engine's roles start as one group (roles.HYBRID) hosting them all; returns what it hosts (None without)."""
    starter = _GroupStarter(config)
    workers = _role_workers(config)
    hosted = None
    if hybrid_roles(config):
        hosted = _hybrid_config(config, workers)
        groups[roles.HYBRID] = starter.start(HybridWorker, roles.ACTOR_TRAIN, hosted, roles.HYBRID)
        for facet in hosted.facets:
            del workers[facet.role]
    for name, (worker_cls, worker_config) in workers.items():
        groups[name] = starter.start(worker_cls, name, worker_config)
    reward = config.reward
    rule_rewards = reward.builtin_weights(config.other_rewards())
    if not config.offline and (rule_rewards or reward.functions or config.agentic is not None):
        groups[roles.REWARD] = starter.start_reward()  # (a reward model alone needs no reward workers)
    start_together(list(groups.values()))
    return hosted


_INIT_MODEL = {
    roles.HYBRID: HybridWorker.init_model,
    roles.ACTOR_TRAIN: ActorWorker.init_model,
    roles.ACTOR_INFER: RolloutWorker.init_model,
    roles.REFERENCE: ReferenceWorker.init_model,
    roles.CRITIC: CriticWorker.init_model,
    roles.REWARD_MODEL: RewardModelWorker.init_model,
    roles.TEACHER: ReferenceWorker.init_model,
}


def build_role_groups(config: PipelineConfig) -> RoleGroups:
    """Start every role's actors (models loaded, engines up). Colocated roles share one placement group; the hybrid
    engine's roles share actor_train's processes (each role's group is then a facet of the hybrid group)."""
    groups: dict[str, WorkerGroup] = {}
    try:
        hosted = _start_groups(config, groups)
        # Model loading in parallel: the groups are independent.
        pending = [groups[name].submit(init_model) for name, init_model in _INIT_MODEL.items() if name in groups]
        for future in pending:
            future.get()
        hybrid = groups.get(roles.HYBRID)
        if hybrid is not None:
            groups |= _facets(hybrid, hosted)
            del groups[roles.HYBRID]
    except BaseException:
        for group in groups.values():
            group.shutdown()
        raise
    return RoleGroups(
        **groups,
        hybrid=hybrid,
        reference_from_actor=config.reference_from_actor_base,
        adapter_sync=synced_adapter_rank(config) is not None,
    )


def _facets(hybrid: WorkerGroup, hosted: HybridConfig) -> dict[str, WorkerGroup]:
    """The hybrid group's roles, each a group of its own to the driver (dispatched by the role's coordinates)."""
    per_rank = hybrid.call(HybridWorker.facet_coords)
    return {
        facet.role: hybrid.facet(facet.role, facet.worker_cls, [coords[facet.role] for coords in per_rank])
        for facet in hosted.facets
    }
