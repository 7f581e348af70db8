"""The offline pipelines on the Megatron train strategy: `sft` (the response tokens' NLL), `reward_model` (a value head
trained with the Bradley-Terry loss on preference pairs) and `dpo` (against a frozen reference role).

A step is one optimizer step on `rollout_batch_size` examples or pairs (pipelines.offline_data). A pair loss is
trained through per-row weights (algorithms.preference.pair_loss_row_weights): one forward pass gives each row's
sequence log-prob (dpo) or score (reward_model), the driver computes the pair loss and its gradient per row, and the
train step's loss sum(weight x value) has the pair loss's gradient. A pair's two rows may then land in different
micro-batches, packs or DP ranks, so every layout, token budget and packing mode of the strategy works unchanged.
Checkpoints, resume, loggers and restarts are PipelineRun's (the same as the RL pipelines').
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

from roll_backend import keys, roles
from roll_backend.algorithms import masked_mean
from roll_backend.algorithms.preference import bradley_terry_loss, dpo_loss, pair_loss_row_weights
from roll_backend.config.schema import AlgorithmConfig, PipelineConfig
from roll_backend.pipelines.data.offline_datasets import OfflineDataset
from roll_backend.pipelines.groups import RoleGroups
from roll_backend.pipelines.loops import phases
from roll_backend.pipelines.services.phase_perf import SequenceLengths
from roll_backend.pipelines.services.tracking import PhaseTimer
from roll_backend.pipelines.services.validation import validation_due
from roll_backend.protocol import DataProto
from roll_backend.workers.actor import ActorWorker
from roll_backend.workers.reward_model import sequence_scores, with_one_more_column


def offline_step(run, step: int) -> dict[str, float]:
    """One optimizer step of run.config.pipeline on the step's batch; its metrics."""
    config = run.config
    timer = PhaseTimer(config.fault_tolerance.timeouts)
    batch = model_batch(config, run.data.batch_at(step, config.rollout_batch_size))
    metrics = {"offline/tokens": float(batch.batch[keys.ATTENTION_MASK].sum())}
    if config.pipeline != "sft":
        pairs = PairScorer(config, run.groups)
        with timer.phase(roles.OLD_LOG_PROBS):
            values = pairs.row_values(batch)
        if config.pipeline == "dpo":
            with timer.phase(roles.REFERENCE_LOG_PROBS):
                pairs.add_reference(batch)
        loss, weights = pair_loss_row_weights(values, pairs.mean_loss(batch))
        batch.batch[keys.ROW_LOSS_WEIGHTS] = weights.float()
        metrics |= pairs.metrics(values, batch, loss, prefix=f"{config.pipeline}/")
    with timer.phase(roles.TRAIN):
        # (one optimizer step on the whole batch: the algorithm block's epochs and mini-batches are the RL loop's)
        metrics |= phases.train_actor(run.groups, batch, AlgorithmConfig(), phases.step_seed(config, step, salt=1))
    run.policy_version += 1
    lengths = SequenceLengths.of(batch)
    perf = run.perf.metrics(run.perf.step_flops(lengths, batch, set(timer.seconds)), timer.seconds)
    return metrics | perf | timer.metrics()


def model_batch(config: PipelineConfig, batch: DataProto) -> DataProto:
    """The batch as the trained model reads it: a value head (reward_model) scores at the last response token
    itself, which needs one more response column (workers.reward_model.with_one_more_column)."""
    if config.pipeline != "reward_model":
        return batch
    extended = with_one_more_column(batch)
    for name in batch.batch.keys():
        if name not in extended.batch.keys():
            extended.batch[name] = batch.batch[name]
    extended.meta_info = dict(batch.meta_info)
    return extended


