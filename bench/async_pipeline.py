"""Synchronous vs one-step off-policy GRPO: generated tokens/s with the same role placement in both modes.

The model and batch of bench/grpo_step.py (its FULL scale; --quick for a smoke test), run by the product loop:
`rl_step` for synchronous steps, `OneStepOffPolicyLoop` for asynchronous ones. The rollout's ranks and the
actor's are pinned to disjoint CPU cores in both modes, as roles own their GPUs on a cluster: the synchronous loop
leaves one side idle while the other works, the asynchronous one overlaps them. The reference (frozen) goes with
the rollout by default (`--reference-on rollout`: colocated with actor_infer, and the async loop prepares each
batch ahead: reward and reference log-probs right after generation, while the actor trains) or with the actor
(`--reference-on trainer`: computed in the trainer's half of each step). Either way both modes share the placement.
Throughput: generated tokens of the timed steps (after warm-up) over their wall time. In bf16 where the CPU has it
natively, else float32 (bench/_machine.py; --dtype).
Run: .venv/bin/python bench/async_pipeline.py [--steps 3] [--warmup 1] [--dtype auto|bfloat16|float32]
     [--reference-on rollout|trainer] [--quick]
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import subprocess
import tempfile
import time
from pathlib import Path

from _machine import add_dtype_option, announce
from grpo_step import FULL, QUICK, prompt_rows, roll_backend_config


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


def timed_steps(
    config, warmup: int, rollout_cores: list[int], trainer_cores: list[int], reference_on_rollout: bool
) -> tuple[float, float]:
    """Run 1..max_steps in the config's mode; returns (generated tokens, wall seconds) of the steps after warm-up."""
    from roll_backend.pipelines.async_loop import OneStepOffPolicyLoop
    from roll_backend.pipelines.rl_step import rl_step
    from roll_backend.pipelines.run import PipelineRun

    mode = "async" if config.async_generation.enabled else "sync"
    asynchronous = config.async_generation.enabled
    with PipelineRun(config) as run, OneStepOffPolicyLoop(run) if asynchronous else contextlib.nullcontext() as loop:
        pin_group(run.groups.actor_infer, rollout_cores)
        pin_group(run.groups.actor_train, trainer_cores)
        pin_group(run.groups.reference, rollout_cores if reference_on_rollout else trainer_cores)
        step_fn = loop.step if asynchronous else lambda s: rl_step(run, s)
        tokens = seconds = 0.0
        for step in run.step_numbers():
            start = time.perf_counter()
            metrics = step_fn(step)
            elapsed = time.perf_counter() - start
            rows = config.rollout_batch_size * config.num_return_sequences_in_group
            generated = metrics["response_length/mean"] * rows
            timings = (k for k in metrics if k.startswith(("async/", "timing/")))
            waits = " ".join(f"{k.split('/')[1]}={metrics[k]:.1f}" for k in timings)
            print(f"{mode} step {step}{' (warm-up)' if step <= warmup else ''}: {elapsed:.1f}s [{waits}]", flush=True)
            if step > warmup:
                tokens, seconds = tokens + generated, seconds + elapsed
    return tokens, seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=3, help="timed steps per mode, after the warm-up")
    parser.add_argument("--warmup", type=int, default=1)
    add_dtype_option(parser)
    parser.add_argument(
        "--reference-on",
        default="rollout",
        choices=("rollout", "trainer"),
        help="the cores the reference runs on (rollout: prepared ahead in async mode)",
    )
    parser.add_argument("--quick", action="store_true", help="tiny scale smoke test (not the benchmark)")
    args = parser.parse_args()
    dtype = announce(args.dtype)
    scale = QUICK if args.quick else FULL

    import ray

    from roll_backend.config.schema import AsyncGenerationConfig
    from roll_backend.distributed.ray_env import init_local_ray
    from roll_backend.models.tiny import TinyModelSpec, build_tiny_model

    work = Path(tempfile.mkdtemp(prefix="async_pipeline_"))
    model_dir = str(build_tiny_model(work / "model", TinyModelSpec(seed=0, **scale.model)))
    data_path = work / "prompts.jsonl"
    data_path.write_text("".join(json.dumps(r) + "\n" for r in prompt_rows(scale.prompts)))
    rollout_cores, trainer_cores = core_split()
    reference_on_rollout = args.reference_on == "rollout"
    print(
        f"rollout on cores {rollout_cores}, actor on {trainer_cores}, reference on the {args.reference_on}'s; "
        f"{scale.prompts} prompts x {scale.samples} samples x {scale.new_tokens} new tokens per step, {dtype}",
        flush=True,
    )

    os.environ.setdefault("RAY_worker_niceness", "0")  # as bench/grpo_step.py: ranks at the driver's priority
    init_local_ray(num_cpus=16, env_vars={"OMP_NUM_THREADS": "1"})  # one thread per pinned rank core
    throughput = {}
    try:
        for mode in ("sync", "async"):
            steps = args.warmup + args.steps - 1
            config = roll_backend_config(model_dir, data_path, work / mode, scale, steps, 1, dtype)
            async_generation = AsyncGenerationConfig(enabled=mode == "async", prepare_ahead=reference_on_rollout)
            colocate_with = "actor_infer" if reference_on_rollout else None
            reference = dataclasses.replace(config.reference, colocate_with=colocate_with)
            config = dataclasses.replace(config, async_generation=async_generation, reference=reference)
            tokens, seconds = timed_steps(config, args.warmup, rollout_cores, trainer_cores, reference_on_rollout)
            throughput[mode] = tokens / seconds
            print(f"{mode}: {throughput[mode]:.0f} generated tokens/s over {args.steps} steps", flush=True)
    finally:
        ray.shutdown()
    print(f"load at the end {os.getloadavg()[0]:.1f}")
    print(f"async one-step off-policy vs synchronous: {throughput['async'] / throughput['sync']:.2f}x")


if __name__ == "__main__":
    main()
