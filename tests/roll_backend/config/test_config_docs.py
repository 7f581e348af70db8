"""docs/configuration.md is generated from the schema and kept current: a stale file fails with the command
that regenerates it; new keys (with their comments) appear by re-running the generator."""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

from roll_backend.config.reference_doc import DOC_PATH, NO_MEANING, REGENERATE, _Writer, field_comments, render

REPO = Path(__file__).resolve().parents[3]


def test_configuration_doc_is_up_to_date():
    current = (REPO / DOC_PATH).read_text() if (REPO / DOC_PATH).is_file() else ""
    assert current == render(), f"{DOC_PATH} is out of date with the config schema; regenerate it with: {REGENERATE}"


def test_every_key_has_a_meaning():
    undocumented = [line.split("|")[1].strip() for line in render().splitlines() if NO_MEANING in line]
    assert not undocumented, (
        f"config keys without a meaning: {undocumented}; add a comment on the field's line (or just above it) "
        f"in its dataclass, then regenerate with: {REGENERATE}"
    )


@dataclasses.dataclass(frozen=True)
class Inner:
    """An inner section."""

    depth: int = 3  # how deep


@dataclasses.dataclass(frozen=True)
class Outer:
    # the name, from the line above
    name: str
    ratio: float | None = None  # a ratio
    inner: Inner = dataclasses.field(default_factory=lambda: Inner(depth=5))
    bare: bool = True


def test_the_walk_reads_types_defaults_comments_and_nested_sections():
    assert field_comments(Outer) == {"name": "the name, from the line above", "ratio": "a ratio"}
    writer = _Writer()
    writer.walk(Outer, "x.", "Outer")
    outer, inner = writer.sections
    assert "| `x.name` | str | required | the name, from the line above |" in outer
    assert "| `x.ratio` | float \\| None | null | a ratio |" in outer
    assert "| `x.inner` | Inner | (section) | An inner section. (section `x.inner` below) |" in outer
    assert f"| `x.bare` | bool | true | {NO_MEANING} |" in outer
    assert "| `x.inner.depth` | int | `5` | how deep |" in inner  # the enclosing default's value, not the class's


def test_check_mode_of_the_script_names_the_command(tmp_path, monkeypatch, capsys):
    import runpy

    monkeypatch.setattr(sys, "argv", ["gen_config_docs.py", "--check"])
    script = runpy.run_path(str(REPO / "scripts" / "gen_config_docs.py"))
    assert script["main"]() == 0
    monkeypatch.setitem(script["main"].__globals__, "REPO", tmp_path)  # a checkout whose file is stale
    (tmp_path / "docs").mkdir()
    (tmp_path / DOC_PATH).write_text("old\n")
    assert script["main"]() == 1
    assert capsys.readouterr().err.strip() == f"{DOC_PATH} is out of date; regenerate it with: {REGENERATE}"
