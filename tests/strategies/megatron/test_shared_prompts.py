"""The prompt-shared layout (strategies/megatron/shared_prompts.py) against the unshared rows, on a transformers
model: per-token log-probs and the gradients of a loss over them are the same when each group's prompt is forwarded
once, on random shapes (prompt lengths per group, response lengths per row including empty ones, group sizes,
padding), within float32 rounding."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from roll_backend.models.tiny import TinyModelSpec, build_tiny_model
from roll_backend.strategies.megatron.shared_prompts import pack_shared_prompts

VOCAB = 320


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    from transformers import AutoModelForCausalLM

    folder = build_tiny_model(tmp_path_factory.mktemp("tiny"), TinyModelSpec(hidden_size=64, num_hidden_layers=2))
    return AutoModelForCausalLM.from_pretrained(folder, attn_implementation="eager", dtype=torch.float32).eval()


def rows_of(groups: list[tuple[int, list[int]]], prompt_width: int, response_width: int, seed: int):
    """Left-padded prompts and right-padded responses: one random prompt per group (its length), its rows' responses
    of the given lengths; the group id of each row."""
    gen = torch.Generator().manual_seed(seed)
    prompts, prompt_mask, responses, present, group_ids = [], [], [], [], []
    for g, (prompt_len, response_lens) in enumerate(groups):
        prompt = torch.randint(3, VOCAB, (prompt_len,), generator=gen)
        for length in response_lens:
            row = torch.zeros(prompt_width, dtype=torch.long)
            row[prompt_width - prompt_len :] = prompt
            prompts.append(row)
            prompt_mask.append((torch.arange(prompt_width) >= prompt_width - prompt_len).long())
            response = torch.zeros(response_width, dtype=torch.long)
            response[:length] = torch.randint(3, VOCAB, (length,), generator=gen)
            responses.append(response)
            present.append((torch.arange(response_width) < length).long())
            group_ids.append(f"uid{g}")
    return torch.stack(prompts), torch.stack(prompt_mask), torch.stack(responses), torch.stack(present), group_ids


def unshared_log_probs(model, prompts, prompt_mask, responses, present) -> torch.Tensor:
    mask = torch.cat([prompt_mask, present], dim=1)
    ids = torch.cat([prompts, responses], dim=1)
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    logits = model(input_ids=ids, attention_mask=mask, position_ids=positions).logits
    width = responses.shape[1]
    log_probs = logits[:, prompts.shape[1] - 1 : -1].log_softmax(-1)
    assert log_probs.shape[1] == width
    return log_probs.gather(-1, responses.unsqueeze(-1)).squeeze(-1) * present


def shared_log_probs(model, pack, responses, present) -> torch.Tensor:
    blocked = torch.finfo(torch.float32).min
    mask = torch.where(pack.attention, 0.0, blocked).unsqueeze(1)  # [G, 1, L, L] additive
    logits = model(input_ids=pack.input_ids, attention_mask=mask, position_ids=pack.position_ids).logits
    per_row = pack.row_outputs(logits.log_softmax(-1))  # [B, T_resp, V]
    return per_row.gather(-1, responses.unsqueeze(-1)).squeeze(-1) * present


def grads(model) -> dict[str, torch.Tensor]:
    out = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return out


group_shapes = st.lists(
    st.tuples(st.integers(1, 9), st.lists(st.integers(0, 6), min_size=1, max_size=4)), min_size=1, max_size=3
)


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(groups=group_shapes, seed=st.integers(0, 1000))
def test_shared_prompts_give_the_unshared_log_probs_and_gradients(model, groups, seed):
    prompt_width = max(p for p, _ in groups) + 1  # (at least one pad column)
    response_width = max(max(lengths) for _, lengths in groups) + 1
    prompts, prompt_mask, responses, present, group_ids = rows_of(groups, prompt_width, response_width, seed)
    weights = torch.randn(responses.shape, generator=torch.Generator().manual_seed(seed + 1))

    expected = unshared_log_probs(model, prompts, prompt_mask, responses, present)
    (expected * weights).sum().backward()
    expected_grads = grads(model)

    pack = pack_shared_prompts(prompts, prompt_mask, responses, present, group_ids)
    got = shared_log_probs(model, pack, responses, present)
    (got * weights).sum().backward()
    got_grads = grads(model)

    torch.testing.assert_close(got, expected, rtol=1e-5, atol=2e-6)
    for name, grad in expected_grads.items():
        torch.testing.assert_close(got_grads[name], grad, rtol=1e-4, atol=1e-6, msg=name)
    prompt_tokens = sum(p for p, _ in groups)
    assert pack.tokens_forwarded == prompt_tokens + int(present.sum())
    assert pack.tokens_unshared == int(prompt_mask.sum() + present.sum())


def test_rows_of_one_group_must_share_their_prompt():
    prompts, prompt_mask, responses, present, _ = rows_of([(3, [2]), (4, [2])], 5, 3, seed=0)
    with pytest.raises(ValueError, match="rows 0 and 1 of group 'same' hold different prompts"):
        pack_shared_prompts(prompts, prompt_mask, responses, present, ["same", "same"])
