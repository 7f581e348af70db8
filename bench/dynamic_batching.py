"""Token-budget micro-batches and sequence packing vs fixed micro-batches: compute_log_probs + one train_step.

The 14.7M Qwen2-style model of bench/grpo_step.py on one Megatron actor rank (a real Ray group),
256 sequences of a 64-token prompt and a response whose length is drawn (seeded) from a long-tailed
log-normal between 16 and 1024 tokens (median near 100). Each mode runs on the same group in the same run:
fixed micro-batches of --micro-batch rows (the batch padded to its longest response), token-budget
micro-batches of at most --micro-batch x (64 + 1024) padded tokens, and packing into rows of --pack-tokens
tokens (one packed row per micro-batch: the local spec's attention is dense over a packed row, so its cost
and memory grow with the square of the row length).
The learning rate is 0 so every mode's train step sees the same weights: equal losses (to bf16 rounding in bf16) show
that all three compute the same thing.
In bf16 where the CPU has it natively, else float32 (bench/_machine.py; --dtype). Without --sequences the run
takes the README's 256 sequences when a GEMM probe and the model's FLOPs say they fit in --minutes (default 5) on
this machine, else the most that fit (a smaller batch has a shorter longest response, so its ratio is not the
README's); it prints which.
Run: .venv/bin/python bench/dynamic_batching.py [--sequences 256] [--minutes 5] [--micro-batch 8] [--pack-tokens 2048]
     [--repeats 1] [--dtype auto|bfloat16|float32]
Last line: `token budget vs fixed micro-batches: Nx (packing: Mx)`.
"""

from __future__ import annotations

import argparse
import math
import os
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from _machine import add_dtype_option, announce

PROMPT_LEN, MIN_RESPONSE, MAX_RESPONSE, MEDIAN_RESPONSE = 64, 16, 1024, 100
FULL_SEQUENCES = 256  # the README's run
MODEL = dict(
    hidden_size=512,
    num_hidden_layers=6,
    intermediate_size=1024,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=512,
)  # bench/grpo_step.py's FULL model
# Model FLOPs over the GEMM probe's peak that one rank reached here (bf16, 2 cores: fixed 39.6 TFLOP in 115 s at
# 892 GFLOP/s, 0.39; budget 0.39; packing 0.34): what the time estimate assumes.
ASSUMED_EFFICIENCY = 0.35


def response_lengths(count: int, seed: int) -> np.ndarray:
    """Log-normal lengths (median MEDIAN_RESPONSE, a long right tail) clipped to [MIN_RESPONSE, MAX_RESPONSE];
    the first n of a larger count are the n of a smaller one."""
    rng = np.random.default_rng(seed)
    return np.clip(rng.lognormal(np.log(MEDIAN_RESPONSE), 1.0, count), MIN_RESPONSE, MAX_RESPONSE).astype(int)


def rl_batch(lengths: np.ndarray, vocab_size: int, seed: int) -> dict[str, torch.Tensor]:
    """64-token prompts, right-padded responses of `lengths`, random advantages and old log-probs."""
    from roll_backend import keys
    from roll_backend.protocol.sequences import sequence_columns

    gen = torch.Generator().manual_seed(seed)
    rows, width = len(lengths), MAX_RESPONSE
    prompts = torch.randint(3, vocab_size, (rows, PROMPT_LEN), generator=gen)
    responses = torch.randint(3, vocab_size, (rows, width), generator=gen)
    response_mask = (torch.arange(width)[None] < torch.as_tensor(lengths)[:, None]).long()
    responses = responses * response_mask
    prompt_mask = torch.ones(rows, PROMPT_LEN, dtype=torch.long)
    return {
        **sequence_columns(prompts, prompt_mask, responses, response_mask),
        keys.RESPONSE_MASK: response_mask,
        keys.ADVANTAGES: torch.randn(rows, width, generator=gen),
    }


def estimated_seconds(lengths: np.ndarray, pack_tokens: int, repeats: int, gflops: float) -> float:
    """The three modes' log-probs + train step (4 forwards' FLOPs) at ASSUMED_EFFICIENCY of `gflops`: fixed
    micro-batches over every row at the longest length, the token budget over the real tokens, packing over
    dense rows of `pack_tokens`."""
    from transformers import Qwen2Config

    from roll_backend.perf.flops import ModelFlops

    model = ModelFlops.from_hf_config(Qwen2Config(**MODEL))
    sequences = PROMPT_LEN + lengths
    packed_rows = math.ceil(int(sequences.sum()) / pack_tokens)
    forwards = (
        model.forward_flops([int(sequences.max())] * len(lengths))
        + model.forward_flops(sequences)
        + model.forward_flops([pack_tokens] * packed_rows)
    )
    return 4 * forwards * repeats / (ASSUMED_EFFICIENCY * gflops * 1e9)


