"""Load a run config: YAML + `key=value` overrides (OmegaConf), typed into PipelineConfig, then validated."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import yaml
from omegaconf import OmegaConf
from omegaconf.errors import InterpolationKeyError, OmegaConfBaseException

from roll_backend import roles
from roll_backend.config.device_defaults import with_device_defaults
from roll_backend.config.schema import LAYOUT_KEYS, PipelineConfig, RoleConfig, StrategySection
from roll_backend.config.typed import ConfigError, build, to_dict, unknown_key_hint
from roll_backend.config.validate import validate
from roll_backend.distributed.layout import ParallelLayout


def _strategy_config_class(name: str):
    from roll_backend.strategies.registry import config_class

    return config_class(name)


def build_strategy(path: str, section: Any, model_path: str, problems: list[str]) -> StrategySection | None:
    from roll_backend.strategies.registry import UnknownStrategyError

    if not isinstance(section, dict) or "name" not in section:
        problems.append(f"{path}: needs a mapping with a `name` (e.g. name: megatron_train)")
        return None
    settings = dict(section)
    name = settings.pop("name")
    try:
        cls = _strategy_config_class(name)
    except UnknownStrategyError as exc:
        problems.append(f"{path}.name: {exc}")
        return None
    known = {f.name for f in dataclasses.fields(cls)} | set(LAYOUT_KEYS)
    for key in [k for k in settings if k not in known]:
        hint = unknown_key_hint(cls, str(key), sorted(known), f"{path}.", getattr(cls, "KEY_EQUIVALENTS", None))
        problems.append(f"{path}.{key}: unknown key for strategy {name!r}; {hint}")
        settings.pop(key)
    layout_settings = {k: settings.pop(k) for k in LAYOUT_KEYS if k in settings}
    layout = build(ParallelLayout, layout_settings, path, problems)
    settings.setdefault("model_path", model_path)
    config = build(cls, settings, path, problems)
    return StrategySection(name, layout, config) if layout is not None and config is not None else None


def build_role(name: str, section: Any, problems: list[str]) -> RoleConfig | None:
    if not isinstance(section, dict):
        problems.append(f"{name}: expected a mapping, got {section!r}")
        return None
    section = dict(section)
    model_path = section.get("model_path", "")
    strategy = build_strategy(f"{name}.strategy", section.pop("strategy", None), model_path, problems)
    if strategy is None:
        fields = {f.name for f in dataclasses.fields(RoleConfig)} - {"strategy"}
        for key in set(section) - fields:
            problems.append(f"{name}.{key}: unknown key; known keys: {', '.join(sorted(fields))}")
        return None
    return build(RoleConfig, {**section, "strategy": strategy}, name, problems)


def resolve_yaml(path: str | Path, overrides: list[str] = ()) -> dict:
    """The YAML with overrides merged and ${...} interpolations resolved, as plain dicts."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError([f"config file {str(path)!r} does not exist"])
    try:
        tree = OmegaConf.merge(OmegaConf.load(path), OmegaConf.from_dotlist(list(overrides)))
        return OmegaConf.to_container(tree, resolve=True)
    except InterpolationKeyError as exc:  # `${model_path}` in a role with no top-level model_path, say
        missing = str(exc).split("'")[1] if "'" in str(exc) else str(exc)
        problem = (
            f"{exc.full_key} refers to ${{{missing}}}, which is not set: set {missing} in the YAML or as {missing}="
        )
        raise ConfigError([problem + "..."]) from exc
    except (OmegaConfBaseException, yaml.YAMLError) as exc:  # a malformed override value is a YAMLError
        raise ConfigError([f"{path}: {exc}".replace("\n", " ")]) from exc


