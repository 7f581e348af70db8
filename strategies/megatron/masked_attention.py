"""Core attention for prompt-shared segments on a GPU (`share_prompts`, strategies/megatron/shared_prompts.py):
torch's FlexAttention with a block mask built from the explicit mask the segments carry, so that blocks no query
of a block may see are skipped and no [sq, sk] score matrix is kept; on a GPU the kernel is compiled (fused).

Megatron's local DotProductAttention materialises the scores and the mask: what runs on CPU (and what the tests
compare against), quadratic in a segment's length on a GPU. `flex_attention_core` is the math (tested on CPU against
a float64 reference and DotProductAttention's math, forward and backward, where FlexAttention runs unfused);
`masked_attention_class()` is DotProductAttention with it for the configurations it expresses.

One difference by design: a query row with every key masked gets zeros here (Megatron's masked softmax spreads it
evenly over all keys). Prompt-shared rows never have one that is read: padding attends to itself, and a position
with no visible key is outside every output and loss.
"""

from __future__ import annotations

import functools

import torch

from roll_backend.strategies.megatron.compiled_layers import compiled, runs_stock_attention

_last_block_mask: list = [None, None]  # (the attention mask it was built from, the block mask): layers share a mask


def block_mask_of(attention_mask: torch.Tensor):
    """FlexAttention's block mask of `attention_mask` [b, 1, sq, sk] bool (True = masked), built once per mask (every
    layer of a micro-batch's forward gets the same tensor)."""
    from torch.nn.attention.flex_attention import create_block_mask

    if _last_block_mask[0] is attention_mask:
        return _last_block_mask[1]
    visible = ~attention_mask[:, 0]
    batch, sq, sk = visible.shape

    def mask_mod(b, h, q_idx, kv_idx):
        return visible[b, q_idx, kv_idx]

    block_mask = create_block_mask(mask_mod, B=batch, H=None, Q_LEN=sq, KV_LEN=sk, device=attention_mask.device)
    _last_block_mask[:] = [attention_mask, block_mask]
    return block_mask


def flex_attention_core(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attention_mask: torch.Tensor, softmax_scale: float
) -> torch.Tensor:
    """Attention of query [sq, b, heads, d] over key/value [sk, b, groups, d] (GQA: each group serves heads / groups
    query heads, as Megatron repeats them) where `attention_mask` [b, 1, sq, sk] is False -> [sq, b, heads * d]."""
    from torch.nn.attention.flex_attention import flex_attention

    sq, batch, heads, head_dim = query.shape
    kernel = compiled(flex_attention) if query.is_cuda else flex_attention  # (unfused on CPU: what the tests run)
    context = kernel(
        query.permute(1, 2, 0, 3),
        key.permute(1, 2, 0, 3),
        value.permute(1, 2, 0, 3),
        block_mask=block_mask_of(attention_mask),
        scale=softmax_scale,
        enable_gqa=heads != key.shape[2],
    )
    return context.permute(2, 0, 1, 3).reshape(sq, batch, heads * head_dim)


@functools.cache
def masked_attention_class():
    """`FlexMaskedAttention`, defined on first use (megatron-core is imported in rank processes only)."""
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    class FlexMaskedAttention(DotProductAttention):
        """Megatron's local core attention through FlexAttention; what `flex_attention_core` does not express
        (compiled_layers.runs_stock_attention) runs DotProductAttention's own forward."""

        def forward(
            self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None, packed_seq_params=None
        ):
            if runs_stock_attention(self, attention_mask, attention_bias, packed_seq_params):
                return super().forward(
                    query, key, value, attention_mask, attn_mask_type, attention_bias, packed_seq_params
                )
            return flex_attention_core(query, key, value, attention_mask, self.softmax_scale)

    return FlexMaskedAttention
