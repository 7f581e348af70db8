"""The phases of one RL step (roll_backend.roles.PHASES), shared by the GRPO and PPO loops. Each takes the groups
and the step's batch; a group call names the worker method it runs (`group.call(ActorWorker.train_step, ...)`)."""

from __future__ import annotations

import time

import numpy as np
import torch

from roll_backend import keys, roles
from roll_backend.algorithms import (
    as_group_ids,
    get_advantage_estimator,
    kl_estimate,
    kl_penalized_rewards,
    masked_mean,
    postprocess_rewards,
    rollout_correction,
)
from roll_backend.config.schema import AlgorithmConfig, DistillationConfig, PipelineConfig, RewardConfig
from roll_backend.distributed.worker_group import GroupFuture, WorkerGroup
from roll_backend.errors import NotRestartableError
from roll_backend.pipelines.groups import RoleGroups
from roll_backend.pipelines.loops import remax
from roll_backend.protocol import DataProto
from roll_backend.protocol.sequences import place_on_last_token
from roll_backend.workers.actor import ActorWorker
from roll_backend.workers.critic import CriticWorker
from roll_backend.workers.hybrid import HybridWorker
from roll_backend.workers.reference import ReferenceWorker
from roll_backend.workers.reward import RewardWorker
from roll_backend.workers.reward_model import RewardModelWorker
from roll_backend.workers.rollout import RolloutWorker


class WeightSyncError(NotRestartableError):
    """After a weight sync the rollout engine's log-probs disagree with the trainer's (a restart would not help)."""


def step_seed(config: PipelineConfig, step: int, salt: int = 0) -> int:
    """A per-step seed: a resumed run samples and shuffles exactly as the uninterrupted one."""
    return (config.seed * 1_000_003 + step * 7919 + salt) % (2**31 - 1)


def generate(groups: RoleGroups, prompts: DataProto, config: PipelineConfig, step: int, salt: int = 0) -> DataProto:
    """Prompts -> n responses each; the engine's sampler is reseeded per step (and `salt`: another generation of
    the same step) so a resumed run samples alike. ReMax: with each row's REWARD_BASELINES (loops/remax.py)."""
    return collect_generated(submit_generate(groups, prompts, config, step, salt))


class PendingGeneration:
    """A generation sent to the rollout group: the sampling call and, for ReMax, the greedy call behind it with
    what scores its responses. `refs`: every rank's pending result of both."""

    def __init__(self, sampled: GroupFuture, greedy: GroupFuture | None = None, score=None):
        self.sampled, self.greedy, self.score = sampled, greedy, score
        self.refs = sampled.refs + (greedy.refs if greedy is not None else [])


def submit_generate(
    groups: RoleGroups, prompts: DataProto, config: PipelineConfig, step: int, salt: int = 0
) -> PendingGeneration:
    """Start `generate` without waiting (the asynchronous loop trains meanwhile); `collect_generated` ends it."""
    prompts.meta_info[keys.META_SAMPLING_SEED] = step_seed(config, step, salt)
    if config.algorithm.adv_estimator != "remax":
        return PendingGeneration(groups.actor_infer.submit(RolloutWorker.generate, prompts))
    remax.tag_groups(prompts)
    sampled = groups.actor_infer.submit(RolloutWorker.generate, prompts)
    greedy = groups.actor_infer.submit(RolloutWorker.generate, remax.greedy_request(prompts))
    return PendingGeneration(sampled, greedy, lambda batch: score(groups, batch, config.reward))


def collect_generated(pending: PendingGeneration) -> DataProto:
    batch = pending.sampled.get()
    batch.meta_info.pop(keys.META_SAMPLING_SEED, None)
    if pending.greedy is not None:
        remax.attach_baselines(batch, pending.greedy.get(), pending.score)
    return batch


def generation_metrics(batch: DataProto) -> dict[str, float]:
    """The rollout's own metrics (rollout/..., agentic/...), taken off the batch: one number each over DP ranks."""
    return _mean_metrics(batch.meta_info.pop(keys.META_METRICS, None) or {}, prefix="")


