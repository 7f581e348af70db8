"""Config errors: one test per rule of the loader and validator, each checking that the message names the key,
the value seen and the fix; and that several problems come back together. Uses the demo config plus overrides
(its numbers are tuned elsewhere: every value a test relies on is set by the test) and tiny YAML files."""

from __future__ import annotations

from pathlib import Path

import pytest
from config_fixtures import CONFIG, TINY_HEADS

from roll_backend.config.loader import load_config
from roll_backend.config.typed import ConfigError


@pytest.fixture()
def base(tmp_path) -> list[str]:
    return [f"output_dir={tmp_path}/run", *TINY_HEADS]


def problems_of(overrides: list[str], path: Path | str = CONFIG) -> list[str]:
    with pytest.raises(ConfigError) as info:
        load_config(path, overrides)
    for problem in info.value.problems:
        assert problem in str(info.value)  # the message lists every problem
    return info.value.problems


def test_demo_config_loads(base):
    config = load_config(CONFIG, base)
    assert config.pipeline == "grpo" and config.actor_train.strategy.name == "megatron_train"


# ---- shape of the tree: keys, types, required fields, strategy names -----------------------------------
def test_unknown_key_suggests_the_close_one(base):
    assert problems_of(base + ["max_step=3"]) == ["max_step: unknown key; did you mean 'max_steps'?"]
    assert problems_of(base + ["algorithm.clip_ratio_lo=0.1"]) == [
        "algorithm.clip_ratio_lo: unknown key; did you mean 'clip_ratio_low'?"
    ]


def test_unknown_strategy_key_suggests_the_close_one(base):
    [problem] = problems_of(base + ["actor_train.strategy.tpp=2"])
    assert problem == "actor_train.strategy.tpp: unknown key for strategy 'megatron_train'; did you mean 'tp'?"


def test_a_key_given_one_section_too_high_is_pointed_to_its_section(base):
    """verl and ROLL users write `lr` or `temperature` beside the strategy's other keys; the hint names the path where
    the key lives rather than the nearest spelling (`lr` is not a typo of `lora`)."""
    [lr] = problems_of(base + ["actor_train.strategy.lr=1e-5"])
    assert lr.endswith(
        "unknown key for strategy 'megatron_train'; it belongs in a section below: write "
        "actor_train.strategy.optimizer.lr"
    )
    [temperature] = problems_of(base + ["actor_infer.strategy.temperature=0.7"])
    assert temperature.endswith(
        "write actor_infer.strategy.sampling.temperature or actor_infer.strategy.validation.temperature"
    )
    assert problems_of(base + ["max_turns=3"]) == [
        "max_turns: unknown key; it belongs in a section below: write agentic.max_turns"
    ]
    assert problems_of(base + ["algorithm.clip_ratio=0.2"])[0].endswith("did you mean 'clip_ratio_low'?")


@pytest.mark.parametrize(
    "setting, expected",
    [
        ("sampling.temperature=-0.5", "sampling.temperature=-0.5; it must be between 0 (greedy) and 2."),
        ("sampling.temperature=2.01", "sampling.temperature=2.01; it must be between 0 (greedy) and 2."),
        ("validation.top_p=0", "sampling.top_p=0.0; it must be above 0 and at most 1 (1: off)."),
        ("sampling.top_p=1.5", "sampling.top_p=1.5; it must be above 0 and at most 1 (1: off)."),
        ("sampling.top_k=-2", "sampling.top_k=-2; it must be -1 or 0 (off) or at least 1."),
    ],
)
def test_sampling_settings_outside_the_engine_s_range_are_refused_before_it_starts(base, setting, expected):
    """vLLM would refuse them at the first generate, after every rank started."""
    [problem] = problems_of(base + [f"actor_infer.strategy.{setting}"])
    assert problem == f"actor_infer.strategy.{setting.split('.')[0]}: {expected}"
    for edge in ("sampling.temperature=2", "sampling.top_p=1", "sampling.top_k=0", "sampling.top_k=-1"):
        load_config(CONFIG, base + [f"actor_infer.strategy.{edge}"])


