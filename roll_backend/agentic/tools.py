"""Tools a model calls in a multi-turn rollout: the call format (Hermes/Qwen `<tool_call>` JSON blocks), the
built-in tools (sandboxed Python, a calculator), tools from a user's file, and `ToolBox`, which runs calls and
turns every failure into a tool message for the model instead of an exception for the rollout.
"""

from __future__ import annotations

import ast
import functools
import inspect
import json
import math
import operator
import re
import threading
import time
import types
import typing
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from roll_backend.agentic.sandbox import Sandbox, SandboxLimits, make_sandbox
from roll_backend.errors import UserCodeError
from roll_backend.rewards.user_functions import import_user_module, is_file_path, source_file

SHOWN_CHARS = 200  # how much of a malformed call an error message shows
CALL_OPEN, CALL_CLOSE = "<tool_call>", "</tool_call>"


class Tool(Protocol):
    """A tool: `parameters` is the JSON schema of its keyword arguments; the call returns what the model reads."""

    name: str
    description: str
    parameters: dict

    def __call__(self, **arguments: Any) -> str: ...


class ToolError(Exception):
    """A tool's own failure: the message goes to the model verbatim and the result is marked an error."""


def tool_schema(tool: Tool) -> dict:
    """The OpenAI function format that `tokenizer.apply_chat_template(messages, tools=[...])` takes."""
    return {
        "type": "function",
        "function": {"name": tool.name, "description": tool.description, "parameters": tool.parameters},
    }


# ---- built-in tools -----------------------------------------------------------------------------------------


class PythonCodeTool:
    """Runs the model's Python in the sandbox (agentic/sandbox/) and returns its output, or its error as a ToolError.
    Made where the sandbox cannot run, it refuses to start (SandboxUnavailable says why and what to set)."""

    name = "python"

    def __init__(self, limits: SandboxLimits = SandboxLimits(), sandbox: Sandbox | None = None):
        self.limits = limits
        self.sandbox = sandbox if sandbox is not None else make_sandbox()
        self.description = (
            "Run Python 3 code and return what it prints (stdout) or its error. Each call starts a fresh "
            "interpreter: print what you need to see. No network, no subprocesses, files only in its working "
            f"directory; limits: {limits.wall_s:g} s, {limits.memory_mb} MB, {limits.output_bytes} bytes of output."
        )
        self.parameters = {
            "type": "object",
            "properties": {"code": {"type": "string", "description": "The Python source to run."}},
            "required": ["code"],
        }

    def __call__(self, code: str) -> str:
        result = self.sandbox.run_python(code, self.limits)
        if not result.ok:
            raise ToolError(result.as_tool_message())
        return result.as_tool_message()


def _power(base, exponent):
    # Refuse before computing: 9**9**9 would take minutes and gigabytes as an exact integer.
    if isinstance(base, int) and isinstance(exponent, int) and exponent > 0 and abs(base) > 1:
        if exponent * math.log2(abs(base)) > CalculatorTool.MAX_RESULT_BITS:
            raise ValueError(f"{base}**{exponent} is too large (over {CalculatorTool.MAX_RESULT_BITS} bits)")
    return base**exponent


def _round(number, digits=0):
    if not isinstance(digits, int) or abs(digits) > 100:
        raise ValueError(f"round() takes a whole number of digits between -100 and 100, got {digits!r}")
    return round(number, digits)


