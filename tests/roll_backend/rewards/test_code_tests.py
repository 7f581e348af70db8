"""The code reward: the response's last code block against the reference's tests (verl's APPS layout), each test
in its own sandboxed process; the expected outputs stay outside. Scores are fractions of tests passed."""

from __future__ import annotations

import json

import numpy as np
import pytest

from roll_backend.agentic.sandbox import SandboxLimits, make_sandbox
from roll_backend.rewards import code_tests
from roll_backend.rewards.registry import score_answer


def sandboxed(**limits):
    """The reward worker's runner: each program in a fresh bubblewrap sandbox with code_tests.TEST_LIMITS."""
    sandbox, bounds = make_sandbox(), SandboxLimits(**(code_tests.TEST_LIMITS | limits))
    return lambda code, stdin: sandbox.run_python(code, bounds, stdin=stdin)


RUN = sandboxed()

SUM_STDIN = {"inputs": ["1 2\n", "3 4\n", "10 -5\n"], "outputs": ["3\n", "7\n", "5\n"]}
ADD_CALLS = {"inputs": [[1, 2], [5, 6], [-1, 1]], "outputs": [[3], [11], 0], "fn_name": "add"}


def fenced(code: str, language: str = "python") -> str:
    return f"Reasoning first.\n```{language}\n{code}\n```\nDone."


@pytest.mark.parametrize(
    "response, reference, expected",
    [
        # stdin -> stdout: every test, one wrong, a crash after the first output, no code block at all
        (fenced("a, b = map(int, input().split())\nprint(a + b)"), SUM_STDIN, 1.0),
        (fenced("a, b = map(int, input().split())\nprint(a + b if a < 10 else 0)"), SUM_STDIN, 2 / 3),
        (fenced("print(3)\nraise SystemExit(1)"), SUM_STDIN, 0.0),
        ("print(3)", SUM_STDIN, 0.0),
        # the last block counts; lines given as lists; trailing spaces and blank lines do not matter
        (
            fenced("print('x')") + fenced("import sys\nfor v in sys.stdin: print(int(v) * 2, ' ')\nprint()"),
            {"inputs": [["1", "2"]], "outputs": [["2", "4"]]},
            1.0,
        ),
        # numbers equal to 1e-6; other tokens exactly
        (fenced("print(1/3)"), {"inputs": [""], "outputs": ["0.333333"]}, 1.0),
        (fenced("print('0.34')"), {"inputs": [""], "outputs": ["0.333333"]}, 0.0),
        # a function called with each input's arguments, module level or a method of class Solution; APPS wraps a
        # return value in a list ([3] matches 3)
        (fenced("def add(a, b):\n    return a + b", "py"), ADD_CALLS, 1.0),
        (fenced("class Solution:\n    def add(self, a, b):\n        return (a + b, )[0]", ""), ADD_CALLS, 1.0),
        (fenced("def add(a, b):\n    return {a + b}"), ADD_CALLS, 0.0),  # a set is not a JSON list
        (
            fenced("def add(a, b):\n    print(99)\n    return a + b if a > 0 else 7"),
            ADD_CALLS,
            2 / 3,
        ),  # its own output is ignored
    ],
)
def test_scores_are_the_fraction_of_tests_passed(response, reference, expected):
    assert code_tests.score(response, json.dumps(reference), RUN) == pytest.approx(expected)


def test_the_first_ten_tests_are_scored_as_verl_scores_them():
    """Some problems have hundreds of tests: verl's continuous score runs the first 10 (a failure past them is not
    seen; one among them costs a tenth)."""
    code = fenced("n = int(input())\nprint(n if n != 3 else -1)")
    fails_third = {"inputs": [f"{i}\n" for i in range(12)], "outputs": [f"{i}\n" for i in range(12)]}
    assert code_tests.score(code, fails_third, RUN) == pytest.approx(0.9)
    fails_eleventh = {"inputs": [f"{i + 8}\n" for i in range(12)], "outputs": [f"{i + 8}\n" for i in range(12)]}
    fails_eleventh["inputs"][10] = "3\n"
    assert code_tests.score(code, fails_eleventh, RUN) == 1.0


def test_a_test_that_runs_out_of_time_fails_alone():
    """A program that loops on one input is stopped at the per-test CPU limit; the other tests still count."""
    code = "n = int(input())\nwhile n == 0:\n    pass\nprint(n)"
    reference = {"inputs": ["0\n", "4\n"], "outputs": ["0\n", "4\n"]}
    assert code_tests.score(fenced(code), reference, sandboxed(cpu_s=1.0)) == 0.5  # (5 s by default)


def test_code_that_looks_around_finds_neither_the_expected_outputs_nor_the_host():
    """Each test's process sees its own input only: no file, variable or process holds another test's answer, and
    the host's files are not there (the sandbox's boundary)."""
    snoop = (
        "import os, sys\n"
        "seen = [p for p in os.listdir('/proc') if p.isdigit()] + os.listdir('/sandbox') + os.listdir('/tmp')\n"
        "print(sys.stdin.read().strip(), os.path.exists('/work'), os.path.exists('/etc/passwd'), sorted(seen))"
    )
    reference = {"inputs": ["a\n"], "outputs": ["a False False ['1', 'main.py', 'main.py']"]}
    assert code_tests.score(fenced(snoop), reference, RUN) == 1.0


def test_the_reference_arrives_typed_and_whole_through_the_registry():
    """verl's parquet keeps ground_truth as JSON text (or, read by pyarrow, nested arrays): either is one set of
    tests, not a list of accepted answers each scored alone."""
    response = fenced("a, b = map(int, input().split())\nprint(a + b)")
    as_arrays = {key: np.array(value, dtype=object) for key, value in SUM_STDIN.items()}
    listed = [{"input": i, "output": o} for i, o in zip(SUM_STDIN["inputs"], SUM_STDIN["outputs"])]
    for reference in (json.dumps(SUM_STDIN), as_arrays, listed):
        assert score_answer("code_tests", response, reference, RUN) == 1.0
    with pytest.raises(ValueError, match="reward 'code_tests' runs the response's code: pass run_code"):
        score_answer("code_tests", response, SUM_STDIN)  # no runner, no run


@pytest.mark.parametrize(
    "reference, message",
    [
        ("[1, 2]", "the reference must be {'inputs': [...], 'outputs': [...], 'fn_name': optional}"),
        ({"inputs": ["1"], "outputs": []}, "1 inputs need as many outputs"),
        ({"inputs": [], "outputs": []}, "0 inputs need as many outputs"),
        ("not json", "Expecting value"),
    ],
)
def test_a_reference_in_another_layout_is_an_error_naming_the_expected_one(reference, message):
    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("]", r"\]").replace("{", r"\{")):
        code_tests.score(fenced("print(1)"), reference, RUN)
