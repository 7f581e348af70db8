"""Other frameworks' prompt files read unchanged: verl's RL parquet and ROLL's RLVR JSONL (written here in each one's
documented schema), detected or declared, with typed ground truths, the whole conversation, the row's source; an
undeclared JSON-string conversation refused; reward-model-only data without an answer column."""

from __future__ import annotations

import json
import logging

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from roll_backend.config.schema import DataConfig
from roll_backend.models.tiny import build_char_tokenizer
from roll_backend.pipelines.data.prompt_dataset import PromptDataset
from roll_backend.pipelines.data.row_formats import detect_format
from roll_backend.pipelines.data.rows import DataError

SYSTEM = "be brief."

# verl's RL parquet: prompt as chat messages, data_source, reward_model {style, ground_truth}, extra_info.
# Ground truths of several types: text, a list of accepted answers, a dict of tests, a number.
VERL_GROUND_TRUTHS = ["3", ["4", "four"], {"inputs": ["1 2"], "outputs": ["3"]}, 7]


def verl_rows() -> list[dict]:
    return [
        {
            "data_source": source,
            "prompt": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": f"add {i} and 1"}],
            "ability": "math",
            "reward_model": {"style": "rule", "ground_truth": truth},
            "extra_info": {"split": "train", "index": i},
        }
        for i, (source, truth) in enumerate(
            zip(["openai/gsm8k", "lighteval/MATH", "code", "gsm8k"], VERL_GROUND_TRUTHS)
        )
    ]


def write_typed_verl_parquet(path) -> str:
    """A verl parquet whose ground truths are lists of strings in every row (parquet keeps the list type)."""
    rows = [
        {**row, "reward_model": {"style": "rule", "ground_truth": [str(i), f"n{i}"]}}
        for i, row in enumerate(verl_rows())
    ]
    pq.write_table(pa.Table.from_pylist(rows), path)
    return str(path)


# ROLL's RLVR JSONL: messages as a JSON string (with the system prompt), prompt the user text alone, tag, ground_truth.
def roll_rows() -> list[dict]:
    return [
        {
            "id": str(i),
            "source": "gsm8k",
            "difficulty": 0,
            "prompt": f"add {i} and 2",
            "messages": json.dumps(
                [{"role": "system", "content": SYSTEM}, {"role": "user", "content": f"add {i} and 2"}]
            ),
            "ground_truth": str(i + 2),
            "case_type": "",
            "test_case_function": "",
            "test_cases": "",
            "tag": tag,
        }
        for i, tag in enumerate(["math_rule", "math_rule", "crossthinkqa"])
    ]


def write_jsonl(path, rows) -> str:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return str(path)


@pytest.fixture(scope="module")
def tokenizer():
    return build_char_tokenizer("0123456789 abcdefghijklmnopqrstuvwxyz.")


def load(path: str, tokenizer, answer_needed=True, **options) -> PromptDataset:
    config = DataConfig(train_path=path, shuffle=False, max_prompt_length=200, **options)
    return PromptDataset(config, tokenizer, seed=0, answer_needed=answer_needed)


def test_a_verl_parquet_is_detected_and_read_with_its_conversation_sources_and_ground_truths(
    tmp_path, tokenizer, caplog
):
    path = write_typed_verl_parquet(tmp_path / "train.parquet")
    with caplog.at_level(logging.INFO):
        data = load(path, tokenizer)
    assert "read as verl format" in caplog.text and "reward_model.ground_truth" in caplog.text
    rows = verl_rows()
    assert [list(p) for p in data.prompts] == [row["prompt"] for row in rows]  # the system prompt kept
    assert list(data.answers) == [[str(i), f"n{i}"] for i in range(len(rows))]  # a list stays a list
    assert list(data.data_sources) == [row["data_source"] for row in rows]
    # extra_info as verl passes it: the row's extra_info dict (and its other columns), not the reward_model column.
    assert data.extra_infos[1] == {"ability": "math", "split": "train", "index": 1}


@pytest.mark.parametrize("format_", ["auto", "verl"])
def test_verl_ground_truths_of_every_type_arrive_as_stored(tmp_path, tokenizer, format_):
    # JSONL keeps every type row by row (parquet needs one per column).
    path = write_jsonl(tmp_path / "verl.jsonl", verl_rows())
    data = load(path, tokenizer, format=format_)
    assert list(data.answers) == VERL_GROUND_TRUTHS
    assert type(data.answers[2]) is dict and type(data.answers[3]) is int


