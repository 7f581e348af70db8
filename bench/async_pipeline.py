"""Synchronous vs one-step off-policy vs streaming GRPO: generated tokens/s with the same role placement, model and
batch in every mode.

Two tasks. `long_tail` (default): responses end when the model samples its end token, as reasoning and agent
responses do, so lengths are long-tailed: a tiny char-tokenizer model over ~190 printable characters (LONG_TAIL_MODEL)
samples its end token about once in 190 tokens, so lengths are roughly geometric up to `--max-tokens`, and the longest
of a step's 32 samples is several times the mean. A whole-batch rollout waits for its longest sample; streaming
(`async_generation.mode: streaming`, `--max-staleness` 4, partial rollouts kept) keeps the engine busy and hands the
trainer the groups that finished. `long_tail` trains without a reference (no KL loss, as DAPO). `fixed`: every
response exactly `new_tokens` long (min_tokens), grpo_step.py's model and batch, with the reference on the rollout's
cores (`--reference-on rollout`: colocated with actor_infer, one-step prepares each batch ahead there) or the
actor's; there streaming has no tail to gain from.
The rollout's ranks and the actor's are pinned to disjoint CPU cores in every mode, as roles own their GPUs on a
cluster: the synchronous loop leaves one side idle while the other works, the asynchronous ones overlap them.
Throughput: generated tokens of the steps trained (after warm-up) over their wall time; groups streaming drops for
staleness do not count. In bf16 where the CPU has it natively, else float32 (bench/_machine.py; --dtype).
Run: .venv/bin/python bench/async_pipeline.py [--task long_tail|fixed] [--steps 16] [--warmup 2]
     [--modes sync,one_step,streaming] [--dtype auto|bfloat16|float32] [--reference-on rollout|trainer] [--quick]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import tempfile
import time
from pathlib import Path

from _machine import add_dtype_option, announce
from grpo_step import FULL, QUICK, Scale, prompt_rows, roll_backend_config


def core_split() -> tuple[list[int], list[int]]:
    """Disjoint core sets for the rollout and the trainer: the machine's usable cores halved."""
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < 2:
        raise SystemExit(
            f"this benchmark pins rollout and trainer on disjoint cores; this process may use only {cores}"
        )
    half = len(cores) // 2
    return cores[:half], cores[half:]


def pin_group(group, cores: list[int]) -> None:
    """Pin every thread of every rank process of `group` to `cores` (threads started later inherit it)."""
    from roll_backend.distributed.worker import Worker

    for pid in group.call(Worker.pid):
        subprocess.run(
            ["taskset", "-a", "-p", "-c", ",".join(map(str, cores)), str(pid)], check=True, stdout=subprocess.DEVNULL
        )


def timed_steps(config, warmup: int, rollout_cores: list[int], trainer_cores: list[int], reference_cores: list[int]):
    """Run 1..max_steps in the config's mode; returns (generated tokens, wall seconds) of the steps after warm-up."""
    from roll_backend.pipelines.loops.one_step_off_policy import OneStepOffPolicyLoop
    from roll_backend.pipelines.loops.rl_step import rl_step
    from roll_backend.pipelines.loops.streaming import StreamingLoop
    from roll_backend.pipelines.run import PipelineRun

    mode = mode_of(config)
    loop_class = {"one_step": OneStepOffPolicyLoop, "streaming": StreamingLoop}.get(mode)
    with PipelineRun(config) as run:
        pin_group(run.groups.actor_infer, rollout_cores)
        pin_group(run.groups.actor_train, trainer_cores)
        if run.groups.reference is not None:
            pin_group(run.groups.reference, reference_cores)
        with loop_class(run) if loop_class else contextlib.nullcontext() as loop:
            step_fn = loop.step if loop_class else lambda s: rl_step(run, s)
            tokens = seconds = 0.0
            for step in run.step_numbers():
                start = time.perf_counter()
                metrics = step_fn(step)
                elapsed = time.perf_counter() - start
                rows = config.rollout_batch_size * config.num_return_sequences_in_group
                generated = metrics["response_length/mean"] * rows
                shown = (
                    "async/trainer_wait_s",
                    "async/rollout_idle_s",
                    "timing/generate",
                    "timing/reference",
                    "timing/train",
                    "timing/weight_sync",
                )
                waits = " ".join(f"{k.split('/')[1]}={metrics[k]:.1f}" for k in shown if k in metrics)
                lengths = f"len mean {metrics['response_length/mean']:.0f} max {metrics['response_length/max']:.0f}"
                extra = ""
                if mode == "streaming":
                    extra = (
                        f" lag max {metrics['async/token_staleness_max']:.0f} partial "
                        f"{metrics['stream/partial_resumed_requests']:.0f} dropped "
                        f"{metrics['stream/dropped_stale_groups']:.0f}"
                    )
                warm = " (warm-up)" if step <= warmup else ""
                print(f"{mode} step {step}{warm}: {elapsed:.1f}s [{waits}] {lengths}{extra}", flush=True)
                if step > warmup:
                    tokens, seconds = tokens + generated, seconds + elapsed
    return tokens, seconds


def mode_of(config) -> str:
    cfg = config.async_generation
    return cfg.mode if cfg.enabled else "sync"


def yaml_bool(value: bool) -> str:
    return "true" if value else "false"


