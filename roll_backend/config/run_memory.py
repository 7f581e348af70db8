"""The run's memory plan before anything starts: what each role's ranks hold (each strategy plans its own, through
its MemoryPlanner in strategies.registry), what the roles sharing a device hold together in each phase, and whether
that fits the declared device memory (`device_memory_gib`).

Roles share a device when they are hybrid (they run in actor_train's processes and hand the device over: a role not
running keeps only the state it does not offload, a sleeping engine nothing) or colocated (`colocate_with`: each keeps
everything). A phase's total on a device is the running role's peak plus what the others keep; the plan refuses a run
where one exceeds the device, naming the largest terms and the settings that shrink them.
"""

from __future__ import annotations

from dataclasses import dataclass

from roll_backend import roles
from roll_backend.config.run_facts import hybrid_roles, run_facts
from roll_backend.config.schema import PipelineConfig
from roll_backend.strategies.base import RankMemory, size
from roll_backend.strategies.registry import memory_planner

GIB = 1 << 30


@dataclass(frozen=True)
class DevicePhase:
    """One phase on the devices of a group of roles: who runs, and each role's bytes by term."""

    devices: str  # the role whose devices these are
    role: str  # the role running the phase
    phase: str
    terms: tuple[tuple[str, str, int], ...]  # (role, term, bytes), largest first

    @property
    def total(self) -> int:
        return sum(size for _, _, size in self.terms)


def role_plans(config: PipelineConfig) -> dict[str, list[RankMemory]]:
    """Each model role's plan (its worst ranks first), [] where its model's config is not known."""
    plans = {}
    for name in roles.MODEL_ROLES:
        role = getattr(config, name, None)
        if role is None:
            continue
        planner = memory_planner(role.strategy.name)
        ranks = planner.plan(role.strategy.config, run_facts(config, name, role)) if planner is not None else []
        plans[name] = sorted(ranks, key=lambda r: -max(r.phase_peak(p) for p in r.phases or {"": {}}))
    return plans


def device_groups(config: PipelineConfig, names) -> dict[str, list[str]]:
    """{the role owning the devices: the roles on them}: hybrid roles on actor_train's, colocated ones on the role
    they colocate with."""
    hosted = hybrid_roles(config)
    groups: dict[str, list[str]] = {}
    for name in names:
        owner, seen = (roles.ACTOR_TRAIN if name in hosted else name), set()
        while owner not in seen and getattr(getattr(config, owner, None), "colocate_with", None):
            seen.add(owner)
            owner = getattr(config, owner).colocate_with
        groups.setdefault(owner, []).append(name)
    return groups


def _terms(name: str, plan: RankMemory, phase: str) -> list[tuple[str, str, int]]:
    if plan.reserved is not None:
        return [(name, "engine reservation (gpu_memory_utilization)", plan.reserved)]
    state = [(name, part, size) for part, size in plan.state.items() if size]
    return state + [(name, term, size) for term, size in plan.phases.get(phase, {}).items() if size]


def device_phases(config: PipelineConfig, plans: dict[str, list[RankMemory]]) -> list[DevicePhase]:
    """Every phase of every role on its devices, with what the other roles there keep meanwhile."""
    hosted = set(hybrid_roles(config))
    out = []
    for owner, members in device_groups(config, [n for n, p in plans.items() if p]).items():
        for name in members:
            worst = plans[name][0]
            for phase in worst.phases:
                terms = _terms(name, worst, phase)
                hybrid_sync = phase == roles.WEIGHT_SYNC and roles.ACTOR_INFER in hosted
                if hybrid_sync:  # the trainer keeps its parameters on the device; its other offloaded parts wait
                    terms = [t for t in terms if t[1] == "params" or t[1] not in worst.offloaded]
                for other in members:
                    if other == name:
                        continue
                    kept = plans[other][0]
                    handing_over = other in hosted or (other == roles.ACTOR_TRAIN and bool(hosted))
                    resident = kept.resident(offloading=handing_over)
                    if hybrid_sync and other == roles.ACTOR_INFER:
                        # The hybrid engine wakes its weights to load the new ones (its KV cache after).
                        terms.append((other, "weights, awake for the sync", sum(kept.state.values())))
                    elif resident:
                        terms.append((other, "kept while idle", resident))
                out.append(DevicePhase(owner, name, phase, tuple(sorted(terms, key=lambda t: -t[2]))))
    return out


