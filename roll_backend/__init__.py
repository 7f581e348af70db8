"""roll-backend: PPO/GRPO pipelines on Ray, Megatron-core training and vLLM rollout."""

__version__ = "0.1.0"
