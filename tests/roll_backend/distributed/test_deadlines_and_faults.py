"""Deadline scopes and fault-injection specs (no Ray): which deadline a call gets, and how faults are named."""

from __future__ import annotations

import pytest

from roll_backend.distributed.deadlines import call_deadline, deadline_scope
from roll_backend.distributed.faults import (
    FAULT_ENV,
    FAULTS_OFF,
    FaultSpec,
    FaultTrigger,
    InjectedFault,
    fault_for_rank,
    parse_faults,
    remaining_faults,
)


def test_a_call_gets_the_earlier_of_its_own_and_the_scope_deadline():
    assert call_deadline(None) is None
    assert call_deadline(30).label == "the call"
    with deadline_scope(100, "phase 'train'") as outer:
        assert call_deadline(None) is outer
        assert call_deadline(5).label == "the call"  # ends first
        assert call_deadline(500) is outer
        with deadline_scope(1000, "inner") as inner:
            assert inner is outer  # a longer inner scope cannot extend the outer one
        with deadline_scope(1, "checkpoint") as short:
            assert call_deadline(None) is short and short.describe() == "the deadline of checkpoint (1s)"
    assert call_deadline(None) is None


def test_fault_specs_parse_or_say_what_is_wrong(monkeypatch):
    assert FaultSpec.parse("kill:actor_train:1:train:3") == FaultSpec("kill", "actor_train", 1, "train", 3)
    for text, complaint in [
        ("kill:actor_train:1:train", "needs 5 parts"),
        ("explode:a:0:train:1", "action 'explode'"),
        ("hang:a:0:sleep:1", "phase 'sleep' is not one of generate"),
        ("raise:a:x:train:0", "whole numbers"),
        ("nan:a:0:generate:1", "action nan changes the data of phase train; use it"),
        ("perturb:a:0:train:1", "action perturb changes the data of phase weight_sync_bucket; use it"),
    ]:
        with pytest.raises(ValueError, match=complaint):
            FaultSpec.parse(text)
    monkeypatch.setenv(FAULT_ENV, "raise:reward:0:reward:2")
    assert fault_for_rank(None, "reward", 0) == FaultSpec("raise", "reward", 0, "reward", 2)  # from the environment
    assert fault_for_rank(None, "reward", 1) is None  # another rank
    assert fault_for_rank(FAULTS_OFF, "reward", 0) is None  # a restarted run turns the variable off
    assert fault_for_rank("hang:reward:1:reward:1", "reward", 1).action == "hang"  # config wins
    # One fault per attempt: the run's first, then the restarted run's.
    both = "hang:actor_infer:0:generate:3; kill:actor_train:1:train:3"
    assert fault_for_rank(both, "actor_infer", 0) == FaultSpec("hang", "actor_infer", 0, "generate", 3)
    assert fault_for_rank(both, "actor_train", 1) is None
    assert remaining_faults(both) == "kill:actor_train:1:train:3"
    assert fault_for_rank(remaining_faults(both), "actor_train", 1).action == "kill"
    assert remaining_faults(remaining_faults(both)) == remaining_faults(None) == FAULTS_OFF
    with pytest.raises(ValueError, match="'kill:actor_train:1' needs 5 parts"):
        parse_faults("hang:actor_infer:0:generate:3;kill:actor_train:1")


def test_the_trigger_fires_at_the_kth_call_of_the_phase_methods_only():
    """The trigger counts calls of methods registered under the fault's deadline (ActorWorker's compute_log_probs
    and compute_values run under log_probs, its train_step under train)."""
    from roll_backend.workers.actor import ActorWorker

    deadline_of = {
        name: getattr(ActorWorker, name).dispatch.deadline
        for name in ("train_step", "compute_log_probs", "compute_values")
    }
    trigger = FaultTrigger(FaultSpec("raise", "actor_train", 0, "log_probs", 2))
    trigger.before_call(deadline_of["train_step"], "[actor_train rank 0/1]")
    trigger.before_call(deadline_of["compute_log_probs"], "[actor_train rank 0/1]")
    trigger.before_call(None, "[actor_train rank 0/1]")  # a method under no deadline
    with pytest.raises(InjectedFault, match=r"\[actor_train rank 0/1\] injected fault in log_probs at call 2"):
        trigger.before_call(deadline_of["compute_values"], "[actor_train rank 0/1]")
    trigger.before_call(deadline_of["compute_log_probs"], "[actor_train rank 0/1]")  # once only
