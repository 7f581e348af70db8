"""Weight sync into a running vLLM engine (RolloutWorker in a Ray actor): after training a Hugging Face copy of the
model a few steps and loading its weights with `update_weights`, vLLM's greedy output equals transformers' greedy
output on 16 prompts sharing a 400+ token prefix (stale prefix-cache entries would break this), and vLLM's
sampling log-probs agree with the trained model's log-probs of the same sequences. Without the prefix-cache reset
in `update_weights`, the greedy check fails with 0/16 prompts matching."""

from __future__ import annotations

import pytest
import ray
import torch

from roll_backend import keys
from roll_backend.keys import META_VALIDATE
from roll_backend.models.tiny import TinyModelSpec, build_tiny_model, default_corpus
from roll_backend.protocol import DataProto
from roll_backend.protocol.sequences import left_pad
from roll_backend.strategies.vllm.config import SamplingConfig, VllmRolloutConfig
from roll_backend.workers.rollout import RolloutWorker, RolloutWorkerConfig

VLLM_TINY = TinyModelSpec(hidden_size=128, intermediate_size=256, num_attention_heads=4, num_key_value_heads=2, seed=2)
NUM_PROMPTS = 16
PREFIX_TOKENS = 420
GREEDY_TOKENS = 16
LM_HEAD_SCALE = 20.0


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """The tiny model with its LM head scaled up: a random init's logits are nearly flat, so a few training steps
    would make greedy decoding emit the corpus' most frequent token whatever the context, and stale prefix-cache
    entries would go unnoticed. Peaked logits keep the output dependent on every prompt token."""
    from transformers import AutoModelForCausalLM

    path = build_tiny_model(tmp_path_factory.mktemp("vllm_sync"), VLLM_TINY)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    with torch.no_grad():
        model.lm_head.weight.mul_(LM_HEAD_SCALE)
    model.save_pretrained(path)
    return str(path)


@pytest.fixture(scope="module")
def tokenizer(model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir)


@pytest.fixture(scope="module")
def rollout(make_group, model_dir):
    config = RolloutWorkerConfig(
        strategy=VllmRolloutConfig(
            model_path=model_dir,
            max_model_len=1024,
            sampling=SamplingConfig(n=4, temperature=1.0, max_tokens=24),
            validation=SamplingConfig(n=1, temperature=0.0, max_tokens=GREEDY_TOKENS),
            weight_sync_bucket_mb=0.1,  # several buckets for this ~1.3 MB model: exercises layer-aligned bucketing
        )
    )
    group = make_group(RolloutWorker, 1, role="rollout", worker_config=config)
    group.call(RolloutWorker.init_model)
    return group


@pytest.fixture(scope="module")
def shared_prefix_prompts(tokenizer) -> list[list[int]]:
    """16 prompts: one 420-token prefix, then a distinct short suffix each."""
    text = " ".join(default_corpus()[1:])
    prefix = tokenizer.encode(text, add_special_tokens=False)[:PREFIX_TOKENS]
    assert len(prefix) == PREFIX_TOKENS
    return [prefix + tokenizer.encode(f" what is {i} + {i + 3}?", add_special_tokens=False) for i in range(NUM_PROMPTS)]


def prompt_batch(prompt_ids: list[list[int]], pad_id: int, **meta) -> DataProto:
    prompts, mask = left_pad(prompt_ids, pad_id)
    return DataProto.from_dict(tensors={keys.PROMPTS: prompts, keys.ATTENTION_MASK: mask}, meta_info=meta)


