"""GSM8K reward: 1.0 when the number after the response's last `####` equals the reference, as GSM8K's solutions
write their answer (verl's strict gsm8k scorer); `flexible` takes the last number in the response instead."""

from __future__ import annotations

import re

_STRICT = re.compile(r"####\s*(-?[0-9][0-9.,]*)")
_NUMBER = re.compile(r"-?[0-9][0-9.,]*")


def _number(text: str) -> str:
    """'1,234.50' -> '1234.5': thousands separators, a trailing period and trailing zeros after the point dropped."""
    text = text.replace(",", "").rstrip(".")
    if "." in text:
        text = text.rstrip("0").rstrip(".")
    return text


def extract(response_text: str, flexible: bool = False) -> str | None:
    """The response's final answer as a normalised number, or None."""
    found = _NUMBER.findall(response_text) if flexible else _STRICT.findall(response_text)
    return _number(found[-1]) if found else None


def score(response_text: str, answer: str) -> float:
    """1.0 when the `#### N` answer equals `answer` (itself a number, or a GSM8K solution ending in `#### N`)."""
    if not isinstance(response_text, str) or not isinstance(answer, str):
        return 0.0
    reference = extract(answer) or _number(answer.strip())
    predicted = extract(response_text)
    return 1.0 if predicted is not None and predicted == reference else 0.0


def flexible_score(response_text: str, answer: str) -> float:
    """As `score`, with the response's last number as its answer (no `####` needed)."""
    if not isinstance(response_text, str) or not isinstance(answer, str):
        return 0.0
    reference = extract(answer) or _number(answer.strip())
    predicted = extract(response_text, flexible=True)
    return 1.0 if predicted is not None and predicted == reference else 0.0
