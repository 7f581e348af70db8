"""`roll-backend convert roll` on ROLL's SFT, DPO and on-policy distillation jobs (written here in ROLL's documented
form): SFT and DPO become the sft and dpo pipelines (a step of theirs, one optimizer step, is one step here; epochs
become steps; DPO's loss settings carry over), on-policy distillation a GRPO run with its teacher role."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from roll_backend import cli
from roll_backend.config.loader import load_config

MODEL = str(Path(__file__).resolve().parents[3] / "configs" / "gpu" / "models" / "Qwen2.5-7B-Instruct")

ROLL_SFT = """
hydra: {{run: {{dir: .}}, output_subdir: null}}
exp_name: qwen-sft
pretrain: {model}
system_envs: {{TOKENIZERS_PARALLELISM: 'false'}}
track_with: stdout
num_gpus_per_node: 8
save_steps: 50
eval_steps: 25
resume_from_checkpoint: false
sequence_length: 1024
max_grad_norm: 0.5
prompt_key: instruction
response_key: output
validation:
  data_args: {{file_name: {data}, template: qwen2_5}}
sft_train:
  model_args: {{dtype: bf16}}
  training_args:
    num_train_epochs: 3
    per_device_train_batch_size: 2
    gradient_accumulation_steps: 4
    learning_rate: 1.0e-5
    lr_scheduler_type: cosine
    warmup_steps: 10
  data_args: {{file_name: [{data}], template: qwen2_5}}
  strategy_args:
    strategy_name: megatron_train
    strategy_config: {{tensor_model_parallel_size: 2, sequence_parallel: true, recompute_granularity: full}}
  use_sequence_packing: true
  device_mapping: list(range(0,8))
"""

ROLL_DPO = """
defaults:
  - ../config/deepspeed_zero2@_here_
exp_name: qwen-dpo
max_steps: 500
save_steps: 100
sequence_length: 512
train_batch_size: 64
val_batch_size: 64
num_gpus_per_node: 4
pretrain: {model}
ipo: {ipo}
beta: 0.2
label_smoothing: 0.1
chosen_key: chosen
rejected_key: rejected
actor_train:
  training_args:
    lr_scheduler_type: constant_with_warmup
    learning_rate: 1.0e-6
    per_device_train_batch_size: 16
    gradient_accumulation_steps: 1
    warmup_steps: 20
  data_args: {{file_name: [{data}], template: qwen3}}
  strategy_args:
    strategy_name: megatron_train
    strategy_config: {{tensor_model_parallel_size: 1, pipeline_model_parallel_size: 1}}
  device_mapping: list(range(0,2))
reference:
  strategy_args:
    strategy_name: megatron_infer
    strategy_config: {{tensor_model_parallel_size: 1}}
  device_mapping: list(range(2,4))
  infer_batch_size: 16
"""


def _convert(tmp_path: Path, text: str):
    source, out = tmp_path / "roll.yaml", tmp_path / "converted.yaml"
    source.write_text(text)
    assert cli.main(["convert", "roll", str(source), "-o", str(out)]) == 0
    return load_config(out, [], recipe_check=True), (tmp_path / "converted.report.txt").read_text()


def test_a_roll_sft_job_is_the_sft_pipeline_one_optimizer_step_a_step(tmp_path):
    data = tmp_path / "sft.jsonl"
    rows = 37  # (not a multiple of the batch: the last step of an epoch is a short one)
    data.write_text("".join(json.dumps({"instruction": f"q{i}", "output": f"a{i}"}) + "\n" for i in range(rows)))
    config, report = _convert(tmp_path, ROLL_SFT.format(model=MODEL, data=data))
    assert config.pipeline == "sft" and config.actor_infer is None and config.reference is None
    assert (config.data.prompt_key, config.data.answer_key) == ("instruction", "output")
    assert config.data.max_prompt_length + config.response_length == 1024
    # One step of theirs: 2 per device x 4 accumulated x 4 data-parallel ranks (8 GPUs at TP2).
    assert config.rollout_batch_size == config.algorithm.ppo_mini_batch_size == 2 * 4 * 4
    assert config.max_steps == 3 * math.ceil(rows / 32)
    train = config.actor_train.strategy.config
    assert config.actor_train.world_size == 8 and config.actor_train.strategy.layout.tp == 2
    assert train.lr_schedule.decay_style == "cosine" and train.optimizer.clip_grad == 0.5
    assert train.sequence_parallel and train.use_sequence_packing and train.recompute_activations
    assert "sft_train.training_args.num_train_epochs = 3 -> max_steps = 6 (epochs become steps)" in report
    assert "system_envs.TOKENIZERS_PARALLELISM = 'false': environment variables" in report


@pytest.mark.parametrize("ipo, loss", [(False, "sigmoid"), (True, "ipo")])
def test_a_roll_dpo_job_is_the_dpo_pipeline_with_its_loss_settings(tmp_path, ipo, loss):
    data = tmp_path / "pairs.jsonl"
    data.write_text("".join(json.dumps({"prompt": "q", "chosen": "a", "rejected": "b"}) + "\n" for _ in range(8)))
    config, report = _convert(tmp_path, ROLL_DPO.format(model=MODEL, data=data, ipo=str(ipo).lower()))
    assert config.pipeline == "dpo" and config.actor_infer is None and config.reference is not None
    assert (config.preference.loss, config.preference.beta) == (loss, 0.2)
    assert config.preference.label_smoothing == (0.0 if ipo else 0.1)  # (ipo has none: reported, not refused)
    assert (config.data.answer_key, config.data.rejected_key) == ("chosen", "rejected")
    assert config.rollout_batch_size == 64 and config.max_steps == 500  # (their batch and steps, as written)
    assert config.actor_train.strategy.config.lr_schedule.decay_style == "constant"
    assert config.reference.strategy.config.micro_batch_size == 16
    assert "defaults = ['../config/deepspeed_zero2@_here_']: Hydra's defaults list" in report


ROLL_ONPOLICY_DISTILL = """
exp_name: qwen-opd
max_steps: 100
rollout_batch_size: 8
prompt_length: 512
response_length: 512
num_return_sequences_in_group: 4
adv_estimator: grpo
pretrain: {model}
student_train:
  model_args: {{model_name_or_path: {model}, dtype: bf16}}
  training_args: {{learning_rate: 5.0e-7, per_device_train_batch_size: 4, gradient_accumulation_steps: 1}}
  data_args: {{file_name: [{data}], domain_interleave_probs: {{math_rule: 1.0}}, messages: messages}}
  strategy_args:
    strategy_name: megatron_train
    strategy_config: {{tensor_model_parallel_size: 1, pipeline_model_parallel_size: 2}}
  device_mapping: list(range(0,4))
