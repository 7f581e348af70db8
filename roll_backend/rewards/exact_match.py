"""Exact-match reward: 1.0 when the response's final answer is the reference string, after light normalisation."""

from __future__ import annotations

import re

_BOXED = re.compile(r"\\boxed\{([^{}]*(?:\{[^{}]*\}[^{}]*)*)\}")
_SPACES = re.compile(r"\s+")


def normalize(text: str) -> str:
    """Lower-case, collapse whitespace, drop surrounding whitespace and a trailing period."""
    return _SPACES.sub(" ", text).strip().rstrip(".").strip().lower()


def extract_final_answer(response_text: str) -> str:
    """The last \\boxed{...} content when there is one, else the whole response."""
    boxed = _BOXED.findall(response_text)
    return boxed[-1] if boxed else response_text


def score(response_text: str, answer: str) -> float:
    if not isinstance(response_text, str) or not isinstance(answer, str):
        return 0.0
    return 1.0 if normalize(extract_final_answer(response_text)) == normalize(answer) else 0.0
