"""The offline pipelines' datasets (no Ray): pairs come as interleaved chosen/rejected rows in the rollout layout
with EOS closing each response, conversations train on their last assistant message, and bad data is refused
naming what to change."""

from __future__ import annotations

import json

import pytest
import torch

from roll_backend import keys
from roll_backend.config.schema import DataConfig
from roll_backend.models.tiny import TinyModelSpec, tokenizer_for
from roll_backend.pipelines.data.offline_datasets import OfflineDataset
from roll_backend.pipelines.data.prompt_dataset import encode_prompt
from roll_backend.pipelines.data.rows import DataError


@pytest.fixture(scope="module")
def tokenizer():
    return tokenizer_for(TinyModelSpec(tokenizer="char", char_alphabet="0123456789 copyabtwhi?"))


def write_rows(path, rows) -> str:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return str(path)


def test_pairs_are_interleaved_rows_in_the_rollout_layout(tokenizer, tmp_path):
    rows = [
        {"prompt": "copy 7", "chosen": "7", "rejected": "71", "margin": 0.5},
        {"prompt": "copy 12", "chosen": "12", "rejected": "3"},
    ]
    data = DataConfig(train_path=write_rows(tmp_path / "pairs.jsonl", rows), answer_key="chosen", shuffle=False)
    dataset = OfflineDataset(data, "dpo", tokenizer, seed=0, response_length=4)
    batch = dataset.batch_at(0, 2)
    eos = tokenizer.eos_token_id
    responses, mask = batch.batch[keys.RESPONSES], batch.batch[keys.RESPONSE_MASK]
    expected = ["7", "71", "12", "3"]
    for row, text in enumerate(expected):
        ids = tokenizer.encode(text, add_special_tokens=False) + [eos]
        assert responses[row, : len(ids)].tolist() == ids and int(mask[row].sum()) == len(ids)
    assert batch.meta_info["margins"] == [0.5, 0.0]
    # the prompts are left-padded to a common width; positions count real tokens only
    prompt = encode_prompt(tokenizer, [{"role": "user", "content": "copy 7"}])
    width = batch.batch[keys.PROMPTS].shape[1]
    assert batch.batch[keys.PROMPTS][0, width - len(prompt) :].tolist() == prompt
    attention = batch.batch[keys.ATTENTION_MASK]
    assert torch.equal(
        batch.batch[keys.POSITION_IDS][attention.bool()], torch.cat([torch.arange(int(r.sum())) for r in attention])
    )


def test_conversations_train_on_their_last_assistant_message(tokenizer, tmp_path):
    conversation = [
        {"role": "user", "content": "copy 5"},
        {"role": "assistant", "content": "5"},
        {"role": "user", "content": "copy 9"},
        {"role": "assistant", "content": "9"},
    ]
    data = DataConfig(
        train_path=write_rows(tmp_path / "chat.jsonl", [{"messages": conversation}]),
        prompt_key="messages",
        answer_key="messages",
        max_prompt_length=200,
    )
    batch = OfflineDataset(data, "sft", tokenizer, seed=0, response_length=2).batch_at(0, 1)
    prompt = encode_prompt(tokenizer, conversation[:-1])
    assert batch.batch[keys.PROMPTS][0].tolist() == prompt
    assert batch.batch[keys.RESPONSES][0].tolist() == tokenizer.encode("9", add_special_tokens=False) + [
        tokenizer.eos_token_id
    ]


def test_bad_offline_data_says_what_to_change(tokenizer, tmp_path):
    pairs = DataConfig(
        train_path=write_rows(tmp_path / "no_rejected.jsonl", [{"prompt": "copy 1", "chosen": "1", "other": "2"}]),
        answer_key="chosen",
    )
    with pytest.raises(DataError, match="no 'rejected' column .* or set data.rejected_key"):
        OfflineDataset(pairs, "reward_model", tokenizer, seed=0, response_length=4)
    long = DataConfig(train_path=write_rows(tmp_path / "long.jsonl", [{"prompt": "copy 1", "answer": "1111"}]))
    with pytest.raises(DataError, match="longer than response_length=3 tokens with EOS .* raise response_length to 5"):
        OfflineDataset(long, "sft", tokenizer, seed=0, response_length=3)