def score(groups: RoleGroups, batch: DataProto, reward: RewardConfig | None = None) -> dict[str, float]:
    """batch[TOKEN_LEVEL_SCORES]: the rule rewards and user functions (the reward group, where the run has one), plus
    the reward model's score with `reward.model_weight` where it has a reward_model role; reward/ and reward_model/
    metrics."""
    if groups.reward is not None:
        rewards = groups.reward.call(RewardWorker.compute_rewards, batch)
        scores = rewards.batch[keys.TOKEN_LEVEL_SCORES]
        metrics = _mean_metrics(rewards.meta_info.get(keys.META_METRICS, {}), prefix="reward/")
    else:  # a reward model alone
        scores, metrics = torch.zeros(batch.batch[keys.RESPONSE_MASK].shape, dtype=torch.float32), {}
    if groups.reward_model is not None:
        model_scores, model_metrics = reward_model_scores(groups, batch, reward or RewardConfig())
        scores = scores + place_on_last_token(model_scores, batch.batch[keys.RESPONSE_MASK])
        metrics |= model_metrics
    batch[keys.TOKEN_LEVEL_SCORES] = scores
    return metrics


def reward_model_scores(groups: RoleGroups, batch: DataProto, reward: RewardConfig) -> tuple[torch.Tensor, dict]:
    """[B] the reward model's score of each response, standardised over the batch and clipped as configured, times
    reward.model_weight; with its metrics (the raw scores' mean and spread, the weighted mean)."""
    out = groups.reward_model.call(RewardModelWorker.compute_rewards, batch)
    raw = out.batch[keys.SEQUENCE_SCORES].float()
    scores = raw
    if reward.model_score_norm == "batch":
        scores = (raw - raw.mean()) / (raw.std(unbiased=False) + 1e-6) if len(raw) > 1 else raw - raw.mean()
    if reward.model_score_clip is not None:
        scores = scores.clamp(-reward.model_score_clip, reward.model_score_clip)
    weighted = reward.model_weight * scores
    metrics = {
        "reward_model/raw_mean": float(raw.mean()),
        "reward_model/raw_std": float(raw.std(unbiased=False)),
        "reward_model/score_mean": float(weighted.mean()),
    }
    counts = _mean_metrics(out.meta_info.get(keys.META_METRICS) or {}, prefix="")
    return weighted, metrics | _phase_tokens(counts, roles.REWARD_MODEL)


def drop_uniform_groups(batch: DataProto) -> tuple[DataProto, int]:
    """Dynamic sampling (DAPO): keep only prompt groups whose rewards are not all equal (they carry no signal)."""
    scores = batch.batch[keys.TOKEN_LEVEL_SCORES].sum(-1).numpy()
    _, group_index = np.unique(batch.non_tensor_batch[keys.UID], return_inverse=True)
    high = np.full(group_index.max() + 1, -np.inf)
    np.maximum.at(high, group_index, scores)
    low = np.full_like(high, np.inf)
    np.minimum.at(low, group_index, scores)
    keep = (high - low)[group_index] > 0
    return batch.select_idxs(np.flatnonzero(keep)), int((~keep).sum())


def is_on_policy(algo: AlgorithmConfig, batch_size: int) -> bool:
    """One epoch, one mini-batch, KL not in the reward: the policy that sampled is the one being updated, so
    its "old" log-probs need no forward pass of their own (the actor loss uses its current ones, detached)."""
    whole_batch = algo.ppo_mini_batch_size is None or algo.ppo_mini_batch_size >= batch_size
    return algo.ppo_epochs == 1 and whole_batch and not algo.use_kl_in_reward


def needs_old_log_probs(algo: AlgorithmConfig, batch_size: int) -> bool:
    """Off-policy updates need the old policy's log-probs, and so does the rollout correction (it compares them
    with the sampler's): only then does the step pay for that forward pass."""
    return not is_on_policy(algo, batch_size) or algo.rollout_correction.enabled


