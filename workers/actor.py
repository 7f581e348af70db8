"""`ActorWorker`: the policy being trained. Log-probs, PPO/GSPO train steps, checkpoints and HF export via its
strategy.
"""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass, field
from typing import Any

import torch

from roll_backend import keys, roles
from roll_backend.algorithms import agg_loss, get_policy_loss, kl_estimate, token_mean_share
from roll_backend.algorithms.preference import sft_loss
from roll_backend.distributed.dispatch import Dispatch, register
from roll_backend.distributed.faults import poisoned_loss
from roll_backend.protocol import DataProto
from roll_backend.workers.reward_model import sequence_scores
from roll_backend.workers.trained import TrainedWorker

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class ActorLossConfig:
    """The actor's objective: policy loss + entropy bonus + KL-to-reference loss, token-mean over the global batch."""

    policy_loss: str = "ppo"
    clip_low: float = 0.2
    clip_high: float | None = None
    clip_c: float = 3.0
    tau_pos: float = 1.0  # sapo: the gate's temperature where the advantage is positive
    tau_neg: float = 1.05  # sapo: ... where it is not
    entropy_coef: float = 0.0
    kl_loss_coef: float = 0.0  # > 0 needs keys.REF_LOG_PROBS in the batch
    kl_estimator: str = "low_var_kl"
    agg_mode: str = "token-mean"  # of the policy loss; normalised by the global token / sequence counts
    # "policy": the RL loss above; "sft": the response tokens' NLL; "pairwise": sum of keys.ROW_LOSS_WEIGHTS x each
    # row's sequence log-prob (or, with a value head, its score): the gradient of a pair loss (reward_model, dpo)
    objective: str = "policy"
    # Distillation as a loss: weight of KL(pi || teacher) per token (keys.TEACHER_LOG_PROBS), kl_estimator's estimate
    distill_loss_coef: float = 0.0


@dataclass(frozen=True)
class ActorConfig:
    """What an ActorWorker is built from: a strategy name (see strategies.registry), its typed config, the loss."""

    strategy: Any  # e.g. MegatronTrainConfig
    strategy_name: str = "megatron_train"
    loss: ActorLossConfig = field(default_factory=ActorLossConfig)


def sft_objective(per_token: dict[str, torch.Tensor], micro_batch: DataProto):
    """LossFn of SFT: the response tokens' negative log-likelihood, this micro-batch's share of the global mean."""
    mask = micro_batch.batch[keys.RESPONSE_MASK].float()
    loss = sft_loss(per_token[keys.LOG_PROBS], mask, micro_batch.meta_info[keys.META_GLOBAL_TOKEN_COUNT])
    return loss, {"sft_loss": loss.detach()}


def pairwise_objective(per_token: dict[str, torch.Tensor], micro_batch: DataProto):
    """LossFn of a pair loss: sum over rows of ROW_LOSS_WEIGHTS x the row's sequence log-prob (LM head) or score (value
    head). The weights are d(pair loss)/d(row value) at these weights, so the gradient is the pair loss's."""
    batch = micro_batch.batch
    mask = batch[keys.RESPONSE_MASK].float()
    if keys.VALUES in per_token:
        row_values = sequence_scores(per_token[keys.VALUES], mask) * (mask.sum(-1) > 0)  # (padding rows: 0)
    else:
        row_values = (per_token[keys.LOG_PROBS] * mask).sum(-1)
    loss = (batch[keys.ROW_LOSS_WEIGHTS].to(row_values.dtype) * row_values).sum()
    return loss, {}


