"""The RL control loop shared by GRPO and PPO: set-up and resume, one step as data flows, checkpoints, metrics."""

from __future__ import annotations

import logging
from pathlib import Path

from roll_backend import keys
from roll_backend.algorithms import make_kl_controller
from roll_backend.config.loader import config_to_yaml
from roll_backend.config.schema import PipelineConfig
from roll_backend.pipelines import checkpoint as ckpt
from roll_backend.pipelines import steps
from roll_backend.pipelines.perf import PhasePerf, SequenceLengths
from roll_backend.pipelines.roles import RoleGroups, build_role_groups
from roll_backend.pipelines.tracking import MetricsTracker, PhaseTimer, phase_deadline
from roll_backend.protocol import DataProto

logger = logging.getLogger(__name__)

PROBE_ROWS = 4  # sequences the post-sync log-prob probe scores with both engines


def ensure_model(config: PipelineConfig) -> None:
    """With `build_tiny_model`, write the tiny model and tokenizer to model_path unless it is already there."""
    if config.build_tiny_model is None or (Path(config.model_path) / "config.json").is_file():
        return
    from roll_backend.models.tiny import TinyModelSpec, build_tiny_model

    spec = TinyModelSpec(**{"seed": config.seed, **config.build_tiny_model})
    build_tiny_model(config.model_path, spec)


class PipelineRun:
    """Everything one run holds: groups, data, KL controller, tracker; `steps()` yields the steps left to run.
    `run_metrics` are added to every step's row (the restart supervisor's counters); rows are appended to
    `history` when given (the supervisor keeps one list across restarts)."""

    def __init__(self, config: PipelineConfig, run_metrics: dict[str, float] | None = None, history: list[dict] | None = None):
        from transformers import AutoTokenizer

        from roll_backend.pipelines.data import PromptDataset

        self.config = config
        self.output_dir = Path(config.output_dir)
        self.output_dir.mkdir(parents=True, exist_ok=True)
        (self.output_dir / "config.yaml").write_text(config_to_yaml(config))
        ensure_model(config)
        self.data = PromptDataset(config.data, AutoTokenizer.from_pretrained(config.model_path), config.seed)
        kl = config.algorithm.kl_ctrl
        self.kl_ctrl = make_kl_controller(kl.type, kl.kl_coef, kl.target_kl, kl.horizon)
        self.timeouts = config.fault_tolerance.timeouts
        self.run_metrics = dict(run_metrics or {})
        with phase_deadline(self.timeouts, "startup"):
            self.groups: RoleGroups = build_role_groups(config)
        self.first_step = 1
        self.history: list[dict] = history if history is not None else []
        # Trainer updates applied so far, and the version the rollout engine holds (equal in synchronous mode).
        self.policy_version = self.rollout_version = 0
        # Asynchronous mode: the next step's batch, generated while this step trained; saved with checkpoints.
        self.next_batch: DataProto | None = None
        try:
            self.perf = PhasePerf(config, self.groups)
            if config.checkpoint.resume:
                with phase_deadline(self.timeouts, "checkpoint"):
                    self._resume(config.checkpoint.resume)
            self.tracker = MetricsTracker(self.output_dir, config.logging, config.max_steps, self.first_step - 1)
        except BaseException:
            self.groups.shutdown()
            raise

    def __enter__(self) -> "PipelineRun":
        return self

    def __exit__(self, *exc) -> None:
        self.tracker.close()
        self.groups.shutdown()

    def steps(self) -> range:
        return range(self.first_step, self.config.max_steps + 1)

    def log(self, step: int, metrics: dict[str, float]) -> None:
        metrics = {**metrics, **self.run_metrics, **self.data.metrics()}
        self.history.append({"step": step, **metrics})
        self.tracker.log(step, metrics)
        save_every = self.config.checkpoint.save_steps
        if save_every and step % save_every == 0:
            with phase_deadline(self.timeouts, "checkpoint"):
                self.save_checkpoint(step)

    # ---- checkpoints ---------------------------------------------------------------------------------------
    def save_checkpoint(self, step: int) -> Path:
        staged = ckpt.staging_dir(self.output_dir, step)
        self.groups.actor.save_checkpoint(str(staged.resolve() / "actor"))
        if self.groups.critic is not None:
            self.groups.critic.save_checkpoint(str(staged.resolve() / "critic"))
        if self.next_batch is not None:
            self.next_batch.save_to_disk(staged / ckpt.NEXT_BATCH)
        state = {"step": step, "kl_coef": self.kl_ctrl.value, "rng": ckpt.driver_rng_state(),
                 "policy_version": self.policy_version}
        return ckpt.commit_checkpoint(staged, state, self.config.checkpoint.keep_last)

    def _resume(self, resume: str) -> None:
        path = ckpt.latest_checkpoint(self.output_dir) if resume == "auto" else Path(resume)
        if path is None:
            logger.info("resume=auto: no checkpoint under %s yet; starting from step 1", self.output_dir)
            return
        state = ckpt.load_driver_state(path)
        self.groups.actor.load_checkpoint(str(Path(path).resolve() / "actor"))
        if self.groups.critic is not None:
            self.groups.critic.load_checkpoint(str(Path(path).resolve() / "critic"))
        self.kl_ctrl.value = state["kl_coef"]
        ckpt.restore_driver_rng(state["rng"])
        steps.sync_weights(self.groups, None, self.config.weight_sync_bucket_bytes, self.config.logprob_gap_limit())
        self.policy_version = self.rollout_version = state.get("policy_version", state["step"])
        if self.config.async_generation.enabled and (Path(path) / ckpt.NEXT_BATCH).is_file():
            # The batch the rollout had generated for the next step (one version behind) resumes as it was.
            self.next_batch = DataProto.load_from_disk(Path(path) / ckpt.NEXT_BATCH)
        self.first_step = state["step"] + 1
        logger.info("resumed from %s at step %d", path, self.first_step)


