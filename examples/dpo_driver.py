"""DPO by hand from a plain Ray driver, no pipeline: a Megatron actor at TP=2 learns the copy task's preferences
against a frozen Megatron reference, step by step with the pieces the `dpo` pipeline uses (its dataset, the pair loss
trained through per-row weights). `roll-backend run configs/dpo_cpu.yaml` runs the same with checkpoints, validation
and loggers.

    .venv/bin/python examples/dpo_driver.py [--steps 30] [--pairs 32]

Takes about a minute on a 2-core CPU machine.
"""

from __future__ import annotations

import argparse
import functools
import tempfile

from roll_backend import keys
from roll_backend.algorithms.preference import dpo_loss, pair_loss_row_weights
from roll_backend.config.schema import DataConfig, SyntheticDataConfig
from roll_backend.distributed.layout import ParallelLayout
from roll_backend.distributed.ray_env import init_local_ray
from roll_backend.distributed.worker_group import WorkerGroup
from roll_backend.models.tiny import TinyModelSpec, build_tiny_model
from roll_backend.pipelines.data.offline_datasets import OfflineDataset
from roll_backend.strategies.megatron.config import MegatronInferConfig, MegatronTrainConfig, OptimizerSettings
from roll_backend.workers.actor import ActorConfig, ActorLossConfig, ActorWorker
from roll_backend.workers.reference import ReferenceConfig, ReferenceWorker

BETA = 0.1


def sequence_log_probs(group, method, batch):
    """[rows] each row's summed response log-probs under the group's model."""
    log_probs = group.call(method, batch).batch[keys.LOG_PROBS]
    return (log_probs * batch.batch[keys.RESPONSE_MASK]).sum(-1)


def mean_dpo_loss(rows, reference):
    """The pair loss of rows [chosen 0, rejected 0, chosen 1, ...] given the reference's sequence log-probs."""
    return dpo_loss(rows[0::2], rows[1::2], reference[0::2], reference[1::2], BETA).losses.mean()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--pairs", type=int, default=32, help="preference pairs per step")
    args = parser.parse_args()

    init_local_ray(num_cpus=8)
    model_dir = build_tiny_model(
        tempfile.mkdtemp() + "/tiny",
        TinyModelSpec(
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=2,
            num_key_value_heads=2,
            tokenizer="char",
            char_alphabet="0123456789 copy",
        ),
    )
    from transformers import AutoTokenizer

    data = DataConfig(synthetic=SyntheticDataConfig(task="copy_digit_pairs", num_prompts=512), max_prompt_length=32)
    dataset = OfflineDataset(data, "dpo", AutoTokenizer.from_pretrained(model_dir), seed=0, response_length=2)

    actor = WorkerGroup(
        ActorWorker,
        "actor",
        2,
        ParallelLayout(tp=2),
        worker_config=ActorConfig(
            strategy=MegatronTrainConfig(
                model_path=str(model_dir), micro_batch_size=8, optimizer=OptimizerSettings(lr=2e-3)
            ),
            loss=ActorLossConfig(objective="pairwise"),  # sum(ROW_LOSS_WEIGHTS x sequence log-prob)
        ),
    )
    reference = WorkerGroup(
        ReferenceWorker,
        "reference",
        1,
        worker_config=ReferenceConfig(strategy=MegatronInferConfig(model_path=str(model_dir), micro_batch_size=8)),
    )
    actor.call(ActorWorker.init_model)
    reference.call(ReferenceWorker.init_model)

    for step in range(args.steps):
        batch = dataset.batch_at(step, args.pairs)  # rows: chosen 2i, rejected 2i+1
        ref = sequence_log_probs(reference, ReferenceWorker.compute_log_probs, batch).double()
        policy = sequence_log_probs(actor, ActorWorker.compute_log_probs, batch)

        loss, weights = pair_loss_row_weights(policy, functools.partial(mean_dpo_loss, reference=ref))
        batch.batch[keys.ROW_LOSS_WEIGHTS] = weights.float()
        actor.call(ActorWorker.train_step, batch)
        margin = float((policy[0::2] - policy[1::2]).mean())
        print(f"step {step + 1}: dpo loss {loss:.4f}, chosen - rejected log-prob {margin:+.3f}")
    actor.shutdown()
    reference.shutdown()


if __name__ == "__main__":
    main()
