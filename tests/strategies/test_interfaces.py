"""Roles use their strategy only through its interface (strategies/base.py): every attribute a role reads off its
strategy (methods, properties, declared attributes) is declared there, so a second backend that fills the interface
fills everything the roles call. Read statically with `ast`, like the structure test."""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
BASE = REPO / "strategies" / "base.py"
# A role's module -> the interface of the strategy it runs (its config's default strategy_name picks a class of it).
ROLE_INTERFACES = {
    "workers/actor.py": "TrainStrategy",
    "workers/critic.py": "TrainStrategy",
    "workers/reference.py": "InferStrategy",
    "workers/reward_model.py": "InferStrategy",
    "workers/rollout.py": "RolloutStrategy",
    "workers/strategy_host.py": "Strategy",  # StrategyWorker starts any of them
    "workers/trained.py": "TrainStrategy",  # the training roles' checkpoints
    "roll_backend/agentic/multi_turn.py": "RolloutStrategy",  # drives the rollout role's engine, turn by turn
}
# How each module names the strategy object it holds.
STRATEGY_REFERENCES = {"strategy", "_strategy", "engine"}
# The hybrid engine's worker holds several strategies, each under its own name (workers/hybrid.py).
HYBRID_REFERENCES = {"trainer": "TrainStrategy", "rollout": "RolloutStrategy", "model": "InferStrategy"}


def declared_names() -> dict[str, set[str]]:
    """Interface -> every name it declares: its methods, properties and annotated attributes, and its bases'."""
    tree = ast.parse(BASE.read_text())
    classes = {node.name: node for node in tree.body if isinstance(node, ast.ClassDef)}

    def names(name: str) -> set[str]:
        node = classes[name]
        own = {item.name for item in node.body if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef))}
        own |= {item.target.id for item in node.body if isinstance(item, ast.AnnAssign)}
        for base in node.bases:
            if isinstance(base, ast.Name) and base.id in classes:
                own |= names(base.id)
        return own

    return {name: names(name) for name in set(ROLE_INTERFACES.values()) | set(HYBRID_REFERENCES.values())}


def strategy_uses(path: Path, references: set[str] = STRATEGY_REFERENCES, named: bool = False) -> list[tuple[int, str]]:
    """(line, attribute) for every attribute read off the strategy: `self.strategy.x`, `self._strategy().x`,
    `self.engine.x` (or the other `references`), and `s.x` where `s` was bound to one of those; with `named`, also
    `r.x` for a local named as a reference."""
    tree = ast.parse(path.read_text())
    bound = set(references) if named else set()  # local names bound to the strategy object
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign) and _is_strategy(node.value, set(), references):
            bound |= {target.id for target in node.targets if isinstance(target, ast.Name)}
    return sorted(
        (node.lineno, node.attr)
        for node in ast.walk(tree)
        if isinstance(node, ast.Attribute) and _is_strategy(node.value, bound, references)
    )


def _is_strategy(node: ast.AST, bound: set[str], references: set[str]) -> bool:
    if isinstance(node, ast.Call):
        node = node.func
    if isinstance(node, ast.Attribute):  # `self.config.strategy` is the strategy's config section, not the strategy
        return node.attr in references and not (isinstance(node.value, ast.Attribute) and node.value.attr == "config")
    return isinstance(node, ast.Name) and node.id in bound


def test_the_hybrid_worker_calls_only_what_each_strategy_interface_declares():
    """The hybrid worker names each strategy it holds by what it is (trainer, rollout, model: locals and attributes),
    and reads off each only what that interface declares."""
    declared, path = declared_names(), REPO / "workers" / "hybrid.py"
    uses = {name: strategy_uses(path, {name}, named=True) for name in HYBRID_REFERENCES}
    undeclared = [
        f"workers/hybrid.py:{line}: .{attr} is not declared on {HYBRID_REFERENCES[name]}"
        for name, found in uses.items()
        for line, attr in found
        if attr not in declared[HYBRID_REFERENCES[name]]
    ]
    assert not undeclared, "\n".join(undeclared)
    assert all(uses.values()), f"the hybrid worker no longer names its strategies so: {uses}"


def test_roles_call_only_what_their_strategy_interface_declares():
    declared = declared_names()
    undeclared = [
        f"{module}:{line}: .{attr} is not declared on {interface} (strategies/base.py)"
        for module, interface in ROLE_INTERFACES.items()
        for line, attr in strategy_uses(REPO / module)
        if attr not in declared[interface]
    ]
    assert not undeclared, "roles reach past their strategy's interface:\n" + "\n".join(undeclared)


def test_every_role_that_runs_a_strategy_is_checked():
    runs_one = {
        f"workers/{path.name}" for path in (REPO / "workers").glob("*.py") if "= start_strategy(" in path.read_text()
    }
    assert runs_one <= set(ROLE_INTERFACES), (
        f"add these roles to ROLE_INTERFACES: {sorted(runs_one - set(ROLE_INTERFACES))}"
    )


def test_the_check_sees_a_reach_through(tmp_path):
    role = tmp_path / "role.py"
    role.write_text(
        "class R:\n    def f(self):\n        s = self._strategy()\n        s.stream.admit(1)\n"
        "        self.strategy.generate(1)\n        self.engine.step()\n"
    )
    assert strategy_uses(role) == [(4, "stream"), (5, "generate"), (6, "step")]
