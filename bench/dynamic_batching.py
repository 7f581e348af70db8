"""Token-budget micro-batches and sequence packing vs fixed micro-batches: compute_log_probs + one train_step.

The 14.7M Qwen2-style model of bench/grpo_step.py in bf16 on one Megatron actor rank (a real Ray group),
256 sequences of a 64-token prompt and a response whose length is drawn (seeded) from a long-tailed
log-normal between 16 and 1024 tokens (median near 100). Each mode runs on the same group in the same run:
fixed micro-batches of --micro-batch rows (the batch padded to its longest response), token-budget
micro-batches of at most --micro-batch x (64 + 1024) padded tokens, and packing into rows of --pack-tokens
tokens (one packed row per micro-batch: the local spec's attention is dense over a packed row, so its cost
and memory grow with the square of the row length).
The learning rate is 0 so every mode's train step sees the same weights: equal losses (to bf16 rounding) show
that all three compute the same thing.
Run: .venv/bin/python bench/dynamic_batching.py [--sequences 256] [--micro-batch 8] [--pack-tokens 2048] [--repeats 1]
Last line: `token budget vs fixed micro-batches: Nx (packing: Mx)`.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

PROMPT_LEN, MIN_RESPONSE, MAX_RESPONSE, MEDIAN_RESPONSE = 64, 16, 1024, 100
MODEL = dict(hidden_size=512, num_hidden_layers=6, intermediate_size=1024, num_attention_heads=4,
             num_key_value_heads=2, vocab_size=512)  # bench/grpo_step.py's FULL model


def response_lengths(count: int, seed: int) -> np.ndarray:
    """Log-normal lengths (median MEDIAN_RESPONSE, a long right tail) clipped to [MIN_RESPONSE, MAX_RESPONSE]."""
    rng = np.random.default_rng(seed)
    return np.clip(rng.lognormal(np.log(MEDIAN_RESPONSE), 1.0, count), MIN_RESPONSE, MAX_RESPONSE).astype(int)


def rl_batch(lengths: np.ndarray, vocab_size: int, seed: int) -> dict[str, torch.Tensor]:
    """64-token prompts, right-padded responses of `lengths`, random advantages and old log-probs."""
    from roll_backend import keys

    gen = torch.Generator().manual_seed(seed)
    rows, width = len(lengths), MAX_RESPONSE
    prompts = torch.randint(3, vocab_size, (rows, PROMPT_LEN), generator=gen)
    responses = torch.randint(3, vocab_size, (rows, width), generator=gen)
    response_mask = (torch.arange(width)[None] < torch.as_tensor(lengths)[:, None]).long()
    responses = responses * response_mask
    attention = torch.cat([torch.ones(rows, PROMPT_LEN, dtype=torch.long), response_mask], dim=1)
    return {
        keys.PROMPTS: prompts, keys.RESPONSES: responses, keys.INPUT_IDS: torch.cat([prompts, responses], dim=1),
        keys.ATTENTION_MASK: attention, keys.POSITION_IDS: (attention.cumsum(-1) - 1).clamp(min=0),
        keys.RESPONSE_MASK: response_mask, keys.ADVANTAGES: torch.randn(rows, width, generator=gen),
    }


def cpu_model() -> str:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
        return next(line.split(":", 1)[1].strip() for line in out.splitlines() if line.startswith("Model name"))
    except (OSError, subprocess.CalledProcessError, StopIteration):
        return "unknown CPU"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sequences", type=int, default=256)
    parser.add_argument("--micro-batch", type=int, default=8, help="rows per fixed micro-batch (budget: this x 1088 tokens)")
    parser.add_argument("--pack-tokens", type=int, default=2048, help="tokens per packed row")
    parser.add_argument("--repeats", type=int, default=1, help="timed repeats per mode (the fastest counts)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    import ray

    from roll_backend import keys
    from roll_backend.distributed.cluster import Cluster
    from roll_backend.distributed.parallel import ParallelLayout
    from roll_backend.distributed.ray_env import init_local_ray
    from roll_backend.models.tiny import TinyModelSpec, build_tiny_model
    from roll_backend.protocol import DataProto
    from roll_backend.strategies.megatron_config import MegatronTrainConfig, OptimizerSettings
    from roll_backend.strategies.micro_batching import META_MAX_TOKENS_PER_MICROBATCH, META_SEQUENCE_PACKING
    from roll_backend.workers.actor import ActorConfig, ActorWorker

    work = Path(tempfile.mkdtemp(prefix="dynamic_batching_"))
    model_dir = str(build_tiny_model(work / "model", TinyModelSpec(seed=0, **MODEL)))
    lengths = response_lengths(args.sequences, args.seed)
    tensors = rl_batch(lengths, MODEL["vocab_size"], args.seed)
    budget = args.micro_batch * (PROMPT_LEN + MAX_RESPONSE)
    real_tokens = int(tensors[keys.ATTENTION_MASK].sum())
    print(f"machine: {cpu_model()}, {os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f} at start")
    print(f"batch: {args.sequences} sequences, prompt {PROMPT_LEN}, responses {lengths.min()}..{lengths.max()} "
          f"(median {int(np.median(lengths))}, mean {lengths.mean():.0f}); {real_tokens} real tokens, "
          f"{args.sequences * (PROMPT_LEN + MAX_RESPONSE)} at the batch's width")

    init_local_ray(num_cpus=8, env_vars={"OMP_NUM_THREADS": str(os.cpu_count() or 1)})
    config = ActorConfig(strategy=MegatronTrainConfig(
        model_path=model_dir, micro_batch_size=args.micro_batch, params_dtype="bfloat16", compute_entropy=False,
        optimizer=OptimizerSettings(lr=0.0, weight_decay=0.0)))
    group = Cluster(ActorWorker, "bench", 1, ParallelLayout(), worker_config=config)
    modes = {
        "fixed micro-batches": {},
        "token budget": {META_MAX_TOKENS_PER_MICROBATCH: budget},
        "packing": {META_MAX_TOKENS_PER_MICROBATCH: args.pack_tokens, META_SEQUENCE_PACKING: True},
    }
    try:
        group.init_model()
        small = {k: v[:4] for k, v in tensors.items()}
        for meta in modes.values():  # warm-up: kernels and allocator, every mode
            group.train_step(DataProto.from_dict(tensors=small, meta_info=dict(meta)))
        seconds, reference = {}, None
        mask = tensors[keys.RESPONSE_MASK].bool()
        for name, meta in modes.items():
            best = float("inf")
            for _ in range(args.repeats):
                start = time.perf_counter()
                log_probs = group.compute_log_probs(DataProto.from_dict(tensors=tensors, meta_info=dict(meta))).batch[keys.LOG_PROBS]
                # Every mode's step uses the first mode's log-probs as the old ones: the losses compare the modes.
                reference = log_probs if reference is None else reference
                batch = DataProto.from_dict(tensors={**tensors, keys.OLD_LOG_PROBS: reference}, meta_info=dict(meta))
                metrics = group.train_step(batch)[0]
                best = min(best, time.perf_counter() - start)
            seconds[name] = best
            gap = float((log_probs - reference).abs()[mask].max())
            print(f"{name}: {best:.1f}s (log-probs + train step), loss {metrics['loss']:.6f}, "
                  f"grad_norm {metrics['grad_norm']:.4f}, log-probs vs fixed: max gap {gap:.1e} (bf16)", flush=True)
    finally:
        group.shutdown()
        ray.shutdown()
    print(f"load average after: {os.getloadavg()[0]:.1f}")
    base = seconds["fixed micro-batches"]
    print(f"token budget vs fixed micro-batches: {base / seconds['token budget']:.1f}x "
          f"(packing: {base / seconds['packing']:.1f}x)")


if __name__ == "__main__":
    main()
