"""Rules a strategy enforces when its ranks start, checked by `validate` before Ray starts (issue 27): each used to
pass validation and fail later with a traceback on a rank."""

from __future__ import annotations

import pytest
from test_config_errors import CONFIG, base, problems_of  # noqa: F401  (base: a fixture)

from roll_backend.config.loader import load_config
from roll_backend.config.run_facts import run_facts


def test_a_zero_response_length_is_refused_before_any_rank_starts(base):
    problems = problems_of(base + ["response_length=0"])
    assert "response_length=0 must be >= 1 (the most tokens a response may have)" in problems
    # the rollout's own rule (its sampling takes max_tokens from the run) says so too, naming the role
    assert any(p.startswith("actor_infer.strategy: ") and "max_tokens=0" in p for p in problems), problems


@pytest.mark.parametrize("lr, min_lr", [(-1e-3, -2e-3), (-1e-3, 0.0), (1e-3, -1e-4)])
def test_negative_learning_rates_are_refused(base, lr, min_lr):
    problems = problems_of(
        base + [f"actor_train.strategy.optimizer.lr={lr}", f"actor_train.strategy.optimizer.min_lr={min_lr}"]
    )
    expected = [
        f"optimizer.{name}={value} must be >= 0" for name, value in (("lr", lr), ("min_lr", min_lr)) if value < 0
    ]
    for message in expected:
        assert any(message in p and p.startswith("actor_train.strategy") for p in problems), (message, problems)


def test_a_model_path_that_is_a_file_says_so(base, tmp_path):
    weights = tmp_path / "model.safetensors"
    weights.write_bytes(b"\0" * 8)
    problems = problems_of(base + ["build_tiny_model=null", f"model_path={weights}"])
    assert problems[0] == (
        f"model_path={str(weights)!r} is a file; point it at the folder that holds the model "
        "(config.json, weights, tokenizer)"
    )
    assert not any("does not exist" in p for p in problems)


@pytest.mark.parametrize("estimator", ["grpo", "rloo", "reinforce_plus_plus_baseline"])
def test_group_baselines_need_more_than_one_response_per_prompt(base, estimator):
    [problem] = problems_of(
        base
        + [
            f"algorithm.adv_estimator={estimator}",
            "num_return_sequences_in_group=1",
            "rollout_batch_size=64",
            "algorithm.ppo_mini_batch_size=null",
        ]
    )
    assert problem.startswith(f"algorithm.adv_estimator={estimator} compares each response with the others")
    assert "num_return_sequences_in_group=1" in problem and "set num_return_sequences_in_group >= 2" in problem


def test_estimators_without_a_group_baseline_take_one_response_per_prompt(base):
    config = load_config(
        CONFIG,
        base
        + [
            "algorithm.adv_estimator=reinforce_plus_plus",
            "num_return_sequences_in_group=1",
            "rollout_batch_size=64",
            "algorithm.ppo_mini_batch_size=null",
        ],
    )
    assert config.num_return_sequences_in_group == 1


def test_router_replay_rules(base):
    """router_replay takes R2, R3 or null, on a MoE model only; the rollout's routes (R3, return_routed_experts)
    are not collected in streaming mode; R3 turns the rollout's route capture on by itself."""
    problems = problems_of(base + ["actor_train.strategy.router_replay=R4"])
    assert any("router_replay='R4'; choose R2" in p for p in problems), problems
    problems = problems_of(base + ["actor_train.strategy.router_replay=R2"])
    assert any(
        p.startswith("actor_train.strategy.router_replay=R2: the model (qwen2) has no routed experts") for p in problems
    ), problems
    moe = ["build_tiny_model.family=qwen3_moe", "build_tiny_model.num_experts=4", "actor_train.strategy.tp=1"]
    moe += ["actor_train.strategy.micro_batch_size=32"]
    config = load_config(CONFIG, base + moe + ["actor_train.strategy.router_replay=R3"])
    rollout = config.actor_infer.strategy.config
    assert not rollout.return_routed_experts and rollout.for_run(run_facts(config, "actor_infer")).return_routed_experts
    streaming = ["async_generation.enabled=true", "async_generation.mode=streaming"]
    problems = problems_of(base + moe + streaming + ["actor_train.strategy.router_replay=R3"])
    assert any("streamed requests' routes are not collected yet; use router_replay=R2" in p for p in problems)
    load_config(CONFIG, base + moe + streaming + ["actor_train.strategy.router_replay=R2"])


