"""PromptDataset: JSONL/parquet/synthetic loading, chat template, length filter, deterministic batches, errors."""

import json

import numpy as np
import pytest

from roll_backend import keys
from roll_backend.config.schema import DataConfig, SyntheticDataConfig
from roll_backend.models.tiny import build_char_tokenizer
from roll_backend.pipelines.data.prompt_dataset import PromptDataset
from roll_backend.pipelines.data.rows import DataError
from roll_backend.pipelines.data.synthetic_tasks import COPY_DIGIT_ALPHABET, generate_task


@pytest.fixture(scope="module")
def tokenizer():
    return build_char_tokenizer("0123456789 abcdefghijklmnopqrstuvwxyz")  # one token per character


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return str(path)


ROWS = [{"question": f"what is {i}", "solution": str(i), "extra": i} for i in range(10)]


def test_jsonl_rows_become_chat_messages(tmp_path, tokenizer):
    path = write_jsonl(tmp_path / "train.jsonl", ROWS)
    data = PromptDataset(
        DataConfig(train_path=path, prompt_key="question", answer_key="solution", shuffle=False), tokenizer, seed=0
    )
    batch = data.batch_at(0, 3)
    assert len(data) == 10 and len(batch) == 3
    assert list(batch.non_tensor_batch[keys.PROMPT_TEXT]) == [
        [{"role": "user", "content": f"what is {i}"}] for i in range(3)
    ]
    assert list(batch.non_tensor_batch[keys.ANSWER]) == ["0", "1", "2"]


def test_other_columns_reach_reward_functions_as_verl_passes_them(tmp_path, tokenizer):
    rows = [
        {"question": "what is 1", "solution": "1", "data_source": "gsm8k", "level": 3, "extra_info": {"index": 7}},
        {"question": "what is 2", "solution": "2", "data_source": "math", "level": 5, "extra_info": {"index": 8}},
    ]
    path = write_jsonl(tmp_path / "train.jsonl", rows)
    data = PromptDataset(
        DataConfig(train_path=path, prompt_key="question", answer_key="solution", shuffle=False), tokenizer, seed=0
    )
    batch = data.batch_at(0, 2)
    assert list(batch.non_tensor_batch[keys.DATA_SOURCE]) == ["gsm8k", "math"]
    assert list(batch.non_tensor_batch[keys.EXTRA_INFO]) == [{"level": 3, "index": 7}, {"level": 5, "index": 8}]
    synthetic = PromptDataset(
        DataConfig(synthetic=SyntheticDataConfig(num_prompts=4)), build_char_tokenizer(COPY_DIGIT_ALPHABET), seed=0
    )
    assert set(synthetic.batch_at(0, 4).non_tensor_batch[keys.DATA_SOURCE]) == {"copy_digit"}


def test_parquet_loads_the_same_rows(tmp_path, tokenizer):
    import pandas as pd

    path = tmp_path / "train.parquet"
    pd.DataFrame(ROWS).rename(columns={"question": "prompt", "solution": "answer"}).to_parquet(path)
    data = PromptDataset(DataConfig(train_path=str(path), shuffle=False, apply_chat_template=False), tokenizer, seed=0)
    batch = data.batch_at(1, 4)
    assert list(batch.non_tensor_batch[keys.PROMPT_TEXT]) == [f"what is {i}" for i in range(4, 8)]  # raw text
    assert list(batch.non_tensor_batch[keys.ANSWER]) == [str(i) for i in range(4, 8)]


def test_length_filter_counts_tokens_after_the_chat_template(tmp_path, tokenizer):
    rows = [{"prompt": "a" * length, "answer": "x"} for length in (1, 5, 10)]
    path = write_jsonl(tmp_path / "train.jsonl", rows)
    # Template around one user message: "<|im_start|>user\n" + text + "<|im_end|>\n<|im_start|>assistant\n" = text + 19
    # tokens.
    overhead = len(
        tokenizer.apply_chat_template([{"role": "user", "content": ""}], add_generation_prompt=True, tokenize=True)[
            "input_ids"
        ]
    )
    assert overhead == 19
    data = PromptDataset(DataConfig(train_path=path, max_prompt_length=overhead + 5, shuffle=False), tokenizer, seed=0)
    assert [messages[0]["content"] for messages in data.batch_at(0, 2).non_tensor_batch[keys.PROMPT_TEXT]] == [
        "a",
        "aaaaa",
    ]
    raw = PromptDataset(DataConfig(train_path=path, max_prompt_length=10, apply_chat_template=False), tokenizer, seed=0)
    assert len(raw) == 3  # without the template every prompt fits in 10 tokens


