"""A role that runs no Megatron model lays its ranks out in TP blocks itself (parallel._init_tp_blocks): its
coordinates and groups must be what Megatron's grid gives the same TP-only layout, for every TP size and DP width
(megatron-core's own RankGenerator, the code initialize_model_parallel builds its groups with; the groups a real
Megatron group and a TP-block group form are compared side by side in test_worker_group.py at TP2 x DP2)."""

from __future__ import annotations

import pytest

from roll_backend.distributed.parallel import tp_block_group_ranks, tp_only_coords

ORDER = "tp-cp-ep-dp-pp"  # (megatron-core's default, which initialize_model_parallel is called with)


def megatron_groups(rank: int, tp: int, dp: int) -> dict[str, list[int]]:
    from megatron.core.parallel_state import RankGenerator

    # (Megatron's expert grid is RankGenerator(tp=etp, ep, dp=expert dp, ...): with etp = tp and ep = 1, this one)
    grid = RankGenerator(tp=tp, ep=1, dp=dp, pp=1, cp=1, order=ORDER)

    def mine(generator, token: str) -> list[int]:
        (group,) = [sorted(ranks) for ranks in generator.get_ranks(token) if rank in ranks]
        return group

    return {
        "tp": mine(grid, "tp"),
        "pp": mine(grid, "pp"),
        "dp": mine(grid, "dp"),
        "cp": mine(grid, "cp"),
        "tp_cp": mine(grid, "tp-cp"),
        "ep": mine(grid, "ep"),
        "etp": mine(grid, "tp"),
        "edp": mine(grid, "dp"),
    }


@pytest.mark.parametrize("tp", [1, 2, 3, 4, 8])
@pytest.mark.parametrize("dp", [1, 2, 3, 5])
def test_tp_blocks_are_megatron_s_tp_only_grid(tp, dp):
    world_size = tp * dp
    for rank in range(world_size):
        expected = megatron_groups(rank, tp, dp)
        assert tp_block_group_ranks(rank, world_size, tp) == expected, (tp, dp, rank)
        coords = tp_only_coords(rank, world_size, tp)
        assert (coords.tp, coords.dp) == (expected["tp"].index(rank), expected["dp"].index(rank)), (tp, dp, rank)
        assert (coords.tp_size, coords.dp_size, coords.pp_size, coords.cp_size) == (tp, dp, 1, 1)


def test_a_tp_that_does_not_tile_the_ranks_is_refused():
    with pytest.raises(ValueError, match="cannot tile 6 ranks; choose a tp that divides 6"):
        tp_block_group_ranks(0, 6, 4)
