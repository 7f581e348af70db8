"""reward.by_source: which rewards score a row of each source; the built-in scorers for common sources (gsm8k,
multiple choice) and typed reference answers (a list of accepted answers scores its best match)."""

from __future__ import annotations

import dataclasses

import pytest

from roll_backend.rewards import gsm8k, multiple_choice
from roll_backend.rewards.registry import score_answer
from roll_backend.rewards.source_routing import KNOWN_SOURCES, SourceRouting, UnroutedSource, known_scorer

EVERYWHERE = {"exact_match": 1.0, "fn.score": 0.5}


def test_no_table_gives_every_row_every_reward():
    routing = SourceRouting.build(None, EVERYWHERE)
    assert routing.weights_for("anything") == EVERYWHERE and routing.names() == set(EVERYWHERE)


def test_patterns_match_in_order_globs_included_and_default_last():
    routing = SourceRouting.build(
        {"default": "exact_match", "lighteval/MATH*": {"math_verify": 2.0}, "openai/gsm8k": ["gsm8k", "fn.score"]},
        EVERYWHERE,
    )
    assert routing.weights_for("lighteval/MATH-hard") == {"math_verify": 2.0}
    assert routing.weights_for("openai/gsm8k") == {"gsm8k": 1.0, "fn.score": 1.0}
    assert routing.weights_for("other") == {"exact_match": 1.0}  # `default` is tried last wherever it is written
    assert routing.names() == {"math_verify", "gsm8k", "fn.score", "exact_match"}


def test_a_source_no_entry_matches_is_named_with_the_fix():
    routing = SourceRouting.build({"gsm8k": "gsm8k"}, EVERYWHERE)
    with pytest.raises(UnroutedSource, match=r"source 'math' matches none of gsm8k; add it \(or a `default:` entry\)"):
        routing.weights_for("math")
    assert routing.problems(["gsm8k", "math", "math", "code"]) == [
        "reward.by_source: source 'code' matches none of gsm8k; add it (or a `default:` entry) to reward.by_source",
        "reward.by_source: source 'math' matches none of gsm8k; add it (or a `default:` entry) to reward.by_source",
    ]


def test_auto_takes_the_known_scorer_of_verl_sources_and_roll_tags():
    routing = SourceRouting.build("auto", {})
    assert routing.weights_for("openai/gsm8k") == {"gsm8k": 1.0}
    assert routing.weights_for("DigitalLearningGmbH/MATH-lighteval") == {"math_verify": 1.0}
    assert routing.weights_for("math_rule") == {"math_verify": 1.0}  # ROLL's math tag
    assert routing.weights_for("crossthinkqa") == {"multiple_choice": 1.0}
    with pytest.raises(UnroutedSource, match="source 'my_data' has no built-in scorer for 'auto'"):
        routing.weights_for("my_data")
    mixed = SourceRouting.build({"my_data": "exact_match", "default": "auto"}, {})
    assert mixed.weights_for("my_data") == {"exact_match": 1.0} and mixed.weights_for("aime24") == {"math_dapo": 1.0}
    assert routing.weights_for("math_dapo") == {"math_dapo": 1.0}  # verl's DAPO sources: its +1 / -1 scale
    assert routing.weights_for("codecontests") == routing.weights_for("taco") == {"code_tests": 1.0}  # verl's code
    assert all(known_scorer(pattern.rstrip("*")) is not None for pattern, _ in KNOWN_SOURCES)


@pytest.mark.parametrize("bad", [{"gsm8k": 3}, {"gsm8k": {"gsm8k": "high"}}, {}, 7, "gsm8k"])
def test_malformed_tables_are_refused(bad):
    with pytest.raises(ValueError):
        SourceRouting.build(bad, {})


@pytest.mark.parametrize(
    "response, answer, strict, flexible",
    [
        ("so 2 + 3 = 5\n#### 5", "5", 1.0, 1.0),
        ("#### 1,234.50", "1234.5", 1.0, 1.0),
        ("the answer is 5", "5", 0.0, 1.0),  # no ####: only the flexible scorer reads it
        ("#### 5 then 6", "5", 1.0, 0.0),  # flexible takes the last number
        ("#### -3", "Natalia sold 48/2 = 24 clips.\n#### -3", 1.0, 1.0),  # the reference as a GSM8K solution
        ("#### 4", "5", 0.0, 0.0),
        ("", "5", 0.0, 0.0),
    ],
)
def test_gsm8k(response, answer, strict, flexible):
    assert gsm8k.score(response, answer) == strict
    assert gsm8k.flexible_score(response, answer) == flexible


