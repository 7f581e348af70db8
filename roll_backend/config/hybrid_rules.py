"""What the hybrid engine (`hybrid: true` on actor_infer, reference, critic) needs of a config: the hosted roles on
actor_train's ranks, one Megatron parallel state per process, and the phases in turn (no asynchronous generation)."""

from __future__ import annotations

from roll_backend import roles
from roll_backend.config.run_facts import hybrid_roles
from roll_backend.config.schema import PipelineConfig

HOSTABLE = (roles.ACTOR_INFER, roles.REFERENCE, roles.CRITIC)


def hybrid_problems(config: PipelineConfig) -> list[str]:
    problems = []
    for name in roles.MODEL_ROLES:
        role = getattr(config, name, None)
        if role is not None and role.hybrid and name not in HOSTABLE:
            problems.append(
                f"{name}.hybrid=true: only {', '.join(HOSTABLE)} run in actor_train's processes; set it false"
            )
    hosted = hybrid_roles(config)
    if not hosted:
        return problems
    train = config.actor_train
    infer = config.actor_infer
    if infer is None or not infer.hybrid:
        problems.append(
            f"{', '.join(f'{n}.hybrid=true' for n in hosted)} needs actor_infer.hybrid=true: the hybrid engine hosts "
            "the rollout engine with the trainer; set it, or give these roles their own ranks (hybrid: false)"
        )
    if train.colocate_with is not None:
        problems.append(
            f"actor_train.colocate_with={train.colocate_with!r}: the hybrid engine runs on actor_train's own ranks; "
            "remove colocate_with"
        )
    for name in hosted:
        role = getattr(config, name)
        if role.world_size != train.world_size:
            problems.append(
                f"{name}.world_size={role.world_size}: a hybrid role runs on actor_train's ranks; set "
                f"{name}.world_size={train.world_size}"
            )
        if role.colocate_with is not None:
            problems.append(
                f"{name}.colocate_with={role.colocate_with!r}: a hybrid role shares actor_train's processes; remove it"
            )
        if name != roles.ACTOR_INFER and role.strategy.layout != train.strategy.layout:
            problems.append(
                f"{name}.hybrid=true: its layout ({role.strategy.layout.describe()}) must be actor_train's "
                f"({train.strategy.layout.describe()}): the models of one process share one Megatron parallel state"
            )
    if config.async_generation.enabled:
        problems.append(
            "async_generation.enabled=true overlaps generation with training, and the hybrid engine runs them in turn "
            "on the same ranks; give actor_infer its own ranks (actor_infer.hybrid=false) or turn async_generation off"
        )
    return problems
