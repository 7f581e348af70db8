"""Rewards users bring, in real runs: user functions (verl's signature and a batched one) mixed with a built-in
in GRPO, a raising function stopping the run with its message while the checkpoint stays, and a PPO critic that
starts from a trained reward model's score head."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from pipeline_fixtures import hybrid_roles

from roll_backend.config.loader import load_config
from roll_backend.errors import UserCodeError
from roll_backend.pipelines import run_pipeline
from roll_backend.pipelines.services.checkpoint import latest_checkpoint, load_driver_state

PROMPTS = [{"prompt": f"copy: {d}", "answer": str(d), "data_source": "copy", "level": d % 3} for d in range(10)]
ROWS_PER_STEP = 4 * 4  # rollout_batch_size * num_return_sequences_in_group

USER_REWARDS = """
import os

COUNTER = {counter!r}
CALLS_BEFORE_FAILING = {calls}


def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    with open(COUNTER, "a") as f:
        f.write("x")
    if os.path.getsize(COUNTER) > CALLS_BEFORE_FAILING:
        raise ValueError("no answer found in " + repr(solution_str[:10]))
    return {{"score": float(solution_str.strip() == ground_truth), "level": extra_info["level"],
            "from_copy": float(data_source == "copy")}}


def length_penalty(data_sources, solution_strs, ground_truths, extra_infos):
    return [-0.1 * len(s) for s in solution_strs]