student_infer:
  generating_args: {{temperature: 0.99, num_return_sequences: 4}}
  strategy_args: {{strategy_name: vllm, strategy_config: {{gpu_memory_utilization: 0.8}}}}
  device_mapping: list(range(0,4))
teacher:
  model_args: {{model_name_or_path: {teacher}, disable_gradient_checkpointing: true, dtype: bf16}}
  strategy_args:
    strategy_name: megatron_infer
    strategy_config: {{tensor_model_parallel_size: 2, pipeline_model_parallel_size: 2}}
  device_mapping: list(range(0,4))
  infer_batch_size: 2
rewards:
  math_rule:
    worker_cls: roll.pipeline.rlvr.rewards.math_rule_reward_worker.MathRuleRewardWorker
    tag_included: [math_dapo]
"""


def test_a_roll_on_policy_distillation_job_gets_its_teacher_role(tmp_path):
    """ROLL's student_train / student_infer are actor_train / actor_infer here, its `teacher` the teacher role (its
    own model, layout and micro-batch), and the run distils on-policy as ROLL's does."""
    data = tmp_path / "math.jsonl"
    row = {"messages": json.dumps([{"role": "user", "content": "1+1?"}]), "ground_truth": "2", "tag": "math_rule"}
    data.write_text(json.dumps(row) + "\n")
    teacher = tmp_path / "teacher"
    teacher.mkdir()
    (teacher / "config.json").write_text((Path(MODEL) / "config.json").read_text())
    (teacher / "tokenizer_config.json").write_text("{}")
    config, report = _convert(tmp_path, ROLL_ONPOLICY_DISTILL.format(model=MODEL, data=data, teacher=teacher))
    assert config.teacher is not None and config.teacher.model_path == str(teacher)
    assert (config.teacher.strategy.layout.tp, config.teacher.strategy.layout.pp) == (2, 2)
    assert config.teacher.strategy.config.micro_batch_size == 2 and config.teacher.world_size == 4
    assert config.actor_train.model_path == MODEL and config.actor_train.strategy.layout.pp == 2
    assert config.actor_infer.strategy.config.sampling.temperature == 0.99
    assert "student_train.model_args.model_name_or_path" in report and "not converted" not in report


def test_several_roll_teachers_are_reported_not_guessed():
    from roll_backend.config.job_import import convert

    tree, report = convert(
        "roll",
        {
            "student_train.strategy_args.strategy_name": "megatron_train",
            "teacher.t32.model_args.model_name_or_path": "Qwen/Qwen3-32B",
            "teacher.t14.model_args.model_name_or_path": "Qwen/Qwen3-14B",
        },
    )
    assert "teacher" not in tree  # (a teacher defaulting to the student's model would distil from itself)
    assert "teacher.{t32, t14}: ROLL's several teachers (one per tag) are not converted" in report.text()
