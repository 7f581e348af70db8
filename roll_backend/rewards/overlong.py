"""DAPO's soft overlong punishment (Yu et al. 2025, eq. 13; verl's DAPO reward manager): a response that reaches into
the last `buffer` tokens before the length limit loses reward in proportion to how far it reaches."""

from __future__ import annotations

import torch


def overlong_penalty(lengths: torch.Tensor, max_length: int, buffer: int, factor: float) -> torch.Tensor:
    """Per response of `lengths` tokens: 0 up to max_length - buffer tokens, then falling linearly to -factor at
    max_length (float32, the shape of `lengths`)."""
    excess = lengths.float() - (max_length - buffer)
    return torch.clamp(-excess / buffer * factor, max=0.0)
