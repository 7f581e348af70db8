"""The source tree's structural rules (issue #27), read statically: cycles, layer directions, backend homes, sizes.

Pure `ast` over roll_backend/, workers/ and strategies/ (named as installed: `workers/x.py` is
`roll_backend.workers.x`); nothing here imports the code it checks, so it runs in well under a second.
Every import counts wherever it sits (module level, inside a function, under `if TYPE_CHECKING:`): a local
import is still a dependency. `from roll_backend.x import y` where `y` is a module counts as importing
`roll_backend.x.y`; otherwise as importing `roll_backend.x`.
"""

from __future__ import annotations

import ast
import itertools
from collections import deque
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
PACKAGE = "roll_backend"
# Source folder -> the package it installs as (pyproject's package-dir).
SOURCE_ROOTS = {
    REPO / "roll_backend": PACKAGE,
    REPO / "workers": f"{PACKAGE}.workers",
    REPO / "strategies": f"{PACKAGE}.strategies",
}

MAX_MODULE_LINES = 600
MAX_FUNCTION_LINES = 60

# DESIGN.md, "Dependencies point one way": layer -> layers it must never import.
FORBIDDEN_LAYER_IMPORTS = {
    "algorithms": {"distributed", "workers", "strategies", "pipelines", "config"},  # the math knows no Ray, no backend
    "protocol": {"distributed", "workers", "strategies", "pipelines", "config"},  # DataProto: no transport, no roles
    "distributed": {"workers", "strategies", "pipelines", "config"},  # dispatch: no roles, no loop
    "strategies": {"workers", "pipelines", "config"},  # a strategy: no role, no loop
    "workers": {"pipelines"},  # a role: no loop
    "models": {"strategies"},  # tiny HF builders, no backend
}

# Third-party backends and the only packages/modules allowed to import them.
BACKEND_HOMES = {
    "megatron": (f"{PACKAGE}.strategies.megatron", f"{PACKAGE}.patches", f"{PACKAGE}.distributed.parallel"),
    "vllm": (f"{PACKAGE}.strategies.vllm",),
}


@dataclass
class Module:
    name: str
    path: Path
    is_package: bool
    tree: ast.Module
    line_count: int
    # (imported name as written and resolved, line) pairs; names are absolute dotted names.
    imports: list[tuple[str, int]] = field(default_factory=list)

    @property
    def rel(self) -> str:
        return str(self.path.relative_to(REPO))


def _module_name(path: Path, root: Path, package: str) -> tuple[str, bool]:
    parts = list(path.relative_to(root).with_suffix("").parts)
    is_package = parts[-1] == "__init__"
    if is_package:
        parts = parts[:-1]
    return ".".join([package, *parts]), is_package


def _resolve_relative(module: Module, level: int, name: str | None) -> str:
    base = module.name.split(".")
    if not module.is_package:
        base = base[:-1]
    if level > 1:
        base = base[: len(base) - (level - 1)]
    return ".".join(base + ([name] if name else []))


def _import_module_call(node: ast.Call) -> str | None:
    """`importlib.import_module("x")` / `__import__("x")` with a literal name: an import all the same."""
    func = node.func
    called = func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else None
    if called in ("import_module", "__import__") and node.args:
        first = node.args[0]
        if isinstance(first, ast.Constant) and isinstance(first.value, str) and not first.value.startswith("."):
            return first.value
    return None