def correct_rollout_mismatch(batch: DataProto, algo: AlgorithmConfig) -> dict[str, float]:
    """batch[ROLLOUT_CORRECTION_WEIGHTS] from the sampler's and the trainer's log-probs; `rollout_correction/`
    metrics.
    """
    cfg = algo.rollout_correction
    tensors = batch.batch
    weights, metrics = rollout_correction(
        tensors[keys.OLD_LOG_PROBS].float(),
        tensors[keys.ROLLOUT_LOG_PROBS].float(),
        tensors[keys.RESPONSE_MASK].float(),
        is_level=cfg.is_level,
        is_cap=cfg.is_cap,
        rejection=cfg.rejection,
        rejection_threshold=cfg.rejection_threshold,
    )
    batch[keys.ROLLOUT_CORRECTION_WEIGHTS] = weights
    return {f"rollout_correction/{name}": float(value) for name, value in metrics.items()}


def stamp_policy_version(batch: DataProto, version: int | None = None) -> None:
    """Every row records the trainer version (updates applied) of the weights that generated it, every sampled token
    its own (keys.TOKEN_POLICY_VERSION, -1 where none). A streaming rollout stamped the tokens already: a row then
    gets its oldest token's version."""
    tensors = batch.batch
    if keys.TOKEN_POLICY_VERSION not in tensors.keys():
        sampled = tensors[keys.RESPONSE_MASK] > 0
        batch[keys.TOKEN_POLICY_VERSION] = torch.where(sampled, version, -1).to(torch.int64)
        batch[keys.POLICY_VERSION] = torch.full((len(batch),), version, dtype=torch.int64)
        return
    versions = tensors[keys.TOKEN_POLICY_VERSION]
    oldest = versions.masked_fill(versions < 0, torch.iinfo(torch.int64).max).amin(-1)
    batch[keys.POLICY_VERSION] = torch.where(versions.amax(-1) >= 0, oldest, -1 if version is None else version)


def staleness_metrics(batch: DataProto, trainer_version: int) -> dict[str, float]:
    """How many updates the trainer is ahead of the weights that generated each row."""
    lag = (trainer_version - batch.batch[keys.POLICY_VERSION]).float()
    return {"async/staleness_mean": float(lag.mean()), "async/staleness_max": float(lag.max())}


def reference_log_probs(groups: RoleGroups, batch: DataProto) -> dict[str, float]:
    """batch[REF_LOG_PROBS] = the reference's log-probs of the responses (at the batch's sampling temperature).
    Metrics: for a MoE reference, its live routes' agreement with the rollout's (reference/moe/route_agreement...),
    and the mean |log-prob| gap to the rollout's (on the first step, the reference holds the weights that sampled:
    the gap a trainer without routing replay starts from)."""
    out = reference_call(groups, batch)
    batch[keys.REF_LOG_PROBS] = out.batch[keys.LOG_PROBS]
    metrics = _forward_metrics(out, "reference/", roles.REFERENCE_LOG_PROBS)
    return metrics | _rollout_gap(batch, keys.REF_LOG_PROBS, "reference/rollout_logprob_gap")


def reference_call(groups: RoleGroups, batch: DataProto) -> DataProto:
    """The reference's log-probs of the batch's responses (keys.LOG_PROBS): its role's, or the actor's with the LoRA
    adapters off (reference.from_actor_base)."""
    if groups.reference is not None:
        return groups.reference.call(ReferenceWorker.compute_log_probs, batch)
    base = DataProto(batch=batch.batch, non_tensor_batch=batch.non_tensor_batch, meta_info=dict(batch.meta_info))
    base.meta_info[keys.META_BASE_MODEL] = True
    return groups.actor_train.call(ActorWorker.compute_log_probs, base)