def test_wrong_type_names_expected_type_and_value(base):
    assert problems_of(base + ["max_steps=abc"]) == ["max_steps: expected int, got str 'abc'"]
    assert problems_of(base + ["seed=1.5"]) == ["seed: expected int, got float 1.5"]
    assert problems_of(base + ["algorithm.use_kl_loss=maybe"]) == [
        "algorithm.use_kl_loss: expected bool, got str 'maybe'"
    ]


def test_an_interpolation_of_an_unset_key_names_the_key_to_set(tmp_path):
    config = tmp_path / "no_model_path.yaml"
    config.write_text(
        "pipeline: grpo\ndata: {synthetic: {}}\n"
        "actor_train: {model_path: '${model_path}', strategy: {name: megatron_train}}\n"
    )
    [problem] = problems_of([], config)
    unset = "actor_train.model_path refers to ${model_path}, which is not set"
    assert problem == f"{unset}: set model_path in the YAML or as model_path=..."


def test_missing_required_field_says_how_to_set_it(tmp_path):
    config = tmp_path / "no_pipeline.yaml"
    config.write_text(
        "model_path: m\n"
        "data: {synthetic: {}}\n"
        "actor_train: {model_path: m, strategy: {name: megatron_train}}\n"
        "actor_infer: {model_path: m, strategy: {name: vllm_rollout}}\n"
    )
    assert "pipeline: required; set it in the YAML or as pipeline=..." in problems_of([], config)


def test_role_strategy_needs_a_name(tmp_path):
    config = tmp_path / "no_name.yaml"
    config.write_text(
        "pipeline: grpo\nmodel_path: m\ndata: {synthetic: {}}\nalgorithm: {use_kl_loss: false}\n"
        "actor_train: {model_path: m, strategy: {tp: 1}}\n"
        "actor_infer: {model_path: m, strategy: {name: vllm_rollout}}\n"
    )
    assert problems_of([], config) == [
        "actor_train.strategy: needs a mapping with a `name` (e.g. name: megatron_train)"
    ]


def test_unknown_strategy_name_lists_the_registry(base):
    [problem] = problems_of(base + ["actor_train.strategy.name=megatron"])
    assert problem.startswith("actor_train.strategy.name: unknown strategy 'megatron'; known: ")
    assert "megatron_train" in problem and "vllm_rollout" in problem


def test_strategy_config_checks_report_the_value(base):
    [problem] = problems_of(base + ["actor_train.strategy.micro_batch_size=0"])
    assert "actor_train.strategy" in problem and "micro_batch_size=0 must be >= 1" in problem


def test_mtp_settings_are_checked_before_ray(base):
    [problem] = problems_of(base + ["actor_train.strategy.mtp_num_layers=-1"])
    assert "actor_train.strategy" in problem and "mtp_num_layers=-1 must be an integer >= 0" in problem
    [problem] = problems_of(
        base + ["actor_train.strategy.mtp_num_layers=1", "actor_train.strategy.mtp_loss_scaling_factor=-0.5"]
    )
    assert (
        "mtp_loss_scaling_factor=-0.5 must be a finite number > 0 with MTP" in problem and "mtp_num_layers=0" in problem
    )
    # without MTP the factor is unused and not checked
    load_config(CONFIG, base + ["actor_train.strategy.mtp_loss_scaling_factor=-0.5"])


# ---- batch sizes --------------------------------------------------------------------------------------
BATCH_16 = ["rollout_batch_size=4", "num_return_sequences_in_group=4"]  # 16 responses per step