def test_lora_rules(base):
    """LoRA settings are checked, and what it cannot do yet (on MoE models: adapter sync, PEFT export) is refused;
    it checkpoints."""
    problems = problems_of(base + ["actor_train.strategy.lora={rank: 0, dropout: 1.0, target_modules: [q_proj, qkv]}"])
    assert any("lora.rank=0 must be >= 1" in p for p in problems), problems
    assert any("lora.dropout=1.0 must be in [0, 1)" in p for p in problems), problems
    assert any("lora.target_modules=['q_proj', 'qkv']: choose from q_proj" in p for p in problems), problems
    problems = problems_of(base + ["actor_train.strategy.lora={rank: 8}", "actor_train.strategy.transformer_impl=te"])
    assert any("lora with transformer_impl=te: TE fuses the norms" in p for p in problems), problems
    load_config(CONFIG, base + ["actor_train.strategy.lora={rank: 8}", "checkpoint.save_steps=5"])  # no problem
    problems = problems_of(base + ["checkpoint.export_peft_dir=/tmp/adapter"])
    assert any("checkpoint.export_peft_dir writes LoRA adapters" in p for p in problems), problems
    moe = ["build_tiny_model.family=qwen3_moe", "build_tiny_model.num_experts=4", "actor_train.strategy.tp=1"]
    moe += ["actor_train.strategy.micro_batch_size=32", "actor_train.strategy.lora={rank: 8}"]
    load_config(CONFIG, base + moe)  # adapters on attention and experts, merged sync: no problem
    load_config(CONFIG, base + moe + ["actor_train.strategy.tp=2"])  # (sequence parallel) no problem either
    wrong = ["actor_train.strategy.lora.sync=adapter", "checkpoint.export_peft_dir=/tmp/a"]
    problems = problems_of(base + moe + wrong)
    assert any("checkpoint.export_peft_dir on a MoE model" in p for p in problems), problems
    assert any("lora.sync=adapter on a MoE model" in p for p in problems), problems
    streaming = [
        "async_generation.enabled=true",
        "async_generation.mode=streaming",
        "actor_train.strategy.lora={sync: adapter}",
    ]
    problems = problems_of(base + streaming + ["async_generation.partial_rollout=keep"])
    assert any("set async_generation.partial_rollout=resubmit, or use lora.sync=merged" in p for p in problems)
    load_config(CONFIG, base + streaming + ["async_generation.partial_rollout=resubmit"])  # adapters resubmitted
    config = load_config(CONFIG, base + ["actor_train.strategy.lora={rank: 8, alpha: 16}"])
    assert config.actor_train.strategy.config.lora.alpha == 16.0


def test_reference_from_actor_base(base):
    """`reference: {from_actor_base: true}` replaces the reference role by the actor's base (LoRA adapters off): it
    needs adapters, the actor's model and the actor's ranks free of prepared batches; it round-trips through YAML."""
    from roll_backend.config.loader import config_from_dict, config_to_yaml, resolve_yaml

    switched = base + ["reference.from_actor_base=true", "actor_train.strategy.lora={rank: 8}"]
    config = load_config(CONFIG, switched)
    assert config.reference is None and config.reference_from_actor_base and config.has_reference
    assert "from_actor_base: true" in config_to_yaml(config)
    problems = problems_of(base + ["reference.from_actor_base=true"])
    assert any("actor_train.strategy (megatron_train) has no `lora:`" in p for p in problems), problems
    problems = problems_of(switched + ["reference.model_path=/elsewhere"])
    assert any("reference.model_path is '/elsewhere'" in p for p in problems), problems
    ahead = ["async_generation.enabled=true", "async_generation.prepare_ahead=true"]
    assert any("set prepare_ahead=false" in p for p in problems_of(switched + ahead))
    assert load_config(CONFIG, base + ["reference.from_actor_base=false"]).reference is not None
    data = resolve_yaml(CONFIG, switched)
    data["reference"] = {"from_actor_base": True}
    assert config_from_dict(data).reference_from_actor_base


def test_the_overlong_buffer_counts_from_the_response_length_unless_set(base):
    from roll_backend.pipelines.groups import overlong_buffer

    run = base + ["response_length=8"]
    config = load_config(CONFIG, run + ["reward.overlong_buffer={length: 8, penalty_factor: 0.5}"])
    assert (overlong_buffer(config).max_length, overlong_buffer(config).length) == (8, 8)  # verl's max_resp_len
    config = load_config(CONFIG, run + ["reward.overlong_buffer={length: 3, max_length: 6}"])
    assert overlong_buffer(config).max_length == 6
    too_long = problems_of(run + ["reward.overlong_buffer={length: 9}"])
    assert any(
        "reward.overlong_buffer.length=9 must be between 1 and the longest response (8 tokens" in p for p in too_long
    )
    assert any(
        "reward.overlong_buffer.penalty_factor=-1.0 must be >= 0" in p
        for p in problems_of(run + ["reward.overlong_buffer={length: 2, penalty_factor: -1}"])
    )


def test_remax_runs_where_its_greedy_baseline_can_be_generated(base):
    """ReMax generates each prompt's greedy response beside its samples: any group size, one-step async too; refused
    (saying why) for multi-turn trajectories, streaming, and a reward normalisation the baseline would escape."""
    remax = ["algorithm.adv_estimator=remax"]
    assert load_config(CONFIG, base + remax).algorithm.adv_estimator == "remax"
    one = ["num_return_sequences_in_group=1", "rollout_batch_size=64", "algorithm.ppo_mini_batch_size=null"]
    load_config(CONFIG, base + remax + one)
    streaming = ["async_generation.enabled=true", "async_generation.mode=streaming"]
    for extra, reason in (
        (streaming, "streaming generation admits prompts one group at a time; use async_generation.mode=one_step"),
        (["algorithm.reward_norm=group"], "algorithm.reward_norm rescales the sampled scores but not the greedy"),
    ):
        problems = problems_of(base + remax + extra)
        assert any(p.startswith(f"algorithm.adv_estimator=remax: {reason}") for p in problems), problems
    problems = problems_of(remax + ["reward.model_score_norm=batch"], "configs/ppo_reward_model_cpu.yaml")
    assert any("remax: reward.model_score_norm standardises each scored batch on its own" in p for p in problems)
    problems = problems_of(remax, "configs/agentic_frozenlake_cpu.yaml")
    assert any("remax: multi-turn trajectories (the `agentic` section) have no greedy" in p for p in problems)


@pytest.mark.parametrize("value_clip, refused", [(0.0, True), (-0.2, True), (0.2, False), (None, False)])
def test_value_clip_is_positive_or_null(base, value_clip, refused):
    setting = [f"algorithm.value_clip={'null' if value_clip is None else value_clip}"]
    if refused:
        assert f"algorithm.value_clip={value_clip} must be > 0 (0.2-0.5 is usual), or null: no clipping" in problems_of(
            base + setting
        )
    else:
        assert load_config(CONFIG, base + setting).algorithm.value_clip == value_clip
