"""Procedural reasoning tasks as prompt rows: the `reasoning-gym` library's datasets (generators with their own
verifiers), picked by name, size and seed (data.reasoning_gym for training, data.val_reasoning_gym for validation).

Each row carries what the library's verifier needs in `extra_info["reasoning_gym"]` (the dataset's name and the
entry), which rewards.procedural.compute_score hands back to that verifier."""

from __future__ import annotations

from difflib import get_close_matches

from roll_backend.pipelines.data.rows import DataError, Rows
from roll_backend.rewards.procedural import EXTRA_INFO_KEY


def reasoning_gym_rows(spec) -> Rows:
    """`spec.size` entries of dataset `spec.name` drawn from `spec.seed` (and `spec.config`, its generator's
    settings), as prompt/answer rows with the dataset's name as data_source."""
    import reasoning_gym
    from reasoning_gym.factory import DATASETS

    if spec.name not in DATASETS:
        close = get_close_matches(spec.name, list(DATASETS), n=3)
        hint = f"; did you mean {', '.join(close)}?" if close else f" ({len(DATASETS)} datasets, e.g. basic_arithmetic)"
        raise DataError(f"data.reasoning_gym: reasoning-gym has no dataset {spec.name!r}{hint}")
    try:
        dataset = reasoning_gym.create_dataset(spec.name, size=spec.size, seed=spec.seed, **dict(spec.config))
    except (TypeError, ValueError, AssertionError) as exc:  # the generator refused its settings
        raise DataError(f"data.reasoning_gym {spec.name!r}: {exc}; check size, seed and config") from None
    rows = [
        {
            "prompt": entry["question"],
            "answer": str(entry["answer"]),
            "data_source": spec.name,
            "extra_info": {EXTRA_INFO_KEY: {"dataset": spec.name, "entry": dict(entry)}},
        }
        for entry in dataset
    ]
    return Rows(rows, [f"reasoning-gym {spec.name} (seed {spec.seed}) entry {i}" for i in range(len(rows))])
