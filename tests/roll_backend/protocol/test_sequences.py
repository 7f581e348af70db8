"""The rollout layout's sequence helpers (protocol.sequences): one score per sequence on its last response token,
read back from there, and the padded id columns."""

from __future__ import annotations

import torch

from roll_backend import keys
from roll_backend.protocol.sequences import (
    at_last_token,
    last_token_index,
    left_pad,
    place_on_last_token,
    right_pad,
    sequence_columns,
)


def test_place_on_last_token_puts_each_score_on_the_last_masked_token():
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 1, 1], [1, 0, 0, 0], [0, 0, 0, 0]])
    out = place_on_last_token(torch.tensor([1.0, 2.0, 3.0, 4.0]), mask)
    expected = torch.tensor([[0, 0, 1.0, 0], [0, 0, 0, 2.0], [3.0, 0, 0, 0], [4.0, 0, 0, 0]])
    assert out.dtype == torch.float32 and torch.equal(out, expected)


def test_at_last_token_reads_the_last_masked_position_and_column_0_of_an_empty_response():
    values = torch.arange(16, dtype=torch.float32).reshape(4, 4)
    mask = torch.tensor([[1, 1, 0, 0], [1, 1, 1, 1], [1, 0, 0, 0], [0, 0, 0, 0]])
    assert torch.equal(last_token_index(mask), torch.tensor([1, 3, 0, 0]))
    assert torch.equal(at_last_token(values, mask), torch.tensor([1.0, 7.0, 8.0, 12.0]))


def test_padding_and_sequence_columns_of_uneven_rows():
    prompts, prompt_mask = left_pad([[5, 6], [7]], pad_id=0, width=3)
    assert prompts.tolist() == [[0, 5, 6], [0, 0, 7]] and prompt_mask.tolist() == [[0, 1, 1], [0, 0, 1]]
    responses, present = right_pad([[1, 2, 3], [4]], pad_id=0, width=2)  # cut at the width
    assert responses.tolist() == [[1, 2], [4, 0]] and present.tolist() == [[1, 1], [1, 0]]
    columns = sequence_columns(prompts, prompt_mask, responses, present)
    assert columns[keys.INPUT_IDS].tolist() == [[0, 5, 6, 1, 2], [0, 0, 7, 4, 0]]
    assert columns[keys.POSITION_IDS].tolist() == [[0, 0, 1, 2, 3], [0, 0, 0, 1, 1]]