def test_mini_batch_must_divide_the_step_batch(base):
    problems = problems_of(
        base + BATCH_16 + ["algorithm.ppo_mini_batch_size=6", "actor_train.strategy.micro_batch_size=1"]
    )
    assert problems == [
        "algorithm.ppo_mini_batch_size=6 does not divide rollout_batch_size*num_return_sequences_in_group=16; "
        "choose one of 1, 2, 4, 8, 16"
    ]


def test_mini_batch_must_split_into_micro_batches_on_every_dp_rank(base):
    # tp=1 on 2 ranks: dp=2, so a mini-batch of 12 gives 6 per rank, not a multiple of micro_batch_size=4.
    overrides = [
        "rollout_batch_size=6",
        "num_return_sequences_in_group=2",
        "algorithm.ppo_mini_batch_size=12",
        "actor_train.world_size=2",
        "actor_train.strategy.tp=1",
        "actor_train.strategy.micro_batch_size=4",
    ]
    assert problems_of(base + overrides) == [
        "actor_train: a mini-batch of 12 responses cannot be split into micro-batches of "
        "actor_train.strategy.micro_batch_size=4 on each of 2 data-parallel ranks; make the mini-batch "
        "(algorithm.ppo_mini_batch_size; offline pipelines: the step's rows) a multiple of 8 or change "
        "micro_batch_size to one of 1, 2, 3, 6"
    ]


def test_whole_step_is_the_mini_batch_by_default(base):
    # ppo_mini_batch_size=null: the 16 responses of a step, split over dp=1 into micro-batches of 5: no.
    [problem] = problems_of(
        base + BATCH_16 + ["algorithm.ppo_mini_batch_size=null", "actor_train.strategy.micro_batch_size=5"]
    )
    assert "a mini-batch of 16 responses" in problem and "micro_batch_size=5" in problem


# ---- algorithm and roles ------------------------------------------------------------------------------
def test_gae_needs_a_critic(base):
    assert problems_of(base + ["algorithm.adv_estimator=gae"]) == [
        "algorithm.adv_estimator=gae needs a critic: add a `critic:` role block or pick grpo/rloo/reinforce_plus_plus"
    ]


def test_kl_needs_a_reference(base):
    expected = [
        "KL (algorithm.use_kl_loss or use_kl_in_reward) needs a `reference:` role block (or, with LoRA, "
        "reference: {from_actor_base: true}); add one or turn both off"
    ]
    assert problems_of(base + ["reference=null", "algorithm.use_kl_loss=true"]) == expected
    assert (
        problems_of(base + ["reference=null", "algorithm.use_kl_loss=false", "algorithm.use_kl_in_reward=true"])
        == expected
    )
    load_config(CONFIG, base + ["reference=null", "algorithm.use_kl_loss=false", "algorithm.use_kl_in_reward=false"])


def test_ppo_pipeline_needs_a_critic(base):
    assert problems_of(base + ["pipeline=ppo"]) == ["pipeline=ppo needs a `critic:` role block (or use pipeline=grpo)"]


def test_unknown_pipeline_lists_the_known_ones(base):
    assert problems_of(base + ["pipeline=kto"]) == [
        "pipeline='kto' is unknown; choose one of grpo, ppo, agentic, sft, reward_model, dpo"
    ]


