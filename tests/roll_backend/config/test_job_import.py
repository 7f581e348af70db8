"""`roll-backend convert`: a verl GRPO Megatron run script and a ROLL RLVR config (written here in each one's
documented form) become configs that validate, with every input key reported as copied, converted or without an
equivalent; unknown-key errors name the equivalent of a verl or ROLL key."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import safetensors.torch
import torch
import yaml

from roll_backend import cli
from roll_backend.config.loader import load_config
from roll_backend.config.typed import ConfigError

MODEL = str(Path(__file__).resolve().parents[3] / "configs" / "gpu" / "models" / "Qwen2.5-7B-Instruct")

VERL_SCRIPT = """set -x
export VLLM_ATTENTION_BACKEND=XFORMERS
python3 -m verl.trainer.main_ppo --config-path=config \\
    --config-name='ppo_megatron_trainer.yaml'\\
    algorithm.adv_estimator=grpo \\
    data.train_files="{train}" \\
    data.val_files="$test_files" \\
    data.train_batch_size=32 \\
    data.max_prompt_length=1024 \\
    data.max_response_length=2048 \\
    data.filter_overlong_prompts=True \\
    data.truncation='error' \\
    actor_rollout_ref.model.path={model} \\
    actor_rollout_ref.actor.optim.lr=1e-6 \\
    actor_rollout_ref.actor.ppo_mini_batch_size=16 \\
    actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4 \\
    actor_rollout_ref.actor.megatron.pipeline_model_parallel_size=2 \\
    actor_rollout_ref.actor.megatron.tensor_model_parallel_size=2 \\
    actor_rollout_ref.actor.use_kl_loss=True \\
    actor_rollout_ref.actor.kl_loss_coef=0.001 \\
    actor_rollout_ref.actor.kl_loss_type=low_var_kl \\
    actor_rollout_ref.actor.entropy_coeff=0 \\
    actor_rollout_ref.model.enable_gradient_checkpointing=True \\
    actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=4 \\
    actor_rollout_ref.rollout.tensor_model_parallel_size=2 \\
    actor_rollout_ref.rollout.name=vllm \\
    actor_rollout_ref.rollout.gpu_memory_utilization=0.6 \\
    actor_rollout_ref.rollout.n=5 \\
    actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=4 \\
    actor_rollout_ref.ref.megatron.pipeline_model_parallel_size=2 \\
    actor_rollout_ref.ref.megatron.tensor_model_parallel_size=2 \\
    algorithm.use_kl_in_reward=False \\
    trainer.critic_warmup=0 \\
    trainer.logger='["console","wandb"]' \\
    trainer.project_name='verl_grpo_example_gsm8k' \\
    trainer.experiment_name='qwen2_7b_megatron' \\
    trainer.n_gpus_per_node=8 \\
    trainer.nnodes=1 \\
    trainer.save_freq=20 \\
    trainer.test_freq=5 \\
    trainer.total_epochs=3 $@
"""

ROLL_CONFIG = """
hydra:
  run: {{dir: .}}
exp_name: qwen2.5-7B-rlvr
seed: 42
track_with: wandb
tracker_kwargs: {{project: roll_rlvr, api_key: sEcReT-123}}
output_dir: ./output
save_steps: 100
logging_steps: 1
eval_steps: 10
rollout_batch_size: 64
prompt_length: 1024
response_length: 2048
sequence_length: 4096
num_return_sequences_in_group: 8
ppo_epochs: 1
adv_estimator: grpo
max_steps: 500
whiten_advantages: true
use_kl_loss: true
kl_loss_coef: 0.001
pretrain: {model}
reward_pretrain: {model}
resume_from_checkpoint: false
validation:
  data_args:
    template: qwen2_5
    file_name: {val}
  generating_args: {{top_p: 0.6, temperature: 0.6}}
