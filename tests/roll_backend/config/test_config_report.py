"""One report for every problem of a config, caught before Ray starts: unknown keys next to layout problems,
max_steps, the model folder, and pipeline layouts that cannot split the model's layers."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from cli_checks import assert_refused_before_ray
from config_fixtures import CONFIG, TINY_HEADS

from roll_backend.config.loader import check_config, load_config
from roll_backend.config.typed import ConfigError


@pytest.fixture()
def base(tmp_path) -> list[str]:
    return [f"output_dir={tmp_path}/run", *TINY_HEADS]


def problems_of(overrides: list[str]) -> list[str]:
    with pytest.raises(ConfigError) as info:
        load_config(CONFIG, overrides)
    return info.value.problems


def test_unknown_keys_and_layout_problems_come_back_together(base):
    problems = problems_of(
        base + ["max_step=3", "actor_train.strategy.tpp=2", "actor_train.strategy.tp=3", "actor_train.world_size=3"]
    )
    assert problems == [
        "actor_train.strategy.tpp: unknown key for strategy 'megatron_train'; did you mean 'tp'?",
        "max_step: unknown key; did you mean 'max_steps'?",
        "actor_train.strategy.tp=3 does not divide num_attention_heads=4; choose one of 1, 2, 4",
        "actor_train.strategy.tp=3 does not divide num_key_value_heads=2; choose one of 1, 2",
    ]


def test_the_typed_config_leaves_the_rules_to_check_config_and_imports_no_torch(base):
    """`run` starts Ray once the config is well-typed and its rules hold (the rules import torch: they run first, the
    data check and Ray's start overlap). Typing alone must stay torch-free, and a tree that has type problems still
    reports its rule problems with them."""
    layout = ["actor_train.strategy.tp=3", "actor_train.world_size=3"]
    config = load_config(CONFIG, base + layout, cross_field=False)  # well-typed: the rules have not run
    with pytest.raises(ConfigError) as info:
        check_config(config)
    assert info.value.problems == problems_of(base + layout)
    assert len(problems_of(base + layout)) == 2
    with pytest.raises(ConfigError) as info:
        load_config(CONFIG, base + layout + ["max_step=3"], cross_field=False)
    assert info.value.problems == problems_of(base + layout + ["max_step=3"])
    assert len(info.value.problems) == 3
    probe = (
        "import sys; from roll_backend.config.loader import load_config; "
        f"load_config({str(CONFIG)!r}, {base!r}, cross_field=False); "
        "print(sorted(m for m in ('torch', 'transformers', 'tensordict', 'ray') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


@pytest.mark.parametrize("steps", [0, -1])
def test_max_steps_must_be_positive(base, steps):
    assert problems_of(base + [f"max_steps={steps}"]) == [
        f"max_steps={steps} must be >= 1 (the number of RL steps to run); set e.g. max_steps=10"
    ]


def test_model_path_must_be_a_model_folder_unless_a_tiny_model_is_built(base, tmp_path):
    missing = tmp_path / "no_such_model"
    [problem] = problems_of(base + ["build_tiny_model=null", f"model_path={missing}"])
    assert problem.startswith(
        f"model_path={str(missing)!r} does not exist; point it at a local Hugging Face model folder"
    )
    assert "or set build_tiny_model" in problem
    half = tmp_path / "half_model"
    half.mkdir()
    assert problems_of(base + ["build_tiny_model=null", f"model_path={half}"]) == [
        f"model_path={str(half)!r} has no config.json; point it at a Hugging Face model folder",
        f"model_path={str(half)!r} has no tokenizer (none of tokenizer.json, tokenizer_config.json, tokenizer.model, "
        "vocab.json); save the model's tokenizer there (tokenizer.save_pretrained)",
    ]
    # A role with its own path is checked under its own name; the built tiny model needs no folder yet.
    [problem] = problems_of(base + [f"reference.model_path={missing}"])
    assert problem.startswith(f"reference.model_path={str(missing)!r} does not exist")
    load_config(CONFIG, base)


def test_a_pipeline_layout_that_cannot_split_the_layers_is_a_config_error(base):
    overrides = [
        "build_tiny_model.num_hidden_layers=3",
        "actor_train.strategy.tp=1",
        "actor_train.strategy.pp=4",
        "actor_train.world_size=4",
        "reference.strategy.pp=3",
        "reference.world_size=3",
    ]
    assert problems_of(base + overrides) == [
        "actor_train.strategy (pp=4, vpp=None): num_hidden_layers=3 cannot be split over pp=4 stages with vpp=None: "
        "every stage needs at least 1 layer(s); lower pp or vpp",
    ]
    # 3 layers over 2 stages is an uneven split Megatron can build (2 + 1)
    load_config(CONFIG, base + [*overrides[:2], "actor_train.strategy.pp=2", "actor_train.world_size=2"])


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["max_steps=-1"], "max_steps=-1 must be >= 1"),
        (
            [
                "build_tiny_model.num_hidden_layers=3",
                "actor_train.strategy.tp=1",
                "actor_train.strategy.pp=4",
                "actor_train.world_size=4",
            ],
            "num_hidden_layers=3 cannot be split over pp=4 stages",
        ),
        (["build_tiny_model=null", "model_path=/nonexistent/model"], "model_path='/nonexistent/model' does not exist"),
    ],
    ids=["max_steps", "pp_split", "model_path"],
)
def test_run_refuses_before_ray_starts(base, capsys, monkeypatch, overrides, message):
    assert_refused_before_ray(monkeypatch, capsys, ["run", str(CONFIG), *base, *overrides], message)
