"""Drive the roles by hand from a plain Ray driver, no pipeline: a tiny model, a Megatron actor at TP=2 and a
vLLM rollout engine; sample a few responses, score them with the actor, and compare with the sampler's log-probs.

    .venv/bin/python examples/driver_direct.py [--prompts 4] [--samples 2]

Takes a minute or two on a 2-core CPU machine (most of it is starting the three rank processes).
"""

from __future__ import annotations

import argparse
import tempfile
import time

import numpy as np
import ray

from roll_backend import keys
from roll_backend.distributed.layout import ParallelLayout
from roll_backend.distributed.ray_env import init_local_ray
from roll_backend.distributed.worker_group import WorkerGroup
from roll_backend.models.tiny import TinyModelSpec, build_tiny_model
from roll_backend.protocol import DataProto
from roll_backend.strategies.megatron.config import MegatronTrainConfig
from roll_backend.strategies.vllm.config import SamplingConfig, VllmRolloutConfig
from roll_backend.workers.actor import ActorConfig, ActorWorker
from roll_backend.workers.rollout import RolloutWorker, RolloutWorkerConfig


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--samples", type=int, default=2, help="responses per prompt")
    parser.add_argument("--max-tokens", type=int, default=12)
    args = parser.parse_args()
    start = time.perf_counter()

    with tempfile.TemporaryDirectory(prefix="tiny_model_") as tmp:
        model_dir = build_tiny_model(
            tmp, TinyModelSpec(hidden_size=128, intermediate_size=256)
        )  # vLLM CPU attention needs head_dim >= 32
        init_local_ray(num_cpus=8)  # CPU shares, not cores: each rank asks for 0.5
        try:
            run(model_dir, args, start)
        finally:
            ray.shutdown()


def run(model_dir, args: argparse.Namespace, start: float) -> None:
    # The trained policy: two ranks, one tensor-parallel pair. The layout is the group's; the strategy's
    # config holds only the backend settings.
    actor = WorkerGroup(
        ActorWorker,
        "actor",
        world_size=2,
        layout=ParallelLayout(tp=2),
        worker_config=ActorConfig(strategy=MegatronTrainConfig(model_path=str(model_dir), micro_batch_size=4)),
    )
    rollout = WorkerGroup(
        RolloutWorker,
        "rollout",
        world_size=1,
        worker_config=RolloutWorkerConfig(
            strategy=VllmRolloutConfig(
                model_path=str(model_dir),
                max_model_len=256,
                sampling=SamplingConfig(n=args.samples, temperature=1.0, max_tokens=args.max_tokens),
            )
        ),
    )
    actor.call(ActorWorker.init_model)  # ONE_TO_ALL: every rank builds its shard of the model
    rollout.call(RolloutWorker.init_model)  # starts the vLLM engine in the rank's process
    print(f"groups ready in {time.perf_counter() - start:.1f}s: actor coords {[c.describe() for c in actor.coords]}")

    prompts = [f"what is {a} + {a + 1}?" for a in range(args.prompts)]
    batch = DataProto.from_dict(non_tensors={keys.PROMPT_TEXT: np.array(prompts, dtype=object)})
    samples = rollout.call(
        RolloutWorker.generate, batch
    )  # DP_MP_COMPUTE: [prompts * samples] rows, n per prompt adjacent
    columns = [keys.INPUT_IDS, keys.ATTENTION_MASK, keys.POSITION_IDS, keys.RESPONSES, keys.RESPONSE_MASK]
    scored = actor.call(
        ActorWorker.compute_log_probs, samples.select(batch_keys=columns)
    )  # DP_MP_DISPATCH_FIRST: tp0 gets tensors

    mask = samples.batch[keys.RESPONSE_MASK].bool()  # [B*n, T_resp]
    gap = (scored.batch[keys.LOG_PROBS] - samples.batch[keys.ROLLOUT_LOG_PROBS]).abs()[mask]
    for prompt, response in zip(np.repeat(prompts, args.samples), samples.non_tensor_batch[keys.RESPONSE_TEXT]):
        print(f"  {str(prompt)!r} -> {str(response)!r}")
    print(
        f"{len(samples)} samples, {int(mask.sum())} response tokens; Megatron (TP2) vs vLLM log-probs: "
        f"mean |gap| {gap.mean():.2e}, max {gap.max():.2e}; total {time.perf_counter() - start:.1f}s"
    )
    actor.shutdown()
    rollout.shutdown()


if __name__ == "__main__":
    main()
