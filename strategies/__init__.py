"""Backends the roles call: InferStrategy / TrainStrategy and their Megatron and vLLM implementations."""
