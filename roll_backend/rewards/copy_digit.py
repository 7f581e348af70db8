"""Copy-digit reward: 1.0 for exactly the reference digit, 0.5 for the right digit followed by more text, else 0.0.

The half credit lets a random tiny model (which rarely stops right after the digit) find the task:
first it learns which digit to say, then that stopping there earns the rest.
"""

from __future__ import annotations

PARTIAL_CREDIT = 0.5


def score(response_text: str, answer: str) -> float:
    if not isinstance(response_text, str) or not isinstance(answer, str) or not answer.strip():
        return 0.0
    response, answer = response_text.strip(), answer.strip()
    if response == answer:
        return 1.0
    return PARTIAL_CREDIT if response.startswith(answer) else 0.0