"""


@pytest.fixture(scope="module")
def prompt_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("data") / "prompts.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in PROMPTS))
    return path


@pytest.fixture(scope="module")
def base_config(tmp_path_factory):
    """The demo config with its built-in reward replaced (dict overrides would merge into it, not replace it)."""
    from omegaconf import OmegaConf

    tree = OmegaConf.load("configs/grpo_tiny_cpu.yaml")
    tree.reward.rewards = {"exact_match": 2.0}
    path = tmp_path_factory.mktemp("config") / "pipeline.yaml"
    OmegaConf.save(tree, path)
    return path


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from roll_backend.models.tiny import TinyModelSpec, build_tiny_model

    return build_tiny_model(
        tmp_path_factory.mktemp("model") / "tiny", TinyModelSpec(hidden_size=128, intermediate_size=256, seed=3)
    )


def overrides(prompt_file, model_dir, output_dir, *extra: str) -> list[str]:
    return [
        f"output_dir={output_dir}",
        f"model_path={model_dir}",
        "build_tiny_model=null",
        f"data.train_path={prompt_file}",
        "data.synthetic=null",
        "data.shuffle=false",
        "rollout_batch_size=4",
        "num_return_sequences_in_group=4",
        "response_length=4",
        "algorithm.ppo_mini_batch_size=16",
        "actor_train.world_size=1",
        "actor_train.strategy.tp=1",
        "actor_train.strategy.micro_batch_size=8",
        "reference=null",
        "algorithm.use_kl_loss=false",
        "logging.progress_bar=false",
        "perf.measure_peak=false",
        "logging.tensorboard=false",
        *extra,
    ]


def test_grpo_with_user_functions_then_a_raising_one_keeps_the_checkpoint(
    ray_session, base_config, prompt_file, model_dir, tmp_path
):
    reward_file = tmp_path / "user_rewards.py"
    reward_file.write_text(USER_REWARDS.format(counter=str(tmp_path / "calls"), calls=ROWS_PER_STEP))
    functions = (
        f"reward.functions=[{{path: {reward_file}, name: compute_score, weight: 1.0}}, "
        f"{{path: {reward_file}, name: length_penalty, weight: 0.5, batched: true}}]"
    )
    config = load_config(
        base_config,
        overrides(
            prompt_file,
            model_dir,
            tmp_path / "run",
            "max_steps=3",
            "checkpoint.save_steps=1",
            functions,
            "reward.overlong_buffer={length: 3, penalty_factor: 0.3}",  # (past 1 of the 4 response tokens)
        ),
    )
    assert config.reward.builtin_weights() == {"exact_match": 2.0}

    with pytest.raises(UserCodeError) as info:  # step 1 scores; step 2's first call raises
        run_pipeline(config)
    message = str(info.value)
    assert "reward.compute_rewards: [reward rank 0/1" in message
    assert "user_rewards.compute_score raised ValueError: no answer found in" in message
    assert "on row 0 (prompt 'copy: " in message and ", response '" in message

    # Nothing checkpointed is lost: step 1's checkpoint is complete and the latest.
    checkpoint = latest_checkpoint(tmp_path / "run")
    assert checkpoint is not None and checkpoint.name == "step_1" and load_driver_state(checkpoint)["step"] == 1
    step1 = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [record["step"] for record in step1] == [1]
    metrics = step1[0]
    # Step 1 is batch_at(1): prompts 4..7 in order (no shuffle), n=4 each; extra_info and data_source reached the
    # function.
    assert metrics["reward/user_rewards.compute_score/level"] == pytest.approx(
        np.mean([PROMPTS[i]["level"] for i in range(4, 8)])
    )
    assert metrics["reward/user_rewards.compute_score/from_copy"] == 1.0
    assert metrics["reward/user_rewards.compute_score/error_count"] == 0.0
    weighted = (
        2.0 * metrics["reward/exact_match_mean"]
        + metrics["reward/user_rewards.compute_score/mean"]
        + 0.5 * metrics["reward/user_rewards.length_penalty/mean"]
        + metrics["reward/overlong_penalty_mean"]  # DAPO's: -0.3 * (L - 1) / 3 for a response of L > 1 tokens
    )
    assert metrics["reward/mean"] == pytest.approx(weighted, abs=1e-6)
    # Every response has L >= 1 tokens, so the penalty is linear in L over the batch: its mean is the mean length's.
    expected_penalty = -0.3 * (metrics["response_length/mean"] - 1) / 3
    assert metrics["reward/overlong_penalty_mean"] == pytest.approx(expected_penalty, abs=1e-6)
    assert metrics["reward/user_rewards.length_penalty/mean"] < 0  # every response has at least one character


def test_ppo_critic_starts_from_a_trained_reward_model(ray_session, base_config, prompt_file, model_dir, tmp_path):
    from transformers import AutoModelForSequenceClassification

    from roll_backend import keys
    from roll_backend.models.tiny import TinyModelSpec, build_tiny_reward_model
    from roll_backend.pipelines.loops import phases
    from roll_backend.pipelines.loops.rl_step import rl_step
    from roll_backend.pipelines.run import PipelineRun
    from roll_backend.workers.critic import CriticWorker

    reward_model = build_tiny_reward_model(tmp_path / "reward_model", TinyModelSpec(seed=5))
    # On the hybrid engine: the critic, a second model (the reward model's) in the actor's processes, at its layout.
    critic = (
        "critic={model_path: " + str(reward_model) + ", world_size: 1, hybrid: true, strategy: {name: megatron_train, "
        "micro_batch_size: 8, value_head_init: score_head, offload_params: true, offload_grads: true, "
        "offload_optimizer: true, optimizer: {lr: 1.0e-3}}}"
    )
    config = load_config(
        base_config,
        overrides(
            prompt_file,
            model_dir,
            tmp_path / "ppo",
            "pipeline=ppo",
            "algorithm.adv_estimator=gae",
            critic,
            "max_steps=1",
            *hybrid_roles(1, 1),
        ),
    )
    with PipelineRun(config) as run:
        batch = phases.generate(run.groups, run.data.batch_at(1, config.rollout_batch_size), config, step=1)
        values = run.groups.critic.call(CriticWorker.compute_values, batch).batch[keys.VALUES]
        # The reward model's score head applied at every position, read where each response token is predicted.
        hf = AutoModelForSequenceClassification.from_pretrained(reward_model, dtype=torch.float32).eval()
        with torch.no_grad():
            hidden = hf.model(
                input_ids=batch.batch[keys.INPUT_IDS],
                attention_mask=batch.batch[keys.ATTENTION_MASK],
                position_ids=batch.batch[keys.POSITION_IDS],
            ).last_hidden_state
            width = batch.batch[keys.RESPONSES].shape[1]
            expected = hf.score(hidden)[:, -width - 1 : -1, 0]
        mask = batch.batch[keys.RESPONSE_MASK].bool()
        assert expected[mask].std() > 0.05  # a fresh head (std 0.02) would score near 0 everywhere
        assert torch.allclose(values[mask], expected[mask], atol=1e-5, rtol=0)
        metrics = rl_step(run, 1)
        assert metrics["critic/vf_loss"] > 0 and "timing/critic_train" in metrics
        after = run.groups.critic.call(CriticWorker.compute_values, batch).batch[keys.VALUES]
        assert (after[mask] - values[mask]).abs().max() > 1e-4  # and the critic trains from there


# ---- other frameworks' data: a verl parquet and a ROLL JSONL, mixed, scored by source -------------------------

SYSTEM = "be brief."
FRAMEWORK_REWARDS = """
class TypedCheck:
    # Scores a copy and reports what reached it: the conversation with its system prompt, ground truths typed.

    def compute_rewards(self, rows):
        out = []
        for messages, answer, response, source in zip(rows.messages, rows.answers, rows.responses, rows.data_sources):
            accepted = answer if isinstance(answer, list) else [answer]
            typed = isinstance(answer, list) if source == "copy" else isinstance(answer, str)
            out.append({{
                "score": float(response.strip() in accepted),
                "typed": float(typed),
                "system_prompt": float(messages[0] == {{"role": "system", "content": {system!r}}}),
                "roll_rows": float(source == "math_rule"),
            }})
        return out
