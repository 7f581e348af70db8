"""Defaults that depend on where a role runs, filled into the config tree before it is typed (a value the YAML sets
always wins):

- a role with GPUs (num_gpus_per_rank > 0, or hosted on the hybrid engine of a trainer with GPUs) gets what a GPU
  user expects: bfloat16 parameters and engine, the distributed optimizer, Megatron's sequence parallelism (at
  tp > 1), an engine with CUDA graphs (not eager);
  the CPU defaults stay float32 and eager (vLLM's CPU build, bf16 emulated where the CPU lacks it);
- the rollout engine's max_model_len, unset, holds the longest prompt plus the response (single-turn runs; a
  multi-turn run's conversation is longer, so it sets its own).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from roll_backend import roles
from roll_backend.config.schema import DataConfig, PipelineConfig

GPU_DEFAULTS: dict[str, dict[str, Any]] = {
    "megatron_train": {
        "params_dtype": "bfloat16",
        "sequence_parallel": True,
        "optimizer": {"use_distributed_optimizer": True},
    },
    "megatron_infer": {"params_dtype": "bfloat16", "sequence_parallel": True},
    "vllm_rollout": {"dtype": "bfloat16", "enforce_eager": False},
}
_DATA_DEFAULTS = {f.name: f.default for f in dataclasses.fields(DataConfig)}
_RUN_DEFAULTS = {f.name: f.default for f in dataclasses.fields(PipelineConfig)}


def with_device_defaults(data: dict) -> dict:
    """The config tree (plain dicts) with the device-dependent defaults filled where the YAML left them unset."""
    data = dict(data)
    trainer_gpus = _gpus(data.get(roles.ACTOR_TRAIN))
    for name in roles.MODEL_ROLES:
        section = data.get(name)
        if not isinstance(section, dict) or not isinstance(section.get("strategy"), dict):
            continue
        gpus = trainer_gpus if section.get("hybrid") else _gpus(section)
        strategy = section["strategy"]
        if gpus > 0:
            strategy = _filled(strategy, GPU_DEFAULTS.get(strategy.get("name"), {}))
        if name == roles.ACTOR_INFER and data.get("agentic") is None:
            strategy = _with_model_len(strategy, data)
        data[name] = {**section, "strategy": strategy}
    return data


def _gpus(section: Any) -> float:
    value = section.get("num_gpus_per_rank", 0) if isinstance(section, dict) else 0
    return value if isinstance(value, (int, float)) else 0


def _filled(settings: dict, defaults: dict) -> dict:
    out = dict(settings)
    for key, value in defaults.items():
        if isinstance(value, dict):  # a nested section (optimizer): fill inside it; a non-mapping is typed later
            inner = out.get(key) or {}
            if isinstance(inner, dict):
                out[key] = _filled(inner, value)
        else:
            out.setdefault(key, value)
    return out


def _with_model_len(strategy: dict, data: dict) -> dict:
    if "max_model_len" in strategy or strategy.get("name") != "vllm_rollout":
        return strategy
    prompt = strategy.get("max_prompt_length") or (data.get("data") or {}).get(
        "max_prompt_length", _DATA_DEFAULTS["max_prompt_length"]
    )
    response = data.get("response_length", _RUN_DEFAULTS["response_length"])
    if not all(isinstance(v, int) and not isinstance(v, bool) for v in (prompt, response)):
        return strategy  # a type error: the typed build reports it
    return {**strategy, "max_model_len": prompt + response}
