"""The compiled pieces of `use_torch_compile` (models/compiled_layers.py) against their eager definitions and
Hugging Face's, forward and backward in float32, with GQA and a causal + padding mask. Whole models with them
are checked at CP2 against transformers and TP1 in tests/strategies/test_megatron_layouts.py."""

from __future__ import annotations

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
