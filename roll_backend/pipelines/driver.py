"""Run a config to max_steps once: the synchronous loop (rl_step) or, with `async_generation.enabled`, the one-step
off-policy loop (async_loop); recovery.run_with_restarts wraps either with automatic restarts."""

from __future__ import annotations

import dataclasses

from roll_backend.config.schema import PipelineConfig
from roll_backend.pipelines.async_loop import OneStepOffPolicyLoop
from roll_backend.pipelines.rl_step import rl_step
from roll_backend.pipelines.run import PipelineRun, StepHistory


def run_pipeline(
    config: PipelineConfig, run_metrics: dict[str, float] | None = None, history: StepHistory | None = None
) -> list[dict]:
    """Run `config` to max_steps once (Ray must be initialised); returns the per-step metrics."""
    with PipelineRun(config, run_metrics, history) as run:
        validation = run.validation
        if validation is not None and config.eval.before_train and run.first_step == 1:
            run.log(0, validation.run(run.groups, 0))
        if config.async_generation.enabled:
            with OneStepOffPolicyLoop(run) as loop:
                for step in run.step_numbers():
                    run.log(step, loop.step(step))
        else:
            for step in run.step_numbers():
                metrics = rl_step(run, step)
                if validation is not None and validation.due(step):
                    metrics |= validation.run(run.groups, step)
                run.log(step, metrics)
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
