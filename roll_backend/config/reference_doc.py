"""docs/configuration.md, generated from the schema: every key with its type, default and meaning.

The walk is generic: it follows the dataclasses of `PipelineConfig` (nested sections become their own tables)
and, for a role's `strategy`, every strategy in the registry with its parallel layout and its typed config.
A key's meaning is the comment on its line in the source, else the comment lines just above it; a nested
section's is its class docstring. So a new key shows up, with its comment, by re-running
`scripts/gen_config_docs.py`.
"""

from __future__ import annotations

import dataclasses
import inspect
import io
import textwrap
import tokenize
import types
import typing
from typing import Any

from roll_backend.config.schema import LAYOUT_KEYS, PipelineConfig, StrategySection
from roll_backend.distributed.layout import ParallelLayout

DOC_PATH = "docs/configuration.md"
REGENERATE = "PYTHONPATH=$PWD .venv/bin/python scripts/gen_config_docs.py"
NO_MEANING = "(undocumented: add a comment next to the field)"

HEADER = f"""# Configuration reference

<!-- Generated from the schema by scripts/gen_config_docs.py; do not edit by hand. Regenerate with:
     {REGENERATE} -->

Every key a run config (YAML) takes, with its type, default and meaning. Keys nest as in the YAML and can be
overridden on the command line with dotted paths, e.g. `actor_train.strategy.tp=2`. `roll-backend validate
CONFIG` prints the resolved config or every problem in it. "required" means the key has no default.
"""


def field_comments(cls: type) -> dict[str, str]:
    """Field name -> its source comment: the one on its line, else the comment lines right above it; a field a
    base class declares has the base's comment."""
    comments: dict[str, str] = {}
    for klass in reversed([k for k in cls.__mro__ if dataclasses.is_dataclass(k)]):
        comments |= _own_field_comments(klass)
    return comments


def _own_field_comments(cls: type) -> dict[str, str]:
    try:
        source = textwrap.dedent(inspect.getsource(cls))
    except (OSError, TypeError):
        return {}
    names = {f.name for f in dataclasses.fields(cls)}
    comments: dict[str, str] = {}
    pending: list[str] = []  # comment lines since the last statement
    line_field: dict[int, str] = {}
    tokens = list(tokenize.generate_tokens(io.StringIO(source).readline))
    for index, token in enumerate(tokens):
        if token.type == tokenize.NAME and token.start[1] == 4 and token.string in names:
            following = tokens[index + 1] if index + 1 < len(tokens) else None
            if following is not None and following.string == ":":
                line_field[token.start[0]] = token.string
                if pending:
                    comments[token.string] = " ".join(pending)
                pending = []
        elif token.type == tokenize.COMMENT:
            text = token.string.lstrip("#").strip()
            owner = line_field.get(token.start[0])
            if owner is not None:  # a comment on the field's own line wins over the lines above
                comments[owner] = text
            elif token.start[1] == 4:
                pending.append(text)
        elif token.type == tokenize.NEWLINE and token.start[0] not in line_field:
            pending = []
    return comments


def type_name(hint: Any) -> str:
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        return " | ".join(type_name(arg) for arg in typing.get_args(hint))
    if origin is not None:
        args = ", ".join("..." if arg is Ellipsis else type_name(arg) for arg in typing.get_args(hint))
        return f"{getattr(origin, '__name__', str(origin))}[{args}]"
    if hint is type(None):
        return "None"
    if hint is Any:
        return "any"
    return getattr(hint, "__name__", str(hint))


def default_text(f: dataclasses.Field, instance: Any = None) -> str:
    """The default as YAML would spell it; `instance`: the enclosing section's default, which may set its
    fields differently from the class (e.g. `validation: SamplingConfig(temperature=0.0)`)."""
    if instance is None and f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
        return "required"
    value = _default_value(f, instance)
    if dataclasses.is_dataclass(value):
        return "(section)"
    if value is None:
        return "null"
    if isinstance(value, bool):
        return str(value).lower()
    return f"`{value!r}`".replace("|", "\\|")


def _default_value(f: dataclasses.Field, instance: Any = None) -> Any:
    if instance is not None:
        return getattr(instance, f.name)
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return None


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def _section_class(hint: Any) -> type | None:
    """The dataclass a field holds (also through `X | None`), else None."""
    candidates = (
        [hint, *typing.get_args(hint)] if typing.get_origin(hint) in (typing.Union, types.UnionType) else [hint]
    )
    for candidate in candidates:
        if isinstance(candidate, type) and dataclasses.is_dataclass(candidate):
            return candidate
    return None


