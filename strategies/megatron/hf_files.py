"""A Hugging Face model folder's weights, read lazily from its safetensors, and whether it has a reward model's score
head (what a critic's value head can load). No Megatron import: the validator reads folders with it too."""

from __future__ import annotations

import json
from pathlib import Path

import torch


class SafetensorsReader:
    """Reads named tensors lazily from a Hugging Face checkpoint folder (single file or sharded index)."""

    def __init__(self, model_dir: str | Path):
        from safetensors import safe_open

        model_dir = Path(model_dir)
        index = model_dir / "model.safetensors.index.json"
        if index.exists():
            weight_map = json.loads(index.read_text())["weight_map"]
        elif (model_dir / "model.safetensors").exists():
            with safe_open(model_dir / "model.safetensors", framework="pt") as f:
                weight_map = {name: "model.safetensors" for name in f.keys()}
        else:
            raise FileNotFoundError(
                f"no model.safetensors(.index.json) in {model_dir}; export the model as safetensors."
            )
        self.model_dir = model_dir
        self._weight_map = weight_map
        self._open = safe_open

    def __contains__(self, name: str) -> bool:
        return name in self._weight_map

    def get(self, name: str) -> torch.Tensor:
        if name not in self._weight_map:
            raise KeyError(f"tensor {name!r} is not in the checkpoint at {self.model_dir}")
        with self._open(self.model_dir / self._weight_map[name], framework="pt") as f:
            return f.get_tensor(name)


SCORE_HEAD = "score.weight"  # [num_labels, hidden] in Qwen2/LlamaForSequenceClassification


def score_head_problem(model_dir: str | Path) -> str | None:
    """Why `model_dir` cannot give a value head its weights (no score head, or more than one label); None if it can."""
    try:
        reader = SafetensorsReader(model_dir)
    except FileNotFoundError as exc:
        return str(exc)
    if SCORE_HEAD not in reader:
        return (
            f"{model_dir} has no {SCORE_HEAD!r} (a Hugging Face *ForSequenceClassification reward model has one); "
            f"use value_head_init=fresh to start the value head from scratch"
        )
    labels = reader.get(SCORE_HEAD).shape[0]
    if labels != 1:
        return f"{model_dir}: {SCORE_HEAD} has {labels} labels; a value head reads a reward model with num_labels=1"
    return None