# A smaller model than grpo_step.py's FULL one: on CPU its decode steps cost about the same whatever the batch (as on
# a GPU), so a whole-batch rollout pays for its longest sample, and its training stays short enough not to hide it.
LONG_TAIL_MODEL = dict(
    hidden_size=128,
    num_hidden_layers=2,
    intermediate_size=256,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=4096,
)
TOKEN_BUDGET = 8192
# The printable Latin-1 characters (the prompts' among them): ~190 tokens, so a random model ends a response about
# once in 190 tokens, and the longest of a batch's samples is several times the mean.
LONG_TAIL_ALPHABET = "".join(chr(code) for code in [*range(32, 127), *range(161, 256)])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--task", default="long_tail", choices=("long_tail", "fixed"))
    parser.add_argument("--steps", type=int, default=16, help="timed steps per mode, after the warm-up")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--max-tokens", type=int, default=2048, help="long_tail: the response cap")
    parser.add_argument("--prompts", type=int, default=4, help="long_tail: prompts per step")
    parser.add_argument(
        "--max-staleness",
        type=int,
        default=4,
        help="streaming: updates a sample's oldest token may lag (one-step is 1 by construction)",
    )
    add_dtype_option(parser)
    parser.add_argument(
        "--reference-on", default="rollout", choices=("rollout", "trainer"), help="fixed: where the reference runs"
    )
    parser.add_argument("--modes", default="sync,one_step,streaming")
    parser.add_argument("--quick", action="store_true", help="tiny scale smoke test (not the benchmark)")
    args = parser.parse_args()
    dtype = announce(args.dtype)
    scale = QUICK if args.quick else FULL
    model = dict(scale.model)
    if args.task == "long_tail":  # ends on its end token: ~1 in 35 of a random char model's samples
        model = dict(LONG_TAIL_MODEL if not args.quick else scale.model)
        model |= {"tokenizer": "char", "char_alphabet": LONG_TAIL_ALPHABET}
        scale = Scale(args.prompts, scale.samples, args.max_tokens if not args.quick else 48, scale.micro_batch, model)
    reference_on = "none" if args.task == "long_tail" else args.reference_on
    modes = args.modes.split(",")

    import ray

    from roll_backend.distributed.ray_env import init_local_ray
    from roll_backend.models.tiny import TinyModelSpec, build_tiny_model

    work = Path(tempfile.mkdtemp(prefix="async_pipeline_"))
    model_dir = str(build_tiny_model(work / "model", TinyModelSpec(seed=0, **model)))
    data_path = work / "prompts.jsonl"
    data_path.write_text("".join(json.dumps(r) + "\n" for r in prompt_rows(max(scale.prompts * 8, 64))))
    rollout_cores, trainer_cores = core_split()
    print(
        f"task {args.task}: rollout on cores {rollout_cores}, actor on {trainer_cores}, reference: {reference_on}; "
        f"{scale.prompts} prompts x {scale.samples} samples x "
        f"{'up to ' if args.task == 'long_tail' else ''}{scale.new_tokens} new tokens per step, {dtype}",
        flush=True,
    )

    os.environ.setdefault("RAY_worker_niceness", "0")  # as bench/grpo_step.py: ranks at the driver's priority
    init_local_ray(num_cpus=16, env_vars={"OMP_NUM_THREADS": "1"})  # one thread per pinned rank core
    throughput = {}
    try:
        for mode in modes:
            steps = args.warmup + args.steps - 1
            settings = [
                f"async_generation.enabled={yaml_bool(mode != 'sync')}",
                f"async_generation.mode={'streaming' if mode == 'streaming' else 'one_step'}",
                f"async_generation.prepare_ahead={yaml_bool(mode == 'one_step' and reference_on == 'rollout')}",
                f"async_generation.max_staleness={args.max_staleness if mode == 'streaming' else 1}",
                "async_generation.partial_rollout=keep",
            ]
            if reference_on == "rollout":
                settings.append("reference.colocate_with=actor_infer")
            if args.task == "long_tail":  # responses end on the end token, up to the cap
                budget = f"max_tokens_per_microbatch={TOKEN_BUDGET}"  # micro-batches trimmed to the rows' lengths
                settings += [
                    "actor_infer.strategy.sampling.min_tokens=0",
                    "algorithm.use_kl_loss=false",  # DAPO-style: no reference model
                    "reference=null",
                    f"actor_train.strategy.{budget}",
                ]
            config = roll_backend_config(model_dir, data_path, work / mode, scale, steps, 1, dtype, overrides=settings)
            reference_cores = rollout_cores if reference_on == "rollout" else trainer_cores
            tokens, seconds = timed_steps(config, args.warmup, rollout_cores, trainer_cores, reference_cores)
            throughput[mode] = tokens / seconds
            print(f"{mode}: {throughput[mode]:.0f} generated tokens/s over {args.steps} steps", flush=True)
    finally:
        ray.shutdown()
    print(f"load at the end {os.getloadavg()[0]:.1f}")
    if "sync" in throughput and "one_step" in throughput:
        print(f"async one-step off-policy vs synchronous: {throughput['one_step'] / throughput['sync']:.2f}x")
    if "streaming" in throughput and "one_step" in throughput:
        sync = throughput.get("sync")
        versus_sync = f"{throughput['streaming'] / sync:.2f}x" if sync else "not run"
        print(
            f"streaming vs one-step off-policy: {throughput['streaming'] / throughput['one_step']:.2f}x "
            f"(vs synchronous: {versus_sync})"
        )


if __name__ == "__main__":
    main()