def old_log_probs(groups: RoleGroups, batch: DataProto) -> dict[str, float]:
    """batch[OLD_LOG_PROBS] = the trained policy's log-probs before this step's updates (and, with router_replay
    R2, batch[RECORDED_ROUTES] = the experts this forward chose). Metrics: the MoE route agreement with the
    rollout's routes (actor/moe/log_probs_route_agreement...), and the mean |log-prob| gap to the rollout's."""
    out = groups.actor_train.call(ActorWorker.compute_log_probs, batch)
    batch[keys.OLD_LOG_PROBS] = out.batch[keys.LOG_PROBS]
    if keys.RECORDED_ROUTES in out.batch.keys():
        batch[keys.RECORDED_ROUTES] = out.batch[keys.RECORDED_ROUTES]
    metrics = _forward_metrics(out, "actor/", roles.OLD_LOG_PROBS)
    return metrics | _rollout_gap(batch, keys.OLD_LOG_PROBS, "actor/rollout_logprob_gap")


def _rollout_gap(batch: DataProto, column: str, name: str) -> dict[str, float]:
    """{name: mean |batch[column] - rollout log-prob| over response tokens}, or {} without rollout log-probs."""
    if keys.ROLLOUT_LOG_PROBS not in batch.batch.keys():
        return {}
    mask = batch.batch[keys.RESPONSE_MASK].float()
    gap = (batch.batch[column] - batch.batch[keys.ROLLOUT_LOG_PROBS]).abs() * mask
    return {name: float(gap.sum() / mask.sum().clamp(min=1))}


def teacher_log_probs(groups: RoleGroups, batch: DataProto) -> None:
    """batch[TEACHER_LOG_PROBS] = the distillation teacher's log-probs of the student's sampled tokens."""
    batch[keys.TEACHER_LOG_PROBS] = groups.teacher.call(ReferenceWorker.compute_log_probs, batch).batch[keys.LOG_PROBS]


def values(groups: RoleGroups, batch: DataProto) -> dict[str, float]:
    out = groups.critic.call(CriticWorker.compute_values, batch)
    batch[keys.VALUES] = out.batch[keys.VALUES]
    return _forward_metrics(out, "critic/", roles.VALUES)


def advantages(
    batch: DataProto, algo: AlgorithmConfig, kl_coef: float, distill: DistillationConfig | None = None
) -> dict[str, float]:
    """Token rewards (post-processed scores, minus the KL penalty if KL is in the reward, minus the reverse KL to the
    teacher where distillation is a reward) and advantages."""
    tensors = batch.batch
    mask = tensors[keys.RESPONSE_MASK].float()
    scores = tensors[keys.TOKEN_LEVEL_SCORES].float()
    group_ids = as_group_ids(batch.non_tensor_batch[keys.UID])
    metrics: dict[str, float] = {}
    if algo.reward_norm is not None or algo.reward_clip is not None:
        sequence = postprocess_rewards(scores.sum(-1), group_ids, norm=algo.reward_norm, clip=algo.reward_clip)
        scores = place_on_last_token(sequence, tensors[keys.RESPONSE_MASK])
    rewards = scores
    if keys.REF_LOG_PROBS in tensors.keys():
        # On-policy steps skip the old log-probs; the sampler's own are then the policy's log-probs.
        policy_log_probs = (
            tensors[keys.OLD_LOG_PROBS] if keys.OLD_LOG_PROBS in tensors.keys() else tensors[keys.ROLLOUT_LOG_PROBS]
        )
        kl = masked_mean(kl_estimate(policy_log_probs, tensors[keys.REF_LOG_PROBS], "k1"), mask)
        metrics["actor/reference_kl"] = float(kl)
        if algo.use_kl_in_reward:
            rewards = kl_penalized_rewards(
                scores, tensors[keys.OLD_LOG_PROBS], tensors[keys.REF_LOG_PROBS], kl_coef, mask=mask
            )
            metrics["actor/kl_coef"] = kl_coef
    if keys.TEACHER_LOG_PROBS in tensors.keys():
        policy_log_probs = (
            tensors[keys.OLD_LOG_PROBS] if keys.OLD_LOG_PROBS in tensors.keys() else tensors[keys.ROLLOUT_LOG_PROBS]
        )
        reverse_kl = (policy_log_probs - tensors[keys.TEACHER_LOG_PROBS]) * mask  # per sampled token (k1)
        metrics["distill/reverse_kl"] = float(reverse_kl.sum() / mask.sum().clamp(min=1))
        if distill is not None and distill.mode == "reward":
            rewards = rewards - distill.coef * reverse_kl
    estimator = get_advantage_estimator(algo.adv_estimator)
    inputs = {"group_ids": group_ids, "gamma": algo.gamma, "lam": algo.lam, "norm_by_std": algo.norm_adv_by_std}
    if keys.VALUES in tensors.keys():
        inputs["values"] = tensors[keys.VALUES].float()
    if keys.REWARD_BASELINES in tensors.keys():
        inputs["baselines"] = tensors[keys.REWARD_BASELINES].float()
        metrics["remax/baseline_mean"] = float(inputs["baselines"].mean())
    adv, returns = estimator(rewards, mask, **inputs)  # it reads only what it needs
    batch[keys.TOKEN_LEVEL_REWARDS] = rewards
    batch[keys.ADVANTAGES] = adv
    batch[keys.RETURNS] = returns
    metrics["advantages/mean"] = float(masked_mean(adv, mask))
    return metrics


