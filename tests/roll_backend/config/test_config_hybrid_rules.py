"""What the hybrid engine refuses before any actor starts (roll_backend/config/hybrid_rules.py and the strategies'
offload and sleep settings), each naming the key and the fix; the hybrid recipe itself loads."""

from __future__ import annotations

from test_config_errors import base, problems_of  # noqa: F401  (base: a fixture)

from roll_backend.config.loader import load_config
from roll_backend.config.run_facts import run_facts

HYBRID = "configs/grpo_hybrid_cpu.yaml"


def test_the_hybrid_recipe_hosts_the_engine_and_the_reference(base):
    config = load_config(HYBRID, base)
    assert config.actor_infer.hybrid and config.reference.hybrid
    assert run_facts(config, "actor_infer").hybrid and run_facts(config, "actor_train").hybrid
    assert config.actor_infer.strategy.config.for_run(run_facts(config, "actor_infer")).hybrid


def test_hybrid_roles_must_fit_on_the_trainers_ranks(base):
    problems = problems_of(
        base
        + [
            "reference.world_size=1",
            "reference.strategy.tp=1",
            "actor_infer.colocate_with=actor_train",
            "actor_train.hybrid=true",
        ],
        HYBRID,
    )
    assert (
        "actor_train.hybrid=true: only actor_infer, reference, critic run in actor_train's processes; set it false"
        in (problems)
    )
    assert "reference.world_size=1: a hybrid role runs on actor_train's ranks; set reference.world_size=2" in problems
    assert any(p.startswith("reference.hybrid=true: its layout (tp=1 pp=1") for p in problems), problems
    assert any(p.startswith("actor_infer.colocate_with='actor_train': a hybrid role shares") for p in problems)


def test_a_hosted_reference_needs_the_engine_hosted_too(base):
    problems = problems_of(
        base + ["actor_infer.hybrid=false", "actor_infer.world_size=1", "actor_infer.strategy.tp=1"], HYBRID
    )
    assert any(p.startswith("reference.hybrid=true needs actor_infer.hybrid=true") for p in problems), problems


def test_asynchronous_generation_is_refused_with_the_reason(base):
    problems = problems_of(base + ["async_generation.enabled=true"], HYBRID)
    assert any(
        p.startswith("async_generation.enabled=true overlaps generation with training, and the hybrid engine runs them")
        for p in problems
    ), problems


def test_offload_and_sleep_settings_outside_the_hybrid_engine_or_out_of_range(base):
    problems = problems_of(base + ["actor_train.strategy.offload_grads=true", "actor_infer.strategy.sleep_level=3"])
    assert any(
        p.startswith("actor_train.strategy: offload_grads hand the device over in the hybrid engine only")
        for p in problems
    ), problems
    assert "actor_infer.strategy.sleep_level=3: vLLM sleeps at level 1 or 2" in problems
