"""Start torch.distributed and the rank grid in a rank process (Megatron's parallel state for the roles that run a
Megatron model; TP blocks of consecutive ranks for an engine or plain code); describe a rank's coordinates."""

from __future__ import annotations

import datetime
import os
import sys
import warnings

import torch
import torch.distributed as dist

from roll_backend.distributed.layout import ParallelLayout, RankCoords


def tp_only_coords(rank: int, world_size: int, tp: int) -> RankCoords:
    """A rank's coordinates in a TP-only grid over the same ranks (consecutive ranks form a TP group, as vLLM lays out
    an engine started on an existing process group): a rollout engine sharing the trainer's ranks (hybrid)."""
    if tp < 1 or world_size % tp:
        raise ValueError(f"an engine at tp={tp} cannot tile {world_size} ranks; choose a tp that divides {world_size}")
    return RankCoords(rank, world_size, rank // tp, rank % tp, 0, 0, world_size // tp, tp, 1, 1)


def pick_device(use_gpu: bool) -> str:
    if use_gpu and not torch.cuda.is_available():
        raise RuntimeError("this role asks for GPUs but torch.cuda is not available in the worker")
    return "cuda" if use_gpu else "cpu"


def rendezvous_store(timeout_s: float = 600.0) -> tuple[dist.TCPStore, str, int]:
    """Rank 0's store, where its group's ranks meet: (the store, this node's address, its port). The port is the one
    the OS gave the store's own socket, held from then on (a free port found first and bound later can be taken in
    between by any other process on the node: EADDRINUSE at start-up)."""
    import ray

    address = ray.util.get_node_ip_address() if ray.is_initialized() else "127.0.0.1"
    store = dist.TCPStore(
        address, 0, is_master=True, wait_for_workers=False, timeout=datetime.timedelta(seconds=timeout_s)
    )
    return store, address, store.port


def init_distributed(
    rank: int,
    world_size: int,
    master_addr: str,
    master_port: int,
    layout: ParallelLayout,
    device: str,
    timeout_s: float = 600.0,
    store: dist.Store | None = None,
    megatron_grid: bool = True,
) -> RankCoords:
    """Join the role's process group (NCCL on cuda, gloo on cpu) and lay out its grid: Megatron's parallel state, or
    without `megatron_grid` (a role that runs no Megatron model: it then never imports megatron-core, seconds of a
    core per rank) TP blocks of consecutive ranks. Rank 0 passes the store it serves (`rendezvous_store`); the others
    reach it at master_addr:master_port."""
    os.environ.update(
        RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_RANK="0" if device == "cpu" else os.environ.get("LOCAL_RANK", "0"),
        MASTER_ADDR=master_addr,
        MASTER_PORT=str(master_port),
    )
    # megatron-core 0.16 calls the collectives torch 2.13 renamed; the warning repeats every step on every rank.
    warnings.filterwarnings(
        "ignore", message=r".*is deprecated\. Please use `torch\.distributed\.", category=FutureWarning
    )
    _prepare_process(device, megatron_grid)
    if store is None:  # (every rank brings a store: a tcp:// client would wait for a count rank 0's store never adds)
        store = dist.TCPStore(
            master_addr,
            master_port,
            is_master=False,
            wait_for_workers=False,
            timeout=datetime.timedelta(seconds=timeout_s),
        )
    dist.init_process_group(
        backend="nccl" if device == "cuda" else "gloo",
        store=store,
        rank=rank,
        world_size=world_size,
        timeout=datetime.timedelta(seconds=timeout_s),
    )
    if not megatron_grid:
        return _init_tp_blocks(rank, world_size, layout)
    return _init_megatron_grid(world_size, layout, timeout_s)


def _prepare_process(device: str, megatron_grid: bool) -> None:
    """Before the process group: on CPU, the gloo and (for a Megatron role) megatron-core compatibility patches; on
    GPU, this rank's device."""
    if megatron_grid:
        _import_megatron_core()
    if device == "cpu":
        from roll_backend.patches import gloo_shared_device

        gloo_shared_device.apply()
        if megatron_grid:
            from roll_backend.patches import megatron_cpu

            megatron_cpu.apply()
    else:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))