def _collect_imports(module: Module, known: set[str]) -> None:
    for node in ast.walk(module.tree):
        if isinstance(node, ast.Import):
            module.imports.extend((alias.name, node.lineno) for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            source = _resolve_relative(module, node.level, node.module) if node.level else node.module
            for alias in node.names:
                submodule = f"{source}.{alias.name}"
                # `from pkg import sub` imports the module pkg.sub when it is one; else a name of pkg.
                module.imports.append((submodule if submodule in known else source, node.lineno))
        elif isinstance(node, ast.Call):
            name = _import_module_call(node)
            if name:
                module.imports.append((name, node.lineno))


@cache
def source_modules() -> dict[str, Module]:
    modules: dict[str, Module] = {}
    for root, package in SOURCE_ROOTS.items():
        for path in sorted(root.rglob("*.py")):
            if "__pycache__" in path.parts:
                continue
            text = path.read_text(encoding="utf-8")
            name, is_package = _module_name(path, root, package)
            modules[name] = Module(name, path, is_package, ast.parse(text, str(path)), len(text.splitlines()))
    known = set(modules)
    for module in modules.values():
        _collect_imports(module, known)
        module.imports = list(dict.fromkeys(module.imports))  # `from x import a, b` is one import of x
    return modules


def _internal_target(name: str, known: set[str]) -> str | None:
    """The source module an imported dotted name lands on (its longest known prefix), or None if third-party."""
    parts = name.split(".")
    if parts[0] != PACKAGE:
        return None
    while parts:
        candidate = ".".join(parts)
        if candidate in known:
            return candidate
        parts.pop()
    return None


@cache
def module_graph() -> dict[str, dict[str, int]]:
    """module -> {imported module: first line}, internal modules only, self-imports dropped."""
    modules = source_modules()
    known = set(modules)
    graph: dict[str, dict[str, int]] = {name: {} for name in modules}
    for module in modules.values():
        for imported, line in module.imports:
            target = _internal_target(imported, known)
            if target and target != module.name:
                graph[module.name].setdefault(target, line)
    return graph


def top_unit(module_name: str) -> str:
    """The package-level unit of a module: roll_backend.<first part> (a top package or a top-level module)."""
    parts = module_name.split(".")
    return ".".join(parts[:2])


def _strongly_connected(graph: dict[str, set[str]]) -> list[list[str]]:
    """Tarjan's components with more than one member, iterative (no recursion limit)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    components: list[list[str]] = []
    counter = 0
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = counter
        counter += 1
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    components.append(sorted(component))
    return components


def _shortest_cycle_through(graph: dict[str, set[str]], start: str, within: set[str]) -> list[str] | None:
    parent: dict[str, str] = {}
    queue = deque([start])
    seen = {start}
    while queue:
        node = queue.popleft()
        for child in sorted(graph[node]):
            if child not in within:
                continue
            if child == start:
                path = [node]
                while path[-1] != start:
                    path.append(parent[path[-1]])
                return [*reversed(path), start]
            if child not in seen:
                seen.add(child)
                parent[child] = node
                queue.append(child)
    return None


def find_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One shortest cycle through each member of every cycle-forming component, duplicates removed."""
    cycles: list[list[str]] = []
    seen: set[tuple[str, ...]] = set()
    for component in _strongly_connected(graph):
        members = set(component)
        for start in component:
            cycle = _shortest_cycle_through(graph, start, members)
            if cycle is None:
                continue
            ring = cycle[:-1]
            pivot = ring.index(min(ring))
            canonical = tuple(ring[pivot:] + ring[:pivot])
            if canonical not in seen:
                seen.add(canonical)
                cycles.append([*canonical, canonical[0]])
    return sorted(cycles)


def _short(name: str) -> str:
    return name.removeprefix(f"{PACKAGE}.")


def test_no_module_import_cycles():
    graph = module_graph()
    cycles = find_cycles({name: set(edges) for name, edges in graph.items()})
    lines = []
    for cycle in cycles:
        hops = [f"{_short(a)} (line {graph[a][b]})" for a, b in itertools.pairwise(cycle)]
        lines.append("  " + " -> ".join([*hops, _short(cycle[-1])]))
    if cycles:
        header = f"{len(cycles)} import cycle(s) between modules (line = where the import is):"
        pytest.fail(header + "\n" + "\n".join(lines), pytrace=False)


def _unit_graph() -> dict[str, dict[str, list[str]]]:
    """top unit -> {imported top unit: ['module:line -> module', ...]} (the imports that make the edge)."""
    units: dict[str, dict[str, list[str]]] = {}
    for name, edges in module_graph().items():
        source = top_unit(name)
        units.setdefault(source, {})
        for target, line in edges.items():
            target_unit = top_unit(target)
            units.setdefault(target_unit, {})
            if target_unit != source and source != PACKAGE and target_unit != PACKAGE:
                units[source].setdefault(target_unit, []).append(f"{_short(name)}:{line} -> {_short(target)}")
    return units


def _examples(evidence: list[str], limit: int = 3) -> str:
    more = f" (+{len(evidence) - limit} more)" if len(evidence) > limit else ""
    return "; ".join(evidence[:limit]) + more


def test_no_package_import_cycles():
    units = _unit_graph()
    cycles = find_cycles({unit: set(edges) for unit, edges in units.items()})
    lines = []
    for cycle in cycles:
        lines.append("  " + " -> ".join(_short(u) for u in cycle))
        for a, b in itertools.pairwise(cycle):
            lines.append(f"      {_short(a)} -> {_short(b)}: {_examples(units[a][b])}")
    if cycles:
        pytest.fail(f"{len(cycles)} import cycle(s) between top packages:\n" + "\n".join(lines), pytrace=False)


def test_dependencies_point_one_way():
    units = _unit_graph()
    offenders = []
    for layer, forbidden in sorted(FORBIDDEN_LAYER_IMPORTS.items()):
        for target in sorted(forbidden):
            evidence = units.get(f"{PACKAGE}.{layer}", {}).get(f"{PACKAGE}.{target}")
            if evidence:
                offenders.append(f"  {layer} -> {target} ({len(evidence)} import(s)): {_examples(evidence)}")
    if offenders:
        header = "imports against DESIGN.md's direction (pipelines -> workers -> strategies; layer -> forbidden layer):"
        pytest.fail(header + "\n" + "\n".join(offenders), pytrace=False)


def _in_home(module_name: str, homes: tuple[str, ...]) -> bool:
    return any(module_name == home or module_name.startswith(f"{home}.") for home in homes)


def test_backends_imported_only_in_their_homes():
    offenders = []
    for module in sorted(source_modules().values(), key=lambda m: m.rel):
        stray = [
            (line, name)
            for name, line in module.imports
            if name.split(".")[0] in BACKEND_HOMES and not _in_home(module.name, BACKEND_HOMES[name.split(".")[0]])
        ]
        if stray:
            lines = sorted({line for line, _ in stray})
            where = f"line{'s' if len(lines) > 1 else ''} {', '.join(map(str, lines))}"
            names = ", ".join(sorted({name for _, name in stray}))
            offenders.append(f"  {module.rel} ({where}): {names}")
    if offenders:
        homes = "; ".join(f"{backend} only under {', '.join(map(_short, h))}" for backend, h in BACKEND_HOMES.items())
        pytest.fail(f"backend imports outside their homes ({homes}):\n" + "\n".join(offenders), pytrace=False)


# Module names a backend or layer may each have its own of; every other name says what one module holds.
SHARED_MODULE_NAMES = {"config", "errors", "registry"}


def test_module_names_are_not_reused():
    by_name: dict[str, list[str]] = {}
    for module in source_modules().values():
        leaf = module.name.rsplit(".", 1)[-1]
        if leaf not in SHARED_MODULE_NAMES:
            by_name.setdefault(leaf, []).append(module.rel)
    reused = {leaf: rels for leaf, rels in sorted(by_name.items()) if len(rels) > 1}
    if reused:
        lines = "\n".join(f"  {leaf}: {', '.join(sorted(rels))}" for leaf, rels in reused.items())
        pytest.fail(f"module (or package) names used twice; name each for what it holds:\n{lines}", pytrace=False)


def test_no_module_over_600_lines():
    offenders = sorted((m.line_count, m.rel) for m in source_modules().values() if m.line_count > MAX_MODULE_LINES)
    listing = "\n".join(f"  {rel}: {count} lines" for count, rel in reversed(offenders))
    if offenders:
        header = f"{len(offenders)} module(s) over {MAX_MODULE_LINES} lines (split by job):"
        pytest.fail(f"{header}\n{listing}", pytrace=False)


def test_no_function_over_60_lines():
    offenders = []
    for module in source_modules().values():
        for node in ast.walk(module.tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                length = node.end_lineno - node.lineno + 1
                if length > MAX_FUNCTION_LINES:
                    offenders.append((length, f"{module.rel}:{node.lineno} {node.name}"))
    listing = "\n".join(f"  {where}: {length} lines" for length, where in sorted(offenders, reverse=True))
    if offenders:
        pytest.fail(f"{len(offenders)} function(s) over {MAX_FUNCTION_LINES} lines:\n{listing}", pytrace=False)


# The checker itself, on small graphs and snippets (so a green run means the rules were really applied).


def test_cycle_finder_reports_each_cycle():
    graph = {"a": {"b"}, "b": {"a", "c"}, "c": {"d"}, "d": {"c"}, "e": {"a"}}
    assert find_cycles(graph) == [["a", "b", "a"], ["c", "d", "c"]]
    assert find_cycles({"a": {"b"}, "b": {"c"}, "c": set()}) == []


def test_imports_are_collected_everywhere_and_resolved_to_modules():
    source = (
        "import roll_backend.keys\n"
        "from . import merge\n"
        "from .errors import DataProtoError\n"
        "def f():\n"
        "    from roll_backend.distributed import parallel\n"
        "    import importlib; importlib.import_module('vllm')\n"
    )
    module = Module("roll_backend.protocol.x", REPO / "x.py", False, ast.parse(source), 6)
    known = {
        "roll_backend.keys",
        "roll_backend.protocol.merge",
        "roll_backend.protocol.errors",
        "roll_backend.distributed",
        "roll_backend.distributed.parallel",
    }
    _collect_imports(module, known)
    assert module.imports == [
        ("roll_backend.keys", 1),
        ("roll_backend.protocol.merge", 2),
        ("roll_backend.protocol.errors", 3),
        ("roll_backend.distributed.parallel", 5),
        ("importlib", 6),
        ("vllm", 6),
    ]


def test_source_tree_is_named_as_installed():
    modules = source_modules()
    assert "roll_backend.protocol.data_proto" in modules
    assert "roll_backend.keys" in modules
    assert any(name.startswith("roll_backend.workers.") for name in modules)
    assert any(name.startswith("roll_backend.strategies.") for name in modules)
    assert not any(name.startswith(("workers", "strategies", "tests", "bench")) for name in modules)
