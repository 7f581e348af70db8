"""The rollout batch's sequence layout, beside DataProto: left-padded prompts, right-padded responses, the sequence
columns built from them, and the last response token of each row (where one score per sequence sits)."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from roll_backend import keys


def last_token_index(response_mask: torch.Tensor) -> torch.Tensor:
    """int64 [B]: the column of each row's last response token in `response_mask` [B, T_resp]; 0 for a row with
    no response token (so a score placed there still lands inside the row)."""
    positions = torch.arange(response_mask.shape[1], device=response_mask.device)
    return (response_mask.bool() * positions).argmax(dim=1)


def place_on_last_token(scores: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    """One score per sequence on its last response token: scores [B], response_mask [B, T_resp] -> [B, T_resp]
    float32, zero elsewhere (column 0 for an empty response, see `last_token_index`)."""
    token_level = torch.zeros(response_mask.shape, dtype=torch.float32, device=scores.device)
    token_level[torch.arange(len(scores)), last_token_index(response_mask)] = scores.to(torch.float32)
    return token_level


def at_last_token(values: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    """values [B, T_resp] -> [B] float32: each row's value at its last response token (`last_token_index`)."""
    return values[torch.arange(values.shape[0]), last_token_index(response_mask)].to(torch.float32)


def left_pad(
    sequences: Sequence[Sequence[int]], pad_id: int, width: int | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Left-padded ids and mask, both [B, width] int64."""
    width = width or max((len(s) for s in sequences), default=0)
    ids = torch.full((len(sequences), width), pad_id, dtype=torch.int64)
    mask = torch.zeros((len(sequences), width), dtype=torch.int64)
    for row, seq in enumerate(sequences):
        if seq:
            ids[row, width - len(seq) :] = torch.as_tensor(list(seq), dtype=torch.int64)
            mask[row, width - len(seq) :] = 1
    return ids, mask


def right_pad(
    sequences: Sequence[Sequence[int]], pad_id: int, width: int | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-padded ids and mask, both [B, width] int64 (longer sequences are cut at `width`)."""
    width = width if width is not None else max((len(s) for s in sequences), default=0)
    ids = torch.full((len(sequences), width), pad_id, dtype=torch.int64)
    mask = torch.zeros((len(sequences), width), dtype=torch.int64)
    for row, seq in enumerate(sequences):
        seq = list(seq)[:width]
        if seq:
            ids[row, : len(seq)] = torch.as_tensor(seq, dtype=torch.int64)
            mask[row, : len(seq)] = 1
    return ids, mask


def sequence_columns(
    prompts: torch.Tensor, prompt_mask: torch.Tensor, responses: torch.Tensor, response_present: torch.Tensor
) -> dict[str, torch.Tensor]:
    """The rollout layout's sequence columns (keys.PROMPTS, RESPONSES, INPUT_IDS, ATTENTION_MASK, POSITION_IDS) from
    left-padded prompts and right-padded responses with their masks (the tokens present; the loss mask is apart)."""
    attention = torch.cat([prompt_mask, response_present], dim=1)
    return {
        keys.PROMPTS: prompts,
        keys.RESPONSES: responses,
        keys.INPUT_IDS: torch.cat([prompts, responses], dim=1),
        keys.ATTENTION_MASK: attention,
        keys.POSITION_IDS: (attention.cumsum(dim=1) - 1).clamp(min=0),
    }
