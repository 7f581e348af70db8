"""What a Hugging Face decoder's config.json implies about its tensors, for every backend that builds or plans one
(torch-free: the config rules read it before anything imports torch)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

QK_NORM_MODEL_TYPES = ("qwen3", "qwen3_moe")  # RMSNorm over each head of q and k, before RoPE


def has_qkv_bias(model_type: str, fields: Mapping[str, Any]) -> bool:
    """Whether q, k and v carry a bias: always in Qwen2 (its config has no flag), else as `qkv_bias` or
    `attention_bias` say."""
    return model_type == "qwen2" or bool(fields.get("qkv_bias", fields.get("attention_bias", False)))