def memory_problems(config: PipelineConfig) -> list[str]:
    """Why the run does not fit the declared device memory ([] when it fits or none is declared)."""
    if config.memory_plan_expert_load < 1:
        return [
            f"memory_plan_expert_load={config.memory_plan_expert_load:g} must be >= 1 (1: balanced routing; a plan "
            "below it would count fewer tokens than the experts compute)"
        ]
    if config.device_memory_gib is not None and config.device_memory_gib <= 0:
        return [f"device_memory_gib={config.device_memory_gib} must be > 0 (or null: the plan is not checked)"]
    if not config.device_memory_gib:
        return []
    limit = int(config.device_memory_gib * GIB)
    plans = role_plans(config)
    problems = []
    for name, planned in plans.items():
        role = getattr(config, name)
        problems += memory_planner(role.strategy.name).problems(role.strategy.config, run_facts(config, name), planned)
    worst: dict[str, DevicePhase] = {}  # the largest phase on each group of devices
    for phase in device_phases(config, plans):
        if phase.devices not in worst or phase.total > worst[phase.devices].total:
            worst[phase.devices] = phase
    for phase in worst.values():
        if phase.total <= limit:
            continue
        largest = ", ".join(f"{role} {term} {size(n)}" for role, term, n in phase.terms[:3])
        hints = {
            f"{role}.strategy: {plans[role][0].hints[term]}"
            for role, term, _ in phase.terms[:3]
            if term in plans[role][0].hints
        }
        problems.append(
            f"memory: {phase.role} {phase.phase} needs {size(phase.total)} on each device of {phase.devices}, "
            f"over device_memory_gib={config.device_memory_gib:g}; largest: {largest}"
            + (f"; to shrink them: {'; '.join(sorted(hints))}" if hints else "")
        )
    return problems


def _rank_lines(rank: RankMemory) -> list[str]:
    state = ", ".join(f"{part} {size(n)}" for part, n in rank.state.items() if n)
    offloaded = f" (to host memory while idle: {', '.join(sorted(rank.offloaded))})" if rank.offloaded else ""
    total = f" = {size(sum(rank.state.values()))}" if len([n for n in rank.state.values() if n]) > 1 else ""
    lines = [f"  {rank.ranks}: {state}{total}{offloaded}"]
    if rank.reserved is not None:
        lines.append(f"    reserves {size(rank.reserved)} of the device")
    for phase, terms in rank.phases.items():
        items = ", ".join(f"{term} {size(n)}" for term, n in terms.items() if n)
        lines.append(f"    {phase}: peak {size(rank.phase_peak(phase))} ({items})")
    return lines + [f"    note: {note}" for note in rank.notes]


def render(config: PipelineConfig) -> str:
    """The plan as text: each role's ranks (state and phase terms), then each device group's phases."""
    plans = role_plans(config)
    limit = config.device_memory_gib
    lines = [f"memory plan of {config.exp_name}" + (f" (devices of {limit:g} GiB)" if limit else "")]
    for name, ranks in plans.items():
        role = getattr(config, name)
        if not ranks:
            lines.append(f"{name}: not planned (its model's config.json is not readable)")
            continue
        lines.append(f"{name} ({role.world_size} ranks, {role.strategy.layout.describe()}), bytes per device:")
        for rank in ranks:
            lines += _rank_lines(rank)
    lines.append("per device, by phase (the running role's peak and what the others there keep):")
    for phase in device_phases(config, plans):
        verdict = ("  fits" if phase.total <= limit * GIB else "  DOES NOT FIT") if limit else ""
        lines.append(f"  {phase.devices}'s devices, {phase.role} {phase.phase}: {size(phase.total)}{verdict}")
    return "\n".join(lines)


def summary(config: PipelineConfig) -> list[str]:
    """One line per group of devices: its largest phase (validate prints them; `roll-backend plan` has the rest)."""
    worst: dict[str, DevicePhase] = {}
    for phase in device_phases(config, role_plans(config)):
        if phase.devices not in worst or phase.total > worst[phase.devices].total:
            worst[phase.devices] = phase
    limit = f" of {config.device_memory_gib:g} GiB" if config.device_memory_gib else ""
    return [
        f"memory plan: {devices}'s devices peak at {size(phase.total)}{limit} ({phase.role} {phase.phase})"
        for devices, phase in worst.items()
    ]