"""


def write_framework_files(folder) -> tuple[str, str]:
    """A verl RL parquet (chat-message prompt, data_source, reward_model.ground_truth a list) and a ROLL RLVR JSONL
    (messages as a JSON string with the system prompt, ground_truth, tag), as each documents its schema."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    def conversation(d):
        return [{"role": "system", "content": SYSTEM}, {"role": "user", "content": f"copy: {d}"}]

    verl = [
        {
            "data_source": "copy",
            "prompt": conversation(d),
            "ability": "copy",
            "reward_model": {"style": "rule", "ground_truth": [str(d), f"{d}{d}"]},
            "extra_info": {"split": "train", "index": d},
        }
        for d in range(6)
    ]
    pq.write_table(pa.Table.from_pylist(verl), folder / "verl.parquet")
    roll = [
        {
            "id": str(d),
            "source": "copy",
            "prompt": f"copy: {d}",
            "messages": json.dumps(conversation(d)),
            "ground_truth": str(d),
            "tag": "math_rule",
        }
        for d in range(6, 10)
    ]
    (folder / "rlvr.jsonl").write_text("".join(json.dumps(row) + "\n" for row in roll))
    return str(folder / "verl.parquet"), str(folder / "rlvr.jsonl")


def test_a_verl_parquet_and_a_roll_jsonl_train_together_scored_by_source(
    ray_session, base_config, prompt_file, model_dir, tmp_path
):
    verl, roll = write_framework_files(tmp_path)
    reward_file = tmp_path / "framework_rewards.py"
    reward_file.write_text(FRAMEWORK_REWARDS.format(system=SYSTEM))
    config = load_config(
        base_config,
        overrides(
            prompt_file,
            model_dir,
            tmp_path / "run",
            "max_steps=2",
            f"data.train_path=[{{path: {verl}}}, {{path: {roll}}}]",
            "data.max_prompt_length=64",
            "actor_infer.strategy.max_prompt_length=64",
            "actor_infer.strategy.max_model_len=96",
            "reward.rewards=null",
            f"reward.functions=[{{path: {reward_file}, name: TypedCheck}}]",
            "reward.by_source={copy: framework_rewards.TypedCheck, math_rule: auto}",
            *hybrid_roles(1, 1),
        ),
    )
    run_pipeline(config)
    steps = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [record["step"] for record in steps] == [1, 2]
    label = "reward/framework_rewards.TypedCheck"
    for metrics in steps:
        # both files in every step, named by their sources (verl's data_source, ROLL's tag)
        assert metrics["data/copy/prompts"] + metrics["data/math_rule/prompts"] == 4
        assert metrics["data/copy/prompts"] >= 1 and metrics["data/math_rule/prompts"] >= 1
        # The verl rows reached the class with their list ground truths and their conversation's system prompt.
        assert metrics[f"{label}/typed"] == 1.0 and metrics[f"{label}/system_prompt"] == 1.0
        assert metrics[f"{label}/roll_rows"] == 0.0  # only the `copy` source is routed to it
        assert "reward/math_verify_mean" in metrics  # ROLL's math_rule tag: the built-in MATH scorer (auto)


