"""torch.compile'd pieces of Megatron's local (non-TransformerEngine) layer spec, for `use_torch_compile`.

The local spec is what runs wherever TransformerEngine does not (CPU, a GPU without TE). Between its GEMMs it
runs unfused ops: the norms' float32 casts and elementwise steps, the scores' float32 masked softmax and its
casts, the SwiGLU halves. On a 2-core CPU those took about half of a bf16 train step
(scripts/profile_megatron_step.py --by-shape). With `use_torch_compile` the Megatron strategies build:

- `CompiledRMSNorm`: the same Hugging Face rounding as `layers.RMSNorm`, compiled;
- `compiled_attention_class()`: DotProductAttention whose scores -> masked softmax -> context runs as one
  compiled function with the same ops and dtypes (configurations it does not express go to Megatron's code);
- the SwiGLU through megatron-core's own `bias_swiglu_impl` (`bias_activation_fusion`; its `jit_fuser` is
  torch.compile).

The math is the eager spec's, so float32 results agree to rounding
(tests/strategies/megatron/test_compiled_layers.py). Compilation happens in each rank process on the first
forward (and first backward) of each kind: seconds with a warm inductor cache, ~20 s cold, once per run; worth
it for long runs, not for a few steps.
"""

from __future__ import annotations

import functools

import torch

from roll_backend.strategies.megatron.layers import RMSNorm, rms_norm


@functools.cache
def compiled(function):
    """`function` compiled once per process, with dynamic shapes (batches and sequence widths vary by step)."""
    return torch.compile(function, dynamic=True)


class CompiledRMSNorm(RMSNorm):
    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return compiled(rms_norm)(hidden_states, self.weight, self.eps)


def attention_core(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor,
    softmax_scale: float,
    softmax_in_fp32: bool,
) -> torch.Tensor:
    """DotProductAttention's math: query [sq, b, heads, d], key/value [sk, b, groups, d], attention_mask
    [b, 1, sq, sk] bool (True = masked) -> context [sq, b, heads * d]."""
    sq, batch, heads, head_dim = query.shape
    sk, groups = key.shape[0], key.shape[2]
    if heads != groups:  # GQA: each K/V group serves heads // groups query heads, as Megatron repeats them
        key = key.repeat_interleave(heads // groups, dim=2)
        value = value.repeat_interleave(heads // groups, dim=2)
    scores = (
        torch.bmm(
            query.reshape(sq, batch * heads, head_dim).transpose(0, 1),
            key.reshape(sk, batch * heads, head_dim).permute(1, 2, 0),
        )
        * softmax_scale
    )
    scores = scores.view(batch, heads, sq, sk)
    if softmax_in_fp32:
        scores = scores.float()
    probs = torch.softmax(scores.masked_fill(attention_mask, -10000.0), dim=-1).to(query.dtype)
    context = torch.bmm(probs.view(batch * heads, sq, sk), value.reshape(sk, batch * heads, head_dim).transpose(0, 1))
    return context.view(batch, heads, sq, head_dim).permute(2, 0, 1, 3).reshape(sq, batch, heads * head_dim)


def runs_stock_attention(attention, attention_mask, attention_bias, packed_seq_params) -> bool:
    """Whether a DotProductAttention call needs Megatron's own forward: what plain masked softmax attention with the
    module's scale does not express (no mask given, attention bias, packed sequences, a softmax offset or scale,
    sliding windows, dropout in training)."""
    softmax = attention.scale_mask_softmax
    return (
        attention_mask is None
        or attention_bias is not None
        or packed_seq_params is not None
        or attention.softmax_offset is not None
        or softmax.scale is not None
        or softmax.window_size is not None
        or (attention.training and attention.config.attention_dropout > 0)
    )


@functools.cache
def compiled_attention_class():
    """`CompiledDotProductAttention`, defined on first use (megatron-core is imported in rank processes only)."""
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    class CompiledDotProductAttention(DotProductAttention):
        """Megatron's local core attention, compiled. What `attention_core` does not express
        (runs_stock_attention) runs DotProductAttention's own forward."""

        def forward(
            self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None, packed_seq_params=None
        ):
            if runs_stock_attention(self, attention_mask, attention_bias, packed_seq_params):
                return super().forward(
                    query, key, value, attention_mask, attn_mask_type, attention_bias, packed_seq_params
                )
            softmax = self.scale_mask_softmax
            softmax_in_fp32 = softmax.input_in_float16 and softmax.softmax_in_fp32
            return compiled(attention_core)(query, key, value, attention_mask, self.softmax_scale, softmax_in_fp32)

    return CompiledDotProductAttention
