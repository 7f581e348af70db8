"""One synchronous RL step of GRPO (no critic) or PPO (critic + GAE), following the data path of DESIGN.md, and the
parts of it the asynchronous loop (async_loop.py) reuses."""

from __future__ import annotations

from roll_backend import keys, roles
from roll_backend.pipelines.data.mixture import per_source_reward_metrics
from roll_backend.pipelines.loops import phases
from roll_backend.pipelines.loops.dynamic_sampling import generate_filled
from roll_backend.pipelines.run import PipelineRun
from roll_backend.pipelines.services.ledger import admit_prompts, positions_of
from roll_backend.pipelines.services.memory_report import memory_report
from roll_backend.pipelines.services.phase_perf import SequenceLengths
from roll_backend.pipelines.services.tracking import PhaseTimer
from roll_backend.protocol import DataProto

PROBE_ROWS = 4  # sequences the post-sync log-prob probe scores with both engines


def rl_step(run: PipelineRun, step: int) -> dict[str, float]:
    """One step of GRPO (no critic) or PPO (critic + GAE), following the data path of DESIGN.md."""
    config = run.config
    timer = PhaseTimer(config.fault_tolerance.timeouts)
    if config.algorithm.dynamic_sampling:  # generates and scores until the batch is full of informative groups
        batch, refill_metrics = generate_filled(run, step, timer)
    else:
        with timer.phase(roles.GENERATE):
            batch = phases.generate(run.groups, step_prompts(run, step), config, step)
        refill_metrics = {}
    phases.stamp_policy_version(batch, run.rollout_version)
    generated = SequenceLengths.of(batch)
    metrics, trained = train_on_batch(run, batch, step, timer, timer.seconds[roles.GENERATE])
    metrics |= refill_metrics
    if len(trained):
        metrics |= sync_rollout_weights(run, trained, timer, step)
    metrics |= phases.hybrid_memory(run.groups)
    return metrics | step_perf(run, generated, trained, timer) | timer.metrics()


def step_prompts(run: PipelineRun, step: int) -> DataProto:
    """Step `step`'s prompts, tagged with their stream positions and admitted in the run's ledger."""
    size = run.config.rollout_batch_size
    return admit_prompts(run.data.batch_at(step, size), list(range(step * size, (step + 1) * size)), run.ledger)


def prepare_batch(
    run: PipelineRun, batch: DataProto, timer: PhaseTimer, seconds_generating: float
) -> tuple[dict, DataProto]:
    """What a generated batch needs from models that do not train: reward scores, batch metrics, dynamic sampling,
    reference log-probs. Returns (metrics, the batch kept). The asynchronous loop can run it on the next batch
    while the actor trains (async_generation.prepare_ahead); it then stores the result with `mark_prepared`."""
    groups, algo = run.groups, run.config.algorithm
    metrics = phases.generation_metrics(batch)
    if len(batch) == 0:  # dynamic sampling found no group with differing rewards
        return metrics, batch
    refilled = keys.TOKEN_LEVEL_SCORES in batch.batch.keys()  # dynamic_sampling.generate_filled scored and kept it
    if not refilled:
        with timer.phase(roles.SCORE):
            metrics |= phases.score(groups, batch, run.config.reward)
    metrics |= phases.batch_metrics(batch, seconds_generating)
    metrics |= per_source_reward_metrics(batch)
    if algo.dynamic_sampling and not refilled:  # (the asynchronous loop: drop without refill)
        generated = positions_of(batch)
        batch, dropped = phases.drop_uniform_groups(batch)
        metrics["dynamic_sampling/dropped_responses"] = dropped
        run.ledger.record("filtered", sorted(set(generated) - set(positions_of(batch))))
    if groups.has_reference and len(batch):
        with timer.phase(roles.REFERENCE_LOG_PROBS):
            metrics |= phases.reference_log_probs(groups, batch)
    if groups.teacher is not None and len(batch):
        with timer.phase(roles.TEACHER_LOG_PROBS):
            phases.teacher_log_probs(groups, batch)
    return metrics, batch


