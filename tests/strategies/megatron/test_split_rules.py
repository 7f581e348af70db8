"""Pure rules behind the Megatron layouts (no ranks): pipeline stage splits and CP chunk order."""

from __future__ import annotations

import pytest
import torch

from roll_backend.strategies.megatron.cp import _own_chunks, _token_order
from roll_backend.strategies.megatron.stage_splits import default_stage_split, stage_split_problem


@pytest.mark.parametrize(
    "layers,pp,vpp,expected",
    [
        (4, 2, None, (None, None)),
        (4, 2, 2, (None, None)),
        (3, 2, None, (2, 1)),
        (5, 3, None, (2, 1)),
        (7, 4, None, (2, 1)),
        (6, 2, 2, (4, 2)),
        (10, 4, None, (3, 1)),
    ],
)
def test_default_split_is_the_most_even_with_the_last_stage_lighter(layers, pp, vpp, expected):
    assert default_stage_split(layers, pp, vpp) == expected
    first, last = expected
    assert stage_split_problem(layers, pp, vpp, first, last) is None


def test_impossible_splits_say_why():
    with pytest.raises(ValueError, match="num_hidden_layers=3 cannot be split over pp=2 stages with vpp=2"):
        default_stage_split(3, 2, 2)
    assert "must be a positive multiple of vpp=2" in stage_split_problem(8, 2, 2, 3, None)
    assert "cannot be split evenly over 2 stage(s)" in stage_split_problem(8, 4, None, 1, 2)
    assert "needs pp >= 2" in stage_split_problem(4, 1, 2, None, None)


@pytest.mark.parametrize("cp", [2, 4])
def test_cp_chunk_order_round_trips(cp):
    """Rank r holds chunks r and 2cp-1-r (Megatron's get_batch_on_this_cp_rank); gathering puts tokens back."""
    from megatron.core.utils import get_batch_on_this_cp_rank  # the layout the model sees

    tokens = torch.arange(3 * 4 * cp).reshape(3, 4 * cp)
    local = []
    for rank in range(cp):
        with pytest.MonkeyPatch.context() as patch:
            from megatron.core import parallel_state

            patch.setattr(parallel_state, "get_context_parallel_world_size", lambda: cp)
            patch.setattr(parallel_state, "get_context_parallel_rank", lambda rank=rank: rank)
            local.append(get_batch_on_this_cp_rank({"tokens": tokens.clone()})["tokens"])
        assert torch.equal(_own_chunks(tokens, 1, rank, cp), local[rank])
    assert torch.equal(_token_order(local, 1), tokens)
