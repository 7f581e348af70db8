"""`PipelineRun`: what one run holds (groups, data, KL controller, metrics tracker) with its set-up, checkpoints
and resume. The step itself is in rl_step.py, the loops in driver.py and async_loop.py."""

from __future__ import annotations

import logging
import time
from pathlib import Path

import psutil

from roll_backend import roles
from roll_backend.algorithms import make_kl_controller
from roll_backend.config.loader import config_to_yaml
from roll_backend.config.schema import PipelineConfig
from roll_backend.pipelines.data.offline_datasets import offline_datasets
from roll_backend.pipelines.groups import RoleGroups, build_role_groups
from roll_backend.pipelines.loops import phases
from roll_backend.pipelines.loops.offline import OfflineValidation
from roll_backend.pipelines.services import checkpoint as ckpt
from roll_backend.pipelines.services.guards import RunGuards
from roll_backend.pipelines.services.ledger import PromptLedger
from roll_backend.pipelines.services.phase_perf import PhasePerf
from roll_backend.pipelines.services.tracking import MetricsTracker, phase_deadline
from roll_backend.pipelines.services.validation import Validation
from roll_backend.protocol import DataProto
from roll_backend.workers.actor import ActorWorker
from roll_backend.workers.critic import CriticWorker

logger = logging.getLogger(__name__)


class StepHistory(list):
    """A run's metrics rows, one per step. PipelineRun appends each step's row, and calls `resumed(step)` once its
    groups are built and it stands after `step` (0: from the start): the rows of later steps go (they run again).
    The restart supervisor keeps one across attempts (recovery.TimedHistory, which also times restarts)."""

    def resumed(self, step: int) -> None:
        self[:] = [row for row in self if row["step"] <= step]


def ensure_model(config: PipelineConfig) -> None:
    """With `build_tiny_model`, write the tiny model and tokenizer to model_path unless it is already there."""
    if config.build_tiny_model is None or (Path(config.model_path) / "config.json").is_file():
        return
    from roll_backend.models.tiny import TinyModelSpec, build_tiny_model

    spec = TinyModelSpec(**{"seed": config.seed, **config.build_tiny_model})
    build_tiny_model(config.model_path, spec)


def _report_startup(first_step: int, groups_seconds: float) -> float:
    """Seconds from the process's start (imports included) to the first step, what a user waits before training;
    logged with the groups' share."""
    seconds = time.time() - psutil.Process().create_time()
    logger.info(
        "ready for step %d %.1f s after the process started (groups started in %.1f s)",
        first_step,
        seconds,
        groups_seconds,
    )
    return seconds


