"""The design's seed layout on one machine: 16 Megatron ranks as TP2 x CP2 x DP2 x PP2 of a tiny model.

Prints each rank's groups (rank 0's pipeline group is [0, 8], rank 7's [7, 15]), runs `compute_log_probs` and
one PPO `train_step`, and compares both with a single-rank (TP1) run of the same weights and batch.

    .venv/bin/python examples/seed_layout_16_ranks.py [--work-dir DIR]

Exits non-zero when the two runs differ by more than 1e-5. Time and memory on a 2-core machine: see README.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import torch

from roll_backend import keys
from roll_backend.distributed.layout import ParallelLayout
from roll_backend.distributed.ray_env import init_local_ray
from roll_backend.distributed.worker_group import WorkerGroup
from roll_backend.models.tiny import TinyModelSpec, build_tiny_model
from roll_backend.protocol import DataProto
from roll_backend.strategies.megatron.config import MegatronTrainConfig, OptimizerSettings
from roll_backend.workers.actor import ActorConfig, ActorLossConfig, ActorWorker

TOLERANCE = 1e-5
SEED_LAYOUT = ParallelLayout(tp=2, cp=2, pp=2)  # x DP2 = 16 ranks


def make_batch(vocab_size: int, rows: int = 8, prompt_len: int = 20, response_len: int = 12) -> dict[str, torch.Tensor]:
    """Left-padded prompts and right-padded responses; 32 columns, so each of the 4 CP chunks holds 8 tokens."""
    gen = torch.Generator().manual_seed(0)
    input_ids = torch.randint(3, vocab_size, (rows, prompt_len + response_len), generator=gen)
    attention = torch.ones_like(input_ids)
    for row in range(rows):
        attention[row, : row % 5] = 0  # left padding of the prompt
        attention[row, prompt_len + response_len - row % 4 :] = 0  # right padding of the response
    input_ids = input_ids * attention
    responses = input_ids[:, prompt_len:]
    return {
        keys.PROMPTS: input_ids[:, :prompt_len],
        keys.RESPONSES: responses,
        keys.INPUT_IDS: input_ids,
        keys.ATTENTION_MASK: attention,
        keys.POSITION_IDS: (attention.cumsum(-1) - 1).clamp(min=0),
        keys.RESPONSE_MASK: attention[:, prompt_len:],
        keys.ADVANTAGES: torch.randn(responses.shape, generator=gen),
    }


def start_group(layout: ParallelLayout, world_size: int, model_dir: str, role: str) -> WorkerGroup:
    config = ActorConfig(
        strategy=MegatronTrainConfig(model_path=model_dir, micro_batch_size=2, optimizer=OptimizerSettings(lr=1e-2)),
        loss=ActorLossConfig(clip_low=0.2),
    )
    group = WorkerGroup(ActorWorker, role, world_size, layout, worker_config=config)
    group.call(ActorWorker.init_model)
    return group


def resident_gib(group: WorkerGroup) -> float:
    import psutil

    return sum(psutil.Process(pid).memory_info().rss for pid in group.call(ActorWorker.pid)) / 2**30


def run(work_dir: Path) -> bool:
    started = time.perf_counter()
    init_local_ray(num_cpus=32)
    spec = TinyModelSpec(
        hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2
    )
    model_dir = str(build_tiny_model(work_dir / "tiny", spec))
    tensors = make_batch(json.loads((Path(model_dir) / "config.json").read_text())["vocab_size"])

    seed = start_group(SEED_LAYOUT, 16, model_dir, "actor_16")
    ready = time.perf_counter()
    print(f"16 ranks (TP2 x CP2 x DP2 x PP2) ready in {ready - started:.0f}s, {resident_gib(seed):.1f} GiB resident")
    for rank, groups in enumerate(seed.call(ActorWorker.group_ranks)):
        print(f"  rank {rank:2d}: " + "  ".join(f"{name}={ranks}" for name, ranks in groups.items()))
    pp_groups = [groups["pp"] for groups in seed.call(ActorWorker.group_ranks)]
    assert pp_groups[0] == [0, 8] and pp_groups[7] == [7, 15], pp_groups

    single = start_group(ParallelLayout(), 1, model_dir, "actor_tp1")
    results = {}
    for name, group in (("seed", seed), ("tp1", single)):
        batch = DataProto.from_dict(tensors=dict(tensors))
        old = group.call(ActorWorker.compute_log_probs, batch).batch[keys.LOG_PROBS]
        step = group.call(
            ActorWorker.train_step, DataProto.from_dict(tensors=dict(tensors, **{keys.OLD_LOG_PROBS: old}))
        )[0]
        after = group.call(ActorWorker.compute_log_probs, batch).batch[keys.LOG_PROBS]
        results[name] = (old, step, after)
    mask = tensors[keys.RESPONSE_MASK].bool()
    gaps = {
        "log-probs": float((results["seed"][0] - results["tp1"][0]).abs()[mask].max()),
        "loss": abs(results["seed"][1]["loss"] - results["tp1"][1]["loss"]),
        "grad norm": abs(results["seed"][1]["grad_norm"] - results["tp1"][1]["grad_norm"]),
        "log-probs after the step": float((results["seed"][2] - results["tp1"][2]).abs()[mask].max()),
    }
    for what, gap in gaps.items():
        print(f"  {what:26s} max |16 ranks - TP1| = {gap:.2e}")
    print(f"done in {time.perf_counter() - started:.0f}s")
    seed.shutdown()
    single.shutdown()
    return all(gap <= TOLERANCE for gap in gaps.values())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--work-dir", type=Path, default=None, help="where the tiny model goes (default: a temp dir)")
    args = parser.parse_args()
    if args.work_dir is not None:
        args.work_dir.mkdir(parents=True, exist_ok=True)
        ok = run(args.work_dir)
    else:
        with tempfile.TemporaryDirectory() as tmp:
            ok = run(Path(tmp))
    raise SystemExit(0 if ok else 1)


if __name__ == "__main__":
    main()
