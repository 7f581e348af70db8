"""LoRA vs full fine-tuning: GRPO steps of bench/grpo_step.py's model and batch through the product loop (PipelineRun +
rl_step), once training every weight with a reference role, once training rank-16 LoRA adapters
(actor_train.strategy.lora, alpha 32, every projection) with the base as the reference on the actor's ranks
(reference.from_actor_base) and the adapters alone sent to vLLM (lora.sync: adapter).

Per mode: the peak resident memory of the actor's ranks and of the reference's (a separate role in full fine-tuning,
none with LoRA), the train phase's seconds, and the weight sync's seconds and bytes, over the timed steps after one
warm-up step. Same placement, dtype and steps for both. Last line: `LoRA vs full: memory Nx, sync bytes Mx, train
time Kx` (memory: the actor and reference ranks together; each ratio full / LoRA).
Run: .venv/bin/python bench/lora_step.py [--steps 2] [--rank 16] [--dtype auto|bfloat16|float32] [--quick]
"""

from __future__ import annotations

import argparse
import os
import time

from _machine import add_dtype_option, announce
from grpo_step import FULL, QUICK, bench_inputs, placement, roll_backend_config


def run_mode(config, name: str) -> dict[str, float]:
    """The timed steps' mean train and sync seconds and sync bytes, and the ranks' peak resident memory (GiB)."""
    from roll_backend.distributed.worker import Worker
    from roll_backend.pipelines.loops.rl_step import rl_step
    from roll_backend.pipelines.run import PipelineRun

    start = time.perf_counter()
    with PipelineRun(config) as run:
        print(f"{name}: role groups up in {time.perf_counter() - start:.1f}s", flush=True)
        rows = []
        for step in run.step_numbers():
            rows.append(rl_step(run, step))
            row = rows[-1]
            print(
                f"{name} step {step}{' (warm-up)' if step == 1 else ''}: train {row['timing/train']:.2f}s, "
                f"sync {row['timing/weight_sync']:.2f}s of {row['weight_sync/bytes'] / 2**20:.2f} MiB "
                f"(probe gap {row['weight_sync/logprob_gap']:.1e})",
                flush=True,
            )
        counts = dict(run.model_metrics)
        peaks = {
            role: max(rank["peak_rss"] for rank in group.call(Worker.memory_gib))
            for role, group in (("actor", run.groups.actor_train), ("reference", run.groups.reference))
            if group is not None
        }
    timed = rows[1:]
    mean = lambda key: sum(row[key] for row in timed) / len(timed)  # noqa: E731
    return {
        "actor_gib": peaks["actor"],
        "reference_gib": peaks.get("reference", 0.0),
        "train_s": mean("timing/train"),
        "sync_s": mean("timing/weight_sync"),
        "sync_bytes": mean("weight_sync/bytes"),
        "trainable": counts["actor/trainable_parameters"],
        "parameters": counts["actor/parameters"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=2, help="timed steps per mode, after one warm-up step")
    parser.add_argument("--rank", type=int, default=16, help="LoRA rank (alpha = 2 x rank)")
    parser.add_argument("--quick", action="store_true", help="tiny scale smoke test (not the benchmark)")
    add_dtype_option(parser)
    args = parser.parse_args()
    dtype = announce(args.dtype)
    os.environ.pop("OMP_NUM_THREADS", None)
    os.environ.setdefault("RAY_worker_niceness", "0")
    scale = QUICK if args.quick else FULL

    import ray

    from roll_backend.distributed.ray_env import init_local_ray

    work, model_dir, _, data_path = bench_inputs(scale, "lora_step_")
    lora = [
        f"actor_train.strategy.lora={{rank: {args.rank}, alpha: {2 * args.rank}, sync: adapter}}",
        "reference.from_actor_base=true",
        "actor_train.strategy.optimizer.lr=1e-4",
    ]
    modes = {"full": [], "LoRA": lora}
    results = {}
    common = placement(os.cpu_count() or 1, 1)
    init_local_ray(num_cpus=16)
    try:
        for name, extra in modes.items():
            config = roll_backend_config(
                model_dir, data_path, work / name, scale, args.steps, 1, dtype, overrides=common + extra
            )
            results[name] = run_mode(config, name)
    finally:
        ray.shutdown()
    print(
        f"{'mode':<6}{'trainable':>14}{'actor GiB':>11}{'reference GiB':>15}{'train s':>9}{'sync s':>8}{'sync MiB':>10}"
    )
    for name, r in results.items():
        print(
            f"{name:<6}{r['trainable']:>14,.0f}{r['actor_gib']:>11.2f}{r['reference_gib']:>15.2f}{r['train_s']:>9.2f}"
            f"{r['sync_s']:>8.2f}{r['sync_bytes'] / 2**20:>10.2f}"
        )
    full, adapted = results["full"], results["LoRA"]
    memory = (full["actor_gib"] + full["reference_gib"]) / (adapted["actor_gib"] + adapted["reference_gib"])
    print(f"load average after: {os.getloadavg()[0]:.1f}")
    print(
        f"LoRA vs full: memory {memory:.2f}x, sync bytes {full['sync_bytes'] / adapted['sync_bytes']:.0f}x, "
        f"train time {full['train_s'] / adapted['train_s']:.2f}x"
    )


if __name__ == "__main__":
    main()