def train_actor(groups: RoleGroups, batch: DataProto, algo: AlgorithmConfig, seed: int) -> dict[str, float]:
    return train(groups.actor_train, ActorWorker.train_step, batch, algo, seed, "actor/", roles.TRAIN)


def train_critic(groups: RoleGroups, batch: DataProto, algo: AlgorithmConfig, seed: int) -> dict[str, float]:
    return train(groups.critic, CriticWorker.train_step, batch, algo, seed, "critic/", roles.CRITIC_TRAIN)


def train(
    group: WorkerGroup, train_step, batch: DataProto, algo: AlgorithmConfig, seed: int, prefix: str, phase: str
) -> dict[str, float]:
    """`ppo_epochs` passes over the batch in shuffled mini-batches; one optimizer step (`train_step`, a worker
    method) per mini-batch; metrics averaged over mini-batches and DP ranks, named `prefix` + metric; counts (the
    step's own, over DP already) added up over mini-batches (`perf/<phase>_tokens_...`)."""
    mini = algo.ppo_mini_batch_size or len(batch)
    collected: dict[str, list[float]] = {}
    counts: dict[str, float] = {}
    for epoch in range(algo.ppo_epochs):
        order = np.random.default_rng(seed + epoch).permutation(len(batch))
        for start in range(0, len(batch), mini):
            per_dp_rank = [m or {} for m in group.call(train_step, batch.select_idxs(order[start : start + mini]))]
            for name in {name for metrics in per_dp_rank for name in metrics if name.endswith("_count")}:
                counts[name] = counts.get(name, 0.0) + max(metrics.get(name, 0.0) for metrics in per_dp_rank)
            for metrics in per_dp_rank:
                for name, value in metrics.items():
                    if not name.endswith("_count"):
                        collected.setdefault(name, []).append(float(value))
    return {f"{prefix}{name}": float(np.mean(vals)) for name, vals in collected.items()} | _phase_tokens(counts, phase)