actor_train:
  model_args: {{disable_gradient_checkpointing: false, dtype: bf16}}
  training_args:
    learning_rate: 1.0e-6
    weight_decay: 0
    per_device_train_batch_size: 2
    gradient_accumulation_steps: 16
    warmup_steps: 20
  data_args:
    template: qwen2_5
    file_name: [{train}]
    domain_interleave_probs: {{math_rule: 0.6, crossthinkqa: 0.4}}
    messages: messages
  strategy_args:
    strategy_name: megatron_train
    strategy_config:
      tensor_model_parallel_size: 2
      pipeline_model_parallel_size: 1
      virtual_pipeline_model_parallel_size: 1
      use_distributed_optimizer: true
      recompute_granularity: full
  device_mapping: list(range(0,8))
  infer_batch_size: 4
actor_infer:
  model_args: {{disable_gradient_checkpointing: true, dtype: bf16}}
  infer_batch_size: 1
  generating_args:
    max_new_tokens: ${{response_length}}
    top_p: 0.99
    temperature: 0.99
    num_return_sequences: ${{num_return_sequences_in_group}}
  strategy_args:
    strategy_name: vllm
    strategy_config: {{gpu_memory_utilization: 0.8, block_size: 16, max_model_len: 3072}}
  device_mapping: list(range(0,8))
reference:
  model_args: {{disable_gradient_checkpointing: true, dtype: bf16}}
  infer_batch_size: 8
  strategy_args:
    strategy_name: megatron_infer
    strategy_config: {{tensor_model_parallel_size: 2}}
  device_mapping: list(range(0,8))
rewards:
  math_rule:
    worker_cls: roll.pipeline.rlvr.rewards.math_rule_reward_worker.MathRuleRewardWorker
    tag_included: [deepmath_103k, aime]
    world_size: 8
  crossthinkqa:
    worker_cls: roll.pipeline.rlvr.rewards.crossthinkqa_rule_reward_worker.CrossThinkQARuleRewardWorker
    tag_included: [crossthinkqa]
  llm_judge:
    worker_cls: roll.pipeline.rlvr.rewards.llm_judge_reward_worker.LLMJudgeRewardWorker
