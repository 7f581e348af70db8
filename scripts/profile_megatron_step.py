"""Where the Megatron train step and log-prob forward spend their time: torch profiler op tables, one rank.

bench/grpo_step.py's model and batch (32 x 8 sequences of a 40-token prompt and 128 response tokens, micro-batches
of 64, KL loss) on one in-process Megatron rank (gloo world of 1) in bf16 mixed precision; one warm-up call, then
each call once unprofiled (its seconds) and once under the profiler. Prints the share of GEMM ops in the CPU time
and the ops that cost most: the evidence behind the MFU figures in the README.
`--by-shape` groups the ops by their input shapes, which tells which layer an op belongs to (e.g. a copy of
[b, heads, s, s] is the attention softmax's float32 cast, of [s, b, hidden] a norm's); recording shapes slows
small ops most, so take the shares from a run without it.
Run: .venv/bin/python scripts/profile_megatron_step.py [--dtype bfloat16|float32] [--rows 30] [--by-shape]
"""

from __future__ import annotations

import argparse
import functools
import os
import sys
import tempfile
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))
from _machine import this_machine  # noqa: E402
from grpo_step import FULL  # noqa: E402  (the same model and batch shape)

GEMM_OPS = ("aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm")
PROMPT_TOKENS = 40  # about the bench's chat-templated prompts


def rl_batch(vocab_size: int):
    from roll_backend import keys
    from roll_backend.protocol import DataProto

    rows, gen = FULL.prompts * FULL.samples, torch.Generator().manual_seed(0)
    prompts = torch.randint(3, vocab_size, (rows, PROMPT_TOKENS), generator=gen)
    responses = torch.randint(3, vocab_size, (rows, FULL.new_tokens), generator=gen)
    attention = torch.ones(rows, PROMPT_TOKENS + FULL.new_tokens, dtype=torch.long)
    return DataProto.from_dict(
        tensors={
            keys.PROMPTS: prompts,
            keys.RESPONSES: responses,
            keys.INPUT_IDS: torch.cat([prompts, responses], 1),
            keys.ATTENTION_MASK: attention,
            keys.POSITION_IDS: attention.cumsum(-1) - 1,
            keys.RESPONSE_MASK: torch.ones_like(responses),
            keys.ADVANTAGES: torch.randn(responses.shape, generator=gen),
            keys.REF_LOG_PROBS: -5 * torch.rand(responses.shape, generator=gen),
        }
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    parser.add_argument("--rows", type=int, default=20, help="ops listed per table")
    parser.add_argument("--by-shape", action="store_true", help="group ops by input shapes (slower to profile)")
    parser.add_argument("--use-torch-compile", action="store_true", help="the strategy's use_torch_compile")
    args = parser.parse_args()

    from roll_backend.distributed import parallel
    from roll_backend.distributed.layout import ParallelLayout
    from roll_backend.models.tiny import TinyModelSpec, build_tiny_model
    from roll_backend.strategies.megatron.config import MegatronTrainConfig, OptimizerSettings
    from roll_backend.strategies.registry import create_strategy
    from roll_backend.workers.actor import ActorLossConfig, actor_loss

    threads = os.cpu_count() or 1
    torch.set_num_threads(threads)
    model_dir = build_tiny_model(
        Path(tempfile.mkdtemp(prefix="profile_step_")) / "model", TinyModelSpec(seed=0, **FULL.model)
    )
    store, address, port = parallel.rendezvous_store()
    parallel.init_distributed(0, 1, address, port, ParallelLayout(), "cpu", store=store)
    config = MegatronTrainConfig(
        model_path=str(model_dir),
        micro_batch_size=FULL.micro_batch,
        params_dtype=args.dtype,
        optimizer=OptimizerSettings(lr=1e-6),
        use_torch_compile=args.use_torch_compile,
    )
    strategy = create_strategy("megatron_train", config, layout=ParallelLayout(), device="cpu")
    strategy.initialize()
    batch = rl_batch(FULL.model["vocab_size"])
    loss_fn = functools.partial(actor_loss, ActorLossConfig(kl_loss_coef=0.04))
    calls = {
        "train_step": lambda: strategy.train_step(batch, loss_fn),
        "log_probs": lambda: strategy.compute_log_probs(batch),
    }
    print(
        f"{this_machine().cpu}, {threads} threads, {args.dtype}; {len(batch)} sequences x "
        f"{PROMPT_TOKENS + FULL.new_tokens} tokens"
    )
    for name, call in calls.items():
        call()  # warm-up
        start = time.perf_counter()
        call()
        seconds = time.perf_counter() - start
        with profile(activities=[ProfilerActivity.CPU], record_shapes=args.by_shape) as prof:
            call()
        ops = prof.key_averages(group_by_input_shape=args.by_shape)
        total = sum(op.self_cpu_time_total for op in ops)
        gemm = sum(op.self_cpu_time_total for op in ops if op.key in GEMM_OPS)
        print(
            f"\n{name}: {seconds:.2f} s unprofiled; profiled self CPU {total / 1e6:.2f} s, GEMM ops {gemm / total:.0%}"
        )
        print(
            ops.table(
                sort_by="self_cpu_time_total",
                row_limit=args.rows,
                max_name_column_width=40,
                max_shapes_column_width=80,
            )
        )
    parallel.destroy_distributed()


if __name__ == "__main__":
    main()