# ---- ReMax: each prompt's greedy response is its samples' baseline ----------------------------------------------

TEXT_SCORE = """
def text_score(data_source, solution_str, ground_truth, extra_info=None):
    return (sum(map(ord, solution_str)) + 7 * int(ground_truth)) % 101 / 101  # (nearly) every text and prompt apart
"""


def test_remax_measures_each_sample_against_its_prompts_greedy_response(
    ray_session, base_config, prompt_file, model_dir, tmp_path
):
    """verl's remax: the baseline of a prompt's samples is its greedy response scored by the run's rewards. Each
    row's baseline equals transformers' greedy continuation of its prompt scored by the same rewards, each advantage
    is the row's score minus that baseline, and a step trains on them."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from roll_backend import keys
    from roll_backend.pipelines.loops import phases
    from roll_backend.pipelines.loops.rl_step import rl_step
    from roll_backend.pipelines.run import PipelineRun
    from roll_backend.rewards import exact_match

    reward_file = tmp_path / "text_score.py"
    reward_file.write_text(TEXT_SCORE)
    scored_by = f"reward.functions=[{{path: {reward_file}, name: text_score, weight: 1.0}}]"
    remax = ["algorithm.adv_estimator=remax", scored_by, "max_steps=1", *hybrid_roles(1, 1)]
    config = load_config(base_config, overrides(prompt_file, model_dir, tmp_path / "remax", *remax))
    with PipelineRun(config) as run:
        batch = phases.generate(run.groups, run.data.batch_at(1, config.rollout_batch_size), config, step=1)
        phases.score(run.groups, batch, config.reward)
        metrics = phases.advantages(batch, config.algorithm, kl_coef=0.0)
        step = rl_step(run, 1)
    assert "actor/pg_loss" in step and "remax/baseline_mean" in step

    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    rows, prompts = batch.batch, batch.batch[keys.PROMPTS]
    prompt_mask = rows[keys.ATTENTION_MASK][:, : prompts.shape[1]].bool()
    expected = []
    for row in range(len(batch)):
        with torch.no_grad():
            ids = prompts[row][prompt_mask[row]].unsqueeze(0)
            out = hf.generate(ids, do_sample=False, max_new_tokens=config.response_length, pad_token_id=0)
        text = tokenizer.decode(out[0, ids.shape[1] :], skip_special_tokens=True)
        answer = batch.non_tensor_batch[keys.ANSWER][row]
        expected.append(2.0 * exact_match.score(text, answer) + (sum(map(ord, text)) + 7 * int(answer)) % 101 / 101)
    baselines = rows[keys.REWARD_BASELINES]
    assert baselines.tolist() == pytest.approx(expected, abs=1e-6)
    uids = batch.non_tensor_batch[keys.UID]
    assert len(set(uids)) == config.rollout_batch_size and len(set(expected)) > 1  # one per prompt, not all alike
    scores = rows[keys.TOKEN_LEVEL_SCORES].sum(-1)
    mask = rows[keys.RESPONSE_MASK].bool()
    advantages = rows[keys.ADVANTAGES]
    for row in range(len(batch)):  # outcome rewards: every token's return is the row's score
        assert advantages[row][mask[row]].tolist() == pytest.approx(
            [float(scores[row] - baselines[row])] * int(mask[row].sum()), abs=1e-6
        )
    assert metrics["remax/baseline_mean"] == pytest.approx(float(baselines.mean()), abs=1e-6)