class CalculatorTool:
    """Evaluates arithmetic by walking its syntax tree: numbers, + - * / // % **, parentheses, a few math
    functions and constants; anything else (names, attributes, imports, strings) is refused with a message."""

    name = "calculator"
    description = "Evaluate an arithmetic expression, e.g. '2 * (3 + 4) ** 2' or 'sqrt(2) * pi'."
    MAX_RESULT_BITS = 10_000  # ~3000 decimal digits
    MAX_CHARS = 1000
    BINARY = {
        ast.Add: operator.add,
        ast.Sub: operator.sub,
        ast.Mult: operator.mul,
        ast.Div: operator.truediv,
        ast.FloorDiv: operator.floordiv,
        ast.Mod: operator.mod,
        ast.Pow: _power,
    }
    UNARY = {ast.USub: operator.neg, ast.UAdd: operator.pos}
    FUNCTIONS: dict[str, Callable] = {
        "abs": abs,
        "round": _round,
        "min": min,
        "max": max,
        **{name: getattr(math, name) for name in ("sqrt", "exp", "log", "log2", "log10", "floor", "ceil")},
        **{name: getattr(math, name) for name in ("sin", "cos", "tan", "asin", "acos", "atan")},
    }
    CONSTANTS = {"pi": math.pi, "e": math.e, "tau": math.tau}
    ALLOWED = (
        f"numbers, + - * / // % ** and parentheses, the functions {', '.join(FUNCTIONS)} and the constants "
        f"{', '.join(CONSTANTS)}"
    )
    parameters = {
        "type": "object",
        "properties": {"expression": {"type": "string", "description": f"Arithmetic with {ALLOWED}."}},
        "required": ["expression"],
    }

    def __call__(self, expression: str) -> str:
        try:
            value = self.evaluate(expression)
        except (ValueError, ArithmeticError, TypeError) as exc:
            raise ToolError(f"cannot evaluate {expression!r:.{SHOWN_CHARS}}: {exc}") from None
        return str(value) if isinstance(value, int) else f"{value:.15g}"

    def evaluate(self, expression: str) -> int | float:
        """The expression's value; ValueError for anything that is not plain arithmetic."""
        if not isinstance(expression, str) or len(expression) > self.MAX_CHARS:
            raise ValueError(f"the expression must be a string of at most {self.MAX_CHARS} characters")
        try:
            tree = ast.parse(expression.strip(), mode="eval")
        except SyntaxError as exc:
            raise ValueError(f"not an arithmetic expression ({exc.msg})") from None
        value = self._value(tree.body)
        if isinstance(value, complex):
            raise ValueError("the result is a complex number; only real arithmetic is supported")
        return value

    def _value(self, node: ast.AST):
        if isinstance(node, ast.Constant) and type(node.value) in (int, float):
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in self.BINARY:
            return self.BINARY[type(node.op)](self._value(node.left), self._value(node.right))
        if isinstance(node, ast.UnaryOp) and type(node.op) in self.UNARY:
            return self.UNARY[type(node.op)](self._value(node.operand))
        if isinstance(node, ast.Name) and node.id in self.CONSTANTS:
            return self.CONSTANTS[node.id]
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in self.FUNCTIONS:
            if node.keywords:
                raise ValueError(f"{node.func.id}() takes positional arguments only")
            return self.FUNCTIONS[node.func.id](*(self._value(arg) for arg in node.args))
        raise ValueError(f"{self._refusal(node)} is not allowed; the calculator takes {self.ALLOWED}")

    def _refusal(self, node: ast.AST) -> str:
        if isinstance(node, ast.Call):
            called = node.func.id if isinstance(node.func, ast.Name) else ast.unparse(node.func)
            return f"calling {called!r:.{SHOWN_CHARS}}"
        if isinstance(node, ast.Name):
            return f"the name {node.id!r}"
        if isinstance(node, ast.Attribute):
            return f"attribute access {ast.unparse(node)!r:.{SHOWN_CHARS}}"
        if isinstance(node, ast.Constant):
            return f"the constant {node.value!r:.{SHOWN_CHARS}}"
        return f"{type(node).__name__} ({ast.unparse(node)!r:.{SHOWN_CHARS}})"


BUILTIN_TOOLS: dict[str, Callable[[], Tool]] = {"python": PythonCodeTool, "calculator": CalculatorTool}


# ---- user tools ---------------------------------------------------------------------------------------------

_ARG_ENTRY = re.compile(r"(\w+)(?:\s*\([^)]*\))?:(.*)")
_JSON_TYPES = {str: "string", int: "integer", float: "number", bool: "boolean", list: "array", dict: "object"}


class FunctionTool:
    """A plain function as a tool: named after it, described by its docstring's first paragraph, its parameters
    the JSON schema of its signature (a parameter without a default is required)."""

    def __init__(self, fn: Callable):
        self.fn = fn
        self.name = fn.__name__
        self.description = _first_paragraph(inspect.getdoc(fn) or "")
        self.parameters = function_parameters(fn)

    def __call__(self, **arguments: Any) -> Any:
        return self.fn(**arguments)


