"""Build frozen dataclasses from plain dicts (YAML after OmegaConf), collecting *every* problem at once."""

from __future__ import annotations

import dataclasses
import difflib
import types
import typing
from typing import Any

from roll_backend.config.foreign_keys import equivalent_hint


class ConfigError(ValueError):
    """One or more problems in a config; the message lists them all, each with what to change."""

    def __init__(self, problems: list[str]):
        self.problems = list(problems)
        super().__init__("invalid config:\n" + "\n".join(f"  - {p}" for p in self.problems))


def suggest(key: str, known: list[str], equivalents: dict[str, str] | None = None) -> str:
    """The hint for an unknown key: its equivalent here when it is another name for a known one, else the closest."""
    if equivalents and key in equivalents:
        return f"write {equivalents[key]} instead"
    close = difflib.get_close_matches(key, known, n=1)
    return f"did you mean {close[0]!r}?" if close else f"known keys: {', '.join(sorted(known))}"


def unknown_key_hint(
    cls: type, key: str, known: list[str], prefix: str, equivalents: dict[str, str] | None = None
) -> str:
    """The hint for key `key` that `cls` (at `prefix`) does not have: where it belongs when a section below has it,
    else `suggest`'s."""
    try:
        homes = [] if equivalents and key in equivalents else nested_homes(cls, key)
    except (NameError, TypeError):  # an annotation that does not resolve: the hint is only a hint
        homes = []
    if homes:  # (the first three: a common name such as `seed` has many)
        return f"it belongs in a section below: write {' or '.join(prefix + home for home in homes[:3])}"
    return suggest(key, known, equivalents)


def _dataclass_in(tp: Any) -> type | None:
    """The dataclass a field holds (itself, or the dataclass of an Optional / union), else None."""
    if dataclasses.is_dataclass(tp):
        return tp
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        return next((arg for arg in typing.get_args(tp) if dataclasses.is_dataclass(arg)), None)
    return None


def nested_homes(cls: type, key: str, depth: int = 2) -> list[str]:
    """Paths below `cls` (at most `depth` sections down) whose last part is a field named `key`: where a key given
    one level too high belongs (`strategy.lr` -> `optimizer.lr`)."""
    homes = []
    for name, tp in typing.get_type_hints(cls).items():
        inner = _dataclass_in(tp)
        if inner is None:
            continue
        if key in {f.name for f in dataclasses.fields(inner) if f.init}:
            homes.append(f"{name}.{key}")
        elif depth > 1:
            homes.extend(f"{name}.{home}" for home in nested_homes(inner, key, depth - 1))
    return homes


def _convert(tp: Any, value: Any, path: str, problems: list[str]) -> Any:
    origin = typing.get_origin(tp)
    if tp is Any:
        return value
    if origin in (typing.Union, types.UnionType):
        options = typing.get_args(tp)
        if value is None:
            if type(None) in options:
                return None
            problems.append(f"{path}: null is not allowed here; give a value")
            return None
        non_none = [o for o in options if o is not type(None)]
        trials = []
        for option in non_none:  # first option that converts cleanly
            trial: list[str] = []
            converted = _convert(option, value, path, trial)
            if not trial:
                return converted
            trials.append(trial)
        # None fits: report the option whose shape matched (its problems are deeper than `path` itself), so a
        # list with one bad entry names that entry rather than "expected str, got list".
        shaped = [trial for trial in trials if not any(p.startswith(f"{path}: expected") for p in trial)]
        problems.extend(shaped[0] if shaped else trials[0])
        return None
    if dataclasses.is_dataclass(tp):
        if isinstance(value, tp):  # already built (e.g. a role section built by the loader)
            return value
        if not isinstance(value, dict):
            problems.append(f"{path}: expected a mapping of {tp.__name__} fields, got {value!r}")
            return None
        return build(tp, value, path, problems)
    if origin in (tuple, list):
        if not isinstance(value, (list, tuple)):
            problems.append(f"{path}: expected a list, got {value!r}")
            return None
        args = typing.get_args(tp)
        if origin is tuple and args and args[-1] is not Ellipsis:
            if len(value) != len(args):
                problems.append(f"{path}: expected {len(args)} items, got {len(value)}")
                return None
            items = [_convert(a, v, f"{path}[{i}]", problems) for i, (a, v) in enumerate(zip(args, value))]
        else:
            item_tp = args[0] if args else Any
            items = [_convert(item_tp, v, f"{path}[{i}]", problems) for i, v in enumerate(value)]
        return tuple(items) if origin is tuple else items
    if origin is dict or tp is dict:
        if not isinstance(value, dict):
            problems.append(f"{path}: expected a mapping, got {value!r}")
            return None
        args = typing.get_args(tp)
        value_tp = args[1] if args else Any
        return {k: _convert(value_tp, v, f"{path}.{k}", problems) for k, v in value.items()}
    if tp is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if tp in (int, float, str, bool):
        if isinstance(value, tp) and not (tp is int and isinstance(value, bool)):
            return value
        problems.append(f"{path}: expected {tp.__name__}, got {type(value).__name__} {value!r}")
        return None
    return value


def build(cls: type, data: dict, path: str = "", problems: list[str] | None = None):
    """`cls(**data)` with nested dataclasses, type checks and suggestions for unknown keys.

    With `problems` given, problems are appended and None may be returned; without it, a ConfigError is raised.
    """
    own = problems is None
    problems = [] if own else problems
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
    prefix = f"{path}." if path else ""
    for key in data:
        if key not in fields:
            hint = equivalent_hint(f"{prefix}{key}") or unknown_key_hint(cls, str(key), list(fields), prefix)
            problems.append(f"{prefix}{key}: unknown key; {hint}")
    kwargs = {}
    before = len(problems)
    for name, f in fields.items():
        if name in data:
            kwargs[name] = _convert(hints[name], data[name], f"{prefix}{name}", problems)
        elif f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
            problems.append(f"{prefix}{name}: required; set it in the YAML or as {prefix}{name}=...")
    result = None
    if len(problems) == before:
        try:
            result = cls(**kwargs)
        except (ValueError, TypeError) as exc:
            problems.append(f"{path or cls.__name__}: {exc}")
    if own and problems:
        raise ConfigError(problems)
    return result


def to_dict(obj) -> Any:
    """A dataclass tree back to plain dicts/lists (for printing and saving the resolved config)."""
    if dataclasses.is_dataclass(obj):
        return {f.name: to_dict(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    if isinstance(obj, (list, tuple)):
        return [to_dict(v) for v in obj]
    if isinstance(obj, dict):
        return {k: to_dict(v) for k, v in obj.items()}
    if callable(obj):  # a Python callable given in code (e.g. a reward function): named, not serialised
        return f"<python callable {getattr(obj, '__module__', '?')}.{getattr(obj, '__qualname__', type(obj).__name__)}>"
    return obj