def test_a_roll_jsonl_is_detected_with_its_system_prompt_tag_and_other_columns(tmp_path, tokenizer, caplog):
    path = write_jsonl(tmp_path / "rlvr.jsonl", roll_rows())
    with caplog.at_level(logging.INFO):
        data = load(path, tokenizer)
    assert "read as roll format" in caplog.text
    for prompt, row in zip(data.prompts, roll_rows()):
        assert list(prompt) == json.loads(row["messages"])  # not the `prompt` column's user text alone
    assert list(data.answers) == ["2", "3", "4"]
    assert list(data.data_sources) == ["math_rule", "math_rule", "crossthinkqa"]  # ROLL routes rewards by tag
    assert data.extra_infos[0]["source"] == "gsm8k" and data.extra_infos[0]["case_type"] == ""


def test_a_roll_row_without_messages_falls_back_to_its_prompt_text(tmp_path, tokenizer):
    rows = roll_rows()
    del rows[1]["messages"]
    data = load(write_jsonl(tmp_path / "rlvr.jsonl", rows), tokenizer, format="roll")
    assert list(data.prompts[1]) == [{"role": "user", "content": "add 1 and 2"}]


def test_an_undeclared_json_conversation_is_an_error_naming_the_column_and_the_setting(tmp_path, tokenizer):
    conversation = json.dumps([{"role": "system", "content": SYSTEM}, {"role": "user", "content": "add 1 and 1"}])
    path = write_jsonl(tmp_path / "p.jsonl", [{"question": conversation, "answer": "2"}])
    with pytest.raises(DataError) as info:
        load(path, tokenizer, prompt_key="question", skip_invalid_rows=True)  # not a bad row: never skipped
    message = str(info.value)
    assert "column 'question' holds a conversation as a JSON string" in message
    assert "data.messages_key=question" in message
    # Declared, it is the conversation.
    data = load(path, tokenizer, messages_key="question")
    assert list(data.prompts[0]) == json.loads(conversation)


def test_a_declared_conversation_column_that_does_not_parse_names_the_row(tmp_path, tokenizer):
    rows = roll_rows()
    rows[2]["messages"] = '[{"role": "user"'
    with pytest.raises(DataError) as info:
        load(write_jsonl(tmp_path / "rlvr.jsonl", rows), tokenizer)
    assert "rlvr.jsonl:3: column 'messages' is not a JSON conversation" in str(info.value)


def test_reward_model_only_data_needs_no_answer_column(tmp_path, tokenizer):
    path = write_jsonl(tmp_path / "hh.jsonl", [{"prompt": "say hi"}, {"prompt": "say no"}])
    data = load(path, tokenizer, answer_needed=False)
    assert list(data.answers) == [None, None]
    with pytest.raises(DataError, match="no column 'answer'"):
        load(path, tokenizer)  # a reward that compares with an answer needs the column
    with pytest.raises(DataError, match="data.answer_key is null"):
        load(path, tokenizer, answer_key=None)


def test_declared_formats_and_overrides_win_over_detection(tmp_path, tokenizer):
    path = write_jsonl(tmp_path / "verl.jsonl", verl_rows())
    with pytest.raises(DataError, match=r"no column 'answer'.*plain format"):
        load(path, tokenizer, format="plain")
    # a dotted answer path reads into the dict column in any format
    data = load(path, tokenizer, format="plain", answer_key="reward_model.style")
    assert list(data.answers) == ["rule"] * 4
    data = load(path, tokenizer, source_key="ability")
    assert list(data.data_sources) == ["math"] * 4
    with pytest.raises(DataError, match="data.format='hf'; choose one of auto, verl, roll, plain"):
        load(path, tokenizer, format="hf")


@pytest.mark.parametrize(
    "row, expected",
    [
        ({"prompt": [{"role": "user", "content": "x"}], "reward_model": {"ground_truth": "1"}}, "verl"),
        ({"messages": '[{"role": "user", "content": "x"}]', "tag": "t"}, "roll"),
        ({"messages": [{"role": "user", "content": "x"}]}, "plain"),  # a list, not a JSON string
        ({"messages": "[1, 2]", "answer": "3"}, "plain"),  # JSON, not a conversation
        ({"prompt": [{"role": "user", "content": "x"}], "data_source": "s", "answer": "1"}, "plain"),
    ],
)
def test_detection(row, expected):
    assert detect_format(row) == expected
