"""Minimal vs full weight sync of the same model after one optimizer step at a typical learning rate (1e-6): bytes and
seconds, against the raw copy of the same bytes on the same transport (Ray's object store, driver -> a task in
another process).

The product's path: a Megatron actor (1 rank) and a vLLM rollout (1 rank) of a PipelineRun; a first sync (whole
tensors, filling both sides' copies), then per measured step an update on the engine's samples, and on the same
trainer weights: the minimal sync (ActorWorker.publish_weight_deltas relative to the engine's
version, then RolloutWorker.load_weight_deltas: rebuilt, checked, loaded all at once), the full sync (the same,
whole tensors) and the raw copy of the full sync's bytes (ray.put here, ray.get in a task). Medians over the steps.
The trainer's parameters are bf16 (fp32 main weights in the optimizer) where the CPU has bf16 natively: a bf16 weight
moves only when its fp32 main copy crosses a bf16 rounding step, which at lr 1e-6 few do. In float32 (no native
bf16, bench/_machine.py) every element Adam touches changes: the minimal sync then saves only the untouched tensors.
Run: .venv/bin/python bench/weight_sync.py [--dtype auto|bfloat16|float32] [--repeats 3] [--quick]
Last line: `minimal vs full sync: Nx fewer bytes, Mx faster (full at Kx the raw copy)`.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

from _machine import add_dtype_option, announce
from grpo_step import Scale, bench_inputs, roll_backend_config

MODEL = Scale(
    4,
    4,
    16,
    16,
    dict(
        hidden_size=1024,
        num_hidden_layers=8,
        intermediate_size=2816,
        num_attention_heads=16,
        num_key_value_heads=4,
        vocab_size=32000,
    ),
)
QUICK = Scale(
    4, 4, 16, 16, dict(MODEL.model, hidden_size=256, intermediate_size=704, num_hidden_layers=4, num_attention_heads=4)
)


def timed_sync(groups, version: int, engine_version: int | None) -> tuple[float, dict]:
    start = time.perf_counter()
    result = sync(groups, version, engine_version)
    return time.perf_counter() - start, result


def sync(groups, version: int, engine_version: int | None) -> dict:
    from roll_backend.workers.actor import ActorWorker
    from roll_backend.workers.rollout import RolloutWorker

    bucket_bytes = 64 << 20
    published = groups.actor_train.call(ActorWorker.publish_weight_deltas, bucket_bytes, version, engine_version)
    refs = next(refs for refs in published if refs)
    return groups.actor_infer.call(RolloutWorker.load_weight_deltas, refs, version=version)[0]


def one_update(run, step: int) -> None:
    """One optimizer step on the engine's samples of the step's prompts, with random advantages (a random model
    earns no reward to learn from; the update's size is what matters here)."""
    import torch

    from roll_backend import keys
    from roll_backend.pipelines.loops import phases
    from roll_backend.protocol import DataProto
    from roll_backend.workers.actor import ActorWorker

    config = run.config
    samples = phases.generate(run.groups, run.data.batch_at(step, config.rollout_batch_size), config, step)
    samples = samples.select(
        batch_keys=[keys.INPUT_IDS, keys.ATTENTION_MASK, keys.POSITION_IDS, keys.RESPONSES, keys.RESPONSE_MASK]
    )
    old = run.groups.actor_train.call(ActorWorker.compute_log_probs, samples).batch[keys.LOG_PROBS]
    advantages = torch.randn(old.shape, generator=torch.Generator().manual_seed(step))
    extra = DataProto.from_dict(tensors={keys.OLD_LOG_PROBS: old, keys.ADVANTAGES: advantages})
    run.groups.actor_train.call(ActorWorker.train_step, samples.union(extra))


def raw_copy(groups, full_bytes: int | None) -> float:
    """Put the full sync's bytes (as the trainer's HF tensors) into the object store and get them in another process."""
    import ray
    import torch

    from roll_backend.workers.actor import ActorWorker

    @ray.remote(num_cpus=0)
    def fetch(refs) -> int:
        return sum(t.numel() * t.element_size() for ref in refs for _, t in ray.get(ref))

    weights = []
    for bucket_refs in groups.actor_train.call(ActorWorker.publish_hf_weights, 64 << 20):
        weights += [ray.get(ref) for ref in bucket_refs]
    copies = [[(name, torch.empty_like(t).copy_(t)) for name, t in bucket] for bucket in weights]
    start = time.perf_counter()
    got = ray.get(fetch.remote([ray.put(bucket) for bucket in copies]))
    seconds = time.perf_counter() - start
    assert full_bytes is None or got == full_bytes, (got, full_bytes)
    return seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_dtype_option(parser)
    parser.add_argument("--repeats", type=int, default=3, help="optimizer steps measured (medians)")
    parser.add_argument("--quick", action="store_true", help="a smaller model (seconds)")
    args = parser.parse_args()
    dtype = announce(args.dtype)
    scale = QUICK if args.quick else MODEL

    import ray

    from roll_backend.distributed.ray_env import init_local_ray
    from roll_backend.pipelines.run import PipelineRun

    work, model_dir, _, data_path = bench_inputs(scale, "weight_sync_")
    config = roll_backend_config(
        model_dir,
        data_path,
        work / "rb",
        scale,
        1 + args.repeats,
        1,
        dtype,
        overrides=["reference=null", "algorithm.use_kl_loss=false"],
    )
    os.environ.setdefault("RAY_worker_niceness", "0")
    init_local_ray(num_cpus=config.ray_num_cpus)
    rows = []
    try:
        with PipelineRun(config) as run:
            sync(run.groups, 1, None)  # the first sync: whole tensors; both sides keep a copy of version 1
            raw_copy(run.groups, None)  # (starts the task's worker process)
            for version in range(2, 2 + args.repeats):
                one_update(run, version)
                minimal_seconds, minimal = timed_sync(run.groups, version, version - 1)
                full_seconds, full = timed_sync(run.groups, version, None)  # the same weights, whole
                raw_seconds = raw_copy(run.groups, full["full_bytes"])
                rows.append((minimal, minimal_seconds, full, full_seconds, raw_seconds))
                print(
                    f"update {version - 1}: minimal {minimal['bytes'] / 2**20:.2f} MiB ({minimal['tensors']} tensors "
                    f"sent, {minimal['unchanged']} unchanged) in {minimal_seconds:.3f}s; full "
                    f"{full['bytes'] / 2**20:.1f} MiB in {full_seconds:.3f}s; raw copy {raw_seconds:.3f}s",
                    flush=True,
                )
    finally:
        ray.shutdown()
    minimal_bytes = statistics.median(row[0]["bytes"] for row in rows)
    full_bytes = statistics.median(row[2]["bytes"] for row in rows)
    minimal_s, full_s, raw_s = (statistics.median(row[i] for row in rows) for i in (1, 3, 4))
    print(
        f"medians over {len(rows)} steps ({dtype} trainer weights, lr 1e-6): minimal {minimal_bytes / 2**20:.2f} MiB "
        f"in {minimal_s:.3f}s, full {full_bytes / 2**20:.1f} MiB in {full_s:.3f}s, raw copy {raw_s:.3f}s",
        flush=True,
    )
    print(
        f"minimal vs full sync: {full_bytes / max(minimal_bytes, 1):.1f}x fewer bytes, "
        f"{full_s / minimal_s:.1f}x faster (full at {full_s / raw_s:.1f}x the raw copy)"
    )


if __name__ == "__main__":
    main()
