"""What a run keeps and reports beside its loop: checkpoints, loggers and metrics tracking, validation, per-phase
performance, and the supervisor that restarts a failed run."""