def actor_loss(cfg: ActorLossConfig, per_token: dict[str, torch.Tensor], micro_batch: DataProto):
    """LossFn of the actor: uses OLD_LOG_PROBS, ADVANTAGES, RESPONSE_MASK (and REF_LOG_PROBS) of the micro-batch."""
    if cfg.objective != "policy":
        return OBJECTIVES[cfg.objective](per_token, micro_batch)
    batch = micro_batch.batch
    mask = batch[keys.RESPONSE_MASK].float()
    global_tokens = micro_batch.meta_info[keys.META_GLOBAL_TOKEN_COUNT]
    log_probs = per_token[keys.LOG_PROBS]
    # Without OLD_LOG_PROBS the update is on-policy (one epoch, one mini-batch): the old policy is the current
    # one, so its log-probs are these, detached (the pipeline then skips a forward pass, as verl does).
    old_log_probs = batch[keys.OLD_LOG_PROBS] if keys.OLD_LOG_PROBS in batch.keys() else log_probs.detach()
    # Rollout-mismatch correction (the pipeline adds the column only when it is on): detached per-token weights.
    correction = batch[keys.ROLLOUT_CORRECTION_WEIGHTS] if keys.ROLLOUT_CORRECTION_WEIGHTS in batch.keys() else None
    policy = get_policy_loss(cfg.policy_loss)(
        old_log_probs,
        log_probs,
        batch[keys.ADVANTAGES],
        mask,
        clip_low=cfg.clip_low,
        clip_high=cfg.clip_high,
        clip_c=cfg.clip_c,
        tau_pos=cfg.tau_pos,
        tau_neg=cfg.tau_neg,
        agg_mode=cfg.agg_mode,
        dp_size=1,
        batch_num_tokens=global_tokens,
        global_batch_size=micro_batch.meta_info.get(keys.META_GLOBAL_SEQUENCE_COUNT),
        token_weights=correction,
    )
    loss = policy.loss
    # Every metric is this micro-batch's share of the step's value (see LossFn): the strategy sums them.
    metrics = {
        "pg_loss": policy.loss.detach(),
        "pg_clipfrac": token_mean_share(policy.clipfrac.detach(), mask, global_tokens),
        "ppo_kl": token_mean_share(policy.approx_kl.detach(), mask, global_tokens),
    }
    if keys.ENTROPY in per_token:
        entropy = agg_loss(per_token[keys.ENTROPY], mask, "token-mean", dp_size=1, batch_num_tokens=global_tokens)
        metrics["entropy"] = entropy.detach()
        loss = loss - cfg.entropy_coef * entropy
    # KL to the reference and (distillation as a loss) to the teacher: the same estimator, token mean over the step
    for coef, column, name in (
        (cfg.kl_loss_coef, keys.REF_LOG_PROBS, "kl_loss"),
        (cfg.distill_loss_coef, keys.TEACHER_LOG_PROBS, "distill_kl"),
    ):
        if coef:
            kl = kl_estimate(log_probs, batch[column], cfg.kl_estimator)
            kl = agg_loss(kl, mask, "token-mean", dp_size=1, batch_num_tokens=global_tokens)
            metrics[name] = kl.detach()
            loss = loss + coef * kl
    return loss, metrics


OBJECTIVES = {"sft": sft_objective, "pairwise": pairwise_objective}