def mark_prepared(batch: DataProto, metrics: dict[str, float], seconds: dict[str, float]) -> None:
    """Record on the batch (kept in its meta_info, so it survives a checkpoint) that `prepare_batch` ran on it."""
    batch.meta_info[keys.META_PREPARED] = {"metrics": dict(metrics), "seconds": dict(seconds)}


def train_on_batch(run: PipelineRun, batch, step: int, timer: PhaseTimer, seconds_generating: float):
    """Everything between generation and the weight sync: `prepare_batch` (unless done already), old log-probs,
    correction, advantages, updates. Returns (metrics, the batch trained on), that batch empty when dynamic
    sampling left nothing to learn from."""
    config, groups, algo = run.config, run.groups, run.config.algorithm
    prepared = batch.meta_info.pop(keys.META_PREPARED, None)
    measuring = step == run.first_step  # the first step's model phases count their memory (memory_report)
    batch.meta_info[keys.META_MEASURE_MEMORY] = measuring
    if prepared is None:
        metrics, batch = prepare_batch(run, batch, timer, seconds_generating)
    else:  # its phases ran off the trainer's path; their seconds still count for their MFU
        metrics = dict(prepared["metrics"])
        timer.seconds.update(prepared["seconds"])
    if len(batch) == 0:
        return metrics, batch  # every group was uniform: nothing to learn from this step
    metrics |= phases.staleness_metrics(batch, run.policy_version)
    if phases.needs_old_log_probs(algo, len(batch)):
        with timer.phase(roles.OLD_LOG_PROBS):
            metrics |= phases.old_log_probs(groups, batch)
    if algo.rollout_correction.enabled:
        metrics |= phases.correct_rollout_mismatch(batch, algo)
    skipped = run.guards.skip_update(metrics, step)
    if skipped is not None:  # a skip guard tripped on the batch: no update, no weight sync
        run.ledger.record("skipped_by_guard", positions_of(batch))
        return metrics | skipped, batch.select_idxs([])
    if groups.critic is not None:
        with timer.phase(roles.VALUES):
            metrics |= phases.values(groups, batch)
    metrics |= phases.advantages(batch, algo, run.kl_ctrl.value, config.distillation)
    if groups.critic is not None:
        with timer.phase(roles.CRITIC_TRAIN):
            metrics |= phases.train_critic(groups, batch, algo, phases.step_seed(config, step, salt=2))
    with timer.phase(roles.TRAIN):
        metrics |= phases.train_actor(groups, batch, algo, phases.step_seed(config, step, salt=1))
    metrics |= phases.prompt_share_saved(metrics)
    if measuring:
        metrics |= memory_report(run)
    run.ledger.record("trained", positions_of(batch))
    run.policy_version += 1
    run.kl_ctrl.update(metrics.get("actor/reference_kl", 0.0), len(batch))
    return metrics, batch


def sync_rollout_weights(
    run: PipelineRun, trained, timer: PhaseTimer, step: int, in_flight: str | None = None
) -> dict[str, float]:
    """Trainer -> rollout engine after step `step`, probed on the first rows of the batch just trained on;
    `in_flight`: streaming requests on the engine are kept, recomputed or resubmitted. The first step's sync counts
    its memory (memory_report)."""
    config = run.config
    measuring = step == run.first_step
    with timer.phase(roles.WEIGHT_SYNC):
        metrics = phases.sync_weights(
            run.groups,
            trained.select_idxs(list(range(min(PROBE_ROWS, len(trained))))),
            config.weight_sync_bucket_bytes,
            config.logprob_gap_limit(),
            version=run.policy_version,
            in_flight=in_flight,
            delta=config.weight_sync_delta,
            measure_memory=measuring,
        )
    run.rollout_version = run.policy_version
    if measuring:
        metrics |= memory_report(run, only=roles.WEIGHT_SYNC)
    return metrics


def step_perf(run: PipelineRun, generated: SequenceLengths, trained, timer: PhaseTimer) -> dict[str, float]:
    """perf/ metrics of the step's timed phases (generation only when nothing was trained)."""
    timed = set(timer.seconds) if len(trained) else {roles.GENERATE}
    return run.perf.metrics(run.perf.step_flops(generated, trained, timed), timer.seconds)
