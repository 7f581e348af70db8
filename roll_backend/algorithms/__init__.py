"""Pure torch math of PPO/GRPO: advantages, policy/value losses, KL, aggregation (no Ray, no backend)."""