def test_offline_pipelines_name_the_roles_they_start_and_their_settings(base):
    """The RL demo turned into a DPO run: the rollout is not used, the objective's settings are checked."""
    problems = problems_of(
        base
        + [
            "pipeline=dpo",
            "reference=null",
            "preference.loss=ipo",
            "preference.label_smoothing=0.1",
            "preference.beta=0",
        ]
    )
    assert problems == [
        "actor_train: a mini-batch of 32 responses cannot be split into micro-batches of "
        "actor_train.strategy.micro_batch_size=64 on each of 1 data-parallel ranks; make the mini-batch "
        "(algorithm.ppo_mini_batch_size; offline pipelines: the step's rows) a multiple of 64 or change "
        "micro_batch_size to one of 1, 2, 4, 8, 16, 32",
        "actor_infer: pipeline=dpo does not use this role (it starts actor_train, reference); remove the block "
        "(actor_infer=null)",
        "pipeline=dpo needs a `reference:` role block (the frozen starting policy, e.g. model_path: ${model_path} "
        "with strategy megatron_infer)",
        "preference.beta=0.0 must be > 0 (0.1 is usual)",
        "preference.label_smoothing applies to the sigmoid loss; set it to 0 with loss=ipo",
    ]
    offline = [
        "pipeline=sft",
        "reference=null",
        "actor_infer=null",
        "async_generation.enabled=true",
        "rollout_batch_size=64",
    ]
    assert problems_of(base + offline) == [
        "async_generation.enabled: pipeline=sft trains on a dataset, without a rollout; drop it"
    ]
    assert problems_of(base + ["pipeline=grpo", "actor_infer=null"]) == [
        "pipeline=grpo needs an `actor_infer:` role block (the rollout engine, strategy vllm_rollout)"
    ]


def test_unknown_algorithm_names_are_all_reported_with_the_known_ones(base):
    overrides = [
        "algorithm.adv_estimator=grpoo",
        "algorithm.policy_loss=ppo2",
        "algorithm.kl_estimator=kl9",
        "algorithm.loss_agg_mode=mean",
        "algorithm.kl_ctrl.type=pid",
        "algorithm.reward_norm=xx",
    ]
    problems = problems_of(base + overrides)
    assert len(problems) == 6
    for needle in (
        "algorithm.adv_estimator='grpoo' is unknown; known: ",
        "algorithm.policy_loss='ppo2' is unknown; known: ",
        "algorithm.kl_estimator='kl9' is unknown; known: ",
        "algorithm.loss_agg_mode='mean' is unknown; known: ",
        "algorithm.kl_ctrl.type='pid' is unknown; known: ",
        "algorithm.reward_norm='xx'; choose one of ",
    ):
        assert any(p.startswith(needle) for p in problems), needle
    joined = "\n".join(problems)
    assert (
        "grpo" in joined
        and "gspo" in joined
        and "low_var_kl" in joined
        and "token-mean" in joined
        and "adaptive" in joined
    )


def test_ppo_epochs_must_be_positive(base):
    assert problems_of(base + ["algorithm.ppo_epochs=0"]) == ["algorithm.ppo_epochs=0 must be >= 1"]


def test_colocate_with_an_unknown_role(base):
    [problem] = problems_of(base + ["reference.colocate_with=critic"])
    assert problem.startswith("reference.colocate_with='critic' names no role in this config; known: ")
    assert "actor_train" in problem


def test_colocated_roles_need_equal_world_sizes(base):
    [problem] = problems_of(
        base
        + [
            "reference.colocate_with=actor_train",
            "reference.world_size=1",
            "actor_train.world_size=2",
            "actor_train.strategy.tp=2",
        ]
    )
    assert problem == (
        "reference.colocate_with='actor_train': world sizes differ (1 vs 2); colocated roles share bundles rank by rank"
    )


# ---- data, model, checkpoints -------------------------------------------------------------------------
def test_data_needs_a_path_or_a_synthetic_task(base):
    assert problems_of(base + ["data.synthetic=null", "data.train_path=null"]) == [
        "data: set data.train_path (JSONL or parquet), data.reasoning_gym or data.synthetic"
    ]


def test_missing_data_file_is_named(base, tmp_path):
    missing = tmp_path / "prompts.jsonl"
    assert problems_of(base + [f"data.train_path={missing}"]) == [f"data.train_path={str(missing)!r} does not exist"]


def test_model_path_needed_without_a_tiny_model(base):
    # Each Megatron role's strategy config refuses the empty path (the roles interpolate ${model_path}).
    problems = problems_of(base + ["build_tiny_model=null", "model_path=''"])
    for role in ("actor_train", "reference"):
        assert any(
            p.startswith(f"{role}.strategy: ") and "model_path is empty; point it at a Hugging Face model folder" in p
            for p in problems
        ), role


