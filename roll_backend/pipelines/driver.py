"""Run a config to max_steps once: the synchronous loop (rl_step) or, with `async_generation.enabled`, the one-step
off-policy loop (async_loop); recovery.run_with_restarts wraps either with automatic restarts."""

from __future__ import annotations

from roll_backend.config.schema import PipelineConfig
from roll_backend.pipelines.async_loop import OneStepOffPolicyLoop
from roll_backend.pipelines.rl_step import rl_step
from roll_backend.pipelines.run import PipelineRun, StepHistory


def run_pipeline(
    config: PipelineConfig, run_metrics: dict[str, float] | None = None, history: StepHistory | None = None
) -> list[dict]:
    """Run `config` to max_steps once (Ray must be initialised); returns the per-step metrics."""
    with PipelineRun(config, run_metrics, history) as run:
        if config.async_generation.enabled:
            with OneStepOffPolicyLoop(run) as loop:
                for step in run.step_numbers():
                    run.log(step, loop.step(step))
        else:
            for step in run.step_numbers():
                run.log(step, rl_step(run, step))
        return run.history
