"""Context parallelism (CP) for the Megatron strategies: Megatron's load-balanced sequence split, the gathers that
put per-token tensors back into token order, and a CP-capable core attention for the local (non-TE) spec.

Layout (megatron.core.utils.get_batch_on_this_cp_rank): every sequence is cut into 2 x CP equal chunks and CP
rank i holds chunks i and 2CP-1-i, so causal attention costs every rank the same. RoPE follows by itself:
Megatron's RotaryEmbedding slices its frequencies the same way when the CP group has more than one rank.

On a GPU with TransformerEngine, TE's attention does CP itself (the TE spec). megatron-core's local
`DotProductAttention` refuses CP, so `ContextParallelDotProductAttention` (plugged in through the layer spec)
all-gathers K and V over the CP group (reduce-scatter in backward), puts them into token order and runs
Megatron's own attention math with this rank's query rows of the mask.
"""

from __future__ import annotations

import copy
import functools

import torch
import torch.distributed as dist


def cp_group_and_size():
    from megatron.core import parallel_state as mpu

    return mpu.get_context_parallel_group(), mpu.get_context_parallel_world_size()


def slice_for_this_cp_rank(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """This CP rank's chunks of [b, T] tensors (and of the query rows of a [b, 1, T, T] `attention_mask`).

    Uses Megatron's own splitter so the layout is exactly the one its RoPE and MTP roll expect.
    """
    from megatron.core.utils import get_batch_on_this_cp_rank

    return get_batch_on_this_cp_rank(dict(tensors))


def _token_order(chunks_by_rank: list[torch.Tensor], dim: int) -> torch.Tensor:
    """Concatenate every CP rank's local tensor (chunks r and 2CP-1-r along `dim`) into token order."""
    cp = len(chunks_by_rank)
    halves = [t.chunk(2, dim=dim) for t in chunks_by_rank]
    ordered = [halves[r][0] for r in range(cp)] + [halves[r][1] for r in reversed(range(cp))]
    return torch.cat(ordered, dim=dim)


def _own_chunks(full: torch.Tensor, dim: int, rank: int, cp: int) -> torch.Tensor:
    """The inverse of `_token_order` for one rank: its chunks `rank` and 2CP-1-rank of a token-ordered tensor."""
    chunks = full.chunk(2 * cp, dim=dim)
    return torch.cat([chunks[rank], chunks[2 * cp - 1 - rank]], dim=dim).contiguous()


def _all_gather(local: torch.Tensor, group) -> list[torch.Tensor]:
    gathered = [torch.empty_like(local) for _ in range(dist.get_world_size(group))]
    dist.all_gather(gathered, local.contiguous(), group=group)
    return gathered


class _GatherSequence(torch.autograd.Function):
    """All-gather CP-local tensors into token order along `dim`.

    Backward: with `sum_grads`, every rank's gradient for the gathered tensor is summed before this rank takes
    its chunks (a reduce-scatter: K/V are used by every rank's queries). Without it each rank takes its chunks
    of its own gradient (the gathered tensor feeds a computation every CP rank repeats identically, such as the
    loss, and the gradients are summed over CP later by DDP).
    """

    @staticmethod
    def forward(ctx, local: torch.Tensor, dim: int, group, sum_grads: bool) -> torch.Tensor:
        ctx.dim, ctx.group, ctx.sum_grads = dim, group, sum_grads
        return _token_order(_all_gather(local, group), dim)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        grad = grad.contiguous()
        rank, cp = dist.get_rank(ctx.group), dist.get_world_size(ctx.group)
        if ctx.sum_grads:
            # Rank-ordered so a reduce-scatter hands each rank its own chunks; gloo has no reduce_scatter.
            by_rank = torch.cat([_own_chunks(grad, ctx.dim, r, cp) for r in range(cp)], dim=ctx.dim)
            if dist.get_backend(ctx.group) == "nccl" and ctx.dim == 0:
                mine = torch.empty_like(by_rank.chunk(cp, dim=0)[0])
                dist.reduce_scatter_tensor(mine, by_rank, group=ctx.group)
                return mine, None, None, None
            dist.all_reduce(by_rank, group=ctx.group)
            return by_rank.chunk(cp, dim=ctx.dim)[rank].contiguous(), None, None, None
        return _own_chunks(grad, ctx.dim, rank, cp), None, None, None


def gather_sequence(local: torch.Tensor, dim: int, sum_grads: bool = False) -> torch.Tensor:
    """CP-local tensor -> the whole sequence in token order (identity at CP=1); differentiable."""
    group, size = cp_group_and_size()
    if size == 1:
        return local
    if local.shape[dim] % 2:
        raise ValueError(f"a CP-local tensor holds two equal chunks along dim {dim}; got length {local.shape[dim]}")
    return _GatherSequence.apply(local, dim, group, sum_grads)


@functools.cache
def context_parallel_attention_class(base: type):
    """`ContextParallelDotProductAttention` over `base` (megatron-core's DotProductAttention or a subclass with
    the same interface), defined on first use (megatron-core is imported in rank processes only)."""

    class ContextParallelDotProductAttention(base):
        """Megatron's local core attention with K/V all-gathered over the CP group.

        query: [s/CP, b, heads, d] (this rank's two chunks); key/value: [s/CP, b, groups, d];
        attention_mask: [b, 1, s/CP, s], this rank's query rows (sliced with the batch) over all keys in token
        order. At CP=1 it is exactly DotProductAttention.
        """

        def __init__(self, config, *args, **kwargs):
            # DotProductAttention refuses CP only because it would attend within the local chunks; this class
            # gathers K/V first, so build it from a view of the config with CP 1 and keep the real config.
            local_view = copy.copy(config)
            local_view.context_parallel_size = 1
            super().__init__(local_view, *args, **kwargs)
            self.config = config

        def forward(self, query, key, value, attention_mask, *args, **kwargs):
            key = gather_sequence(key, dim=0, sum_grads=True)
            value = gather_sequence(value, dim=0, sum_grads=True)
            return super().forward(query, key, value, attention_mask, *args, **kwargs)

    return ContextParallelDotProductAttention
