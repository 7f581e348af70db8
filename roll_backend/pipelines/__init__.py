"""PPO and GRPO control loops, checkpoint/resume, metrics."""
