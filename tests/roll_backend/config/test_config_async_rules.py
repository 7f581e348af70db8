"""Config errors of asynchronous generation (one_step and streaming): each message names the key, the value seen and
the fix. The helpers are test_config_errors.py's."""

from __future__ import annotations

from test_config_errors import CONFIG, base, problems_of  # noqa: F401  (base: a fixture)

from roll_backend.config.loader import load_config


def test_async_generation_refuses_a_colocated_rollout(base):
    [problem] = problems_of(base + ["async_generation.enabled=true", "actor_infer.colocate_with=reference"])
    assert problem.startswith(
        "async_generation.enabled=true needs actor_infer on resources disjoint from actor_train's; remove colocate_with"
    )
    assert "actor_infer.colocate_with='reference'" in problem


def test_preparing_ahead_refuses_a_reference_on_the_actors_devices(base):
    [problem] = problems_of(
        base
        + [
            "async_generation.enabled=true",
            "async_generation.prepare_ahead=true",
            "reference.colocate_with=actor_train",
            "reference.world_size=2",
        ]
    )
    assert problem.startswith(
        "async_generation.prepare_ahead=true runs the reference while the actor trains, but the "
        "reference shares actor_train's devices"
    )
    config = load_config(
        CONFIG,
        base
        + [
            "async_generation.enabled=true",
            "async_generation.prepare_ahead=true",
            "reference.colocate_with=actor_infer",
        ],
    )  # on the rollout's devices
    assert config.async_generation.prepare_ahead
    [problem] = problems_of(base + ["async_generation.prepare_ahead=true"])
    assert problem.startswith(
        "async_generation.prepare_ahead=true prepares the next batch while the actor trains, "
        "which only the asynchronous loop does; set async_generation.enabled=true"
    )


def test_async_generation_needs_a_positive_staleness(base):
    [problem] = problems_of(base + ["async_generation.enabled=true", "async_generation.max_staleness=0"])
    assert problem.startswith("async_generation.max_staleness=0: one-step generation is one step behind at least")


def test_streaming_rules_name_the_setting(base):
    """Streaming takes max_staleness 0 (the synchronous run); the rest says what to change."""
    streaming = ["async_generation.enabled=true", "async_generation.mode=streaming"]
    config = load_config(CONFIG, base + streaming + ["async_generation.max_staleness=0"])
    assert config.async_generation.mode == "streaming" and config.async_generation.max_staleness == 0
    problems = problems_of(
        base
        + streaming
        + [
            "async_generation.max_staleness=-1",
            "async_generation.partial_rollout=pause",
            "async_generation.on_stale=keep",
            "async_generation.steps_per_call=0",
            "async_generation.prepare_ahead=true",
            "actor_infer.world_size=2",
            "actor_infer.strategy.tp=2",
        ]
    )
    expected = (
        "async_generation.max_staleness=-1 must be >= 0 in streaming mode",
        "async_generation.partial_rollout='pause'; choose one of keep, recompute, resubmit",
        "async_generation.on_stale='keep'; choose drop or regenerate",
        "async_generation.steps_per_call=0 must be >= 1",
        "async_generation.prepare_ahead=true is for mode=one_step",
        "async_generation.mode=streaming with actor_infer.strategy.tp=2",
    )
    for start in expected:
        assert any(p.startswith(start) for p in problems), (start, problems)
    [problem] = problems_of(base + ["async_generation.enabled=true", "async_generation.mode=stream"])
    assert problem == "async_generation.mode='stream'; choose one of one_step, streaming"