def test_distributed_optimizer_cannot_checkpoint_on_cpu(base):
    overrides = [
        "checkpoint.save_steps=5",
        "actor_train.num_gpus_per_rank=0",
        "actor_train.strategy.optimizer.use_distributed_optimizer=true",
    ]
    assert problems_of(base + overrides) == [
        "checkpoint.save_steps > 0 with the distributed optimizer on CPU: megatron-core 0.16.1 cannot save its state "
        "there; set actor_train.strategy.optimizer.use_distributed_optimizer=false"
    ]
    # On GPUs, or without checkpoints, the same optimizer is fine.
    load_config(
        CONFIG, base + ["checkpoint.save_steps=0", "actor_train.strategy.optimizer.use_distributed_optimizer=true"]
    )


# ---- overrides and files ------------------------------------------------------------------------------
def test_override_without_equals_sign(base):
    assert problems_of(base + ["actor_train.strategy.tp"]) == [
        "override 'actor_train.strategy.tp' is not key=value (e.g. actor_train.strategy.tp=2)"
    ]


def test_override_with_malformed_value_is_a_config_error(base):
    [problem] = problems_of(base + ["max_steps=[1"])
    assert str(CONFIG) in problem and "flow sequence" in problem


def test_malformed_yaml_file(tmp_path):
    config = tmp_path / "broken.yaml"
    config.write_text("pipeline: grpo\n  bad: [\n")
    [problem] = problems_of([], config)
    assert problem.startswith(f"{config}: ") and "line 2" in problem


def test_missing_config_file():
    assert problems_of([], "/nonexistent/run.yaml") == ["config file '/nonexistent/run.yaml' does not exist"]


# ---- all at once ------------------------------------------------------------------------------------------
def test_every_shape_problem_is_reported_together(base):
    problems = problems_of(
        base
        + [
            "max_step=3",
            "seed=x",
            "algorithm.clip_ratio_lo=0.1",
            "actor_train.strategy.tpp=2",
            "actor_infer.strategy.name=vllm",
        ]
    )
    assert len(problems) == 5
    joined = "\n".join(problems)
    for key in (
        "max_step:",
        "seed:",
        "algorithm.clip_ratio_lo:",
        "actor_train.strategy.tpp:",
        "actor_infer.strategy.name:",
    ):
        assert key in joined


def test_every_cross_field_problem_is_reported_together(base):
    overrides = [
        "actor_train.strategy.tp=2",
        "actor_train.world_size=3",
        "algorithm.adv_estimator=gae",
        "reference=null",
        "algorithm.use_kl_loss=true",
        "rollout_batch_size=3",
        "num_return_sequences_in_group=2",
        "algorithm.ppo_mini_batch_size=4",
        "data.synthetic=null",
    ]
    problems = problems_of(base + overrides)
    assert len(problems) == 5
    starts = (
        "actor_train: tp*pp*cp",
        "algorithm.adv_estimator=gae",
        "KL (algorithm.use_kl_loss",
        "algorithm.ppo_mini_batch_size=4",
        "data: set data.train_path",
    )
    for start in starts:
        assert any(p.startswith(start) for p in problems), start


def test_vllm_on_cpu_refuses_small_attention_heads(base):
    [problem] = problems_of(base + ["build_tiny_model.hidden_size=64"])
    assert problem == (
        "actor_infer: the model's attention head size is 16, and vLLM on CPU needs at least 32; "
        "use fewer heads or a larger hidden_size (e.g. build_tiny_model.hidden_size=128)"
    )


