"""Plan beside measured at the end of the first step: every role that runs a model counts the memory of its phases
in that step (keys.META_MEASURE_MEMORY: tensor accounting on a CPU rank, the allocator's peak on a GPU), and the run
log shows it beside the plan, at the micro-batches that ran and at the config's largest (`roll-backend plan`)."""

from __future__ import annotations

import logging

from roll_backend import roles
from roll_backend.config.run_facts import run_facts
from roll_backend.config.run_memory import role_plans
from roll_backend.strategies.base import size
from roll_backend.strategies.registry import memory_planner

logger = logging.getLogger(__name__)
MEASURED_ROLES = (
    roles.ACTOR_TRAIN,
    roles.REFERENCE,
    roles.CRITIC,
    roles.REWARD_MODEL,
    roles.TEACHER,
    roles.ACTOR_INFER,
)


def memory_report(run, only: str | None = None) -> dict[str, float]:
    """Log each measured role's phases (`only` that one; the model state and every phase otherwise), measured vs
    planned, and return them as `memory/<role>_<phase>/...` metrics (GiB, the largest over the role's ranks)."""
    config, metrics = run.config, {}
    plans = role_plans(config)
    for name in MEASURED_ROLES:
        group, role = getattr(run.groups, name, None), getattr(config, name, None)
        if group is None or role is None or not plans.get(name):
            continue
        facts, planner = run_facts(config, name, role), memory_planner(role.strategy.name)
        measured, planned, loads = {}, {}, {}
        for report in group.call(group.worker_cls.measured_memory):  # (StrategyWorker's, RolloutWorker's)
            at = planner.planned_at(role.strategy.config, facts, report)
            figures = {"model_state": sum(report["model_state"].values()), **report["phases"]}
            if only is not None:
                figures = {what: value for what, value in figures.items() if what == only}
            for what, value in figures.items():
                if value >= measured.get(what, -1):
                    measured[what], planned[what] = value, at.get(what, 0)
            for what, shape in report.get("micro_batches", {}).items():
                # a MoE rank: what its experts computed (moe.ExpertLoad)
                if only is None and (shape or {}).get("expert_load"):
                    loads[what] = max(loads.get(what, 0.0), shape["expert_load"]["busiest"])
        for what, load in loads.items():
            metrics[f"memory/{name}_{what}/expert_load"] = load
            logger.info(
                "memory at step 1, %s %s: the busiest rank's experts computed %.2fx the tokens its own tokens route "
                "(the plan takes memory_plan_expert_load=%g)",
                name,
                what,
                load,
                config.memory_plan_expert_load,
            )
        for what, value in measured.items():
            prefix = f"memory/{name}_{what}"
            metrics[f"{prefix}/measured_gib"] = value / 2**30
            metrics[f"{prefix}/planned_gib"] = planned[what] / 2**30
            config_plan = _config_plan(plans[name], what)
            if name == roles.ACTOR_INFER:
                ran = "the engine's settings"  # (an engine holds its weights and KV cache whatever the batch)
            else:
                ran = "the bucket size that ran" if what == roles.WEIGHT_SYNC else "the micro-batches that ran"
            logger.info(
                "memory at step 1, %s %s: measured %s, planned %s at %s (%+.0f%%), %s at the config's largest",
                name,
                what,
                size(value),
                size(planned[what]),
                ran,
                100 * (planned[what] / value - 1) if value else 0.0,
                size(config_plan),
            )
    return metrics


def _config_plan(ranks, what: str) -> int:
    """The plan of the config's largest batch for `what`: the model state, a phase, or one term of a phase (a rollout
    engine's KV cache, held through its generate phase)."""
    if what == "model_state":
        return max(sum(rank.state.values()) for rank in ranks)
    return max(
        sum(rank.phases[what].values())
        if what in rank.phases
        else max((terms.get(what, 0) for terms in rank.phases.values()), default=0)
        for rank in ranks
    )
