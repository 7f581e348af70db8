"""Format rewards: 1.0 when the response's text has the shape a task asks for (a regex), else 0.0."""

from __future__ import annotations

import re
from collections.abc import Callable

# A response that ends with its final answer in \boxed{...} (trailing whitespace/period allowed).
BOXED_AT_END = r"(?s).*\\boxed\{.+\}\s*\.?\s*"
# R1-style reasoning then answer tags.
THINK_ANSWER = r"(?s)\s*<think>.+?</think>\s*<answer>.+?</answer>\s*"


def regex_format(pattern: str) -> Callable[[str, str], float]:
    """A scorer giving 1.0 when the whole response matches `pattern` (the reference answer is ignored)."""
    compiled = re.compile(pattern)

    def score(response_text: str, answer: str = "") -> float:
        if not isinstance(response_text, str):
            return 0.0
        return 1.0 if compiled.fullmatch(response_text) else 0.0

    score.__name__ = f"regex_format({pattern!r})"
    return score


boxed_score = regex_format(BOXED_AT_END)
think_answer_score = regex_format(THINK_ANSWER)