class PipelineRun:
    """Everything one run holds: groups, data, KL controller, tracker; `step_numbers()` are the steps left to run.
    `run_metrics` are added to every step's row (the restart supervisor's counters, kept by reference: it updates
    them during the run); rows go to `history` when given (the supervisor keeps one across restarts)."""

    def __init__(
        self, config: PipelineConfig, run_metrics: dict[str, float] | None = None, history: StepHistory | None = None
    ):
        from transformers import AutoTokenizer

        from roll_backend.pipelines.data.prompts import load_validation_prompts, run_prompts

        self.config = config
        self.output_dir = Path(config.output_dir)
        self.output_dir.mkdir(parents=True, exist_ok=True)
        (self.output_dir / "config.yaml").write_text(config_to_yaml(config))
        ensure_model(config)
        tokenizer = AutoTokenizer.from_pretrained(config.model_path)
        if config.offline:
            self.data, val_data = offline_datasets(config, tokenizer)
        else:
            self.data = run_prompts(config, tokenizer)
            val_prompts = load_validation_prompts(config, tokenizer)
        kl = config.algorithm.kl_ctrl
        self.kl_ctrl = make_kl_controller(kl.type, kl.kl_coef, kl.target_kl, kl.horizon)
        self.timeouts = config.fault_tolerance.timeouts
        self.run_metrics = run_metrics if run_metrics is not None else {}
        groups_started = time.monotonic()
        with phase_deadline(self.timeouts, roles.STARTUP):
            self.groups: RoleGroups = build_role_groups(config)
        groups_seconds = time.monotonic() - groups_started
        self.first_step = 1
        self.history = history if history is not None else StepHistory()
        # Trainer updates applied so far, and the version the rollout engine holds (equal in synchronous mode).
        self.policy_version = self.rollout_version = 0
        # Asynchronous mode: the next step's batch, generated while this step trained; saved with checkpoints.
        # Streaming mode: the buffer's finished groups (restored from a checkpoint; the loop then owns them).
        self.next_batch: DataProto | None = None
        # Streaming mode: the loop's snapshot for a checkpoint, () -> (buffered groups or None, driver state to add).
        self.stream_checkpoint = None
        self.resume_state: dict = {}  # the driver state of the checkpoint resumed from
        self.guards = RunGuards(config.guards)
        self.ledger = PromptLedger(self.output_dir)  # (begun by the training loop: evaluation leaves it alone)
        self.resumed_from: Path | None = None
        self.last_checkpoint: tuple[int, Path] | None = None  # (step, folder) of the latest save
        try:
            self.perf = PhasePerf(config, self.groups)
            # On every row: how many parameters the actor has and trains (LoRA: the adapters).
            counts = self.groups.actor_train.call(ActorWorker.parameter_counts)[0]
            self.model_metrics = {f"actor/{name}": float(value) for name, value in counts.items()}
            if config.checkpoint.resume:
                with phase_deadline(self.timeouts, roles.CHECKPOINT):
                    self._resume(config.checkpoint.resume)
            self.tracker = MetricsTracker(self.output_dir, config.logging, config.max_steps, self.first_step - 1)
            if config.offline:
                self.validation = None if val_data is None else OfflineValidation(config, val_data)
            else:
                self.validation = (
                    None if val_prompts is None else Validation(config, val_prompts, self.output_dir, self.first_step)
                )
            self.history.resumed(self.first_step - 1)
            self.startup_seconds = _report_startup(self.first_step, groups_seconds)
        except BaseException:
            self.groups.shutdown()
            raise

    def __enter__(self) -> PipelineRun:
        return self

    def __exit__(self, *exc) -> None:
        self.tracker.close()
        self.groups.shutdown()

    def step_numbers(self) -> range:
        return range(self.first_step, self.config.max_steps + 1)

    def log(self, step: int, metrics: dict[str, float]) -> None:
        metrics = {**metrics, **self.run_metrics, **self.model_metrics, **self.data.metrics()}
        if step == self.first_step:
            metrics["timing/startup_s"] = self.startup_seconds
        if step:  # (step 0: validation before training, no training batch)
            metrics |= self.data.step_metrics(step, self.config.rollout_batch_size) | self.guards.flags(metrics)
            metrics |= self.ledger.flush(step)
        self.history.append({"step": step, **metrics})
        self.tracker.log(step, metrics)
        save_every = self.config.checkpoint.save_steps
        if save_every and step and step % save_every == 0:  # (step 0: validation before training)
            with phase_deadline(self.timeouts, roles.CHECKPOINT):
                self.save_checkpoint(step)
        if step:
            self.guards.after_step(metrics, step, self._checkpoint_of)

    def _checkpoint_of(self, step: int) -> Path:
        """The checkpoint of `step`: the one just saved, else a new one (a stop guard's)."""
        if self.last_checkpoint is not None and self.last_checkpoint[0] == step:
            return self.last_checkpoint[1]
        with phase_deadline(self.timeouts, roles.CHECKPOINT):
            return self.save_checkpoint(step)

    # ---- checkpoints ---------------------------------------------------------------------------------------
    def save_checkpoint(self, step: int) -> Path:
        staged = ckpt.staging_dir(self.output_dir, step)
        self.groups.actor_train.call(ActorWorker.save_checkpoint, str(staged.resolve() / "actor"))
        if self.groups.critic is not None:
            self.groups.critic.call(CriticWorker.save_checkpoint, str(staged.resolve() / "critic"))
        pending, stream_state = self.next_batch, {}
        if self.stream_checkpoint is not None:
            pending, stream_state = self.stream_checkpoint()
        if pending is not None:
            pending.save_to_disk(staged / ckpt.NEXT_BATCH)
        self.ledger.record("in_flight_at_checkpoint", stream_state.get("stream", {}).get("in_flight", []))
        self.ledger.flush(step)
        self.ledger.save_to(staged)
        state = {
            "step": step,
            "kl_coef": self.kl_ctrl.value,
            "rng": ckpt.driver_rng_state(),
            "policy_version": self.policy_version,
            **stream_state,
        }
        folder = ckpt.commit_checkpoint(staged, state, self.config.checkpoint.keep_last)
        self.last_checkpoint = (step, folder)
        return folder

    def _resume(self, resume: str) -> None:
        path = ckpt.resume_checkpoint(resume, self.output_dir)  # logs what auto skips; refuses an incomplete folder
        if path is None:
            return
        state = ckpt.load_driver_state(path)
        with ckpt.loading(path):
            self.groups.actor_train.call(ActorWorker.load_checkpoint, str(Path(path).resolve() / "actor"))
            if self.groups.critic is not None:
                self.groups.critic.call(CriticWorker.load_checkpoint, str(Path(path).resolve() / "critic"))
        self.resumed_from = Path(path)
        self.kl_ctrl.value = state["kl_coef"]
        ckpt.restore_driver_rng(state["rng"])
        self.resume_state = state
        self.policy_version = self.rollout_version = state.get("policy_version", state["step"])
        if self.groups.actor_infer is not None:
            phases.sync_weights(
                self.groups,
                None,
                self.config.weight_sync_bucket_bytes,
                self.config.logprob_gap_limit(),
                version=self.policy_version,
                delta=self.config.weight_sync_delta,
            )
        if self.config.async_generation.enabled and (Path(path) / ckpt.NEXT_BATCH).is_file():
            # The batch the rollout had generated for the next step (one version behind) resumes as it was.
            self.next_batch = DataProto.load_from_disk(Path(path) / ckpt.NEXT_BATCH)
        self.first_step = state["step"] + 1
        logger.info("resumed from %s at step %d", path, self.first_step)
