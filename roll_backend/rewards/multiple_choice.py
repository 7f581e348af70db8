"""Multiple-choice reward: 1.0 when the response's chosen letter (A-J) is the reference's.

The choice is read, in order of preference, from a final \\boxed{X}, an "answer is (X)" / "Answer: X" phrase, or
a response that is the letter alone (with optional parentheses or a period). The reference may be the letter, "(X)",
or a 0-based option index.
"""

from __future__ import annotations

import re

LETTERS = "ABCDEFGHIJ"
_BOXED = re.compile(r"\\boxed\{\s*\(?([A-J])\)?\s*\}")
_PHRASE = re.compile(r"(?i:answer)\s*(?:is|:)?\s*:?\s*\(?([A-J])\)?(?![A-Za-z])")
_ALONE = re.compile(r"\s*\(?([A-J])\)?\.?\s*")


def extract(response_text: str) -> str | None:
    """The letter the response chose, or None when it names none unambiguously."""
    for pattern in (_BOXED, _PHRASE):
        found = pattern.findall(response_text)
        if found:
            return found[-1].upper()
    alone = _ALONE.fullmatch(response_text)
    return alone.group(1) if alone else None


def reference_letter(answer) -> str | None:
    if isinstance(answer, int) and not isinstance(answer, bool):
        return LETTERS[answer] if 0 <= answer < len(LETTERS) else None
    text = str(answer).strip().strip("()").strip().upper()
    if text.isdigit():
        return reference_letter(int(text))
    return text if len(text) == 1 and text in LETTERS else None


def score(response_text: str, answer) -> float:
    if not isinstance(response_text, str):
        return 0.0
    reference = reference_letter(answer)
    return 1.0 if reference is not None and extract(response_text) == reference else 0.0