def function_parameters(fn: Callable) -> dict:
    """The JSON schema of `fn`'s keyword arguments from its type hints (str, int, float, bool, list[...], dict,
    Optional, Literal); descriptions from a Google-style `Args:` section when the docstring has one."""
    hints = typing.get_type_hints(fn)
    described = _argument_descriptions(inspect.getdoc(fn) or "")
    properties, required = {}, []
    for name, parameter in inspect.signature(fn).parameters.items():
        if parameter.kind in (parameter.VAR_POSITIONAL, parameter.VAR_KEYWORD):
            continue
        schema = _type_schema(hints[name]) if name in hints else {}
        if name in described:
            schema["description"] = described[name]
        properties[name] = schema
        if parameter.default is parameter.empty:
            required.append(name)
    return {"type": "object", "properties": properties, "required": required}


def _type_schema(hint: Any) -> dict:
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if hint in _JSON_TYPES:
        return {"type": _JSON_TYPES[hint]}
    if origin in (typing.Union, types.UnionType):
        present = [arg for arg in args if arg is not type(None)]
        return _type_schema(present[0]) if len(present) == 1 else {}
    if origin is typing.Literal:
        return {"enum": list(args)}
    if origin is list:
        return {"type": "array", **({"items": _type_schema(args[0])} if args else {})}
    if origin is dict:
        return {"type": "object"}
    return {}


def _first_paragraph(doc: str) -> str:
    return " ".join(doc.strip().split("\n\n")[0].split())


def _argument_descriptions(doc: str) -> dict[str, str]:
    """`name: text` (or `name (type): text`) entries of a Google-style `Args:` section; deeper-indented lines
    continue the entry above."""
    described: dict[str, str] = {}
    section = re.search(r"^Args:\n((?:[ \t]+\S.*(?:\n|$))+)", doc, re.M)
    if section is None:
        return described
    lines = section.group(1).splitlines()
    indent = len(lines[0]) - len(lines[0].lstrip())
    current = None
    for line in lines:
        entry = _ARG_ENTRY.match(line[indent:]) if len(line) - len(line.lstrip()) == indent else None
        if entry:
            current = entry.group(1)
            described[current] = entry.group(2).strip()
        elif current is not None:
            described[current] = f"{described[current]} {line.strip()}".strip()
    return described


def load_user_tools(path: str, names: Sequence[str], kwargs: Mapping[str, Any] | None = None) -> list[Tool]:
    """The tools `names` defined in `path` (a .py file or an importable module): tool objects (name, description,
    parameters, __call__ or the stateful create / execute), tool classes (made with `kwargs`), or plain functions
    (see FunctionTool)."""
    module = _import_user_module(path)
    tools = []
    for name in names:
        obj = getattr(module, name, None)
        if obj is None:
            defined = sorted(n for n, v in vars(module).items() if not n.startswith("_") and _is_defined_in(v, module))
            raise ValueError(f"tools file {path!r} defines no {name!r}; it defines: {', '.join(defined) or 'nothing'}")
        tools.append(_as_tool(obj, f"{path}:{name}", kwargs))
    return tools


def _is_defined_in(value: Any, module: types.ModuleType) -> bool:
    return getattr(value, "__module__", None) == module.__name__ or _is_tool_like(value)


def _is_tool_like(obj: Any) -> bool:
    described = all(hasattr(obj, attr) for attr in ("name", "description", "parameters"))
    return described and (callable(obj) or is_stateful(obj))


def is_stateful(tool: Any) -> bool:
    """A tool with an instance per trajectory (verl's BaseTool): `create(instance_id, **create_kwargs)`,
    `execute(instance_id, **arguments)`, and optionally `reward(instance_id)` and `release(instance_id)`."""
    return callable(getattr(tool, "create", None)) and callable(getattr(tool, "execute", None))