def load_config(
    path: str | Path, overrides: list[str] = (), recipe_check: bool = False, cross_field: bool = True
) -> PipelineConfig:
    """Read, type and validate a run config; raises ConfigError listing every problem at once. `recipe_check`: see
    validate (a model folder holding only config.json passes). `cross_field=False` returns a well-typed config
    without running the cross-field rules (a tree with type errors or unknown keys still gets the whole report):
    `run` starts Ray with it and runs the rules (`check_config`), which import torch, while Ray comes up."""
    for item in overrides:
        if "=" not in item:
            raise ConfigError([f"override {item!r} is not key=value (e.g. actor_train.strategy.tp=2)"])
    data = resolve_yaml(path, overrides)
    return config_from_dict(data, recipe_check, cross_field)


def check_config(config: PipelineConfig, recipe_check: bool = False) -> None:
    """The cross-field rules of a well-typed config (what `load_config(cross_field=False)` left out)."""
    problems = validate(config, recipe_check)
    if problems:
        raise ConfigError(problems)


def config_from_dict(data: dict, recipe_check: bool = False, cross_field: bool = True) -> PipelineConfig:
    """Type errors and unknown keys of the whole tree are reported together; the cross-field rules
    (layouts, batch splits, algorithm names) run once the tree is well-typed (with `cross_field`, or when the tree
    has other problems: one report lists them all)."""
    problems: list[str] = []
    data = with_device_defaults(_reference_from_actor_base(dict(data), problems))
    broken_roles = []
    for role in roles.MODEL_ROLES:
        if data.get(role) is not None:
            before = len(problems)
            data[role] = build_role(role, data[role], problems)
            if len(problems) > before:
                broken_roles.append(role)
    top_problems: list[str] = []
    config = build(PipelineConfig, data, "", top_problems)
    # A role that failed to build shows up again as "required"; its own problems already say why.
    problems.extend(p for p in top_problems if not any(p.startswith(f"{r}:") for r in broken_roles))
    # Unknown keys are dropped and do not stop the tree from building: the cross-field rules still run, so a
    # typo and a bad layout come back in one report. A role that did not build would look absent to them.
    roles_built = all(data.get(role) is not None for role in broken_roles)
    if config is not None and roles_built and (cross_field or problems):
        problems.extend(validate(config, recipe_check))
    if problems:
        raise ConfigError(problems)
    return config


def _reference_from_actor_base(data: dict, problems: list[str]) -> dict:
    """`reference: {from_actor_base: true}` -> no reference role, reference_from_actor_base=True: the actor's ranks
    compute the reference with the LoRA adapters off. The block's other keys (a YAML's reference role, switched to
    the actor's base by an override) start nothing; a model_path other than the actor's is refused. from_actor_base:
    false leaves a plain reference block."""
    section = data.get("reference")
    if not isinstance(section, dict) or "from_actor_base" not in section:
        return data
    section = dict(section)
    if not section.pop("from_actor_base"):
        return {**data, "reference": section}
    actor_path = (data.get("actor_train") or {}).get("model_path")
    if section.get("model_path", actor_path) != actor_path:
        problems.append(
            f"reference.from_actor_base=true uses the actor's base ({actor_path!r}) as the reference, and "
            f"reference.model_path is {section['model_path']!r}; drop from_actor_base to run a reference role on that "
            "model, or set reference.model_path to the actor's"
        )
    return {**data, "reference": None, "reference_from_actor_base": True}


def config_to_yaml(config: PipelineConfig) -> str:
    """The resolved config as YAML (roles' strategies flattened back to the YAML shape)."""
    tree = to_dict(config)
    for role in roles.MODEL_ROLES:
        section = getattr(config, role)
        if section is not None:
            strategy = section.strategy
            flat = {
                "name": strategy.name,
                **{k: v for k, v in to_dict(strategy.layout).items()},
                **to_dict(strategy.config),
            }
            tree[role]["strategy"] = flat
    if tree.pop("reference_from_actor_base"):
        tree["reference"] = {"from_actor_base": True}
    return OmegaConf.to_yaml(OmegaConf.create(tree))