def _first_line(doc: str | None) -> str:
    return " ".join((doc or "").strip().split("\n\n")[0].split())


def _class_doc(cls: type) -> str:
    """The class docstring's first paragraph; not the signature dataclasses put there when there is none."""
    doc = _first_line(cls.__doc__)
    return "" if doc.startswith(f"{cls.__name__}(") else doc


class _Writer:
    def __init__(self):
        self.sections: list[str] = []

    def table(self, title: str, intro: str, rows: list[tuple[str, str, str, str]]) -> None:
        lines = [f"## {title}", ""]
        if intro:
            lines += [intro, ""]
        lines += ["| key | type | default | meaning |", "|---|---|---|---|"]
        lines += [f"| `{key}` | {_cell(tp)} | {default} | {_cell(meaning)} |" for key, tp, default, meaning in rows]
        self.sections.append("\n".join(lines) + "\n")

    def walk(
        self,
        cls: type,
        prefix: str,
        title: str,
        skip: tuple[str, ...] = (),
        filled: dict[str, str] | None = None,
        instance: Any = None,
        intro: str | None = None,
    ) -> None:
        """One table for `cls` under key `prefix`, then one per nested dataclass section, depth first.
        `filled`: field name -> (default, meaning) for keys the loader fills in when the YAML leaves them out."""
        hints = typing.get_type_hints(cls)
        comments = field_comments(cls)
        rows, nested = [], []
        for f in dataclasses.fields(cls):
            if not f.init or f.name in skip:
                continue
            key = f"{prefix}{f.name}"
            hint = hints[f.name]
            section = _section_class(hint)
            meaning = comments.get(f.name) or (_class_doc(section) if section else "") or NO_MEANING
            if section is StrategySection:
                rows.append(
                    (
                        f"{key}.name",
                        "str",
                        "required",
                        "the backend: one of the strategies below; its other keys follow",
                    )
                )
                continue
            if section is not None:
                nested.append((section, f"{key}.", key, _default_value(f, instance)))
                meaning = f"{meaning} (section `{key}` below)"
            default, meaning = (filled or {}).get(f.name) or (default_text(f, instance), meaning)
            rows.append((key, type_name(hint), default, meaning))
        self.table(title, intro if intro is not None else _class_doc(cls), rows)
        for section, sub_prefix, sub_title, section_default in nested:
            self.walk(
                section,
                sub_prefix,
                f"`{sub_title}`",
                instance=section_default if dataclasses.is_dataclass(section_default) else None,
            )


def render() -> str:
    """The whole reference, as docs/configuration.md holds it."""
    from roll_backend.roles import MODEL_ROLES
    from roll_backend.strategies.registry import STRATEGY_CONFIGS, config_class

    writer = _Writer()
    top_hints = typing.get_type_hints(PipelineConfig)
    role_fields = [name for name in MODEL_ROLES if name in top_hints]
    writer.walk(PipelineConfig, "", "Top level (`PipelineConfig`)", skip=tuple(role_fields))
    role_cls = _section_class(top_hints[role_fields[0]])
    fields = {f.name: f for f in dataclasses.fields(PipelineConfig)}
    which = ", ".join(
        f"`{r}` ({'required' if default_text(fields[r]) == 'required' else 'optional'})" for r in role_fields
    )
    writer.walk(
        role_cls,
        "<role>.",
        f"Roles: {', '.join(f'`{r}`' for r in role_fields)}",
        intro=f"{_class_doc(role_cls)} Role blocks: {which}; `<role>` below stands for each.",
    )
    layout_comments = field_comments(ParallelLayout)
    layout_hints = typing.get_type_hints(ParallelLayout)
    layout_rows = [
        (
            f"<role>.strategy.{f.name}",
            type_name(layout_hints[f.name]),
            default_text(f),
            layout_comments.get(f.name, NO_MEANING),
        )
        for f in dataclasses.fields(ParallelLayout)
        if f.name in LAYOUT_KEYS
    ]
    writer.table("`<role>.strategy`: parallel layout (every strategy)", _class_doc(ParallelLayout), layout_rows)
    for name in sorted(STRATEGY_CONFIGS):
        cls = config_class(name)
        writer.walk(
            cls,
            "<role>.strategy.",
            f"`<role>.strategy` with `name: {name}` (`{cls.__name__}`)",
            filled={
                "model_path": ("the role's `model_path`", "the model folder; the loader fills in the role's model_path")
            },
        )
    return HEADER + "\n" + "\n".join(writer.sections)