"""


@pytest.fixture()
def prompt_files(tmp_path):
    rows = [
        {"prompt": [{"role": "user", "content": f"q{i}"}], "reward_model": {"ground_truth": str(i)}} for i in range(100)
    ]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "train.parquet")
    pq.write_table(pa.Table.from_pylist(rows[:10]), tmp_path / "test.parquet")
    return str(tmp_path / "train.parquet"), str(tmp_path / "test.parquet")


def test_a_verl_megatron_grpo_script_converts_to_a_config_that_validates(tmp_path, prompt_files, capsys):
    script = tmp_path / "run_qwen2-7b_megatron.sh"
    script.write_text(VERL_SCRIPT.format(train=prompt_files[0], model=MODEL))
    out = tmp_path / "converted.yaml"
    assert cli.main(["convert", "verl", str(script), "-o", str(out)]) == 0
    report = (tmp_path / "converted.report.txt").read_text()
    printed = capsys.readouterr().out
    assert report in printed and f"{out} validates" in printed
    config = load_config(out, [], recipe_check=True)
    # Copied: parallel sizes, the learning rate, sampling, the batch of prompts.
    assert (config.actor_train.strategy.layout.tp, config.actor_train.strategy.layout.pp) == (2, 2)
    assert (config.reference.strategy.layout.tp, config.reference.strategy.layout.pp) == (2, 2)
    assert config.actor_infer.strategy.layout.tp == 2 and config.actor_train.strategy.config.optimizer.lr == 1e-6
    assert config.rollout_batch_size == 32 and config.num_return_sequences_in_group == 5
    # Converted where the meaning differs: the mini-batch counts responses; epochs become steps; GPUs become ranks
    # on the hybrid engine (verl's colocated layout).
    assert config.algorithm.ppo_mini_batch_size == 16 * 5
    assert config.max_steps == 3 * 100 // 32 + 3  # 3 epochs of ceil(100 / 32) = 4 steps
    assert config.actor_train.world_size == config.actor_infer.world_size == config.reference.world_size == 8
    assert config.actor_infer.hybrid and config.reference.hybrid
    assert config.reward.by_source == "auto"  # verl's default scorer picks by data source
    assert "actor_rollout_ref.actor.ppo_mini_batch_size = 16 -> algorithm.ppo_mini_batch_size = 80" in report
    assert config.logging.backends == ("jsonl", "console", "wandb")  # (the run's metrics.jsonl kept)
    assert "trainer.total_epochs = 3 -> max_steps = 12" in report
    # No equivalent, each with why; a shell variable is left to the user.
    assert "data.truncation = 'error': prompts are never truncated here" in report
    assert "data.val_files = $test_files: a shell variable" in report
    assert "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu = 4: old log-probs run on actor_train" in report


def test_a_roll_rlvr_config_converts_to_a_config_that_validates(tmp_path, prompt_files):
    source = tmp_path / "rlvr_config.yaml"
    source.write_text(ROLL_CONFIG.format(model=MODEL, train=prompt_files[0], val=prompt_files[1]))
    out = tmp_path / "rlvr.yaml"
    assert cli.main(["convert", "roll", str(source), "-o", str(out)]) == 0
    report = (tmp_path / "rlvr.report.txt").read_text()
    config = load_config(out, [], recipe_check=True)
    assert config.model_path == MODEL and config.max_steps == 500 and config.response_length == 2048
    assert config.data.max_prompt_length == 1024  # (an RL job's sequence_length does not split its limits)
    assert config.actor_infer.strategy.config.sampling.temperature == 0.99
    assert (
        config.actor_train.strategy.config.params_dtype == "bfloat16"
        and config.actor_train.strategy.config.recompute_activations
    )
    assert config.actor_train.world_size == 8 and config.actor_train.num_gpus_per_rank == 1
    # A mini-batch is micro-batch x accumulation x data-parallel ranks (8 GPUs / TP2 = 4); the trainer's micro-batch is
    # its training one (its infer_batch_size is ROLL's log-prob batch), the reference's its infer_batch_size.
    assert config.algorithm.ppo_mini_batch_size == 2 * 16 * 4
    assert config.actor_train.strategy.config.micro_batch_size == 2
    assert config.reference.strategy.config.micro_batch_size == 8 and config.checkpoint.resume is None
    assert "actor_infer.model_args.disable_gradient_checkpointing = True: an inference role has no backward" in report
    # ROLL's reward domains and their tags route to the built-in scorers; a domain with none is reported.
    assert config.reward.by_source == {
        "math_rule": "math_verify",
        "deepmath_103k": "math_verify",
        "aime": "math_verify",
        "crossthinkqa": "multiple_choice",
    }
    assert "rewards.llm_judge.worker_cls" in report and "no built-in scorer for domain 'llm_judge'" in report
    assert config.data.source_weights == {"math_rule": 0.6, "crossthinkqa": 0.4}  # domain_interleave_probs
    assert config.data.messages_key == "messages"
    assert (config.eval.temperature, config.eval.top_p) == (0.6, 0.6)  # validation's generating_args
    assert config.logging.backends == ("jsonl", "wandb") and config.logging.project == "roll_rlvr"
    assert config.actor_train.strategy.layout.vpp is None  # ROLL's vpp 1: one chunk per stage
    assert "sEcReT" not in report and "sEcReT" not in out.read_text()  # (a key in the report is a leaked key)
    assert "tracker_kwargs.api_key = '***': trackers read their own credentials" in report


def test_a_job_of_the_other_framework_or_of_this_project_is_refused_with_the_command_that_reads_it(
    tmp_path, prompt_files, capsys
):
    script, roll = tmp_path / "run_verl.sh", tmp_path / "rlvr_config.yaml"
    script.write_text(VERL_SCRIPT.format(train=prompt_files[0], model=MODEL))
    roll.write_text(ROLL_CONFIG.format(model=MODEL, train=prompt_files[0], val=prompt_files[1]))
    empty = tmp_path / "empty.yaml"
    empty.write_text("{}\n")
    cases = [
        ("roll", script, "is not a roll job: 0 of its", "convert it with `roll-backend convert verl`"),
        ("verl", roll, "is not a verl job: ", "convert it with `roll-backend convert roll`"),
        ("verl", "configs/grpo_tiny_cpu.yaml", "is a roll-backend config already", "`roll-backend validate`"),
        ("roll", empty, "is not a roll job: it holds no settings", "key=value arguments"),
    ]
    for framework, source, what, fix in cases:
        out = tmp_path / f"{framework}_{Path(source).stem}.yaml"
        assert cli.main(["convert", framework, str(source), "-o", str(out)]) == cli.EXIT_USAGE
        err = capsys.readouterr().err
        assert what in err and fix in err, err
        assert not out.exists()  # nothing written for the wrong reader


def test_a_verl_or_roll_key_typed_here_names_its_equivalent():
    with pytest.raises(ConfigError) as info:
        load_config(
            "configs/grpo_tiny_cpu.yaml",
            ["data.train_batch_size=8", "actor_rollout_ref.rollout.n=4", "data.truncation=error", "prompt_length=9"],
        )
    assert info.value.problems == [
        "actor_rollout_ref: unknown key; that is a section of verl's config; `roll-backend convert verl` writes its "
        "equivalent",
        "prompt_length: unknown key; that is roll's key; write data.max_prompt_length instead (or roll-backend "
        "convert)",
        "data.train_batch_size: unknown key; that is verl's key; write rollout_batch_size instead (or roll-backend "
        "convert)",
        "data.truncation: unknown key; that is verl's key; it has no equivalent here (prompts are never truncated "
        "here; longer ones are dropped)",
    ]
    yaml.safe_dump(info.value.problems)  # plain strings


def test_the_coming_from_page_shows_the_key_table_as_it_is():
    from roll_backend.config.foreign_keys import FRAMEWORKS, KEY_MAP_DOC, key_map

    page = (Path(__file__).resolve().parents[3] / KEY_MAP_DOC).read_text()
    stale = [framework for framework in FRAMEWORKS if key_map(framework) not in page]
    assert not stale, (
        f"{KEY_MAP_DOC}'s {stale} key map is stale; run PYTHONPATH=$PWD .venv/bin/python scripts/gen_key_map.py"
    )


VERL_FSDP_SCRIPT = """set -x
gsm8k_train_path=$HOME/data/gsm8k/train.parquet
export math_train_path="${{HOME}}/data/math/train.parquet"
train_files="['$gsm8k_train_path', '$math_train_path']"
python3 -m verl.trainer.main_ppo \\
    algorithm.adv_estimator=grpo \\
    data.train_files="$train_files" \\
    data.val_files="$UNSET_IN_THIS_SCRIPT/test.parquet" \\
    data.train_batch_size=32 \\
    data.max_prompt_length=512 \\
    data.max_response_length=1024 \\
    actor_rollout_ref.model.path={model} \\
    actor_rollout_ref.model.use_remove_padding=True \\
    actor_rollout_ref.actor.ppo_mini_batch_size=16 \\
    actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=8 \\
    actor_rollout_ref.actor.use_kl_loss=True \\
    actor_rollout_ref.actor.fsdp_config.param_offload=True \\
    actor_rollout_ref.actor.fsdp_config.optimizer_offload=True \\
    actor_rollout_ref.rollout.name=vllm \\
    actor_rollout_ref.rollout.n=4 \\
    actor_rollout_ref.rollout.max_num_seqs=64 \\
    actor_rollout_ref.ref.fsdp_config.param_offload=True \\
    trainer.n_gpus_per_node=8 \\
    trainer.nnodes=1 $@