def train_hf_model(model_dir: str, prompt_ids: list[list[int]], tokenizer, steps: int = 3, lr: float = 0.15):
    """A few SGD steps of next-token loss on prompt + a fixed answer."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    answer = tokenizer.encode(" the answer is 12.", add_special_tokens=False) + [tokenizer.eos_token_id]
    sequences = [ids + answer for ids in prompt_ids]
    width = max(map(len, sequences))
    input_ids = torch.tensor([seq + [tokenizer.pad_token_id] * (width - len(seq)) for seq in sequences])  # right-padded
    attention_mask = torch.tensor([[1] * len(seq) + [0] * (width - len(seq)) for seq in sequences])
    labels = input_ids.masked_fill(attention_mask == 0, -100)
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    for _ in range(steps):
        loss = model(input_ids=input_ids, attention_mask=attention_mask, labels=labels).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    return model.eval()


@torch.no_grad()
def hf_greedy(model, prompt_ids: list[int], max_new_tokens: int, eos_id: int) -> list[int]:
    out = model.generate(
        torch.tensor([prompt_ids]),
        attention_mask=torch.ones(1, len(prompt_ids), dtype=torch.long),
        max_new_tokens=max_new_tokens,
        do_sample=False,
        eos_token_id=eos_id,
        pad_token_id=eos_id,
    )
    generated = out[0, len(prompt_ids) :].tolist()
    return generated[: generated.index(eos_id) + 1] if eos_id in generated else generated


@torch.no_grad()
def hf_response_log_probs(model, rollout_batch: DataProto) -> torch.Tensor:
    """The trainer-side log-probs of the rollout's responses: [B, T_resp], from a padded forward pass."""
    input_ids, attention = rollout_batch.batch[keys.INPUT_IDS], rollout_batch.batch[keys.ATTENTION_MASK]
    logits = model(
        input_ids=input_ids, attention_mask=attention, position_ids=rollout_batch.batch[keys.POSITION_IDS]
    ).logits
    t_resp = rollout_batch.batch[keys.RESPONSES].shape[1]
    resp_logits = logits[:, -t_resp - 1 : -1].float()  # position t predicts token t+1
    return torch.log_softmax(resp_logits, dim=-1).gather(-1, rollout_batch.batch[keys.RESPONSES][..., None])[..., 0]


def vllm_greedy_rows(out: DataProto) -> list[list[int]]:
    responses, mask = out.batch[keys.RESPONSES], out.batch[keys.RESPONSE_MASK].bool()
    return [row[row_mask].tolist() for row, row_mask in zip(responses, mask)]


@pytest.fixture(scope="module")
def synced(rollout, model_dir, tokenizer, shared_prefix_prompts):
    """Greedy output with the initial weights (this fills the prefix cache with the old model's keys/values),
    then train a transformers copy and load its weights into the engine. Returns (greedy before, trained model)."""
    before = vllm_greedy_rows(
        rollout.call(
            RolloutWorker.generate, prompt_batch(shared_prefix_prompts, tokenizer.pad_token_id, **{META_VALIDATE: True})
        )
    )
    trained = train_hf_model(model_dir, shared_prefix_prompts, tokenizer)
    named = [(name, param.detach()) for name, param in trained.named_parameters()]
    assert rollout.call(RolloutWorker.update_weights, named) == [len(named)]  # one count per rank
    return before, trained


def test_synced_weights_give_transformers_greedy_output_on_shared_prefix(
    rollout, synced, tokenizer, shared_prefix_prompts
):
    before, trained = synced
    after = vllm_greedy_rows(
        rollout.call(
            RolloutWorker.generate, prompt_batch(shared_prefix_prompts, tokenizer.pad_token_id, **{META_VALIDATE: True})
        )
    )
    expected = [hf_greedy(trained, ids, GREEDY_TOKENS, tokenizer.eos_token_id) for ids in shared_prefix_prompts]
    assert before != expected, "training did not change the greedy output; the test would prove nothing"
    matches = sum(a == e for a, e in zip(after, expected))
    assert matches == NUM_PROMPTS, f"{matches}/{NUM_PROMPTS} prompts match transformers after the sync"


