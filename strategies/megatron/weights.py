"""Full HF-named weights of a Megatron model on every rank (gathered over TP and EP, broadcast over PP), one tensor
at a time or in buckets: what the rollout's weight sync and the HF checkpoint export read."""

from __future__ import annotations

import functools
from collections.abc import Iterator

import torch
import torch.distributed as dist

from roll_backend.strategies.megatron import convert
from roll_backend.strategies.megatron.builder import HFArch, unwrap


def _all_gather_tp(shard: torch.Tensor) -> list[torch.Tensor]:
    from megatron.core import parallel_state as mpu

    return _all_gather(shard, mpu.get_tensor_model_parallel_group())


def _expert_gathers() -> dict:
    """iter_stage_hf_tensors' gathers over the expert-tensor-parallel and expert-parallel groups."""
    from megatron.core import parallel_state as mpu

    return dict(
        all_gather_etp=functools.partial(_all_gather, group=mpu.get_expert_tensor_parallel_group()),
        all_gather_ep=functools.partial(_all_gather, group=mpu.get_expert_model_parallel_group()),
        ep_size=mpu.get_expert_model_parallel_world_size(),
    )


def _all_gather(shard: torch.Tensor, group) -> list[torch.Tensor]:
    size = dist.get_world_size(group)
    if size == 1:
        return [shard]
    shards = [torch.empty_like(shard) for _ in range(size)]
    dist.all_gather(shards, shard.contiguous(), group=group)
    return shards


def iter_full_hf_tensors(
    chunks: list, arch: HFArch, include_mtp: bool = False, include_value_head: bool = False
) -> Iterator[tuple[str, torch.Tensor]]:
    """Every HF-named tensor of the whole model, in HF layer order, on every rank (gathered over TP, broadcast
    over PP); MTP layers (`model.mtp_layers.*`) only with `include_mtp`, a value head (as a sequence classifier's
    `score.weight`) only with `include_value_head`. With interleaved stages layers run virtual stage by virtual
    stage: chunk 0 of every PP rank, then chunk 1 of every PP rank, and so on."""
    from megatron.core import parallel_state as mpu

    chunks = [unwrap(chunk) for chunk in chunks]
    pp_group = mpu.get_pipeline_model_parallel_group()
    pp_size, pp_rank = mpu.get_pipeline_model_parallel_world_size(), mpu.get_pipeline_model_parallel_rank()
    tp_size = mpu.get_tensor_model_parallel_world_size()
    experts = _expert_gathers()
    included = dict(include_mtp=include_mtp, include_value_head=include_value_head)
    if pp_size == 1:
        for chunk in chunks:
            yield from convert.iter_stage_hf_tensors(chunk, arch, _all_gather_tp, **experts, **included)
        return
    metadata = [None] * pp_size
    local_meta = [
        convert.stage_hf_metadata(
            chunk, arch, tp_size, mpu.get_expert_tensor_parallel_world_size(), experts["ep_size"], **included
        )
        for chunk in chunks
    ]
    dist.all_gather_object(metadata, local_meta, group=pp_group)
    device = next(chunks[0].parameters()).device
    for vp_stage, stage in ((v, s) for v in range(len(chunks)) for s in range(pp_size)):
        stage_meta = metadata[stage][vp_stage]
        source = dist.get_global_rank(pp_group, stage)
        local = (
            convert.iter_stage_hf_tensors(chunks[vp_stage], arch, _all_gather_tp, **experts, **included)
            if stage == pp_rank
            else None
        )
        for name, shape, dtype in stage_meta:
            if local is not None:
                local_name, tensor = next(local)
                assert local_name == name, (local_name, name)
                tensor = tensor.contiguous()
            else:
                tensor = torch.empty(shape, dtype=dtype, device=device)
            dist.broadcast(tensor, src=source, group=pp_group)
            yield name, tensor
            del tensor  # (else it stays alive while this stage's next parameter is gathered)


def bucketed(
    named_tensors: Iterator[tuple[str, torch.Tensor]], bucket_bytes: int
) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """Group (name, tensor) pairs into lists of at most `bucket_bytes` (a larger tensor is a bucket alone). A full
    bucket goes out at once, not when the next tensor arrives (by then the next parameter has been gathered beside it),
    and its list is emptied once the next one is asked for: a consumer's loop variable would otherwise keep the
    previous bucket's tensors (full gathered weights, on the device) alive while the next bucket is gathered."""
    bucket, size = [], 0
    for name, tensor in named_tensors:
        nbytes = tensor.numel() * tensor.element_size()
        if bucket and size + nbytes > bucket_bytes:
            yield bucket
            bucket.clear()
            size = 0
        bucket.append((name, tensor))
        size += nbytes
        del tensor  # (the loop variable would hold it while the next parameter is made)
        if size >= bucket_bytes:
            yield bucket
            bucket.clear()
            size = 0
    if bucket:
        yield bucket
        bucket.clear()