"""


def test_verl_s_fsdp_example_script_with_its_shell_variables_converts_to_a_config_that_validates(tmp_path, monkeypatch):
    """verl's own GRPO examples set their data paths in shell variables above the command and turn on
    use_remove_padding and FSDP offload: the variables resolve as the shell would (the script's, then the
    environment's), padding removal becomes packing with a token budget of the micro-batch's whole sequences, and
    FSDP's offload is the hybrid engine's; a variable set nowhere is reported."""
    rows = [{"prompt": [{"role": "user", "content": f"q{i}"}], "reward_model": {"ground_truth": "1"}} for i in range(8)]
    for name in ("gsm8k", "math"):
        (tmp_path / "data" / name).mkdir(parents=True)
        pq.write_table(pa.Table.from_pylist(rows), tmp_path / "data" / name / "train.parquet")
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.delenv("UNSET_IN_THIS_SCRIPT", raising=False)
    script = tmp_path / "run_qwen2-7b_seq_balance.sh"
    script.write_text(VERL_FSDP_SCRIPT.format(model=MODEL))
    out = tmp_path / "converted.yaml"
    assert cli.main(["convert", "verl", str(script), "-o", str(out)]) == 0
    report = (tmp_path / "converted.report.txt").read_text()
    config = load_config(out, [], recipe_check=True)
    assert [entry.path for entry in config.data.train_path] == [
        str(tmp_path / "data" / name / "train.parquet") for name in ("gsm8k", "math")
    ]
    train = config.actor_train.strategy.config
    assert train.use_sequence_packing and train.max_tokens_per_microbatch == 8 * (512 + 1024)
    assert train.offload_params and train.offload_optimizer and config.reference.strategy.config.offload_params
    assert config.actor_infer.strategy.config.max_num_seqs == 64
    assert "data.val_files = $UNSET_IN_THIS_SCRIPT/test.parquet: a shell variable" in report
    assert "-> actor_train.strategy.max_tokens_per_microbatch = 12288 (verl removes the padding" in report


def test_verl_s_ppo_script_gets_its_critic_hosted_beside_the_actor(tmp_path, prompt_files):
    """verl's PPO example (GAE advantages, a critic colocated with the actor): the critic's settings become a Megatron
    critic on the hybrid engine, and the job is a PPO pipeline that validates."""
    script = tmp_path / "run_deepseek7b_llm.sh"
    script.write_text(
        "python3 -m verl.trainer.main_ppo algorithm.adv_estimator=gae "
        f"data.train_files={prompt_files[0]} data.train_batch_size=16 data.max_prompt_length=256 "
        f"data.max_response_length=256 actor_rollout_ref.model.path={MODEL} actor_rollout_ref.rollout.n=4 "
        "actor_rollout_ref.actor.ppo_mini_batch_size=16 actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4 "
        f"critic.model.path={MODEL} critic.optim.lr=1e-5 critic.model.use_remove_padding=True "
        "critic.ppo_micro_batch_size_per_gpu=8 critic.model.fsdp_config.param_offload=True critic.cliprange_value=0.3 "
        "critic.ppo_mini_batch_size=8 trainer.n_gpus_per_node=4 trainer.nnodes=2\n"
    )
    out = tmp_path / "ppo.yaml"
    assert cli.main(["convert", "verl", str(script), "-o", str(out)]) == 0
    config = load_config(out, [], recipe_check=True)
    assert config.pipeline == "ppo" and config.algorithm.adv_estimator == "gae"
    assert config.critic.hybrid and config.critic.world_size == config.actor_train.world_size == 8
    critic = config.critic.strategy.config
    assert config.critic.strategy.name == "megatron_train" and critic.optimizer.lr == 1e-5 and critic.offload_params
    assert critic.use_sequence_packing and critic.max_tokens_per_microbatch == 8 * (256 + 256)
    assert config.algorithm.value_clip == 0.3
    assert config.reference is None and not (config.algorithm.use_kl_loss or config.algorithm.use_kl_in_reward)
    report = (tmp_path / "ppo.report.txt").read_text()
    assert "critic.ppo_mini_batch_size = 8: the critic steps on the actor's mini-batches" in report


VERL_SHELL_SCRIPT = """set -x
ENGINE=${{1:-sglang}}
MODEL_PATH=${{MODEL_PATH:-"${{MODELS}}/Qwen2.5-7B-Instruct"}}
max_prompt_length=$((256 * 2))
max_response_length=$((128 * 4))
actor_ppo_max_token_len=$(((max_prompt_length + max_response_length) * 2))
NAME=run${{SUFFIX:+"-"}}${{SUFFIX}}
VLLM_USE_V1=1 \\
python3 -m verl.trainer.main_ppo \\
    algorithm.adv_estimator=gae \\
    data.train_files={train} \\
    data.train_batch_size=16 \\
    data.max_prompt_length=${{max_prompt_length}} \\
    data.max_response_length=${{max_response_length}} \\
    actor_rollout_ref.model.path="${{MODEL_PATH}}" \\
    actor_rollout_ref.rollout.name=$ENGINE \\
    actor_rollout_ref.rollout.n=4 \\
    actor_rollout_ref.actor.ppo_mini_batch_size=16 \\
    actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2 \\
    actor_rollout_ref.actor.ppo_max_token_len_per_gpu=${{actor_ppo_max_token_len}} \\
    actor_rollout_ref.actor.megatron.tensor_model_parallel_size=2 \\
    critic.model.path="${{MODEL_PATH}}" \\
    critic.megatron.tensor_model_parallel_size=4 \\
    reward_model.enable=True \\
    reward_model.model.path={reward_model} \\
    reward_model.rollout.tensor_model_parallel_size=2 \\
    trainer.experiment_name=$NAME \\
    trainer.test_freq=-1 \\
    trainer.n_gpus_per_node=8 $@
"""


def test_a_verl_script_s_shell_expansions_engines_critic_and_reward_model_convert(tmp_path, prompt_files, monkeypatch):
    """The shell forms verl's example scripts use resolve as the shell would: a positional parameter's default,
    nested defaults (`${MODEL_PATH:-"${MODELS}/..."}`), arithmetic with nested parentheses over earlier variables,
    `${X:+alt}`, and a `NAME=value command` environment prefix (not an assignment swallowing the command). sglang
    serves through vLLM here, a hosted critic takes the actor's layout (said in the report), an enabled reward
    model becomes a Megatron scorer, and test_freq=-1 means no validation during training."""
    monkeypatch.setenv("MODELS", str(Path(MODEL).parent))
    monkeypatch.delenv("MODEL_PATH", raising=False)
    monkeypatch.setenv("SUFFIX", "b2")
    script = tmp_path / "run_qwen2_5-7b_megatron_gae.sh"
    reward_model = tmp_path / "rm"  # (a reward model folder: its config and a one-label score head)
    reward_model.mkdir()
    (reward_model / "config.json").write_text((Path(MODEL) / "config.json").read_text())
    (reward_model / "tokenizer_config.json").write_text("{}")  # (validation looks for a tokenizer's files)
    hidden = json.loads((Path(MODEL) / "config.json").read_text())["hidden_size"]
    safetensors.torch.save_file({"score.weight": torch.zeros(1, hidden)}, reward_model / "model.safetensors")
    script.write_text(VERL_SHELL_SCRIPT.format(train=prompt_files[0], reward_model=reward_model))
    out = tmp_path / "converted.yaml"
    assert cli.main(["convert", "verl", str(script), "-o", str(out)]) == 0
    config = load_config(out, [], recipe_check=True)
    report = (tmp_path / "converted.report.txt").read_text()
    assert config.model_path == MODEL and config.exp_name == "run-b2"
    assert (config.data.max_prompt_length, config.response_length) == (512, 512)
    assert config.actor_train.strategy.config.max_tokens_per_microbatch == (512 + 512) * 2
    assert config.actor_infer.strategy.name == "vllm_rollout" and "sglang and trtllm have no backend here" in report
    assert config.critic.strategy.layout.tp == config.actor_train.strategy.layout.tp == 2
    assert "critic.strategy.tp = 4 -> 2 (a role on the hybrid engine runs in actor_train's processes" in report
    assert config.reward_model.strategy.name == "megatron_infer" and config.reward_model.model_path == str(reward_model)
    assert config.reward_model.strategy.layout.tp == config.reward_model.world_size == 2
    assert config.eval.every_steps == 0


@pytest.mark.parametrize("norm_mean_type, ours", [("~", "reinforce_plus_plus"), ("group", "grpo")])
def test_roll_s_reinforce_is_reinforce_plus_plus_or_grpo_by_its_reward_normalisation(
    tmp_path, prompt_files, norm_mean_type, ours
):
    """Most of ROLL's RLVR examples run adv_estimator: reinforce (discounted returns whitened over the batch, which is
    REINFORCE++ here; with rewards normalised by group first, GRPO), some set an engine max_model_len below the
    prompt plus the response, which the engine here is raised to (reported), and some `value_clip: null` (an
    unclipped critic loss)."""
    source = tmp_path / "rlvr_config.yaml"
    text = ROLL_CONFIG.format(model=MODEL, train=prompt_files[0], val=prompt_files[1])
    text = text.replace("adv_estimator: grpo", f"adv_estimator: reinforce\nnorm_mean_type: {norm_mean_type}")
    text = text.replace("ppo_epochs: 1", "ppo_epochs: 1\nvalue_clip: null")
    source.write_text(text.replace("max_model_len: 3072", "max_model_len: 2048"))
    out = tmp_path / "rlvr.yaml"
    assert cli.main(["convert", "roll", str(source), "-o", str(out)]) == 0
    config = load_config(out, [], recipe_check=True)
    assert config.algorithm.adv_estimator == ours and config.algorithm.value_clip is None
    assert config.actor_infer.strategy.config.max_model_len == 1024 + 2048
    assert (
        "max_model_len = 2048 -> actor_infer.strategy.max_model_len = 3072"
        in (tmp_path / "rlvr.report.txt").read_text()
    )


def test_a_roll_agentic_config_says_its_environments_are_not_converted(tmp_path, prompt_files):
    source = tmp_path / "agent_val_frozen_lake.yaml"
    text = ROLL_CONFIG.format(model=MODEL, train=prompt_files[0], val=prompt_files[1])
    source.write_text(text + "train_env_manager: {num_env_groups: 128, group_size: 8, tags: [FrozenLake]}\n")
    assert cli.main(["convert", "roll", str(source), "-o", str(tmp_path / "agentic.yaml")]) == 0
    report = (tmp_path / "agentic.report.txt").read_text()
    assert "No equivalent here" in report and "ROLL's agentic pipeline is not converted" in report


VERL_DAPO_SCRIPT = """set -x
max_response_length=$((1024 * 2))
enable_overlong_buffer={enable}
python3 -m verl.trainer.main_ppo \\
    algorithm.adv_estimator=grpo \\
    data.train_files={train} \\
    data.val_files={val} \\
    data.train_batch_size=16 \\
    data.max_prompt_length=512 \\
    data.max_response_length=${{max_response_length}} \\
    actor_rollout_ref.model.path={model} \\
    actor_rollout_ref.rollout.n=4 \\
    actor_rollout_ref.actor.optim.lr_decay_style=cosine \\
    actor_rollout_ref.rollout.val_kwargs.do_sample=False \\
    actor_rollout_ref.rollout.val_kwargs.temperature=0.6 \\
    actor_rollout_ref.rollout.val_kwargs.n=1 \\
    algorithm.filter_groups.enable=True \\
    algorithm.filter_groups.metric=acc \\
    algorithm.filter_groups.max_num_gen_batches={max_rounds} \\
    +actor_rollout_ref.actor.megatron.override_transformer_config.apply_rope_fusion=True \\
    reward_model.reward_manager=dapo \\
    custom_reward_function.path={reward_file} \\
    custom_reward_function.name=dapo_score \\
    +custom_reward_function.reward_kwargs.wrong_score=-1.0 \\
    +reward_model.reward_kwargs.overlong_buffer_cfg.enable=${{enable_overlong_buffer}} \\
    +reward_model.reward_kwargs.overlong_buffer_cfg.len=512 \\
    +reward_model.reward_kwargs.overlong_buffer_cfg.penalty_factor=0.5 \\
    +reward_model.reward_kwargs.max_resp_len=${{max_response_length}} \\
    trainer.n_gpus_per_node=8 $@
