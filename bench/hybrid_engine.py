"""The hybrid engine vs split roles: the same GRPO job on the same cores, steps per second, and the weight sync's
seconds in the process vs across processes.

Split (as roles own their GPUs on a cluster): the trainer and the reference on one half of the cores, the rollout
engine on the other; each phase runs on its role's half while the other half waits. Hybrid (`hybrid: true`, as
configs/grpo_hybrid_cpu.yaml): trainer, engine and reference in the same processes, one per core-set, every phase on
all of them: the trainer data-parallel over both halves, one engine per half. Every rank is pinned to its cores with
one thread per core. The job is bench/grpo_step.py's (a ~14M Qwen2, 32 prompts x 8 samples x 128 new tokens, one
update a step, KL to the reference), in bf16 where the CPU has it natively, else float32 (bench/_machine.py).
Run: .venv/bin/python bench/hybrid_engine.py [--steps 3] [--warmup 1] [--dtype auto|bfloat16|float32] [--quick]
Last line: `hybrid vs split: Nx steps/s (sync: Mx faster)`.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import tempfile
import time
from pathlib import Path

from _machine import add_dtype_option, announce
from grpo_step import FULL, QUICK, prompt_rows, roll_backend_config


def core_halves() -> tuple[list[int], list[int]]:
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < 2:
        raise SystemExit(f"this benchmark splits the cores in two; this process may use only {cores}")
    half = len(cores) // 2
    return cores[:half], cores[half:]


def pin(pids: list[int], cores: list[int]) -> None:
    for pid in pids:
        subprocess.run(
            ["taskset", "-a", "-p", "-c", ",".join(map(str, cores)), str(pid)], check=True, stdout=subprocess.DEVNULL
        )


def placement(mode: str, halves: tuple[list[int], list[int]]) -> list[str]:
    """The roles' ranks and thread counts in `mode` (each rank gets one thread per core of its half)."""
    threads = len(halves[0])
    if mode == "split":
        return [
            "actor_train.world_size=1",
            "actor_infer.world_size=1",
            "reference.world_size=1",
            f"actor_train.num_cpus_per_rank={threads}",
            f"actor_infer.num_cpus_per_rank={threads}",
            f"reference.num_cpus_per_rank={threads}",
        ]
    return [
        "actor_train.world_size=2",  # data-parallel over the halves
        f"actor_train.num_cpus_per_rank={threads}",
        "actor_infer.world_size=2",  # one engine per half
        "actor_infer.hybrid=true",
        "reference.world_size=2",
        "reference.hybrid=true",
        "actor_train.strategy.offload_params=true",
        "actor_train.strategy.offload_grads=true",
        "actor_train.strategy.offload_optimizer=true",
        "reference.strategy.offload_params=true",
    ]


def timed_run(config, mode: str, warmup: int, halves) -> tuple[float, float, list[float]]:
    """(steps per second after the warm-up, mean weight-sync transfer seconds, the steps' seconds)."""
    from roll_backend.distributed.worker import Worker
    from roll_backend.pipelines.loops.rl_step import rl_step
    from roll_backend.pipelines.run import PipelineRun

    with PipelineRun(config) as run:
        groups = run.groups
        if mode == "split":
            pin(groups.actor_train.call(Worker.pid) + groups.reference.call(Worker.pid), halves[0])
            pin(groups.actor_infer.call(Worker.pid), halves[1])
        else:
            for pid, cores in zip(groups.hybrid.call(Worker.pid), halves):
                pin([pid], cores)
        seconds, syncs = [], []
        for step in run.step_numbers():
            start = time.perf_counter()
            metrics = rl_step(run, step)
            elapsed = time.perf_counter() - start
            phases = " ".join(
                f"{k.split('/')[1]}={v:.2f}"
                for k, v in metrics.items()
                if k.startswith("timing/") and k != "timing/startup_s"
            )
            warm = " (warm-up)" if step <= warmup else ""
            print(
                f"{mode} step {step}{warm}: {elapsed:.2f}s [{phases}] reward {metrics['reward/mean']:.3f}", flush=True
            )
            if step > warmup:
                seconds.append(elapsed)
                syncs.append(metrics["weight_sync/transfer_seconds"])
    return len(seconds) / sum(seconds), sum(syncs) / len(syncs), seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=3, help="timed steps per mode, after the warm-up")
    parser.add_argument("--warmup", type=int, default=1)
    add_dtype_option(parser)
    parser.add_argument("--quick", action="store_true", help="tiny scale smoke test (not the benchmark)")
    args = parser.parse_args()
    dtype = announce(args.dtype)
    scale = QUICK if args.quick else FULL
    halves = core_halves()
    print(
        f"cores {halves[0]} | {halves[1]}; {scale.prompts} prompts x {scale.samples} samples x {scale.new_tokens} new "
        f"tokens per step, {dtype}",
        flush=True,
    )

    import ray

    from roll_backend.distributed.ray_env import init_local_ray
    from roll_backend.models.tiny import TinyModelSpec, build_tiny_model

    work = Path(tempfile.mkdtemp(prefix="hybrid_engine_"))
    model_dir = str(build_tiny_model(work / "model", TinyModelSpec(seed=0, **scale.model)))
    data_path = work / "prompts.jsonl"
    data_path.write_text("".join(json.dumps(r) + "\n" for r in prompt_rows(max(scale.prompts * 8, 64))))
    os.environ.setdefault("RAY_worker_niceness", "0")  # as bench/grpo_step.py: ranks at the driver's priority
    init_local_ray(num_cpus=16)
    results = {}
    try:
        for mode in ("split", "hybrid"):
            steps = args.warmup + args.steps - 1
            config = roll_backend_config(
                model_dir, data_path, work / mode, scale, steps, 1, dtype, overrides=placement(mode, halves)
            )
            results[mode] = timed_run(config, mode, args.warmup, halves)
            rate, sync, _ = results[mode]
            print(f"{mode}: {rate:.3f} steps/s; weight sync transfer {sync:.3f} s", flush=True)
    finally:
        ray.shutdown()
    (split_rate, split_sync, _), (hybrid_rate, hybrid_sync, _) = results["split"], results["hybrid"]
    print(f"load at the end {os.getloadavg()[0]:.1f}")
    print(f"hybrid vs split: {hybrid_rate / split_rate:.2f}x steps/s (sync: {split_sync / hybrid_sync:.2f}x faster)")


if __name__ == "__main__":
    main()