def test_vllm_on_cpu_takes_kv_blocks_of_a_multiple_of_32_tokens(base):
    [problem] = problems_of(base + ["actor_infer.strategy.block_size=48"])
    assert problem == (
        "actor_infer.strategy.block_size=48: vLLM on CPU takes KV blocks of a multiple of 32 tokens; "
        "set 32, 64, 128 or null (32 on CPU)"
    )
    assert (
        load_config(CONFIG, base + ["actor_infer.strategy.block_size=64"]).actor_infer.strategy.config.block_size == 64
    )
    load_config(
        CONFIG, base + ["actor_infer.strategy.block_size=48", "actor_infer.num_gpus_per_rank=1"]
    )  # GPU: vLLM's rules


# ---- rollout correction and asynchronous generation ------------------------------------------------------
def test_rollout_correction_is_off_by_default_and_typed(base):
    config = load_config(CONFIG, base)
    assert not config.algorithm.rollout_correction.enabled and not config.async_generation.enabled
    config = load_config(
        CONFIG, base + ["algorithm.rollout_correction.is_level=sequence", "algorithm.rollout_correction.is_cap=3"]
    )
    assert config.algorithm.rollout_correction.enabled and config.algorithm.rollout_correction.is_cap == 3.0


def test_rollout_correction_bad_values(base):
    problems = problems_of(
        base
        + [
            "algorithm.rollout_correction.is_level=tok",
            "algorithm.rollout_correction.rejection=sequence",
            "algorithm.rollout_correction.rejection_threshold=0.5",
        ]
    )
    assert problems == [
        "algorithm.rollout_correction.is_level='tok'; choose one of token, sequence or null",
        "algorithm.rollout_correction.rejection_threshold=0.5 must be > 1 (ratios inside [1/C, C] are kept; 2.0 is "
        "usual)",
    ]


def test_value_head_init_score_head_needs_the_critic_and_a_reward_model(base, tmp_path):
    from roll_backend.models.tiny import TinyModelSpec, build_tiny_model, build_tiny_reward_model

    policy = build_tiny_model(tmp_path / "policy", TinyModelSpec())
    reward_model = build_tiny_reward_model(tmp_path / "reward_model", TinyModelSpec())
    ppo = ["pipeline=ppo", "algorithm.adv_estimator=gae"]
    critic = "critic={{model_path: {}, strategy: {{name: megatron_train, value_head_init: {}}}}}"
    problems = problems_of(
        [*base, *ppo, critic.format(policy, "score_head"), "actor_train.strategy.value_head_init=score_head"]
    )
    assert any(
        p.startswith("critic.strategy.value_head_init=score_head: ")
        and "has no 'score.weight'" in p
        and "use value_head_init=fresh" in p
        for p in problems
    ), problems
    assert any(p.startswith("actor_train.strategy.value_head_init=score_head: only the critic") for p in problems), (
        problems
    )
    assert "value_head_init='trained'; choose one of fresh, score_head" in " ".join(
        problems_of([*base, *ppo, critic.format(policy, "trained")])
    )
    config = load_config(CONFIG, [*base, *ppo, critic.format(reward_model, "score_head")])
    assert config.critic.strategy.config.value_head_init == "score_head"


# ---- prompt sharing ---------------------------------------------------------------------------------------------
def test_prompt_sharing_refuses_what_it_cannot_build_with_the_reason(base):
    share = ["actor_train.strategy.share_prompts=true"]
    cp_and_mtp = ["actor_train.strategy.cp=2", "actor_train.world_size=2", "actor_train.strategy.mtp_num_layers=1"]
    assert not [p for p in problems_of(base + share + cp_and_mtp) if "share_prompts" in p]  # both compose with it
    with pytest.raises(ConfigError, match="share_prompts with transformer_impl=transformer_engine"):
        load_config(CONFIG, base + share + ["actor_train.strategy.transformer_impl=transformer_engine"])
    config = load_config(CONFIG, base + share + ["reference.strategy.share_prompts=true"])
    assert config.actor_train.strategy.config.share_prompts and config.reference.strategy.config.share_prompts
