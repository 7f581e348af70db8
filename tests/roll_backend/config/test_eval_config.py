"""The `eval` block and data.val_path: every rule refused before Ray starts, with the key and the fix; the
`eval` command's own arguments (no Ray: it stops before starting one)."""

from __future__ import annotations

import json

import pytest
from config_fixtures import CONFIG, TINY_HEADS

from roll_backend import cli
from roll_backend.config.loader import load_config
from roll_backend.config.typed import ConfigError


@pytest.fixture()
def base(tmp_path) -> list[str]:
    val = tmp_path / "val.jsonl"
    val.write_text(json.dumps({"prompt": "copy 1", "answer": "1"}) + "\n")
    return [f"output_dir={tmp_path}/run", *TINY_HEADS, f"data.val_path={val}"]


def problems_of(overrides: list[str]) -> list[str]:
    with pytest.raises(ConfigError) as info:
        load_config(CONFIG, overrides)
    return info.value.problems


def test_a_val_set_with_pass_and_maj_k_up_to_n_loads(base, tmp_path):
    config = load_config(CONFIG, [*base, "eval.n=4", "eval.pass_k=[1,4]", "eval.maj_k=[4]", "eval.every_steps=2"])
    assert config.data.val_paths() == (str(tmp_path / "val.jsonl"),)
    assert config.eval.pass_k == (1, 4) and config.eval.before_train


def test_k_above_n_is_refused(base):
    (problem,) = problems_of([*base, "eval.n=2", "eval.pass_k=[1,3]"])
    assert "eval.pass_k=[1, 3]" in problem and "1..eval.n=2" in problem and "raise eval.n" in problem
    (problem,) = problems_of([*base, "eval.maj_k=[2]"])
    assert "eval.maj_k=[2]" in problem and "eval.n=1" in problem


def test_other_eval_rules(base, tmp_path):
    problems = problems_of([*base, "eval.n=3", "eval.temperature=0", "eval.every_steps=-1"])
    assert any("greedy samples are all the same" in p for p in problems)
    assert any("eval.every_steps=-1 must be >= 0" in p for p in problems)
    problems = problems_of([*base, "eval.temperature=2.5", "eval.top_p=0"])
    assert "eval.temperature=2.5; it must be between 0 (greedy) and 2." in problems
    assert "eval.top_p=0.0; it must be above 0 and at most 1 (1: off)." in problems
    (problem,) = problems_of([*base[:-1], f"data.val_path=[{tmp_path / 'missing.jsonl'}]"])
    assert "data.val_path" in problem and "missing.jsonl" in problem and "does not exist" in problem
    (problem,) = problems_of([*base[:-1], "eval.every_steps=5"])
    assert "set data.val_path" in problem
    config = load_config(CONFIG, [*base, "async_generation.enabled=true", "actor_infer.colocate_with=null"])
    assert config.data.has_validation()  # validation runs between the steps of an asynchronous run too


def test_eval_command_needs_validation_prompts_and_a_complete_checkpoint(base, tmp_path, capsys):
    assert cli.main(["eval", str(CONFIG), *base[:-1]]) == 2
    assert "eval needs validation prompts: set data.val_path" in capsys.readouterr().err
    assert cli.main(["eval", str(CONFIG), *base, "checkpoint=auto"]) == 2
    assert "checkpoint=auto: no complete checkpoint under" in capsys.readouterr().err
