"""Run a config to max_steps once: the synchronous loop (rl_step; offline.offline_step for sft, reward_model and
dpo) or, with `async_generation.enabled`, the one-step off-policy loop (async_loop) or the streaming one
(streaming, `async_generation.mode: streaming`); recovery.run_with_restarts wraps any of them with automatic
restarts. With checkpoint.export_hf_dir the trained model is exported at the end (export_peft_dir: its LoRA
adapters)."""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path

from roll_backend import roles
from roll_backend.config.schema import PipelineConfig
from roll_backend.pipelines.loops.offline import offline_step
from roll_backend.pipelines.loops.one_step_off_policy import OneStepOffPolicyLoop
from roll_backend.pipelines.loops.rl_step import rl_step
from roll_backend.pipelines.loops.streaming import StreamingLoop
from roll_backend.pipelines.run import PipelineRun, StepHistory
from roll_backend.pipelines.services.tracking import phase_deadline
from roll_backend.workers.actor import ActorWorker

logger = logging.getLogger(__name__)


def run_pipeline(
    config: PipelineConfig, run_metrics: dict[str, float] | None = None, history: StepHistory | None = None
) -> list[dict]:
    """Run `config` to max_steps once (Ray must be initialised); returns the per-step metrics."""
    with PipelineRun(config, run_metrics, history) as run:
        validation = run.validation
        if not run.ledger.begin(run.resumed_from):
            logger.warning("checkpoint %s has no prompt ledger (older than ledgers): it starts here", run.resumed_from)
        if validation is not None and config.eval.before_train and run.first_step == 1:
            run.log(0, validation.run(run.groups, 0))
        if config.async_generation.enabled:
            loop_class = StreamingLoop if config.async_generation.mode == "streaming" else OneStepOffPolicyLoop
            with loop_class(run) as loop:
                for step in run.step_numbers():
                    metrics = loop.step(step)
                    # Between steps, on the weights just synced: the rollout ranks take the validation calls
                    # between their generation calls (streaming: beside the requests in flight).
                    if validation is not None and validation.due(step):
                        metrics |= validation.run(run.groups, step)
                    run.log(step, metrics)
        else:
            step_fn = offline_step if config.offline else rl_step
            for step in run.step_numbers():
                metrics = step_fn(run, step)
                if validation is not None and validation.due(step):
                    metrics |= validation.run(run.groups, step)
                run.log(step, metrics)
        run.ledger.flush(config.max_steps)  # (streaming: what the run ended with)
        saved = config.checkpoint
        for export, out_dir in (
            (ActorWorker.export_hf, saved.export_hf_dir),
            (ActorWorker.export_peft, saved.export_peft_dir),
        ):
            if out_dir:
                with phase_deadline(run.timeouts, roles.CHECKPOINT):
                    run.groups.actor_train.call(export, str(Path(out_dir).resolve()))
        return run.history


def evaluate(config: PipelineConfig) -> dict[str, float]:
    """Validation alone (Ray must be initialised): the model of `checkpoint.resume` (else model_path) on
    data.val_path with the `eval` settings; returns {"step": the checkpoint's step (0 without), val/... metrics}
    and logs them to config.output_dir (it saves no checkpoint)."""
    config = dataclasses.replace(config, checkpoint=dataclasses.replace(config.checkpoint, save_steps=0))
    with PipelineRun(config) as run:
        if run.validation is None:
            raise ValueError("evaluation needs validation prompts: set data.val_path")
        step = run.first_step - 1
        metrics = run.validation.run(run.groups, step)
        run.log(step, metrics)
        return {"step": step, **metrics}
