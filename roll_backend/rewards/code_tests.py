"""Code rewards: the response's last fenced Python block runs against the reference's test cases, each test in its
own process through `run` (the reward worker passes the sandbox: roll_backend.agentic.sandbox, bubblewrap, with
TEST_LIMITS), and the score is the fraction of the first SCORED_TESTS that pass (verl's continuous score for its
code sources: codecontests, apps, codeforces, taco; some of their problems have hundreds of tests).

The reference (the row's ground truth, as the data stored it: a dict or its JSON text) is the APPS layout verl's code
data uses: `{"inputs": [...], "outputs": [...]}` for programs that read stdin and write stdout, with `"fn_name"` for
a function called with each input's arguments (module-level, or a method of `class Solution`); or a list of
`{"input": ..., "output": ...}` stdin tests. Expected outputs never enter the sandbox: the code sees one test's input
and its output is compared here, so code that reads its surroundings learns nothing that would pass another test.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np


class RunResult(Protocol):
    ok: bool  # the program ended by itself with exit code 0, within its limits
    stdout: str


CodeRunner = Callable[[str, str], RunResult]  # (program, its stdin) -> how it ran; each call a fresh process

# Per test (the runner's limits): CPU seconds are what a program needs (a slow host stretches the wall clock, not
# them); the wall limit only stops a program that waits.
TEST_LIMITS = {"cpu_s": 5.0, "wall_s": 20.0, "memory_mb": 1024, "output_bytes": 1 << 20, "disk_mb": 16}
PARALLEL_TESTS = 4  # tests of one response run at once (each is its own process)
SCORED_TESTS = 10  # verl's continuous score runs the first 10 tests
_FENCED = re.compile(r"```[ \t]*(?:python3?|py)?[ \t]*\n(.*?)```", re.DOTALL | re.IGNORECASE)
# Appended to the response's code for call tests: the arguments come on stdin, the result goes out as JSON on the
# last line (a result JSON cannot carry, e.g. a set, is written as its repr and fails to match).
_CALL_RUNNER = """

def __roll_call():
    import json, sys
    args = json.loads(sys.stdin.read())
    fn = globals().get({name!r})
    if fn is None and "Solution" in globals():
        fn = getattr(globals()["Solution"](), {name!r})
    result = fn(*args)
    result = list(result) if isinstance(result, tuple) else result
    try:
        line = json.dumps(result)
    except (TypeError, ValueError):
        line = repr(result)
    sys.stdout.write("\\n" + line + "\\n")

__roll_call()
"""


@dataclass(frozen=True)
class CodeTests:
    """Test cases: stdin texts and expected stdout texts, or (with `fn_name`) argument lists and return values."""

    inputs: list
    outputs: list
    fn_name: str | None = None


def parse_tests(reference: Any) -> CodeTests:
    """The reference's test cases; ValueError saying which layout is expected."""
    reference = _plain(json.loads(reference) if isinstance(reference, str) else reference)
    if isinstance(reference, list) and all(isinstance(t, dict) and {"input", "output"} <= set(t) for t in reference):
        reference = {"inputs": [t["input"] for t in reference], "outputs": [t["output"] for t in reference]}
    if not (isinstance(reference, dict) and isinstance(reference.get("inputs"), list)):
        raise ValueError(
            "code_tests: the reference must be {'inputs': [...], 'outputs': [...], 'fn_name': optional} (verl's and "
            f"APPS' layout, or its JSON text) or a list of {{'input', 'output'}} tests; got {str(reference)[:120]!r}"
        )
    inputs, outputs = reference["inputs"], reference.get("outputs")
    if not isinstance(outputs, list) or len(outputs) != len(inputs) or not inputs:
        raise ValueError(f"code_tests: {len(inputs)} inputs need as many outputs (got {str(outputs)[:80]!r}), >= 1")
    return CodeTests(inputs, outputs, reference.get("fn_name") or None)


def extract_code(response_text: str) -> str | None:
    """The last fenced code block (```python, ```py or bare ```), else None."""
    blocks = _FENCED.findall(response_text)
    return blocks[-1] if blocks else None


def score(response_text: str, reference: Any, run: CodeRunner) -> float:
    """The fraction of the reference's first SCORED_TESTS tests the response's code passes (0.0 without a code
    block), each test run by `run`."""
    tests = parse_tests(reference)
    code = extract_code(response_text)
    if code is None:
        return 0.0
    scored = range(min(SCORED_TESTS, len(tests.inputs)))
    with ThreadPoolExecutor(max_workers=min(PARALLEL_TESTS, len(scored))) as pool:
        passed = list(pool.map(lambda i: _passes(code, tests, i, run), scored))
    return sum(passed) / len(passed)


def _passes(code: str, tests: CodeTests, index: int, run: CodeRunner) -> bool:
    expected = tests.outputs[index]
    if tests.fn_name is None:
        result = run(code, _text(tests.inputs[index]))
        return result.ok and same_stdout(result.stdout, _text(expected))
    args = tests.inputs[index]
    result = run(code + _CALL_RUNNER.format(name=tests.fn_name), json.dumps(args if isinstance(args, list) else [args]))
    if not result.ok or not result.stdout.strip():
        return False
    try:
        returned = json.loads(result.stdout.strip().splitlines()[-1])
    except ValueError:
        return False
    # APPS wraps a return value in a list: [value] matches value too (as verl's checker reads it)
    return returned == expected or (isinstance(expected, list) and len(expected) == 1 and returned == expected[0])


def same_stdout(got: str, expected: str) -> bool:
    """Equal line by line ignoring trailing spaces and blank lines at the end, else token by token with numbers
    equal to 1e-6 (relative or absolute)."""
    if _lines(got) == _lines(expected):
        return True
    mine, theirs = got.split(), expected.split()
    return len(mine) == len(theirs) and all(a == b or _close(a, b) for a, b in zip(mine, theirs))


def _lines(text: str) -> list[str]:
    lines = [line.rstrip() for line in text.strip("\n").splitlines()]
    while lines and not lines[-1]:
        lines.pop()
    return lines


def _close(a: str, b: str) -> bool:
    try:
        x, y = float(a), float(b)
    except ValueError:
        return False
    return math.isclose(x, y, rel_tol=1e-6, abs_tol=1e-6)


def _text(value: Any) -> str:
    """A stdin/stdout test value as text: lines given as a list are joined."""
    return "\n".join(map(str, value)) + "\n" if isinstance(value, list) else str(value)


def _plain(value: Any) -> Any:
    """numpy arrays (a parquet's nested lists) as lists, recursively."""
    if isinstance(value, np.ndarray):
        value = value.tolist()
    if isinstance(value, dict):
        return {key: _plain(item) for key, item in value.items()}
    if isinstance(value, list):
        return [_plain(item) for item in value]
    return value