class ActorWorker(TrainedWorker):
    """One rank of the trained policy. Call `init_model` once after the group starts. `compute_log_probs` and
    `train_step` receive their batch by the in-actor broadcast (DP_MP_DISPATCH_FIRST_BALANCED)."""

    @register(Dispatch.DP_MP_DISPATCH_FIRST_BALANCED, deadline=roles.LOG_PROBS_DEADLINE)
    def compute_log_probs(self, batch: DataProto) -> DataProto | None:
        """keys.LOG_PROBS (and ENTROPY) [B, T_resp] of the batch's responses under the current weights."""
        return self.strategy.compute_log_probs(batch)

    @register(Dispatch.DP_MP_DISPATCH_FIRST_BALANCED, deadline=roles.LOG_PROBS_DEADLINE)
    def compute_values(self, batch: DataProto) -> DataProto | None:
        """keys.VALUES of a value-head model (a reward model in training)."""
        return self.strategy.compute_values(batch)

    @register(Dispatch.DP_MP_DISPATCH_FIRST_BALANCED, deadline=roles.TRAIN_DEADLINE)
    def train_step(self, batch: DataProto) -> dict[str, float] | None:
        """One optimizer step on the batch; returns the step's metrics (last PP stage; None elsewhere)."""
        loss_fn = functools.partial(actor_loss, self.config.loss)
        if self.poisoned():  # fault injection (tests): a NaN gradient
            loss_fn = poisoned_loss(loss_fn)
        metrics = self.strategy.train_step(batch, loss_fn)
        if metrics is not None:
            metrics["broadcast_seconds"] = self.last_broadcast_seconds
        return metrics  # reduced over DP already; the group call returns one dict per DP rank

    @register(Dispatch.ONE_TO_ALL)
    def publish_hf_weights(self, bucket_bytes: int, measure_memory: bool = False) -> list:
        """Full HF-named weights for the rollout engine: every rank joins the gather, rank 0 puts each bucket
        in the object store and returns the refs ([] on other ranks). The driver only passes refs along.
        `measure_memory`: the gathers count as the weight_sync phase on a CPU rank too (measured_memory)."""
        import ray

        refs = []
        for bucket in self.strategy.iter_hf_weights(bucket_bytes, measure_memory):
            if self.rank == 0:
                refs.append(ray.put([(name, tensor.detach().cpu()) for name, tensor in bucket]))
        return refs

    @register(Dispatch.ONE_TO_ALL)
    def publish_weight_deltas(
        self, bucket_bytes: int, version: int | None, engine_version: int | None, measure_memory: bool = False
    ) -> list:
        """A minimal sync to `version` for engines holding `engine_version` (roll_backend/protocol/weight_delta.py):
        every rank joins the gather, rank 0 sends per tensor nothing, its changed elements or the whole tensor
        (whichever is fewer bytes) against its copy of what it last sent, whole tensors when that copy is not the
        engines' version, and returns the buckets' refs ([] on other ranks). Rank 0 keeps a host copy of the
        weights. `measure_memory` as in publish_hf_weights."""
        import ray

        from roll_backend.protocol.weight_delta import SentWeights

        refs = []
        if self.rank == 0:
            if getattr(self, "sent_weights", None) is None:
                self.sent_weights = SentWeights()
            base = self.sent_weights.begin(engine_version)
        for bucket in self.strategy.iter_hf_weights(bucket_bytes, measure_memory):
            if self.rank == 0:
                refs.append(ray.put(self.sent_weights.encode(bucket, base, version)))
        if self.rank == 0:
            self.sent_weights.sent(version)
        return refs

    @register(Dispatch.ONE_TO_ALL)
    def export_hf(self, out_dir: str, max_shard_bytes: int | None = None):
        """A Hugging Face checkpoint in `out_dir`, in safetensors files of at most `max_shard_bytes` (None: the
        strategy's default). Returns what the writing rank wrote (None on the others)."""
        if max_shard_bytes is None:
            return self.strategy.export_hf(out_dir)
        return self.strategy.export_hf(out_dir, max_shard_bytes=max_shard_bytes)

    @register(Dispatch.ONE_TO_ALL)
    def parameter_counts(self) -> dict[str, int]:
        """The model's parameters and those that train (the same on every rank)."""
        return self.strategy.parameter_counts()

    @register(Dispatch.ONE_TO_ALL)
    def publish_adapter(self) -> list:
        """The LoRA adapters for a rollout engine that serves them (lora.sync: adapter): every rank joins the
        gathers, rank 0 puts (PEFT-named tensors, peft.LoraConfig) in the object store and returns [its ref]."""
        import ray

        tensors = self.strategy.adapter_tensors("publish_adapter")
        return [ray.put((tensors, self.strategy.peft_config()))] if tensors is not None else []

    @register(Dispatch.ONE_TO_ALL)
    def export_peft(self, out_dir: str) -> list[str] | None:
        """The LoRA adapters in `out_dir` as a PEFT adapter folder; the tensor names written (None on other ranks)."""
        return self.strategy.export_peft(out_dir)

    @register(Dispatch.ONE_TO_ALL)
    def param_grad_norms(self, prefix: str = "") -> dict[str, float]:
        """Per-parameter gradient norms of the last train step on this rank (diagnostics)."""
        return self.strategy.param_grad_norms(prefix)

    @register(Dispatch.ONE_TO_ALL)
    def hf_weight_checksums(self, bucket_bytes: int = 1 << 20) -> dict[str, tuple[tuple[int, ...], float]] | None:
        """{HF name: (shape, float64 sum)} from `iter_hf_weights` (a cheap view of what a weight sync sends)."""
        out = {}
        for bucket in self.strategy.iter_hf_weights(bucket_bytes):
            for name, tensor in bucket:
                out[name] = (tuple(tensor.shape), float(tensor.double().sum()))
        return out