class PairScorer:
    """Row values of a pair batch (sequence log-probs for dpo, scores for reward_model), the pair loss on them, and
    its metrics."""

    def __init__(self, config: PipelineConfig, groups: RoleGroups):
        self.config, self.groups = config, groups

    def row_values(self, batch: DataProto) -> torch.Tensor:
        mask = batch.batch[keys.RESPONSE_MASK]
        if self.config.pipeline == "reward_model":
            out = self.groups.actor_train.call(ActorWorker.compute_values, batch)
            return sequence_scores(out.batch[keys.VALUES], mask)
        out = self.groups.actor_train.call(ActorWorker.compute_log_probs, batch)
        return (out.batch[keys.LOG_PROBS] * mask).sum(-1)

    def add_reference(self, batch: DataProto) -> None:
        """keys.REF_LOG_PROBS of the frozen reference (dpo), once per batch."""
        batch.batch[keys.REF_LOG_PROBS] = phases.reference_call(self.groups, batch).batch[keys.LOG_PROBS]

    def mean_loss(self, batch: DataProto) -> Callable[[torch.Tensor], torch.Tensor]:
        """rows [2P] -> the mean pair loss (what pair_loss_row_weights differentiates)."""
        if self.config.pipeline == "reward_model":
            margins = torch.tensor(batch.meta_info["margins"], dtype=torch.float64)
            return lambda rows: bradley_terry_loss(rows[0::2], rows[1::2], margins).mean()
        return lambda rows: self._dpo(rows, batch).losses.mean()

    def _dpo(self, rows: torch.Tensor, batch: DataProto):
        mask = batch.batch[keys.RESPONSE_MASK]
        reference = (batch.batch[keys.REF_LOG_PROBS] * mask).sum(-1).to(rows.dtype)
        tokens = mask.sum(-1).to(rows.dtype)
        pref = self.config.preference
        return dpo_loss(
            rows[0::2],
            rows[1::2],
            reference[0::2],
            reference[1::2],
            pref.beta,
            pref.loss,
            pref.label_smoothing,
            chosen_tokens=tokens[0::2],
            rejected_tokens=tokens[1::2],
        )

    def metrics(self, rows: torch.Tensor, batch: DataProto, loss: float, prefix: str) -> dict[str, float]:
        """loss, accuracy (chosen above rejected) and margins of the pairs; dpo adds the implicit rewards and the
        policy's chosen and rejected sequence log-probs."""
        metrics = {f"{prefix}loss": loss}
        if self.config.pipeline == "reward_model":
            chosen, rejected = rows[0::2], rows[1::2]
            metrics[f"{prefix}chosen_score"] = float(chosen.mean())
            metrics[f"{prefix}rejected_score"] = float(rejected.mean())
        else:
            out = self._dpo(rows.double(), batch)
            chosen, rejected = out.chosen_rewards, out.rejected_rewards
            metrics[f"{prefix}chosen_logps"] = float(rows[0::2].mean())
            metrics[f"{prefix}rejected_logps"] = float(rows[1::2].mean())
            metrics[f"{prefix}logp_margin"] = float((rows[0::2] - rows[1::2]).mean())
        metrics[f"{prefix}accuracy"] = float((chosen > rejected).float().mean())
        metrics[f"{prefix}margin"] = float((chosen - rejected).mean())
        return metrics


class OfflineValidation:
    """Validation of an offline run on its held-out examples or pairs, at the steps the `eval` block asks for:
    val/sft/nll (and perplexity), or the pair metrics of the training step (loss, accuracy, margin) as val/<pipeline>/.
    The reference's log-probs of the held-out pairs are computed once."""

    def __init__(self, config: PipelineConfig, data: OfflineDataset):
        self.config = config
        self.batch = model_batch(config, data.all_rows())
        self.has_reference = False

    def due(self, step: int) -> bool:
        return validation_due(self.config, step)

    def run(self, groups: RoleGroups, step: int) -> dict[str, float]:
        timer = PhaseTimer(self.config.fault_tolerance.timeouts)
        with timer.phase(roles.OLD_LOG_PROBS):
            metrics = self._metrics(groups)
        return metrics | {"timing/validation": timer.seconds[roles.OLD_LOG_PROBS]}

    def _metrics(self, groups: RoleGroups) -> dict[str, float]:
        prefix = f"val/{self.config.pipeline}/"
        batch = self.batch
        if self.config.pipeline == "sft":
            out = groups.actor_train.call(ActorWorker.compute_log_probs, batch)
            nll = float(-masked_mean(out.batch[keys.LOG_PROBS], batch.batch[keys.RESPONSE_MASK].float()))
            return {f"{prefix}nll": nll, f"{prefix}perplexity": float(np.exp(nll))}
        pairs = PairScorer(self.config, groups)
        if self.config.pipeline == "dpo" and not self.has_reference:
            pairs.add_reference(batch)
            self.has_reference = True
        values = pairs.row_values(batch)
        loss = float(pairs.mean_loss(batch)(values.double()))
        return pairs.metrics(values, batch, loss, prefix)