def _as_tool(obj: Any, where: str, kwargs: Mapping[str, Any] | None = None) -> Tool:
    if inspect.isclass(obj):
        obj = obj(**(kwargs or {}))
    if _is_tool_like(obj):
        return obj
    if inspect.isfunction(obj) or inspect.isbuiltin(obj):
        return FunctionTool(obj)
    raise TypeError(
        f"{where} is a {type(obj).__name__}, neither a tool (name, description, parameters, __call__) nor a function"
    )


def _import_user_module(path: str) -> types.ModuleType:
    is_file = is_file_path(path)
    if is_file and not Path(path).is_file():
        raise FileNotFoundError(f"tools file {path!r} not found (looked in {Path.cwd()}); give a .py file or a module")
    if not is_file and source_file(path) is None:
        raise ModuleNotFoundError(f"tools module {path!r} is not importable (not on sys.path); or give a .py file")
    try:
        return import_user_module(path)
    except Exception as exc:
        raise UserCodeError(f"loading tools from {path!r} raised {type(exc).__name__}: {exc}") from exc


# ---- parsing calls ------------------------------------------------------------------------------------------


@dataclass
class ToolCall:
    name: str
    arguments: dict
    raw: str  # the whole block as the model wrote it


def parse_tool_calls(text: str) -> tuple[list[ToolCall], list[str]]:
    """Hermes/Qwen calls in a model's text: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` blocks
    (arguments may be a JSON string). Returns the calls and one message per malformed block; never raises."""
    calls: list[ToolCall] = []
    problems: list[str] = []
    position, number = 0, 0
    while (start := text.find(CALL_OPEN, position)) != -1:
        number += 1
        body_start = start + len(CALL_OPEN)
        end = text.find(CALL_CLOSE, body_start)
        next_open = text.find(CALL_OPEN, body_start)
        if end == -1 or (next_open != -1 and next_open < end):
            problems.append(f"tool call {number}: {CALL_OPEN} at character {start} is never closed with {CALL_CLOSE}")
            position = body_start
            continue
        raw = text[start : end + len(CALL_CLOSE)]
        call = _decode_call(text[body_start:end].strip(), raw)
        if isinstance(call, str):
            problems.append(f"tool call {number}: {call}")
        else:
            calls.append(call)
        position = end + len(CALL_CLOSE)
    return calls, problems


def _decode_call(body: str, raw: str) -> ToolCall | str:
    """The call in one block's JSON body, or what is wrong with it."""
    shown = f"{body!r:.{SHOWN_CHARS}}"
    try:
        payload = json.loads(body)
    except json.JSONDecodeError as exc:
        return f"bad JSON ({exc}): {shown}"
    if not isinstance(payload, dict):
        return f'expected a JSON object {{"name": ..., "arguments": {{...}}}}, got {type(payload).__name__}: {shown}'
    name = payload.get("name")
    if not isinstance(name, str) or not name:
        return f"no tool name (a non-empty string under 'name'): {shown}"
    arguments = payload.get("arguments", {})
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments) if arguments.strip() else {}
        except json.JSONDecodeError as exc:
            return f"tool {name!r}: arguments are a string but not JSON ({exc}): {shown}"
    if not isinstance(arguments, dict):
        return f"tool {name!r}: arguments must be a JSON object, got {type(arguments).__name__}: {shown}"
    return ToolCall(name=name, arguments=arguments, raw=raw)


# ---- running calls ------------------------------------------------------------------------------------------


@dataclass
class ToolResult:
    name: str
    content: str  # what the model reads
    error: bool
    seconds: float

    def as_message(self) -> dict:
        """The tool message appended to the conversation."""
        return {"role": "tool", "name": self.name, "content": self.content}