def test_batches_are_deterministic_across_instances_and_reshuffled_per_epoch(tmp_path, tokenizer):
    path = write_jsonl(tmp_path / "train.jsonl", [{"prompt": f"p{i}", "answer": str(i)} for i in range(10)])
    config = DataConfig(train_path=path)
    first, resumed = PromptDataset(config, tokenizer, seed=7), PromptDataset(config, tokenizer, seed=7)
    answers = lambda data, step: list(data.batch_at(step, 4).non_tensor_batch[keys.ANSWER])  # noqa: E731
    run = [answers(first, step) for step in range(10)]
    assert [answers(resumed, step) for step in (9, 3, 5)] == [run[9], run[3], run[5]]  # any order, fresh instance
    stream = [answer for batch in run for answer in batch]  # 40 rows = 4 epochs of 10
    epochs = [stream[i : i + 10] for i in range(0, 40, 10)]
    assert all(
        sorted(epoch, key=int) == [str(i) for i in range(10)] for epoch in epochs
    )  # each epoch sees each row once
    assert len({tuple(epoch) for epoch in epochs}) == 4  # and in a new order
    assert epochs[0] != [str(i) for i in range(10)]
    other_seed = PromptDataset(config, tokenizer, seed=8)
    assert [answers(other_seed, step) for step in range(3)] != run[:3]


def test_no_shuffle_keeps_file_order_across_epochs(tmp_path, tokenizer):
    path = write_jsonl(tmp_path / "train.jsonl", [{"prompt": f"p{i}", "answer": str(i)} for i in range(5)])
    data = PromptDataset(DataConfig(train_path=path, shuffle=False), tokenizer, seed=0)
    assert list(data.batch_at(1, 3).non_tensor_batch[keys.ANSWER]) == ["3", "4", "0"]  # wraps into epoch 1


def test_synthetic_copy_digit(tokenizer):
    config = DataConfig(synthetic=SyntheticDataConfig(task="copy_digit", num_prompts=64, seed=3), max_prompt_length=64)
    data = PromptDataset(config, build_char_tokenizer(COPY_DIGIT_ALPHABET), seed=0)
    batch = data.batch_at(2, 16)
    assert len(data) == 64
    for messages, answer in zip(batch.non_tensor_batch[keys.PROMPT_TEXT], batch.non_tensor_batch[keys.ANSWER]):
        assert messages == [{"role": "user", "content": f"copy {answer}"}] and answer in "0123456789"
    assert generate_task("copy_digit", 64, 3) == generate_task("copy_digit", 64, 3)
    assert len({row["answer"] for row in generate_task("copy_digit", 64, 3)}) == 10


def test_missing_file_is_a_clear_error(tmp_path, tokenizer):
    with pytest.raises(DataError, match="does not exist"):
        PromptDataset(DataConfig(train_path=str(tmp_path / "nope.jsonl")), tokenizer, seed=0)


def test_missing_columns_name_the_columns_present(tmp_path, tokenizer):
    path = write_jsonl(tmp_path / "train.jsonl", ROWS)
    with pytest.raises(
        ValueError, match=r"no column 'prompt', 'answer'; columns present: \['question', 'solution', 'extra'\]"
    ):
        PromptDataset(DataConfig(train_path=path), tokenizer, seed=0)


def test_all_prompts_filtered_says_which_limit_to_raise(tmp_path, tokenizer):
    path = write_jsonl(tmp_path / "train.jsonl", [{"prompt": "abcdef", "answer": "x"}])
    with pytest.raises(ValueError, match=r"raise data.max_prompt_length to at least 25"):
        PromptDataset(DataConfig(train_path=path, max_prompt_length=8), tokenizer, seed=0)


def test_unknown_synthetic_task_lists_the_known_ones(tokenizer):
    with pytest.raises(ValueError, match="unknown synthetic task 'nope'; known: copy_digit"):
        PromptDataset(DataConfig(synthetic=SyntheticDataConfig(task="nope")), tokenizer, seed=0)


def test_bad_step_or_batch_size(tmp_path, tokenizer):
    data = PromptDataset(
        DataConfig(
            train_path=write_jsonl(tmp_path / "t.jsonl", ROWS[:2]), prompt_key="question", answer_key="solution"
        ),
        tokenizer,
        0,
    )
    with pytest.raises(ValueError, match="step >= 0"):
        data.batch_at(-1, 2)
    assert isinstance(data.batch_at(0, 5).non_tensor_batch[keys.ANSWER], np.ndarray)  # more rows than the data: wraps