def _init_megatron_grid(world_size: int, layout: ParallelLayout, timeout_s: float) -> RankCoords:
    from megatron.core import parallel_state as mpu

    problems = layout.expert_problems(world_size)
    if problems:
        raise ValueError("; ".join(problems) + ".")
    mpu.initialize_model_parallel(
        tensor_model_parallel_size=layout.tp,
        expert_model_parallel_size=layout.ep,
        expert_tensor_parallel_size=layout.etp,
        pipeline_model_parallel_size=layout.pp,
        virtual_pipeline_model_parallel_size=layout.vpp,
        context_parallel_size=layout.cp,
        distributed_timeout_minutes=max(1, int(timeout_s // 60)),
    )
    return current_coords()


# What megatron-core imports if installed though no rank uses it: ranks never log (the driver does).
_TRACKERS_RANKS_SKIP = ("wandb", "torch.utils.tensorboard")


def _import_megatron_core() -> None:
    """Import megatron-core without the experiment trackers it reaches for at import (wandb, tensorboard: ~0.5 s of a
    core per rank); they stay importable afterwards."""
    if "megatron.core" in sys.modules:
        return
    blocked = [name for name in _TRACKERS_RANKS_SKIP if name not in sys.modules]
    sys.modules.update(dict.fromkeys(blocked))  # (None: `import` raises ImportError, which megatron-core expects)
    try:
        import megatron.core  # noqa: F401
    finally:
        for name in blocked:
            sys.modules.pop(name, None)


# The TP blocks of a rank without Megatron's grid: {"tp": its block's ranks, "group": that block's process group}.
_tp_block: dict | None = None


def _init_tp_blocks(rank: int, world_size: int, layout: ParallelLayout) -> RankCoords:
    """Consecutive ranks form a TP group (as vLLM lays out an engine over an existing process group); every rank
    creates every block's group (torch.distributed's rule for new_group)."""
    global _tp_block
    if layout.pp != 1 or layout.cp != 1 or layout.vpp is not None or layout.ep != 1 or layout.etp is not None:
        raise ValueError(
            "a role that runs no Megatron model lays its ranks out in TP blocks only; its layout has "
            f"{layout.describe()}: set pp=1, cp=1, vpp=null, ep=1 and no etp"
        )
    coords = tp_only_coords(rank, world_size, layout.tp)
    for start in range(0, world_size, layout.tp):
        ranks = list(range(start, start + layout.tp))
        group = dist.new_group(ranks) if layout.tp > 1 else None
        if rank in ranks:
            _tp_block = {"tp": ranks, "group": group}
    return coords


def tp_block_group_ranks(rank: int, world_size: int, tp: int) -> dict[str, list[int]]:
    """A rank's groups (as `group_ranks` names them) in TP blocks of consecutive ranks: what Megatron's grid gives a
    TP-only layout (no pp/cp/ep split), computed without it."""
    coords = tp_only_coords(rank, world_size, tp)
    block = list(range(coords.dp * tp, (coords.dp + 1) * tp))
    dp = list(range(coords.tp, world_size, tp))
    return {"tp": block, "pp": [rank], "dp": dp, "cp": [rank], "tp_cp": block, "ep": [rank], "etp": block, "edp": dp}


def current_coords() -> RankCoords:
    from megatron.core import parallel_state as mpu

    return RankCoords(
        rank=dist.get_rank(),
        world_size=dist.get_world_size(),
        dp=mpu.get_data_parallel_rank(),
        tp=mpu.get_tensor_model_parallel_rank(),
        pp=mpu.get_pipeline_model_parallel_rank(),
        cp=mpu.get_context_parallel_rank(),
        dp_size=mpu.get_data_parallel_world_size(),
        tp_size=mpu.get_tensor_model_parallel_world_size(),
        pp_size=mpu.get_pipeline_model_parallel_world_size(),
        cp_size=mpu.get_context_parallel_world_size(),
    )


def group_ranks() -> dict[str, list[int]]:
    """Global ranks of this rank's tp, pp, dp, cp, tp x cp and expert (ep, etp, expert-dp) groups."""
    if _tp_block is not None:
        return tp_block_group_ranks(dist.get_rank(), dist.get_world_size(), len(_tp_block["tp"]))
    from megatron.core import parallel_state as mpu

    groups = {
        "tp": mpu.get_tensor_model_parallel_group(),
        "pp": mpu.get_pipeline_model_parallel_group(),
        "dp": mpu.get_data_parallel_group(),
        "cp": mpu.get_context_parallel_group(),
        "tp_cp": mpu.get_tensor_and_context_parallel_group(),
        "ep": mpu.get_expert_model_parallel_group(),
        "etp": mpu.get_expert_tensor_parallel_group(),
        "edp": mpu.get_expert_data_parallel_group(),
    }
    return {name: sorted(dist.get_process_group_ranks(group)) for name, group in groups.items()}


def batch_broadcast_hops(coords: RankCoords) -> list[dist.ProcessGroup]:
    """The groups the in-actor broadcast crosses, in order: TP x CP (from pp0's tp0/cp0, which got the batch
    from the controller), then PP (from the first stage), so every stage holds labels, masks and MTP inputs.
    A rank takes part in the hops of the groups it belongs to; an empty list when it is alone in both."""
    if _tp_block is not None:
        return [_tp_block["group"]] if coords.tp_size > 1 else []
    from megatron.core import parallel_state as mpu

    hops = []
    if coords.tp_size * coords.cp_size > 1 and coords.pp == 0:
        hops.append(mpu.get_tensor_and_context_parallel_group())
    if coords.pp_size > 1:
        hops.append(mpu.get_pipeline_model_parallel_group())
    return hops


def every_rank_agrees(yes: bool, device: str) -> bool:
    """Whether every rank of the world says yes (a collective: every rank calls it)."""
    flag = torch.tensor([int(yes)], device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    return bool(flag.item())


def destroy_distributed() -> None:
    """Leave the process groups and Megatron's parallel state (a pooled process then joins another group's)."""
    global _tp_block
    if _tp_block is None and "megatron.core.parallel_state" in sys.modules:
        from megatron.core import parallel_state as mpu

        mpu.destroy_model_parallel()
    _tp_block = None
    if dist.is_initialized():
        dist.destroy_process_group()