def sync_weights(
    groups: RoleGroups,
    probe_rows: DataProto | None,
    bucket_bytes: int,
    max_gap: float,
    version: int | None = None,
    in_flight: str | None = None,
    delta: bool = False,
    measure_memory: bool = False,
) -> dict[str, float]:
    """Trainer weights (the trainer's `version`) -> rollout engine, then a probe: both score the same sequences; the
    gap must stay small. `in_flight`: what the engine does with streaming requests in flight (keep, recompute or
    resubmit them). With LoRA adapter sync (groups.adapter_sync) only the adapters travel; with `delta` only what
    changed since the engine's version, switched to all at once (weight_sync_delta). A failed probe undoes a minimal
    sync (the hybrid engine's in-process one too) or an adapter load (the engine serves its version again, and the error
    says so); a full sync is not undone (no copy of the old weights is kept): the run stops, to resume from a
    checkpoint. `measure_memory`: the trainer's ranks count the sync's gathers on a CPU too (memory_report)."""
    started = time.perf_counter()
    if groups.hybrid is not None:  # in each rank's process, adapters or weights as the run syncs them
        loaded = groups.hybrid.call(HybridWorker.sync_engine_weights, version=version, measure_memory=measure_memory)
    elif groups.adapter_sync:
        refs = next(refs for refs in groups.actor_train.call(ActorWorker.publish_adapter) if refs)
        loaded = groups.actor_infer.call(RolloutWorker.load_adapter, refs, version=version, in_flight=in_flight)
    elif delta:
        loaded = _sync_deltas(groups, bucket_bytes, version, in_flight, measure_memory)
    else:
        published = groups.actor_train.call(ActorWorker.publish_hf_weights, bucket_bytes, measure_memory)
        refs = next(refs for refs in published if refs)
        loaded = groups.actor_infer.call(RolloutWorker.load_weight_buckets, refs, version=version, in_flight=in_flight)
    metrics = {
        "weight_sync/tensors": float(loaded[0]["tensors"]),
        "weight_sync/bytes": float(loaded[0]["bytes"]),
        "weight_sync/transfer_seconds": time.perf_counter() - started,  # (the probe aside)
    }
    if "full_bytes" in loaded[0]:  # a minimal sync: what a full one would have sent, what did not change
        metrics["weight_sync/full_bytes"] = float(loaded[0]["full_bytes"])
        metrics["weight_sync/unchanged_tensors"] = float(loaded[0]["unchanged"])
    if probe_rows is None:
        return metrics
    return metrics | {"weight_sync/logprob_gap": _probe(groups, probe_rows, max_gap, minimal_sync=delta)}


def _probe(groups: RoleGroups, probe_rows: DataProto, max_gap: float, minimal_sync: bool) -> float:
    """The engine's and the trainer's log-probs of the same sequences: their mean gap, or a WeightSyncError when it
    is over `max_gap` (after undoing the sync where the engine kept what it served before)."""
    probe = probe_rows.select(
        batch_keys=[
            keys.INPUT_IDS,
            keys.ATTENTION_MASK,
            keys.POSITION_IDS,
            keys.PROMPTS,
            keys.RESPONSES,
            keys.RESPONSE_MASK,
        ]
    )
    probe.meta_info[keys.META_TEMPERATURE] = 1.0
    probe.meta_info[keys.META_LIVE_ROUTES] = True  # the engine's probe routes live: so does the trainer's
    engine = groups.actor_infer.call(RolloutWorker.probe_log_probs, probe).batch[keys.LOG_PROBS]
    trainer = groups.actor_train.call(ActorWorker.compute_log_probs, probe).batch[keys.LOG_PROBS]
    mask = probe.batch[keys.RESPONSE_MASK].float()
    gap = float(masked_mean((engine - trainer).abs(), mask))
    if not gap <= max_gap:
        # the engine goes back to what it served where it kept it: a minimal sync's host copy, the adapter before
        if groups.adapter_sync or minimal_sync:
            reverted = _undo_sync(groups)
        else:
            reverted = (
                "; the engine holds them (a whole-weight sync, weight_sync_delta: false, keeps no copy of the version "
                "before it), so resume from the last checkpoint"
            )
        raise WeightSyncError(
            f"after the weight sync the rollout engine's log-probs differ from the trainer's by {gap:.2e} on average "
            f"(limit weight_sync_max_logprob_gap={max_gap}); the weights did not arrive intact{reverted}"
        )
    return gap


def _undo_sync(groups: RoleGroups) -> str:
    """The engine back on the version it served before the sync whose probe failed; what the error then says."""
    try:
        version = groups.actor_infer.call(RolloutWorker.revert_weights)[0]
    except RuntimeError as exc:  # e.g. the run's first sync, which filled an empty copy: no version before it
        reason = str(exc).strip().splitlines()[-1]
        return f"; undoing the sync failed ({reason}), so the engine holds them: resume from the last checkpoint"
    return f"; the engine serves version {version} again"


