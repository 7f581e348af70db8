"""`reward.by_source`: which rewards score a row, chosen by the row's source (verl's `data_source`, ROLL's `tag`).

A table of pattern -> rewards, patterns matched in the order written (exact names or shell-style globs, e.g.
`lighteval/MATH*`), the key `default` for rows no pattern matches. The rewards of an entry are a mapping name ->
weight, a list of names (weight 1 each) or one name; a name is a built-in (rewards.registry) or the label of one of
`reward.functions` (`file_stem.function`). The value `auto` takes the built-in scorer of a known source
(KNOWN_SOURCES: verl's default scorer's data sources and ROLL's reward tags); `by_source: auto` does that for
every row. Without `by_source`, every row gets `reward.rewards` and every function, as before. A source that no entry
matches, with no `default`, is an error before the run starts.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from fnmatch import fnmatchcase
from typing import Any

AUTO = "auto"
DEFAULT_KEY = "default"

# (pattern, built-in): the data sources verl's default scorer knows and ROLL's reward tags, first match wins.
KNOWN_SOURCES: tuple[tuple[str, str], ...] = (
    ("openai/gsm8k", "gsm8k"),
    ("gsm8k", "gsm8k"),
    ("lighteval/MATH*", "math_verify"),
    ("DigitalLearningGmbH/MATH-lighteval", "math_verify"),
    ("HuggingFaceH4/MATH-500", "math_verify"),
    ("math_dapo*", "math_dapo"),  # (verl's DAPO scorer: +1 / -1)
    ("aime*", "math_dapo"),
    ("numina_*", "math_verify"),
    ("math_rule", "math_verify"),  # ROLL's math domain
    ("math*", "math_verify"),
    ("deepscaler*", "math_verify"),
    ("multiple_choice", "multiple_choice"),
    ("crossthinkqa", "multiple_choice"),  # ROLL's multiple-choice reasoning domain
    ("mmlu*", "multiple_choice"),
    ("gpqa*", "multiple_choice"),
    ("Idavidrein/gpqa*", "multiple_choice"),
    *((source, "code_tests") for source in ("codecontests", "apps", "codeforces", "taco")),  # verl's code sources
)


class UnroutedSource(ValueError):
    """A row's source matches no entry of reward.by_source."""


def known_scorer(source: str) -> str | None:
    """The built-in scorer KNOWN_SOURCES gives `source`, else None."""
    return next((scorer for pattern, scorer in KNOWN_SOURCES if fnmatchcase(source, pattern)), None)


def entry_weights(entry: Any) -> dict[str, float] | str:
    """One by_source entry as name -> weight (or AUTO); ValueError for any other shape."""
    if entry == AUTO:
        return AUTO
    if isinstance(entry, str):
        return {entry: 1.0}
    if isinstance(entry, (list, tuple)) and all(isinstance(name, str) for name in entry):
        return {name: 1.0 for name in entry}
    if isinstance(entry, Mapping) and all(
        isinstance(w, (int, float)) and not isinstance(w, bool) for w in entry.values()
    ):
        return {str(name): float(weight) for name, weight in entry.items()}
    raise ValueError(f"{entry!r}: give a reward name, a list of names, a mapping name -> weight, or {AUTO!r}")


@dataclass(frozen=True)
class SourceRouting:
    """Per source, the rewards (name -> weight) that score its rows; `everywhere` without a table."""

    everywhere: Mapping[str, float]
    table: tuple[tuple[str, Any], ...] | None = None  # (pattern, weights or AUTO); None: no by_source
    _cache: dict = field(default_factory=dict, compare=False, repr=False)

    @classmethod
    def build(cls, by_source: Mapping[str, Any] | str | None, everywhere: Mapping[str, float]) -> SourceRouting:
        if by_source is None:
            return cls(dict(everywhere))
        if by_source == AUTO:
            return cls(dict(everywhere), ((DEFAULT_KEY, AUTO),))
        if not isinstance(by_source, Mapping) or not by_source:
            raise ValueError(f"reward.by_source={by_source!r}: give a mapping source -> rewards, or {AUTO!r}")
        entries = [(str(key), entry_weights(value)) for key, value in by_source.items()]
        ordered = [item for item in entries if item[0] != DEFAULT_KEY] + [i for i in entries if i[0] == DEFAULT_KEY]
        return cls(dict(everywhere), tuple(ordered))

    def names(self) -> set[str]:
        """Every reward name the routing can use (AUTO entries: every known scorer)."""
        if self.table is None:
            return set(self.everywhere)
        used: set[str] = set()
        for _, weights in self.table:
            used |= {scorer for _, scorer in KNOWN_SOURCES} if weights == AUTO else set(weights)
        return used

    def weights_for(self, source: str) -> dict[str, float]:
        """The rewards of a row from `source`; UnroutedSource when nothing matches."""
        if self.table is None:
            return dict(self.everywhere)
        if source not in self._cache:
            self._cache[source] = self._route(source)
        return self._cache[source]

    def _route(self, source: str) -> dict[str, float]:
        for pattern, weights in self.table:
            if pattern == DEFAULT_KEY or fnmatchcase(source, pattern):
                if weights != AUTO:
                    return dict(weights)
                scorer = known_scorer(source)
                if scorer is None:
                    raise UnroutedSource(
                        f"reward.by_source: source {source!r} has no built-in scorer for {AUTO!r} (known: "
                        f"{', '.join(pattern for pattern, _ in KNOWN_SOURCES)}); map it to a reward in reward.by_source"
                    )
                return {scorer: 1.0}
        patterns = ", ".join(pattern for pattern, _ in self.table)
        raise UnroutedSource(
            f"reward.by_source: source {source!r} matches none of {patterns}; add it (or a `default:` entry) to "
            "reward.by_source"
        )

    def problems(self, sources: Iterable[str]) -> list[str]:
        """The sources of a dataset that cannot be scored, each with what to change."""
        problems = []
        for source in sorted(set(sources)):
            try:
                self.weights_for(source)
            except UnroutedSource as exc:
                problems.append(str(exc))
        return problems