class ToolBox:
    """The tools of one rollout: their schemas for the chat template, and `execute`, which never raises: an
    unknown tool, bad arguments, a raising or slow tool each become an error result the model reads."""

    def __init__(
        self,
        tools: Sequence[Tool],
        timeout_s: float = 30.0,
        max_result_chars: int = 16_000,
        instance_id: str | None = None,  # the trajectory's instance of each stateful tool
    ):
        names = [tool.name for tool in tools]
        duplicates = sorted({name for name in names if names.count(name) > 1})
        if duplicates:
            raise ValueError(f"tool names must be unique; {', '.join(duplicates)} given more than once")
        if not timeout_s > 0 or not max_result_chars > 0:
            raise ValueError(f"timeout_s={timeout_s!r} and max_result_chars={max_result_chars!r} must be positive")
        self.tools = {tool.name: tool for tool in tools}
        self.timeout_s, self.max_result_chars = timeout_s, max_result_chars
        self.instance_id = instance_id

    def schemas(self) -> list[dict]:
        return [tool_schema(tool) for tool in self.tools.values()]

    def execute(self, call: ToolCall) -> ToolResult:
        started = time.monotonic()
        tool = self.tools.get(call.name)
        if tool is None:
            available = ", ".join(sorted(self.tools)) or "none"
            return self._result(call.name, f"unknown tool {call.name!r}; available: {available}", True, started)
        problem = argument_problem(tool.parameters, call.arguments)
        if problem:
            return self._result(call.name, f"tool {call.name!r}: {problem}", True, started)
        run = functools.partial(tool.execute, self.instance_id) if is_stateful(tool) else tool
        finished, outcome = _call_with_timeout(run, call.name, call.arguments, self.timeout_s)
        if not finished:
            message = f"tool {call.name!r} did not finish within {self.timeout_s:g}s and was abandoned"
            return self._result(call.name, message, True, started)
        if isinstance(outcome, ToolError):
            return self._result(call.name, str(outcome), True, started)
        if isinstance(outcome, BaseException):
            message = f"tool {call.name!r} raised {type(outcome).__name__}: {outcome}"
            return self._result(call.name, message, True, started)
        return self._result(call.name, _as_text(outcome), False, started)

    def _result(self, name: str, content: str, error: bool, started: float) -> ToolResult:
        if len(content) > self.max_result_chars:
            note = f"\n[truncated: {len(content)} characters, the first {self.max_result_chars} shown]"
            content = content[: self.max_result_chars] + note
        return ToolResult(name, content, error, time.monotonic() - started)


def argument_problem(parameters: Mapping, arguments: Mapping) -> str | None:
    """What is wrong with `arguments` for a tool's JSON schema (unknown, missing, wrong JSON type), or None."""
    properties = parameters.get("properties", {})
    problems = [f"unknown argument {name!r}" for name in arguments if properties and name not in properties]
    problems += [f"missing argument {name!r}" for name in parameters.get("required", []) if name not in arguments]
    for name, value in arguments.items():
        expected = properties.get(name, {}).get("type")
        if expected and not _has_json_type(value, expected):
            problems.append(f"argument {name!r} should be {expected}, got {type(value).__name__}")
    if not problems:
        return None
    takes = ", ".join(
        f"{name} ({spec.get('type', 'any')}{', required' if name in parameters.get('required', []) else ''})"
        for name, spec in properties.items()
    )
    return f"{'; '.join(problems)}. It takes: {takes or 'no arguments'}"


def _has_json_type(value: Any, expected: str) -> bool:
    if expected == "integer":
        return isinstance(value, int) and not isinstance(value, bool)
    if expected == "number":
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    python_type = {"string": str, "boolean": bool, "array": list, "object": dict}.get(expected)
    return python_type is None or isinstance(value, python_type)


def _call_with_timeout(tool: Callable, name: str, arguments: Mapping, timeout_s: float) -> tuple[bool, Any]:
    """(True, the return value or the exception raised), or (False, None) past `timeout_s`. A tool past its time
    keeps running in its daemon thread: Python cannot stop a thread (the python tool ends its process itself)."""
    box: list = []

    def target():
        try:
            box.append(tool(**arguments))
        except BaseException as exc:  # handed to the caller as the outcome, never lost
            box.append(exc)

    thread = threading.Thread(target=target, name=f"tool-{name}", daemon=True)
    thread.start()
    thread.join(timeout_s)
    return (True, box[0]) if box else (False, None)


def _as_text(value: Any) -> str:
    if isinstance(value, str):
        return value
    try:
        return json.dumps(value)
    except (TypeError, ValueError):
        return str(value)
