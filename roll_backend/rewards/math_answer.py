"""Math answer rewards: 1.0 when math-verify finds the response's final answer equivalent to the reference; DAPO's
scale of the same judgement (+1 / -1 over the response's end, as verl's math_dapo scorer)."""

from __future__ import annotations

import logging
import threading

logger = logging.getLogger(__name__)

DEFAULT_TIMEOUT_S = 5


def _timeout_for_this_thread(timeout_s: int | None) -> int | None:
    # math-verify times out with signal.alarm, which only works on the main thread: elsewhere it raises
    # ValueError. Off the main thread we run without its timeout (callers bound the work themselves,
    # e.g. by running rewards in Ray actors, whose sync methods run on the main thread).
    if threading.current_thread() is threading.main_thread():
        return timeout_s
    return None


def score(response_text: str, answer: str, timeout_s: int | None = DEFAULT_TIMEOUT_S) -> float:
    """1.0 if the response's answer (a \\boxed{} one preferred) equals `answer` mathematically, else 0.0.

    Equivalent forms count (1/2, 0.5, \\frac{1}{2}); unparsable text and timeouts score 0.0, never raise.
    """
    if not isinstance(response_text, str) or not isinstance(answer, str) or not response_text.strip():
        return 0.0
    # (imported here: math-verify loads sympy, a second of a core in every reward rank of a run that scores no math)
    from math_verify import parse, verify
    from math_verify.errors import TimeoutException

    timeout = _timeout_for_this_thread(timeout_s)
    try:
        gold = parse(answer, parsing_timeout=timeout)
        if not gold:  # a bare number without LaTeX delimiters may need them to parse
            gold = parse(f"${answer}$", parsing_timeout=timeout)
        predicted = parse(response_text, parsing_timeout=timeout)
        if not gold or not predicted:
            return 0.0
        return 1.0 if verify(gold, predicted, timeout_seconds=timeout) else 0.0
    except TimeoutException:
        logger.warning(
            "math-verify timed out after %ss on a response of %d chars; scoring 0", timeout, len(response_text)
        )
        return 0.0


DAPO_WINDOW = 300  # characters of a response's end DAPO's scorer reads (the longest MATH-500 answer has 159)


def dapo_score(response_text: str, answer: str) -> float:
    """+1.0 when the end of the response (DAPO_WINDOW characters: its `Answer:` line or last boxed answer) is
    equivalent to `answer`, else -1.0: the scale and window of DAPO's scorer, verl's default for math_dapo and aime
    sources, judged by math-verify."""
    return 1.0 if score(response_text[-DAPO_WINDOW:] if isinstance(response_text, str) else "", answer) else -1.0
