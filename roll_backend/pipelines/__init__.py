"""PPO and GRPO control loops, checkpoint/resume, metrics, automatic restart.

The loops are imported on first use, so the data and config checks (roll_backend.pipelines.data) load
without Ray: `roll-backend validate` checks the prompts and starts nothing heavy.
"""

__all__ = ["evaluate", "run_pipeline", "run_with_restarts"]


def __getattr__(name: str):
    if name == "run_pipeline":
        from roll_backend.pipelines.driver import run_pipeline

        return run_pipeline
    if name == "evaluate":
        from roll_backend.pipelines.driver import evaluate

        return evaluate
    if name == "run_with_restarts":
        from roll_backend.pipelines.recovery import run_with_restarts

        return run_with_restarts
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