def test_sampling_log_probs_agree_with_the_trained_model(rollout, synced, tokenizer, shared_prefix_prompts):
    _, trained = synced
    sampled = rollout.call(RolloutWorker.generate, prompt_batch(shared_prefix_prompts[:4], tokenizer.pad_token_id))
    mask = sampled.batch[keys.RESPONSE_MASK].bool()
    gap = (hf_response_log_probs(trained, sampled) - sampled.batch[keys.ROLLOUT_LOG_PROBS]).abs()[mask]
    print(
        f"vLLM vs transformers sampling log-probs: mean |gap| {gap.mean():.2e}, max {gap.max():.2e} over "
        f"{int(mask.sum())} tokens"
    )
    assert gap.mean() < 1e-5 and gap.max() < 1e-4  # measured on CPU float32: mean 2e-7, max 5e-6


# ---- partial rollouts (streaming mode): a weight update lands while requests are in flight ------------------------
STREAM_TOKENS = 24  # every response this long (min_tokens): the update always lands mid-generation
STEPS_BEFORE_UPDATE = 6  # one prefill step, then a token per step


def stream_prompts(tokenizer, count: int = 3) -> DataProto:
    prompt_ids = [tokenizer.encode(f" what is {i} + {2 * i + 1}?", add_special_tokens=False) for i in range(count)]
    batch = prompt_batch(prompt_ids, tokenizer.pad_token_id, min_tokens=STREAM_TOKENS, max_tokens=STREAM_TOKENS)
    batch.batch[keys.STREAM_POSITION] = torch.arange(count)
    return batch


def stream_until_done(rollout) -> tuple[DataProto, dict[str, float]]:
    """Step until the engine is empty: the finished groups and the summed counters."""
    parts, counters = [], {}
    while True:
        [(finished, unfinished, stats)] = rollout.call(RolloutWorker.stream_run, 8)
        parts += [finished] if finished is not None else []
        counters = {name: counters.get(name, 0.0) + value for name, value in stats.items()}
        if not unfinished:
            return DataProto.concat(parts), counters