def fitted_sequences(args, dtype: str) -> int:
    """--sequences when given, else FULL_SEQUENCES or the most (a multiple of 16) whose estimate fits --minutes."""
    if args.sequences is not None:
        return args.sequences
    from roll_backend.perf.peak import gemm_shapes, measure_gemm_tflops

    torch.set_num_threads(os.cpu_count() or 1)
    gflops = 1e3 * measure_gemm_tflops(dtype, "cpu", gemm_shapes(MODEL["hidden_size"], MODEL["intermediate_size"]), 1.0)
    full = estimated_seconds(response_lengths(FULL_SEQUENCES, args.seed), args.pack_tokens, args.repeats, gflops)
    count = FULL_SEQUENCES
    while (
        count > 16
        and estimated_seconds(response_lengths(count, args.seed), args.pack_tokens, args.repeats, gflops)
        > 60 * args.minutes
    ):
        count -= 16
    print(
        f"GEMM probe: {gflops:.0f} GFLOP/s in {dtype}; {FULL_SEQUENCES} sequences estimated at {full / 60:.1f} min "
        + (
            "here: running them"
            if count == FULL_SEQUENCES
            else f"here, over --minutes {args.minutes:g}: running {count} (the README's figure is at "
            f"{FULL_SEQUENCES}: --sequences {FULL_SEQUENCES})"
        ),
        flush=True,
    )
    return count


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--sequences", type=int, default=None, help=f"default: {FULL_SEQUENCES}, or what fits --minutes"
    )
    parser.add_argument("--minutes", type=float, default=5.0, help="time the default batch is fitted to (estimate)")
    parser.add_argument(
        "--micro-batch", type=int, default=8, help="rows per fixed micro-batch (budget: this x 1088 tokens)"
    )
    parser.add_argument("--pack-tokens", type=int, default=2048, help="tokens per packed row")
    parser.add_argument("--repeats", type=int, default=1, help="timed repeats per mode (the fastest counts)")
    parser.add_argument("--seed", type=int, default=0)
    add_dtype_option(parser)
    return parser.parse_args()


def time_modes(group, tensors: dict[str, torch.Tensor], modes: dict[str, dict], repeats: int) -> dict[str, float]:
    """Best seconds of log-probs + one train step per mode, after a warm-up of every mode on 4 rows."""
    from roll_backend import keys
    from roll_backend.protocol import DataProto
    from roll_backend.workers.actor import ActorWorker

    small = {k: v[:4] for k, v in tensors.items()}
    for meta in modes.values():  # warm-up: kernels and allocator, every mode
        group.call(ActorWorker.train_step, DataProto.from_dict(tensors=small, meta_info=dict(meta)))
    seconds, reference = {}, None
    mask = tensors[keys.RESPONSE_MASK].bool()
    for name, meta in modes.items():
        best = float("inf")
        for _ in range(repeats):
            start = time.perf_counter()
            batch = DataProto.from_dict(tensors=tensors, meta_info=dict(meta))
            log_probs = group.call(ActorWorker.compute_log_probs, batch).batch[keys.LOG_PROBS]
            # Every mode's step uses the first mode's log-probs as the old ones: the losses compare the modes.
            reference = log_probs if reference is None else reference
            batch = DataProto.from_dict(tensors={**tensors, keys.OLD_LOG_PROBS: reference}, meta_info=dict(meta))
            metrics = group.call(ActorWorker.train_step, batch)[0]
            best = min(best, time.perf_counter() - start)
        seconds[name] = best
        gap = float((log_probs - reference).abs()[mask].max())
        print(
            f"{name}: {best:.1f}s (log-probs + train step), loss {metrics['loss']:.6f}, "
            f"grad_norm {metrics['grad_norm']:.4f}, log-probs vs fixed: max gap {gap:.1e}",
            flush=True,
        )
    return seconds


def main() -> None:
    args = parse_args()
    dtype = announce(args.dtype)
    sequences = fitted_sequences(args, dtype)

    import ray

    from roll_backend import keys
    from roll_backend.distributed.ray_env import init_local_ray
    from roll_backend.distributed.worker_group import WorkerGroup
    from roll_backend.models.tiny import TinyModelSpec, build_tiny_model
    from roll_backend.strategies.megatron.config import MegatronTrainConfig, OptimizerSettings
    from roll_backend.workers.actor import ActorConfig, ActorWorker

    work = Path(tempfile.mkdtemp(prefix="dynamic_batching_"))
    model_dir = str(build_tiny_model(work / "model", TinyModelSpec(seed=0, **MODEL)))
    lengths = response_lengths(sequences, args.seed)
    tensors = rl_batch(lengths, MODEL["vocab_size"], args.seed)
    real_tokens = int(tensors[keys.ATTENTION_MASK].sum())
    print(
        f"batch: {sequences} sequences, prompt {PROMPT_LEN}, responses {lengths.min()}..{lengths.max()} "
        f"(median {int(np.median(lengths))}, mean {lengths.mean():.0f}); {real_tokens} real tokens, "
        f"{sequences * (PROMPT_LEN + MAX_RESPONSE)} at the batch's width"
    )
    init_local_ray(num_cpus=8, env_vars={"OMP_NUM_THREADS": str(os.cpu_count() or 1)})
    strategy = MegatronTrainConfig(
        model_path=model_dir,
        micro_batch_size=args.micro_batch,
        params_dtype=dtype,
        compute_entropy=False,
        optimizer=OptimizerSettings(lr=0.0, weight_decay=0.0),
    )
    modes = {
        "fixed micro-batches": {},
        "token budget": {keys.META_MAX_TOKENS_PER_MICROBATCH: args.micro_batch * (PROMPT_LEN + MAX_RESPONSE)},
        "packing": {keys.META_MAX_TOKENS_PER_MICROBATCH: args.pack_tokens, keys.META_SEQUENCE_PACKING: True},
    }
    group = None
    try:
        group = WorkerGroup(ActorWorker, "actor_train", 1, worker_config=ActorConfig(strategy=strategy))
        group.call(ActorWorker.init_model)
        seconds = time_modes(group, tensors, modes, args.repeats)
    finally:
        if group is not None:
            group.shutdown()
        ray.shutdown()
    print(f"load average after: {os.getloadavg()[0]:.1f}")
    base = seconds["fixed micro-batches"]
    print(
        f"token budget vs fixed micro-batches: {base / seconds['token budget']:.1f}x "
        f"(packing: {base / seconds['packing']:.1f}x)"
    )


if __name__ == "__main__":
    main()