"""


@pytest.mark.parametrize("enable, max_rounds", [(True, 10), (False, 0)])
def test_a_dapo_script_keeps_its_overlong_penalty_when_enabled_and_its_greedy_validation(
    tmp_path, prompt_files, enable, max_rounds, monkeypatch
):
    """DAPO's overlong penalty (the reward manager's overlong_buffer_cfg) becomes reward.overlong_buffer, only where
    verl applies it (enable true); its group filter is dynamic sampling (verl's 0 rounds, no limit, leaves ours at
    its default); do_sample=False is greedy validation whatever temperature follows it. A reward file given as
    `$(pwd)/...` is that path in the run's working directory."""
    script = tmp_path / "run_dapo.sh"
    reward_file = tmp_path / "dapo_reward.py"
    reward_file.write_text(
        "def dapo_score(data_source, solution_str, ground_truth, extra_info=None, wrong_score=0.0):\n"
        "    return 1.0 if solution_str.strip().endswith(str(ground_truth)) else wrong_score\n"
    )
    script.write_text(
        VERL_DAPO_SCRIPT.format(
            train=prompt_files[0],
            val=prompt_files[1],
            model=MODEL,
            enable=enable,
            max_rounds=max_rounds,
            reward_file=reward_file if enable else "$(pwd)/dapo_reward.py",
        )
    )
    monkeypatch.chdir(tmp_path)
    out = tmp_path / "converted.yaml"
    assert cli.main(["convert", "verl", str(script), "-o", str(out)]) == 0
    config = load_config(out, [], recipe_check=True)
    report = (tmp_path / "converted.report.txt").read_text()
    overlong = config.reward.overlong_buffer
    if enable:
        assert (overlong.length, overlong.penalty_factor, overlong.max_length) == (512, 0.5, 2048)
    else:
        assert overlong is None
        assert "its enable flag is not true, so verl applies no overlong penalty" in report
    assert config.eval.temperature == 0.0 and config.eval.n == 1
    (function,) = config.reward.functions  # verl's custom reward function, its reward_kwargs passed on every call
    path = str(reward_file) if enable else "dapo_reward.py"
    assert (function.path, function.name, function.kwargs) == (path, "dapo_score", {"wrong_score": -1.0})
    assert config.algorithm.dynamic_sampling
    default_rounds = next(f.default for f in dataclasses.fields(config.algorithm) if f.name == "max_generation_rounds")
    assert config.algorithm.max_generation_rounds == (max_rounds or default_rounds)
    assert config.actor_train.strategy.config.lr_schedule.decay_style == "cosine"
    assert "reward_model.reward_manager = 'dapo': rewards are reward.by_source" in report
    assert "override_transformer_config.apply_rope_fusion = True: megatron-core's TransformerConfig is built" in report