def rl_step(run: PipelineRun, step: int) -> dict[str, float]:
    """One step of GRPO (no critic) or PPO (critic + GAE), following the data path of DESIGN.md."""
    config = run.config
    timer = PhaseTimer(config.fault_tolerance.timeouts)
    with timer.phase("generate"):
        batch = steps.generate(run.groups, run.data.batch_at(step, config.rollout_batch_size), config, step)
    steps.stamp_policy_version(batch, run.rollout_version)
    generated = SequenceLengths.of(batch)
    metrics, trained = train_on_batch(run, batch, step, timer, timer.seconds["generate"])
    if len(trained):
        metrics |= sync_rollout_weights(run, trained, timer)
    return metrics | step_perf(run, generated, trained, timer) | timer.metrics()


def prepare_batch(run: PipelineRun, batch: DataProto, timer: PhaseTimer, seconds_generating: float) -> tuple[dict, DataProto]:
    """What a generated batch needs from models that do not train: reward scores, batch metrics, dynamic sampling,
    reference log-probs. Returns (metrics, the batch kept). The asynchronous loop can run it on the next batch
    while the actor trains (async_generation.prepare_ahead); it then stores the result with `mark_prepared`."""
    groups, algo = run.groups, run.config.algorithm
    metrics = {}
    with timer.phase("reward"):
        metrics |= steps.score(groups, batch)
    metrics |= steps.batch_metrics(batch, seconds_generating)
    if algo.dynamic_sampling:
        batch, dropped = steps.drop_uniform_groups(batch)
        metrics["dynamic_sampling/dropped_responses"] = dropped
    if groups.reference is not None and len(batch):
        with timer.phase("reference"):
            steps.log_probs(groups.reference, batch, keys.REF_LOG_PROBS)
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
    if prepared is None:
        metrics, batch = prepare_batch(run, batch, timer, seconds_generating)
    else:  # its phases ran off the trainer's path; their seconds still count for their MFU
        metrics = dict(prepared["metrics"])
        timer.seconds.update(prepared["seconds"])
    if len(batch) == 0:
        return metrics, batch  # every group was uniform: nothing to learn from this step
    metrics |= steps.staleness_metrics(batch, run.policy_version)
    if steps.needs_old_log_probs(algo, len(batch)):
        with timer.phase("log_probs"):
            steps.log_probs(groups.actor, batch, keys.OLD_LOG_PROBS)
    if algo.rollout_correction.enabled:
        metrics |= steps.correct_rollout_mismatch(batch, algo)
    if groups.critic is not None:
        with timer.phase("values"):
            steps.values(groups.critic, batch)
    metrics |= steps.advantages(batch, algo, run.kl_ctrl.value)
    if groups.critic is not None:
        with timer.phase("critic_train"):
            metrics |= steps.train(groups.critic, batch, algo, steps.step_seed(config, step, salt=2), "critic/")
    with timer.phase("train"):
        metrics |= steps.train(groups.actor, batch, algo, steps.step_seed(config, step, salt=1), "actor/")
    run.policy_version += 1
    run.kl_ctrl.update(metrics.get("actor/reference_kl", 0.0), len(batch))
    return metrics, batch


def sync_rollout_weights(run: PipelineRun, trained, timer: PhaseTimer) -> dict[str, float]:
    """Trainer -> rollout engine, probed on the first rows of the batch just trained on."""
    config = run.config
    with timer.phase("weight_sync"):
        metrics = steps.sync_weights(run.groups, trained.select_idxs(list(range(min(PROBE_ROWS, len(trained))))),
                                     config.weight_sync_bucket_bytes, config.logprob_gap_limit())
    run.rollout_version = run.policy_version
    return metrics


def step_perf(run: PipelineRun, generated: SequenceLengths, trained, timer: PhaseTimer) -> dict[str, float]:
    """perf/ metrics of the step's timed phases (generation only when nothing was trained)."""
    phases = set(timer.seconds) if len(trained) else {"generate"}
    return run.perf.metrics(run.perf.step_flops(generated, trained, phases), timer.seconds)


def run_pipeline(config: PipelineConfig, run_metrics: dict[str, float] | None = None, history: list[dict] | None = None) -> list[dict]:
    """Run `config` to max_steps once (Ray must be initialised); returns the per-step metrics. With
    `async_generation.enabled` the one-step off-policy loop (pipelines.async_loop) runs the steps;
    recovery.run_with_restarts wraps either with automatic restarts."""
    with PipelineRun(config, run_metrics, history) as run:
        if config.async_generation.enabled:
            from roll_backend.pipelines.async_loop import OneStepOffPolicyLoop

            with OneStepOffPolicyLoop(run) as loop:
                for step in run.steps():
                    run.log(step, loop.step(step))
        else:
            for step in run.steps():
                run.log(step, rl_step(run, step))
        return run.history
