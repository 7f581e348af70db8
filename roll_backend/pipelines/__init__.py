"""PPO and GRPO control loops, checkpoint/resume, metrics, automatic restart, split by job:

- `loops/`: one RL step (`rl_step`), the one-step off-policy and streaming loops, the offline trainers, and the
  phases they share;
- `data/`: prompt datasets and mixtures, rows and their checks, offline datasets, generated tasks;
- `services/`: checkpoints, loggers and tracking, validation, per-phase performance, the restart supervisor;
- here: the run's state (`run`), its role groups (`groups`) and the driver (`driver.run_pipeline`, `evaluate`).

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
        from roll_backend.pipelines.services.recovery import run_with_restarts

        return run_with_restarts
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
