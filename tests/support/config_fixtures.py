"""The demo config the config tests start from, and the overrides that fix its tiny model's shape: every roles'
model_path interpolates ${output_dir}; a folder that does not exist means the head counts come from
build_tiny_model (4 attention heads of size 32, 2 kv heads, untied: set here), never from a model someone built in
runs/."""

from __future__ import annotations

from pathlib import Path

CONFIG = Path(__file__).resolve().parents[2] / "configs" / "grpo_tiny_cpu.yaml"
TINY_HEADS = [
    "build_tiny_model.num_attention_heads=4",
    "build_tiny_model.num_key_value_heads=2",
    "build_tiny_model.hidden_size=128",
    "build_tiny_model.tie_word_embeddings=false",
]
