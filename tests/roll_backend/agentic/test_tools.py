"""Tools: Hermes/Qwen tool calls parsed from text, the calculator's values and refusals, ToolBox turning every
failure into an error result the model reads, user tools from a file, and the schemas a chat template takes."""

from __future__ import annotations

import json
import threading
import time

import pytest

from roll_backend.agentic.sandbox import SandboxLimits
from roll_backend.agentic.tools import (
    BUILTIN_TOOLS,
    CalculatorTool,
    PythonCodeTool,
    ToolBox,
    ToolCall,
    ToolError,
    load_user_tools,
    parse_tool_calls,
    tool_schema,
)
from roll_backend.errors import UserCodeError

# ---- parsing ------------------------------------------------------------------------------------------------


def test_parses_one_call_in_qwen_format():
    text = 'Let me compute.\n<tool_call>\n{"name": "calculator", "arguments": {"expression": "2+2"}}\n</tool_call>'
    calls, problems = parse_tool_calls(text)
    assert problems == []
    assert calls == [
        ToolCall(
            name="calculator",
            arguments={"expression": "2+2"},
            raw='<tool_call>\n{"name": "calculator", "arguments": {"expression": "2+2"}}\n</tool_call>',
        )
    ]


def test_parses_several_calls_and_arguments_given_as_a_json_string():
    text = (
        '<tool_call>{"name": "python", "arguments": "{\\"code\\": \\"print(1)\\"}"}</tool_call> then '
        '<tool_call>{"name": "calculator", "arguments": {"expression": "1/3"}}</tool_call>'
        '<tool_call>{"name": "clock"}</tool_call>'
    )
    calls, problems = parse_tool_calls(text)
    assert problems == []
    assert [(c.name, c.arguments) for c in calls] == [
        ("python", {"code": "print(1)"}),
        ("calculator", {"expression": "1/3"}),
        ("clock", {}),
    ]


def test_text_without_calls_gives_nothing():
    assert parse_tool_calls("The answer is 4.") == ([], [])


def test_malformed_blocks_are_reported_and_the_good_ones_kept():
    text = (
        "<tool_call>{not json}</tool_call>"
        '<tool_call>{"arguments": {}}</tool_call>'
        '<tool_call>{"name": "python", "arguments": [1, 2]}</tool_call>'
        '<tool_call>{"name": "python", "arguments": "{oops"}</tool_call>'
        '<tool_call>["python"]</tool_call>'
        '<tool_call>{"name": "calculator", "arguments": {"expression": "1"}}</tool_call>'
        '<tool_call>{"name": "python", "arguments": {"code": "x"}'
    )
    calls, problems = parse_tool_calls(text)
    assert [c.name for c in calls] == ["calculator"]
    assert len(problems) == 6
    assert problems[0].startswith("tool call 1: bad JSON (Expecting property name enclosed in double quotes")
    assert problems[1] == "tool call 2: no tool name (a non-empty string under 'name'): '{\"arguments\": {}}'"
    assert problems[2].startswith("tool call 3: tool 'python': arguments must be a JSON object, got list")
    assert problems[3].startswith("tool call 4: tool 'python': arguments are a string but not JSON")
    assert problems[4].startswith('tool call 5: expected a JSON object {"name": ..., "arguments": {...}}, got list')
    assert problems[5].startswith("tool call 7: <tool_call> at character ")
    assert problems[5].endswith("is never closed with </tool_call>")


def test_an_unclosed_block_before_a_good_one_does_not_swallow_it():
    text = '<tool_call>{"name": "a"\n<tool_call>{"name": "b", "arguments": {}}</tool_call>'
    calls, problems = parse_tool_calls(text)
    assert [c.name for c in calls] == ["b"]
    assert problems == ["tool call 1: <tool_call> at character 0 is never closed with </tool_call>"]


# ---- the calculator ------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "expression, expected",
    [
        ("2 * (3 + 4) ** 2", "98"),
        ("7 // 2 + 7 % 2", "4"),
        ("-3 ** 2", "-9"),
        ("1 / 4", "0.25"),
        ("sqrt(16)", "4"),
        ("round(2.675, 2)", "2.67"),
        ("max(1, 5, 3) - min(4, 2)", "3"),
        ("log(8, 2) + log10(1000)", "6"),
        ("abs(-2.5)", "2.5"),
        ("cos(pi)", "-1"),
        ("e", "2.71828182845905"),
        ("2 ** 100", "1267650600228229401496703205376"),
    ],
)
def test_calculator_values(expression, expected):
    assert CalculatorTool()(expression=expression) == expected