@pytest.mark.parametrize("in_flight", ["recompute", "resubmit", "keep"])
def test_a_weight_update_mid_generation_gives_two_versions_in_one_sample(
    rollout, synced, model_dir, tokenizer, shared_prefix_prompts, in_flight
):
    """Requests sampled 5 tokens with the initial weights (version 0) when the trained weights (version 1) arrive.
    Each token records the version that sampled it, and its log-prob is that version's: the first tokens match the
    initial model in transformers, the later ones (recompute, resubmit: their KV computed again) the trained model.
    The token-level rollout correction against the trained model then weights the later tokens 1 and the earlier
    ones by their real ratio. A probe and a validation generate (greedy, 2 samples a prompt) while requests are in
    flight use the new weights and leave them be."""
    from transformers import AutoModelForCausalLM

    from roll_backend.algorithms import rollout_correction

    _, trained = synced
    initial = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    initial_weights = [(name, param.detach()) for name, param in initial.named_parameters()]
    trained_weights = [(name, param.detach()) for name, param in trained.named_parameters()]
    rollout.call(RolloutWorker.update_weights, initial_weights, version=0)
    probe_rows = rollout.call(RolloutWorker.generate, stream_prompts(tokenizer, 2))

    rollout.call(RolloutWorker.stream_admit, stream_prompts(tokenizer))
    [(finished, unfinished, _)] = rollout.call(RolloutWorker.stream_run, STEPS_BEFORE_UPDATE)
    assert finished is None and unfinished
    refs = [ray.put([(name, tensor)]) for name, tensor in trained_weights]
    rollout.call(RolloutWorker.load_weight_buckets, refs, version=1, in_flight=in_flight)
    probed = rollout.call(RolloutWorker.probe_log_probs, probe_rows).batch[keys.LOG_PROBS]
    mask = probe_rows.batch[keys.RESPONSE_MASK].bool()
    assert agree(probed[mask], hf_response_log_probs(trained, probe_rows)[mask])
    validated = rollout.call(
        RolloutWorker.generate,
        # (top_k 1: greedy, with the 2 samples a prompt that temperature 0 would refuse)
        prompt_batch(
            shared_prefix_prompts[:3], tokenizer.pad_token_id, n=2, temperature=1.0, top_k=1, **{META_VALIDATE: True}
        ),
    )
    expected = [hf_greedy(trained, ids, GREEDY_TOKENS, tokenizer.eos_token_id) for ids in shared_prefix_prompts[:3]]
    assert vllm_greedy_rows(validated) == [ids for ids in expected for _ in range(2)]
    batch, counters = stream_until_done(rollout)

    versions, mask = batch.batch[keys.TOKEN_POLICY_VERSION], batch.batch[keys.RESPONSE_MASK].bool()
    assert len(batch) == 3 * 4 and bool(mask.all())  # every sample STREAM_TOKENS long
    # The prefill step samples the first token: each step before the update sampled one token per request.
    early_count = STEPS_BEFORE_UPDATE
    assert (versions[:, :early_count] == 0).all() and (versions[:, early_count:] == 1).all(), versions[0]
    assert batch.batch[keys.STREAM_POSITION].tolist() == [0] * 4 + [1] * 4 + [2] * 4
    rollout_log_probs = batch.batch[keys.ROLLOUT_LOG_PROBS]
    early, late = versions == 0, versions == 1
    before, after = hf_response_log_probs(initial, batch), hf_response_log_probs(trained, batch)
    assert agree(rollout_log_probs[early], before[early])
    assert (rollout_log_probs - after).abs()[early].mean() > 1e-2  # the two versions really differ there
    if in_flight != "keep":  # keep: later tokens attend over keys/values the initial weights computed
        assert agree(rollout_log_probs[late], after[late])
    weights, _ = rollout_correction(after, rollout_log_probs, mask.float(), is_level="token", is_cap=1e9)
    expected = torch.exp(after - rollout_log_probs)
    assert torch.allclose(weights[mask], expected[mask], rtol=1e-5)
    if in_flight != "keep":
        assert (weights[late] - 1).abs().max() < 1e-3 < (weights[early] - 1).abs().mean()
    assert counters["partial_resumed_requests"] == 12
    assert counters["recomputed_tokens"] == (12 * early_count + 4 * sum(stream_prompt_lengths(tokenizer))) * (
        in_flight == "recompute"
    )


def agree(engine: torch.Tensor, reference: torch.Tensor) -> bool:
    """float32 log-probs of the same tokens under the same weights, on average. This module's LM head is scaled by
    20, and so are the logits' rounding errors: measured means 3e-8 to 5e-4 (single sampled tokens of the initial
    model up to 3e-2), while the two versions' log-probs of the same tokens differ by > 1e-2 on average."""
    return bool((engine - reference).abs().mean() < 1e-3)


def stream_prompt_lengths(tokenizer) -> list[int]:
    return stream_prompts(tokenizer).batch[keys.ATTENTION_MASK].sum(-1).tolist()


def test_a_sync_does_not_warn_that_the_rotary_cache_failed_to_load():
    """vLLM's reload logs "<layer>: Failed to load weights" for a layer it could load nothing into: a rotary layer's
    cos/sin cache is no checkpoint weight (dropped); any other layer's is a real failure (kept)."""
    import logging

    from roll_backend.strategies.vllm.weight_sync import RELOAD_LOGGER

    def record(layer: str) -> logging.LogRecord:
        return logging.LogRecord(
            RELOAD_LOGGER, logging.WARNING, __file__, 1, "%s: Failed to load weights", (layer,), None
        )

    reload_logger = logging.getLogger(RELOAD_LOGGER)
    assert not reload_logger.filter(record("RotaryEmbedding"))
    assert not reload_logger.filter(record("YaRNScalingRotaryEmbedding"))
    assert reload_logger.filter(record("QKVParallelLinear"))
    assert reload_logger.filter(logging.LogRecord(RELOAD_LOGGER, logging.INFO, __file__, 1, "reloading", (), None))