@pytest.mark.parametrize(
    "response, answer, expected",
    [
        ("The answer is (B).", "B", 1.0),
        ("answer: c", "C", 0.0),  # lower-case letters are words, not choices
        ("Answer: C", "(C)", 1.0),
        ("\\boxed{D}", 3, 1.0),  # an option index
        ("B", "1", 1.0),
        ("I think A. Final answer is B", "A", 0.0),  # the stated answer wins over an earlier letter
        ("the answer is a prime", "A", 0.0),
        ("no idea", "A", 0.0),
    ],
)
def test_multiple_choice(response, answer, expected):
    assert multiple_choice.score(response, answer) == expected


def test_typed_answers_reach_built_ins_as_text_or_their_best_match():
    assert score_answer("exact_match", "four", ["4", "four"]) == 1.0  # any accepted answer
    assert score_answer("exact_match", "5", ["4", "four"]) == 0.0
    assert score_answer("gsm8k", "#### 7", 7) == 1.0  # a number compares as its text
    assert score_answer("math_verify", "\\boxed{1}", None) == 0.0  # no reference: nothing to match
    assert score_answer("format_boxed", "\\boxed{1}", None) == 1.0  # an answer-free reward needs none
    assert score_answer("multiple_choice", "Answer: B", 1) == 1.0  # takes the index as stored


# ---- in the config: checked before Ray ----------------------------------------------------------------------


def test_by_source_and_data_format_problems_are_reported_before_ray(tmp_path):
    from roll_backend.config.loader import load_config
    from roll_backend.config.typed import ConfigError

    def problems_of(overrides):
        with pytest.raises(ConfigError) as info:
            load_config("configs/grpo_tiny_cpu.yaml", overrides)
        return info.value.problems

    base = [f"output_dir={tmp_path}/run"]
    assert problems_of([*base, "reward.by_source=auto"]) == [  # the demo's rewards: {copy_digit: 1.0}
        "reward.rewards={'copy_digit': 1.0} and reward.by_source are both set: with by_source each source's rewards "
        "are named there (a `default:` entry for the other sources); set reward.rewards=null"
    ]
    base.append("reward.rewards=null")
    problems = problems_of([*base, "reward.by_source={gsm8k: gsm8k, default: [exact_match, my.fn]}", "data.format=hf"])
    assert problems == [
        "reward.by_source names my.fn: neither a built-in reward (code_tests, copy_digit, exact_match, format_boxed, "
        "format_think_answer, gsm8k, gsm8k_flexible, math_dapo, math_verify, multiple_choice) nor the label of one of "
        "reward.functions (none given)",
        "data.format='hf'; choose one of auto, verl, roll, plain",
    ]
    assert problems_of([*base, "reward.by_source={gsm8k: 3}"]) == [
        "reward.by_source: 3: give a reward name, a list of names, a mapping name -> weight, or 'auto'"
    ]
    assert problems_of([f"output_dir={tmp_path}/run", "reward.rewards={math_verify: 1.0}", "data.answer_key=null"]) == [
        "data.answer_key is null but a built-in reward compares responses with a reference answer; name the answer "
        "column, or use rewards that need none (a reward model, format rewards, functions)"
    ]
    config = load_config("configs/grpo_tiny_cpu.yaml", [*base, "reward.by_source=auto"])
    assert config.reward.builtin_weights() == {}  # rewards: null with a routing is the routing alone
    assert config.needs_answers()
    format_only = dataclasses.replace(config.reward, rewards={"format_boxed": 1.0}, by_source=None)
    assert not dataclasses.replace(config, reward=format_only).needs_answers()  # it reads no answer: rows need none


def test_a_source_of_the_data_that_nothing_scores_is_refused_before_ray(tmp_path):
    from roll_backend.config.loader import load_config
    from roll_backend.pipelines.data.prompts import check_data
    from roll_backend.pipelines.data.rows import DataError

    path = tmp_path / "p.jsonl"
    path.write_text('{"prompt": "copy 1", "answer": "1", "data_source": "copy"}\n' * 2)
    overrides = [f"output_dir={tmp_path}/run", f"data.train_path={path}", "data.synthetic=null", "reward.rewards=null"]
    config = load_config("configs/grpo_tiny_cpu.yaml", [*overrides, "reward.by_source={other: copy_digit}"])
    with pytest.raises(DataError, match="source 'copy' matches none of other"):
        check_data(config)
    config = load_config("configs/grpo_tiny_cpu.yaml", [*overrides, "reward.by_source={cop*: copy_digit}"])
    assert len(check_data(config)) == 2