@pytest.mark.parametrize(
    "expression, refusal",
    [
        ("__import__('os').system('ls')", "calling \"__import__('os').system\" is not allowed"),
        ("__import__('os')", "calling '__import__' is not allowed"),
        ("().__class__.__bases__", "attribute access '().__class__.__bases__' is not allowed"),
        ("open", "the name 'open' is not allowed"),
        ("'a' * 3", "the constant 'a' is not allowed"),
        ("[1, 2]", "List ('[1, 2]') is not allowed"),
        ("9 ** 9 ** 9", "9**387420489 is too large (over 10000 bits)"),
        ("1 / 0", "division by zero"),
        ("sqrt(-1)", "math domain error"),
        ("(-8) ** 0.5", "the result is a complex number"),
        ("round(1, 10 ** 9)", "round() takes a whole number of digits between -100 and 100"),
        ("2 +", "not an arithmetic expression (invalid syntax)"),
    ],
)
def test_calculator_refusals_are_messages_not_crashes(expression, refusal):
    started = time.monotonic()
    with pytest.raises(ToolError) as caught:
        CalculatorTool()(expression=expression)
    assert refusal in str(caught.value) and str(caught.value).startswith("cannot evaluate ")
    assert time.monotonic() - started < 1.0


# ---- running calls ------------------------------------------------------------------------------------------


class EchoTool:
    name = "echo"
    description = "Repeat a text n times."
    parameters = {
        "type": "object",
        "properties": {"text": {"type": "string"}, "times": {"type": "integer"}},
        "required": ["text"],
    }

    def __call__(self, text: str, times: int = 1) -> str:
        if times < 0:
            raise ValueError("times must be >= 0")
        return text * times


class SlowTool:
    name = "slow"
    description = "Waits until released."
    parameters = {"type": "object", "properties": {}, "required": []}

    def __init__(self):
        self.release = threading.Event()

    def __call__(self) -> str:
        self.release.wait(10)
        return "done"


def test_a_good_call_returns_the_tools_text():
    box = ToolBox([EchoTool(), CalculatorTool()])
    result = box.execute(ToolCall("echo", {"text": "ab", "times": 2}, raw=""))
    assert (result.name, result.content, result.error) == ("echo", "abab", False)
    assert result.as_message() == {"role": "tool", "name": "echo", "content": "abab"}
    assert box.execute(ToolCall("calculator", {"expression": "6*7"}, raw="")).content == "42"


def test_unknown_tool_is_an_error_result_naming_the_available_ones():
    result = ToolBox([EchoTool(), CalculatorTool()]).execute(ToolCall("search", {}, raw=""))
    assert result.error and result.content == "unknown tool 'search'; available: calculator, echo"


def test_bad_arguments_name_the_expected_parameters():
    box = ToolBox([EchoTool()])
    result = box.execute(ToolCall("echo", {"txt": "a", "times": "2"}, raw=""))
    assert result.error
    assert result.content == (
        "tool 'echo': unknown argument 'txt'; missing argument 'text'; argument 'times' should be integer, got str. "
        "It takes: text (string, required), times (integer)"
    )


def test_a_raising_tool_is_an_error_result_and_a_tool_error_is_shown_verbatim():
    box = ToolBox([EchoTool(), CalculatorTool()])
    raised = box.execute(ToolCall("echo", {"text": "a", "times": -1}, raw=""))
    assert raised.error and raised.content == "tool 'echo' raised ValueError: times must be >= 0"
    refused = box.execute(ToolCall("calculator", {"expression": "1/0"}, raw=""))
    assert refused.error and refused.content == "cannot evaluate '1/0': division by zero"


def test_a_slow_tool_times_out_and_the_box_goes_on():
    slow = SlowTool()
    box = ToolBox([slow, EchoTool()], timeout_s=0.2)
    started = time.monotonic()
    result = box.execute(ToolCall("slow", {}, raw=""))
    assert time.monotonic() - started < 1.0
    assert result.error and result.content == "tool 'slow' did not finish within 0.2s and was abandoned"
    slow.release.set()
    assert box.execute(ToolCall("echo", {"text": "still here"}, raw="")).content == "still here"


def test_long_results_are_truncated_with_a_note():
    result = ToolBox([EchoTool()], max_result_chars=10).execute(ToolCall("echo", {"text": "x", "times": 50}, raw=""))
    assert result.content == "x" * 10 + "\n[truncated: 50 characters, the first 10 shown]" and not result.error


