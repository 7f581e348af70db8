"""The roles/phases vocabulary (roll_backend/roles.py) is the one list: every table that names roles, phases or
deadlines agrees with it, so adding a role or a phase in one place and missing another fails here."""

import dataclasses

import pytest

from roll_backend import roles
from roll_backend.config.schema import PhaseTimeouts, PipelineConfig
from roll_backend.distributed.faults import FaultSpec
from roll_backend.pipelines.groups import RoleGroups
from roll_backend.workers.actor import ActorWorker
from roll_backend.workers.critic import CriticWorker
from roll_backend.workers.reference import ReferenceWorker
from roll_backend.workers.reward import RewardWorker
from roll_backend.workers.reward_model import RewardModelWorker
from roll_backend.workers.rollout import RolloutWorker

ROLE_WORKERS = {
    roles.ACTOR_TRAIN: ActorWorker,
    roles.ACTOR_INFER: RolloutWorker,
    roles.REFERENCE: ReferenceWorker,
    roles.CRITIC: CriticWorker,
    roles.REWARD: RewardWorker,
    roles.REWARD_MODEL: RewardModelWorker,
    roles.TEACHER: ReferenceWorker,  # (a teacher's log-probs are computed as a reference's)
}


def test_every_deadline_is_a_timeouts_setting_and_back():
    assert tuple(field.name for field in dataclasses.fields(PhaseTimeouts)) == roles.DEADLINES


def test_every_role_has_a_config_block_a_group_and_a_worker():
    config_fields = {field.name for field in dataclasses.fields(PipelineConfig)}
    assert set(roles.ROLES) <= config_fields
    # One group field per role, and the hybrid engine's group hosting some of them (the other fields say how roles
    # stand in for each other: the actor's base as the reference, the adapters as the rollout's weights).
    groups = {field.name for field in dataclasses.fields(RoleGroups) if "WorkerGroup" in str(field.type)}
    assert groups == {*roles.ROLES, roles.HYBRID}
    assert set(ROLE_WORKERS) == set(roles.ROLES)


def test_every_phase_names_a_role_and_a_deadline_and_fault_methods_exist():
    for phase in roles.PHASES.values():
        assert phase.role in roles.ROLES and phase.deadline in roles.DEADLINES, phase
        assert roles.deadline_of(phase.name) == phase.deadline
    # Each worker method says the deadline its calls run under; a fault phase is one that some method runs under.
    tagged = {
        (worker.__name__, name): how.deadline
        for worker in ROLE_WORKERS.values()
        for name in dir(worker)
        if (how := getattr(getattr(worker, name), "dispatch", None)) is not None and how.deadline is not None
    }
    assert set(tagged.values()) == set(roles.FAULT_PHASES)
    assert set(roles.FAULT_PHASES) <= set(roles.DEADLINES)
    assert tagged[("ActorWorker", "train_step")] == roles.TRAIN_DEADLINE
    assert tagged[("RolloutWorker", "stream_run")] == roles.GENERATION_DEADLINE
    for target in roles.FAULT_TARGETS:  # the phases and the points inside a weight sync
        assert FaultSpec.parse(f"kill:{roles.ACTOR_TRAIN}:0:{target}:1").phase == target
    with pytest.raises(ValueError, match="phase 'startup' is not one of generate, reward"):
        FaultSpec.parse(f"kill:{roles.ACTOR_TRAIN}:0:{roles.STARTUP}:1")
    with pytest.raises(KeyError, match="neither a phase"):
        roles.deadline_of("warmup")
