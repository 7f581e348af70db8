"""Prompt sharing (share_prompts) vs unshared rows: the reference, old-log-prob and train phases of a GRPO step.

The 14.7M Qwen2-style model of bench/grpo_step.py on one Megatron rank (a real Ray group, the same ranks for both
modes): --groups groups of --n samples, each a --prompt-token prompt (512) and a --response-token response (64; the
lengths of a group's responses drawn between half and all of it). A step's Megatron phases: the reference's and the
old policy's log-probs (forward-only passes of the model; a run's reference is another copy of it on the same ranks)
and one train step over the batch. Micro-batches of --n rows (one group each), in both modes. The learning rate is 0,
so both modes' steps see the same weights: equal log-probs and losses (to float rounding) show they compute the same.
In bf16 where the CPU has it natively, else float32 (bench/_machine.py; --dtype). `--gpus 1` runs the rank on a
GPU (the same local-spec attention with its explicit mask; tests/strategies/megatron/test_shared_prompts.py's gpu(1)
check runs it so and requires the shared log-probs to match within bf16 rounding).
Run: .venv/bin/python bench/shared_prompts.py [--groups 4] [--n 16] [--prompt 512] [--response 64] [--repeats 2]
     [--dtype auto|bfloat16|float32] [--gpus 0|1] [--max-gap X]
Last line: `shared vs unshared prompts: Nx (tokens forwarded: Mx fewer)`.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from pathlib import Path

import torch
from _machine import add_dtype_option, announce
from grpo_step import FULL

MODEL = FULL.model  # bench/grpo_step.py's 14.7M model


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--groups", type=int, default=4, help="prompts, each with --n samples")
    parser.add_argument("--n", type=int, default=16, help="samples per prompt")
    parser.add_argument("--prompt", type=int, default=512, help="prompt tokens")
    parser.add_argument("--response", type=int, default=64, help="most response tokens")
    parser.add_argument("--repeats", type=int, default=2, help="timed repeats per mode (the fastest counts)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--gpus", type=int, default=0, help="1: the rank on a GPU")
    parser.add_argument("--max-gap", type=float, default=None, help="exit 1 when the log-probs differ by more")
    add_dtype_option(parser)
    return parser.parse_args()


def grpo_batch(args, vocab_size: int) -> dict[str, torch.Tensor]:
    """--groups prompts of --prompt tokens, --n responses each of --response / 2 .. --response tokens."""
    from roll_backend import keys
    from roll_backend.protocol.sequences import sequence_columns

    gen = torch.Generator().manual_seed(args.seed)
    rows = args.groups * args.n
    prompts = torch.randint(3, vocab_size, (args.groups, args.prompt), generator=gen).repeat_interleave(args.n, 0)
    lengths = torch.randint(args.response // 2, args.response + 1, (rows,), generator=gen)
    response_mask = (torch.arange(args.response)[None] < lengths[:, None]).long()
    responses = torch.randint(3, vocab_size, (rows, args.response), generator=gen) * response_mask
    return {
        **sequence_columns(prompts, torch.ones_like(prompts), responses, response_mask),
        keys.RESPONSE_MASK: response_mask,
        keys.ADVANTAGES: torch.randn(rows, args.response, generator=gen),
    }


def run_phases(group, tensors: dict, old_log_probs: torch.Tensor | None) -> tuple[float, dict, dict]:
    """(seconds, outputs, metrics) of the reference's and the old policy's log-probs and one train step."""
    from roll_backend import keys
    from roll_backend.protocol import DataProto
    from roll_backend.workers.actor import ActorWorker

    start = time.perf_counter()
    reference = group.call(ActorWorker.compute_log_probs, DataProto.from_dict(tensors=tensors))
    old = group.call(ActorWorker.compute_log_probs, DataProto.from_dict(tensors=tensors))
    old_log_probs = old.batch[keys.LOG_PROBS] if old_log_probs is None else old_log_probs
    batch = DataProto.from_dict(tensors={**tensors, keys.OLD_LOG_PROBS: old_log_probs})
    metrics = group.call(ActorWorker.train_step, batch)[0]
    seconds = time.perf_counter() - start
    forwarded = sum(out.meta_info[keys.META_METRICS][keys.METRIC_TOKENS_FORWARDED][0] for out in (reference, old))
    forwarded += metrics[keys.METRIC_TOKENS_FORWARDED]
    return seconds, {"log_probs": old.batch[keys.LOG_PROBS]}, {**metrics, "forwarded": forwarded}


def main() -> None:
    args = parse_args()
    dtype = announce(args.dtype)

    import ray

    from roll_backend import keys
    from roll_backend.distributed.ray_env import init_local_ray
    from roll_backend.distributed.worker_group import RankResources, WorkerGroup
    from roll_backend.models.tiny import TinyModelSpec, build_tiny_model
    from roll_backend.strategies.megatron.config import MegatronTrainConfig, OptimizerSettings
    from roll_backend.workers.actor import ActorConfig, ActorWorker

    work = Path(tempfile.mkdtemp(prefix="shared_prompts_"))
    model_dir = str(build_tiny_model(work / "model", TinyModelSpec(seed=0, **MODEL)))
    tensors = grpo_batch(args, MODEL["vocab_size"])
    print(
        f"batch: {args.groups} prompts of {args.prompt} tokens x {args.n} responses of {args.response // 2}.."
        f"{args.response} tokens ({int(tensors[keys.ATTENTION_MASK].sum())} tokens unshared); micro-batches of "
        f"{args.n} rows; {dtype}"
    )
    init_local_ray(num_cpus=8, env_vars={"OMP_NUM_THREADS": str(os.cpu_count() or 1)})
    seconds, outputs, metrics = {}, {}, {}
    group = None
    try:
        for mode in ("unshared", "shared"):
            strategy = MegatronTrainConfig(
                model_path=model_dir,
                micro_batch_size=args.n,
                params_dtype=dtype,
                compute_entropy=False,
                share_prompts=mode == "shared",
                optimizer=OptimizerSettings(lr=0.0, weight_decay=0.0),
            )
            config = ActorConfig(strategy=strategy)
            resources = RankResources(num_cpus=1, num_gpus=args.gpus)
            group = WorkerGroup(ActorWorker, "actor_train", 1, resources=resources, worker_config=config)
            group.call(ActorWorker.init_model)
            small = {k: v[: args.n] for k, v in tensors.items()}
            run_phases(group, small, None)  # warm-up: kernels and allocator
            old = outputs["unshared"]["log_probs"] if mode == "shared" else None
            runs = [run_phases(group, tensors, old) for _ in range(args.repeats)]
            seconds[mode], outputs[mode], metrics[mode] = min(runs, key=lambda run: run[0])
            group.shutdown()
            group = None
            print(
                f"{mode}: {seconds[mode]:.1f}s (reference + old log-probs + train step), "
                f"{int(metrics[mode]['forwarded'])} tokens forwarded, loss {metrics[mode]['loss']:.6f}, "
                f"grad_norm {metrics[mode]['grad_norm']:.5f}",
                flush=True,
            )
    finally:
        if group is not None:
            group.shutdown()
        ray.shutdown()
    mask = tensors[keys.RESPONSE_MASK].bool()
    gap = float((outputs["shared"]["log_probs"] - outputs["unshared"]["log_probs"]).abs()[mask].max())
    print(f"log-probs shared vs unshared: max gap {gap:.1e}; load average after: {os.getloadavg()[0]:.1f}")
    print(
        f"shared vs unshared prompts: {seconds['unshared'] / seconds['shared']:.1f}x "
        f"(tokens forwarded: {metrics['unshared']['forwarded'] / metrics['shared']['forwarded']:.1f}x fewer)"
    )
    if args.max_gap is not None and not gap <= args.max_gap:
        raise SystemExit(f"FAIL: shared log-probs differ from unshared by {gap:.1e} > {args.max_gap:g}")


if __name__ == "__main__":
    main()