def test_duplicate_tool_names_are_refused():
    with pytest.raises(ValueError, match="tool names must be unique; echo given more than once"):
        ToolBox([EchoTool(), EchoTool()])


def test_python_tool_through_the_box():
    box = ToolBox([PythonCodeTool(SandboxLimits(wall_s=5, cpu_s=2))])
    calls, _ = parse_tool_calls(
        '<tool_call>{"name": "python", "arguments": {"code": "print(sum(range(10)))"}}</tool_call>'
    )
    ok = box.execute(calls[0])
    assert (ok.content, ok.error) == ("45", False)
    failed = box.execute(ToolCall("python", {"code": "import socket\nsocket.create_connection(('1.1.1.1', 53))"}, ""))
    assert failed.error
    assert failed.content.startswith("Error: network access is blocked in the sandbox (socket.")


# ---- schemas and user tools -----------------------------------------------------------------------------------


def test_builtin_schemas_have_the_chat_template_shape():
    schemas = ToolBox([factory() for factory in BUILTIN_TOOLS.values()]).schemas()
    assert [s["function"]["name"] for s in schemas] == ["python", "calculator"]
    for schema in schemas:
        assert set(schema) == {"type", "function"} and schema["type"] == "function"
        assert set(schema["function"]) == {"name", "description", "parameters"}
        assert schema["function"]["parameters"]["type"] == "object"
        assert json.loads(json.dumps(schema)) == schema
    assert tool_schema(CalculatorTool())["function"]["parameters"]["required"] == ["expression"]


USER_TOOLS = '''
from typing import Literal, Optional


def weather(city: str, days: int = 1, unit: Literal["C", "F"] = "C", hourly: bool = False,
            tags: list[str] | None = None, extra: Optional[dict] = None, note=None) -> str:
    """Forecast for a city.

    A second paragraph the schema leaves out.

    Args:
        city: The city's name,
            in English.
        days (int): How many days ahead.
    """
    return f"{city}: sunny for {days} day(s) in {unit}"


class Clock:
    name = "clock"
    description = "The time."
    parameters = {"type": "object", "properties": {}, "required": []}

    def __call__(self):
        return "12:00"


shout = str.upper
'''


def test_user_function_becomes_a_tool_with_an_exact_schema(tmp_path):
    path = tmp_path / "my_tools.py"
    path.write_text(USER_TOOLS)
    weather, clock = load_user_tools(str(path), ["weather", "Clock"])
    assert tool_schema(weather) == {
        "type": "function",
        "function": {
            "name": "weather",
            "description": "Forecast for a city.",
            "parameters": {
                "type": "object",
                "properties": {
                    "city": {"type": "string", "description": "The city's name, in English."},
                    "days": {"type": "integer", "description": "How many days ahead."},
                    "unit": {"enum": ["C", "F"]},
                    "hourly": {"type": "boolean"},
                    "tags": {"type": "array", "items": {"type": "string"}},
                    "extra": {"type": "object"},
                    "note": {},
                },
                "required": ["city"],
            },
        },
    }
    box = ToolBox([weather, clock])
    assert box.execute(ToolCall("weather", {"city": "Oslo", "days": 2}, "")).content == "Oslo: sunny for 2 day(s) in C"
    assert box.execute(ToolCall("clock", {}, "")).content == "12:00"


def test_user_tool_errors_name_the_file_and_what_it_defines(tmp_path):
    path = tmp_path / "my_tools.py"
    path.write_text(USER_TOOLS)
    with pytest.raises(ValueError) as missing:
        load_user_tools(str(path), ["weather", "search"])
    assert str(missing.value) == f"tools file {str(path)!r} defines no 'search'; it defines: Clock, weather"
    with pytest.raises(FileNotFoundError, match="tools file 'nowhere/tools.py' not found"):
        load_user_tools("nowhere/tools.py", ["x"])
    with pytest.raises(ModuleNotFoundError, match="tools module 'no_such_tools_module' is not importable"):
        load_user_tools("no_such_tools_module", ["x"])
    broken = tmp_path / "broken.py"
    broken.write_text("raise RuntimeError('config missing')\n")
    with pytest.raises(UserCodeError, match=r"loading tools from '.*broken.py' raised RuntimeError: config missing"):
        load_user_tools(str(broken), ["x"])
    with pytest.raises(TypeError, match=r"my_tools.py:shout is a method_descriptor, neither a tool"):
        load_user_tools(str(path), ["shout"])
