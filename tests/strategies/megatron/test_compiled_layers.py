"""The compiled pieces of `use_torch_compile` (models/compiled_layers.py) against their eager definitions and
Hugging Face's, forward and backward in float32, with GQA and a causal + padding mask. Whole models with them
are checked at CP2 against transformers and TP1 in tests/strategies/test_megatron_layouts.py."""

from __future__ import annotations

import pytest
import torch
from transformers.models.qwen2.modeling_qwen2 import Qwen2RMSNorm

from roll_backend.strategies.megatron.compiled_layers import attention_core, compiled
from roll_backend.strategies.megatron.layers import rms_norm


def _grads(function, *inputs) -> tuple[torch.Tensor, list[torch.Tensor]]:
    inputs = [x.detach().clone().requires_grad_(x.is_floating_point()) for x in inputs]
    out = function(*inputs)
    out.backward(torch.linspace(-1, 1, out.numel()).view_as(out))
    return out.detach(), [x.grad for x in inputs if x.grad is not None]


def test_compiled_rms_norm_equals_eager_and_hugging_face():
    gen = torch.Generator().manual_seed(0)
    hidden, weight = torch.randn(5, 3, 16, generator=gen), 1 + 0.1 * torch.randn(16, generator=gen)
    hf = Qwen2RMSNorm(16, eps=1e-6)
    hf.weight.data.copy_(weight)
    expected, expected_grads = _grads(lambda h, w: rms_norm(h, w, 1e-6), hidden, weight)
    torch.testing.assert_close(expected, hf(hidden).detach(), rtol=0, atol=0)
    actual, actual_grads = _grads(lambda h, w: compiled(rms_norm)(h, w, 1e-6), hidden, weight)
    torch.testing.assert_close(actual, expected, rtol=1e-5, atol=1e-6)
    for got, want in zip(actual_grads, expected_grads, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def _reference_attention(query, key, value, mask, scale):
    """Softmax attention written out per head in float64 (keys repeated per query group; masked scores set to
    -10000 as Megatron does, so a padding query with every key masked attends to all keys equally)."""
    heads, groups = query.shape[2], key.shape[2]
    q, k, v = (t.double().permute(1, 2, 0, 3) for t in (query, key, value))  # [b, heads, s, d]
    k, v = k.repeat_interleave(heads // groups, 1), v.repeat_interleave(heads // groups, 1)
    scores = (q @ k.transpose(-1, -2) * scale).masked_fill(mask, -10000.0)
    context = torch.softmax(scores, -1) @ v  # [b, heads, sq, d]
    return context.permute(2, 0, 1, 3).reshape(query.shape[0], query.shape[1], -1).float()


def test_compiled_attention_core_equals_eager_and_a_float64_reference():
    gen = torch.Generator().manual_seed(1)
    seq, batch, heads, groups, dim = 7, 3, 4, 2, 8
    query = torch.randn(seq, batch, heads, dim, generator=gen)
    key, value = (
        torch.randn(seq, batch, groups, dim, generator=gen),
        torch.randn(seq, batch, groups, dim, generator=gen),
    )
    padding = torch.tensor([[0] * 7, [1, 1, 0, 0, 0, 0, 0], [0] * 5 + [1, 1]], dtype=torch.bool)  # left and right
    mask = torch.ones(seq, seq, dtype=torch.bool).triu(1)[None, None] | padding[:, None, None, :]
    scale = dim**-0.5
    expected = _reference_attention(query, key, value, mask, scale)
    eager, eager_grads = _grads(lambda q, k, v, m: attention_core(q, k, v, m, scale, False), query, key, value, mask)
    torch.testing.assert_close(eager, expected, rtol=1e-5, atol=1e-5)
    actual, actual_grads = _grads(
        lambda q, k, v, m: compiled(attention_core)(q, k, v, m, scale, False), query, key, value, mask
    )
    torch.testing.assert_close(actual, eager, rtol=1e-5, atol=1e-5)
    for got, want in zip(actual_grads, eager_grads, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert [g.shape for g in actual_grads] == [query.shape, key.shape, value.shape]


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")  # (unfused on CPU, as intended)
@pytest.mark.parametrize("query_rows", ["all", "cp_rank"])
def test_flex_attention_core_equals_the_dense_core_on_a_shared_prompt_mask(query_rows):
    """masked_attention.flex_attention_core (share_prompts' attention on a GPU; unfused here) against the float64
    reference and the dense core, with GQA and the mask of two prompt-shared segments (prompt once, each response
    seeing it, its own tail copy and its own earlier tokens; padding seeing itself); with a CP rank's query rows over
    every key too. Forward only: FlexAttention has no backward on CPU (the gpu(1) check of test_shared_prompts.py
    trains through it)."""
    from roll_backend.strategies.megatron.masked_attention import flex_attention_core
    from roll_backend.strategies.megatron.shared_prompts import lay_out, shared_segments

    gen = torch.Generator().manual_seed(2)
    prompts = torch.tensor([[0, 5, 6, 7], [0, 5, 6, 7], [0, 5, 6, 7], [9, 8, 7, 6], [9, 8, 7, 6]])
    prompt_mask = torch.tensor([[0, 1, 1, 1]] * 3 + [[1, 1, 1, 1]] * 2)
    responses = torch.randint(3, 20, (5, 3), generator=gen)
    present = torch.tensor([[1, 1, 0], [1, 1, 1], [1, 0, 0], [1, 1, 1], [1, 1, 0]])
    ids, mask = torch.cat([prompts, responses], 1), torch.cat([prompt_mask, present], 1)
    segments, _ = shared_segments(ids, mask, 3, tail=2)
    layout = lay_out(ids, mask, 3, [segments], 32)  # both segments in one row, padding after them
    blocked = ~layout.visible[:, None].repeat(2, 1, 1, 1)  # [b=2, 1, 32, 32]
    rows = slice(None) if query_rows == "all" else torch.cat([torch.arange(0, 8), torch.arange(24, 32)])
    blocked = blocked[:, :, rows]
    seq, heads, groups, dim = 32, 4, 2, 16
    query = torch.randn(seq, 2, heads, dim, generator=gen)[rows]
    key, value = torch.randn(seq, 2, groups, dim, generator=gen), torch.randn(seq, 2, groups, dim, generator=gen)
    scale = dim**-0.5
    expected = _reference_attention(query, key, value, blocked, scale)
    with torch.no_grad():
        dense = attention_core(query, key, value, blocked, scale, False).float()
        flex = flex_attention_core(query, key, value, blocked, scale)
    torch.testing.assert_close(dense, expected, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(flex, expected, rtol=1e-5, atol=1e-5)
    assert not blocked.all(-1).any()  # (no query row with every key masked: where the two cores differ by design)
