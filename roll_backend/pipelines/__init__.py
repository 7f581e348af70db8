"""PPO and GRPO control loops, checkpoint/resume, metrics."""

from roll_backend.pipelines.loop import run_pipeline

__all__ = ["run_pipeline"]