@pytest.mark.parametrize(
    "script, said",
    [
        (
            'ACTOR="\n    actor_rollout_ref.actor.optim.lr=1e-6"\npython3 -m verl.trainer.main_ppo $ACTOR\n',
            "cannot read",
        ),
        (
            'ACTOR="actor_rollout_ref.actor.optim.lr=1e-6 actor_rollout_ref.rollout.n=4"\n'
            "python3 -m verl.trainer.main_ppo data.train_batch_size=8 $ACTOR\n",
            "takes settings from the shell variable $ACTOR",
        ),
    ],
)
def test_settings_held_in_shell_variables_are_a_clear_error_not_a_traceback_or_a_silent_loss(
    tmp_path, capsys, script, said
):
    """verl's GSPO and SAPO examples gather settings in multi-line shell variables passed as `$ACTOR_CONFIG`: the
    reader does not run scripts, so it says so (a quote left open was a traceback; a variable's settings were
    dropped without a word)."""
    path = tmp_path / "run.sh"
    path.write_text(script)
    assert cli.main(["convert", "verl", str(path), "-o", str(tmp_path / "out.yaml")]) == 2
    error = capsys.readouterr().err
    assert said in error and ("put the settings on the command itself" in error or "put them on the command" in error)
    assert not (tmp_path / "out.yaml").exists()
