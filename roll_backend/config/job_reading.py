"""A verl or ROLL job read as dotted settings (`roll-backend convert`'s input): a YAML config flattened, or a run
script's `key=value` arguments with its shell variables resolved as the shell would (the script's own assignments
above the command, then the environment's; `${X:-default}`, `${X:+alt}`, `$(( arithmetic ))`, `$(pwd)` as the
run's working directory: `$(pwd)/recipe/x.py` is `recipe/x.py`); a value with a variable set nowhere is left as
`$name` for the converter to report, never guessed."""

from __future__ import annotations

import os
import re
import shlex
from pathlib import Path
from typing import Any

import yaml


def read_job(source: str) -> dict[str, Any]:
    """The job's settings as dotted keys: a YAML file flattened, or a script's `key=value` arguments."""
    text = Path(source).read_text()
    if Path(source).suffix in (".yaml", ".yml"):
        from omegaconf import OmegaConf

        tree = OmegaConf.load(source)
        try:  # ROLL's configs refer to their own keys (${response_length}); resolve them where they resolve
            return flatten(OmegaConf.to_container(tree, resolve=True))
        except Exception:
            return flatten(OmegaConf.to_container(tree, resolve=False))
    settings, variables = {}, {}
    for line in text.replace("\\\n", " ").splitlines():
        line = _substitute_arithmetic(line, variables)
        assignment = re.fullmatch(r"\s*(?:export\s+)?([A-Za-z_]\w*)=(.*)", line)
        words = _words(assignment.group(2), source, line) if assignment else []
        if assignment and len(words) <= 1:  # a shell variable the command below may use (not `NAME=value command`)
            variables[assignment.group(1)] = _expand(words[0] if words else "", variables)
            continue
        for token in _words(line, source, line):
            held = re.fullmatch(r"\$\{?([A-Za-z_]\w*)\}?", token)
            if held and "=" in (variables.get(held.group(1)) or ""):
                raise JobReadError(
                    f"{source}: the command takes settings from the shell variable {token}; this reader does not "
                    "run the script: put them on the command itself, or convert the command the script runs (its "
                    "`set -x` output)"
                )
            match = re.fullmatch(r"\+{0,2}([A-Za-z_][\w.]*)=(.*)", token, re.S)
            if match and "." in match.group(1):  # verl's settings are all dotted; shell variables are not
                expanded = _expand(match.group(2), variables)
                # (a variable that is empty leaves nothing to convert: reported like one set nowhere)
                settings[match.group(1)] = _value(expanded if expanded or "$" not in match.group(2) else match.group(2))
    return settings


class JobReadError(ValueError):
    """A run script this reader cannot take apart without guessing; says where and what to do instead."""


def _words(text: str, source: str, line: str) -> list[str]:
    """`text` split as the shell splits words, or a JobReadError naming the line."""
    try:
        return shlex.split(text, comments=True)
    except ValueError as exc:
        raise JobReadError(
            f"{source}: cannot read the line {line.strip()[:60]!r}: {exc} (a quoted value that spans lines, such as "
            "settings gathered in a multi-line shell variable); put the settings on the command itself, or convert "
            "the command the script runs (its `set -x` output)"
        ) from None


_UNSET = "\x00"  # marks a variable set nowhere while the expansion goes on (written back as `$name`)


def _lookup(name: str, variables: dict[str, str]) -> str | None:
    if name.isdigit():  # a positional parameter (`$1`): the script is read, never run with arguments
        return None
    return variables.get(name, os.environ.get(name))


def _expand(text: str, variables: dict[str, str]) -> str:
    """Parameter expansion as the shell does it: `$name`, `${name}`, and `${name:-default}` (`-`, `=`, `:=` alike,
    `:+alternative`), innermost first, from the script's assignments or the environment; a variable set nowhere and
    without a default stays as `$name` (and is reported)."""

    def braced(match: re.Match) -> str:
        found = re.fullmatch(r"([A-Za-z_]\w*|\d+)(?:(:?[-=+])(.*))?", match.group(1), re.S)
        if found is None:
            return match.group(0).replace("${", "$\x01")  # (not an expansion this reads: left as written)
        name, operation, word = found.groups()
        value = _lookup(name, variables)
        is_set = value is not None and not (value == "" and (operation or "").startswith(":"))
        if operation and operation.endswith("+"):
            return word if is_set else ""
        if is_set:
            return value
        if operation is None:
            return f"{_UNSET}{name}{_UNSET}"
        if operation.endswith("="):
            variables[name] = word
        return word

    text = re.sub(r"\$\(\s*pwd\s*\)(/+|$|(?=[\s,\]]))", lambda m: "" if m.group(1) else ".", text)
    previous = None
    while previous != text:
        previous, text = text, re.sub(r"\$\{([^{}]*)\}", braced, text)

    def plain(match: re.Match) -> str:
        value = _lookup(match.group(1), variables)
        return f"{_UNSET}{match.group(1)}{_UNSET}" if value is None else value

    text = re.sub(r"\$([A-Za-z_]\w*)", plain, text)
    return re.sub(f"{_UNSET}(\\w+){_UNSET}", r"$\1", text).replace("$\x01", "${")


def _substitute_arithmetic(line: str, variables: dict[str, str]) -> str:
    """Each `$(( expression ))` of a line (parentheses balanced) replaced by its value."""
    out, index = [], 0
    while (start := line.find("$((", index)) >= 0:
        depth, end = 2, start + 3
        while end < len(line) and depth:
            depth += {"(": 1, ")": -1}.get(line[end], 0)
            end += 1
        if depth:
            break
        out += [line[index:start], _arithmetic(line[start + 3 : end - 2], variables, line[start:end])]
        index = end
    return "".join(out) + line[index:]


def _arithmetic(expression: str, variables: dict[str, str], written: str) -> str:
    """The value of a shell `$(( expression ))` over integers (its names are variables), or `written` when it is not
    one this can read."""
    import ast
    import operator

    operators = {
        ast.Add: operator.add,
        ast.Sub: operator.sub,
        ast.Mult: operator.mul,
        ast.FloorDiv: operator.floordiv,
        ast.Div: operator.floordiv,  # (the shell's division is an integer's)
        ast.Mod: operator.mod,
    }

    def evaluate(node: ast.AST) -> int:
        if isinstance(node, ast.Constant) and isinstance(node.value, int):
            return node.value
        if isinstance(node, ast.Name):
            return int(_lookup(node.id, variables) or 0)  # (an unset name is 0 in the shell)
        if isinstance(node, ast.BinOp) and type(node.op) in operators:
            return operators[type(node.op)](evaluate(node.left), evaluate(node.right))
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
            return -evaluate(node.operand)
        raise ValueError(expression)

    try:
        return str(evaluate(ast.parse(_expand(expression, variables).strip(), mode="eval").body))
    except (ValueError, SyntaxError, ZeroDivisionError):
        return written


def flatten(tree: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(tree, dict) and tree:
        out = {}
        for key, value in tree.items():
            out |= flatten(value, f"{prefix}{key}.")
        return out
    return {prefix.rstrip("."): tree} if prefix else {}  # (an empty or scalar document holds no settings)


def _value(text: str) -> Any:
    """A command-line value as Hydra reads it: YAML, with 1e-6 a number (YAML 1.1 wants 1.0e-6)."""
    try:
        value = yaml.safe_load(text)
    except yaml.YAMLError:
        return text
    if isinstance(value, str) and re.fullmatch(r"[-+]?\d+(\.\d*)?[eE][-+]?\d+", value):
        return float(value)
    return value