def _sync_deltas(
    groups: RoleGroups, bucket_bytes: int, version: int | None, in_flight: str | None, measure_memory: bool
) -> list[dict]:
    """A minimal sync: relative to the version every engine holds (whole tensors when they differ or hold none)."""
    held = set(groups.actor_infer.call(RolloutWorker.weights_version))
    engine_version = held.pop() if len(held) == 1 else None
    published = groups.actor_train.call(
        ActorWorker.publish_weight_deltas, bucket_bytes, version, engine_version, measure_memory
    )
    refs = next(refs for refs in published if refs)
    return groups.actor_infer.call(RolloutWorker.load_weight_deltas, refs, version=version, in_flight=in_flight)


def batch_metrics(batch: DataProto, seconds_generating: float) -> dict[str, float]:
    mask = batch.batch[keys.RESPONSE_MASK].float()
    lengths = mask.sum(-1)
    scores = batch.batch[keys.TOKEN_LEVEL_SCORES].sum(-1)
    return {
        "reward/mean": float(scores.mean()),
        "reward/max": float(scores.max()),
        "reward/min": float(scores.min()),
        "response_length/mean": float(lengths.mean()),
        "response_length/max": float(lengths.max()),
        "throughput/generated_tokens_per_s": float(lengths.sum()) / max(seconds_generating, 1e-9),
    }


def _forward_metrics(out: DataProto, prefix: str, phase: str) -> dict[str, float]:
    """A forward-only phase's metrics: its own named `prefix` + metric, its token counts `perf/<phase>_tokens_...`."""
    metrics = _mean_metrics(out.meta_info.get(keys.META_METRICS) or {}, prefix="")
    counts = {
        name: metrics.pop(name) for name in (keys.METRIC_TOKENS_FORWARDED, keys.METRIC_TOKENS_HELD) if name in metrics
    }
    named = {name if name.startswith(prefix) else prefix + name: value for name, value in metrics.items()}
    return named | _phase_tokens(counts, phase)


def _phase_tokens(counts: dict[str, float], phase: str) -> dict[str, float]:
    """perf/<phase>_tokens_forwarded and perf/<phase>_tokens_unshared (what the rows hold) from a phase's counts."""
    names = {keys.METRIC_TOKENS_FORWARDED: "tokens_forwarded", keys.METRIC_TOKENS_HELD: "tokens_unshared"}
    return {f"perf/{phase}_{names[name]}": value for name, value in counts.items() if name in names}


def prompt_share_saved(metrics: dict[str, float]) -> dict[str, float]:
    """perf/prompt_share_saved: the share of the tokens the step's Megatron phases would have forwarded unshared
    that prompt sharing did not forward (0 without it); nothing when no phase counted its tokens."""
    held = sum(v for name, v in metrics.items() if name.startswith("perf/") and name.endswith("_tokens_unshared"))
    forwarded = sum(v for name, v in metrics.items() if name.startswith("perf/") and name.endswith("_tokens_forwarded"))
    return {"perf/prompt_share_saved": 1.0 - forwarded / held} if held else {}


def _mean_metrics(metrics: dict, prefix: str) -> dict[str, float]:
    """One number per metric from the per-rank lists: counts (`*_count`) add up, everything else is averaged."""
    out = {}
    for name, value in metrics.items():
        values = value if isinstance(value, (list, tuple)) else [value]
        reduce = np.sum if name.endswith("_count") else np.mean
        out[name if name.startswith(prefix) else prefix + name] = float(reduce(values))
    return out


def hybrid_memory(groups: RoleGroups) -> dict[str, float]:
    """The hybrid engine's memory after each phase of the step, the most over its ranks (nothing without one)."""
    if groups.hybrid is None:
        return {}
    per_rank = groups.hybrid.call(HybridWorker.memory_by_phase)
    return {name: max(rank[name] for rank in per_rank if name in rank) for name in per_rank[0]}
