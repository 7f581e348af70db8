"""One-GPU check of the hybrid engine: trainer, vLLM engine and reference of a ~0.5B random-init Qwen2 (built here) in
one process on one GPU, a few GRPO steps of the demo task, against the same roles split into three processes sharing
the GPU. Needs the project installed with CUDA builds of vLLM and Ray (scripts/setup.sh on a GPU machine).

Run from the repository root:  python3 scripts/gpu_hybrid_check.py [--steps 3] [--out DIR]
Prints one PASS/FAIL line per check with its numbers:
  the hybrid run's steps equal the split run's (rewards, loss, KL, grad norm; bf16, so within 1e-3 relative);
  the engine's post-sync probe agrees with the trainer at every step;
  device memory while the reference runs (engine asleep, actor offloaded) is below the memory while the engine
    generates (KV cache and weights awake), and training holds more than the log-prob passes (gradients, Adam).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

MODEL = dict(
    hidden_size=1024,
    intermediate_size=3584,
    num_hidden_layers=24,
    num_attention_heads=16,
    num_key_value_heads=2,
    tokenizer="char",
    char_alphabet="0123456789 copy",
    model_vocab_size=32768,  # padded rows, as real models pad theirs: ~0.45B parameters in all
    initializer_range=0.02,
)
ON_ONE_GPU = (
    "actor_train.world_size=1",
    "actor_train.strategy.tp=1",
    "actor_train.num_gpus_per_rank=1",
    "actor_train.strategy.params_dtype=bfloat16",
    "actor_infer.world_size=1",
    "actor_infer.strategy.tp=1",
    "actor_infer.strategy.dtype=bfloat16",
    "actor_infer.strategy.gpu_memory_utilization=0.3",
    "reference.world_size=1",
    "reference.strategy.tp=1",
    "reference.strategy.params_dtype=bfloat16",
    "actor_train.strategy.micro_batch_size=16",
    "reference.strategy.micro_batch_size=16",
    "logging.progress_bar=false",
)
SPLIT = (  # the same roles in their own processes on the same GPU
    "actor_infer.hybrid=false",
    "reference.hybrid=false",
    "actor_train.num_gpus_per_rank=0.4",
    "actor_infer.num_gpus_per_rank=0.3",
    "actor_infer.colocate_with=actor_train",
    "reference.num_gpus_per_rank=0.3",
    "reference.colocate_with=actor_train",
    "actor_train.strategy.offload_params=false",
    "actor_train.strategy.offload_grads=false",
    "actor_train.strategy.offload_optimizer=false",
    "reference.strategy.offload_params=false",
)
KEYS = ("reward/mean", "actor/pg_loss", "actor/reference_kl", "actor/grad_norm")


def check(name: str, ok: bool, detail: str) -> bool:
    print(f"{'PASS' if ok else 'FAIL'} {name}: {detail}", flush=True)
    return ok


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    from roll_backend.config.loader import load_config
    from roll_backend.distributed.ray_env import init_local_ray
    from roll_backend.models.tiny import TinyModelSpec, build_tiny_model
    from roll_backend.pipelines import run_pipeline

    out = Path(args.out or tempfile.mkdtemp(prefix="gpu_hybrid_"))
    model = build_tiny_model(out / "model", TinyModelSpec(**MODEL))
    common = [f"model_path={model}", "build_tiny_model=null", f"max_steps={args.steps}", *ON_ONE_GPU]
    init_local_ray(num_cpus=8, num_gpus=1)
    runs = {
        mode: run_pipeline(
            load_config(REPO / "configs/grpo_hybrid_cpu.yaml", [*common, f"output_dir={out / mode}", *extra])
        )
        for mode, extra in (("hybrid", ()), ("split", SPLIT))
    }
    hybrid, split = runs["hybrid"], runs["split"]
    ok = True
    for ours, theirs in zip(hybrid, split):
        diffs = {k: abs(ours[k] - theirs[k]) / max(abs(theirs[k]), 1e-6) for k in KEYS}
        ok &= check(f"step {ours['step']} equals the split run", max(diffs.values()) < 1e-3, f"relative {diffs}")
        ok &= check(
            f"step {ours['step']} probe",
            ours["weight_sync/logprob_gap"] < 2e-2,
            f"gap {ours['weight_sync/logprob_gap']:.2e}",
        )
    last = hybrid[-1]
    memory = {phase: last[f"memory/{phase}/allocated_gib"] for phase in ("generate", "reference", "log_probs", "train")}
    ok &= check(
        "memory after sleep and offload below the engine's", memory["reference"] < memory["generate"], f"GiB {memory}"
    )
    ok &= check("training holds gradients and optimizer state", memory["train"] > memory["log_probs"], f"GiB {memory}")
    print(
        f"sync: {last['weight_sync/transfer_seconds']:.2f} s in process for {last['weight_sync/bytes'] / 2**30:.2f} GiB"
    )
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
