"""Synthetic prompt sets for demos and tests: task name -> generator of (prompt, answer) rows, no files needed."""

from __future__ import annotations

import random
from collections.abc import Callable, Mapping

# A generator takes (num_prompts, rng) and returns that many {"prompt": str, "answer": str} rows.
TaskGenerator = Callable[[int, random.Random], list[dict[str, str]]]

# The characters copy_digit prompts and answers use: a tiny model's char tokenizer needs only these
# (TinyModelSpec(tokenizer="char", char_alphabet=COPY_DIGIT_ALPHABET)).
COPY_DIGIT_ALPHABET = "0123456789 copy"


def copy_digit(num_prompts: int, rng: random.Random) -> list[dict[str, str]]:
    """ "copy 7" -> "7": the answer is the prompt's digit (scored by the `copy_digit` reward)."""
    digits = [rng.randrange(10) for _ in range(num_prompts)]
    return [{"prompt": f"copy {digit}", "answer": str(digit)} for digit in digits]


def copy_digit_pairs(num_prompts: int, rng: random.Random) -> list[dict[str, str]]:
    """Preference pairs of copy_digit: the prompt's digit is chosen, another digit rejected (reward_model, dpo)."""
    rows = copy_digit(num_prompts, rng)
    for row in rows:
        row["rejected"] = str((int(row["answer"]) + rng.randrange(1, 10)) % 10)
    return rows


def episodes(num_prompts: int, rng: random.Random) -> list[dict[str, str]]:
    """Rows that only seed an environment's episodes (agentic runs, the prompt comes from the environment): an
    empty prompt and answer, `seed` (the row's extra_info.seed) drawn at random."""
    return [{"prompt": "", "answer": "", "seed": rng.randrange(2**31 - 1)} for _ in range(num_prompts)]


SYNTHETIC_TASKS: Mapping[str, TaskGenerator] = {
    "copy_digit": copy_digit,
    "copy_digit_pairs": copy_digit_pairs,
    "episodes": episodes,
}


def generate_task(name: str, num_prompts: int, seed: int) -> list[dict[str, str]]:
    """`num_prompts` rows of task `name`, the same for the same seed."""
    try:
        generator = SYNTHETIC_TASKS[name]
    except KeyError:
        raise ValueError(f"unknown synthetic task '{name}'; known: {', '.join(sorted(SYNTHETIC_TASKS))}.") from None
    if num_prompts < 1:
        raise ValueError(f"data.synthetic.num_prompts={num_prompts}; it must be >= 1.")
    return generator(num_prompts, random.Random(seed))
