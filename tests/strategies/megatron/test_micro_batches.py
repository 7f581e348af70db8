"""Token-budget grouping, packing, DP balancing and grouping-independent losses, without Ray or ranks."""

from __future__ import annotations

import logging

import numpy as np
import pytest
import torch

from roll_backend import keys
from roll_backend.algorithms import AGG_MODE_NAMES, agg_loss
from roll_backend.distributed import balance
from roll_backend.distributed.dispatch import Dispatch
from roll_backend.distributed.layout import RankCoords
from roll_backend.protocol import DataProto
from roll_backend.strategies.megatron import micro_batches as mb
from roll_backend.strategies.megatron.config import MegatronInferConfig, MegatronTrainConfig

PROMPT_LENS = [10, 3, 7, 1, 5, 9, 2, 6, 4]
RESPONSE_LENS = [2, 24, 5, 17, 1, 9, 12, 0, 3]


def _batch(prompt_width: int = 10, response_width: int = 24) -> DataProto:
    gen = torch.Generator().manual_seed(0)
    rows = len(PROMPT_LENS)
    input_ids = torch.zeros(rows, prompt_width + response_width, dtype=torch.long)
    attention = torch.zeros_like(input_ids)
    for row, (p, r) in enumerate(zip(PROMPT_LENS, RESPONSE_LENS)):
        used = slice(prompt_width - p, prompt_width + r)
        input_ids[row, used] = torch.randint(3, 300, (p + r,), generator=gen)
        attention[row, used] = 1
    return DataProto.from_dict(
        tensors={
            keys.INPUT_IDS: input_ids,
            keys.ATTENTION_MASK: attention,
            keys.RESPONSES: input_ids[:, prompt_width:],
            keys.RESPONSE_MASK: attention[:, prompt_width:],
            keys.POSITION_IDS: (attention.cumsum(-1) - 1).clamp(min=0),
        }
    )


def test_sequence_extents_count_used_prompt_and_response_columns():
    prompt, response = mb.sequence_extents(_batch().batch[keys.ATTENTION_MASK], 24)
    assert prompt.tolist() == PROMPT_LENS and response.tolist() == RESPONSE_LENS


def test_token_budget_groups_stay_within_the_budget_and_cover_every_row_once(caplog, monkeypatch):
    monkeypatch.setattr(mb, "_warned_over_budget", False)
    with caplog.at_level(logging.WARNING):
        groups = mb.group_by_token_budget(PROMPT_LENS, RESPONSE_LENS, budget=24)
        mb.group_by_token_budget(PROMPT_LENS, RESPONSE_LENS, budget=24)
    assert sorted(i for g in groups for i in g) == list(range(len(PROMPT_LENS)))
    for group in groups:
        width = mb.round_up(max(max(PROMPT_LENS[i] for i in group), 1) + max(RESPONSE_LENS[i] for i in group))
        assert len(group) * width <= 24 or len(group) == 1
    over = [g for g in groups if mb.round_up(PROMPT_LENS[g[0]] + RESPONSE_LENS[g[0]]) > 24]
    assert over == [[1]]  # 3 + 24 tokens -> 32 padded > 24: alone; and a single warning for both calls
    assert sum("exceeds max_tokens_per_microbatch=24" in r.message for r in caplog.records) == 1


def test_packing_fills_rows_up_to_the_budget():
    lengths = [p + r for p, r in zip(PROMPT_LENS, RESPONSE_LENS)]
    bins = mb.pack_by_token_budget(lengths, budget=30)
    assert sorted(i for b in bins for i in b) == list(range(len(lengths)))
    assert all(sum(lengths[i] for i in b) <= 30 for b in bins)
    assert len(bins) <= -(-sum(lengths) // 30) + 1  # within one row of the lower bound


@pytest.mark.parametrize(
    "plan", [mb.BatchingPlan(2, 32), mb.BatchingPlan(2, 40, packing=True)], ids=["budget", "packing"]
)
def test_gathered_columns_predict_each_response_token_and_packed_sequences_see_only_themselves(plan):
    batch = _batch()
    micro_batches, rows = mb.split(batch, plan, "cpu", "test")
    assert rows == len(batch)
    assert sorted(torch.cat([m.index for m in micro_batches]).tolist()) == list(range(len(batch)))
    for micro in micro_batches:
        next_cols = (micro.gather.cols + 1).clamp(max=micro.input_ids.shape[1] - 1)
        tokens = micro.input_ids[micro.gather.rows, next_cols]  # the token each gathered output predicts
        valid = micro.gather.valid
        assert torch.equal(tokens[valid], micro.responses[valid])
        lengths = [RESPONSE_LENS[i] for i in micro.index.tolist()]
        # Each row's response is covered: packed rows exactly, budget rows up to the micro-batch's longest.
        assert valid.sum(1).tolist() == (lengths if plan.packing else [max(lengths)] * len(lengths))
        assert micro.input_ids.shape[1] % 8 == 0
        if plan.packing:
            assert micro.input_ids.shape[0] == 1 and micro.input_ids.shape[1] <= 40
            visible = ~micro.attention_mask[0, 0]
            segment = torch.full((micro.input_ids.shape[1],), -1)
            for n, row in enumerate(micro.index.tolist()):
                start = int(micro.gather.cols[n, 0]) - (max(PROMPT_LENS[row], 1) - 1)
                segment[start : start + max(PROMPT_LENS[row], 1) + RESPONSE_LENS[row]] = n
                assert micro.position_ids[0, start] == 0
            real = segment >= 0
            same = (segment[:, None] == segment[None, :]) & real[:, None] & real[None, :]
            causal = torch.ones_like(visible).tril()
            # a sequence's positions see exactly the earlier positions of the same sequence
            assert torch.equal(visible[real][:, real], (same & causal)[real][:, real])


@pytest.mark.parametrize(
    "micro_batch_size, count_multiple, sizes",
    [
        (64, 1, [9]),
        (4, 1, [3, 3, 3]),
        (2, 1, [2, 2, 2, 2, 2]),
        (9, 1, [9]),
        (8, 2, [5, 5]),
        (64, 2, [5, 5]),
    ],
)
def test_fixed_micro_batches_are_as_few_as_the_size_allows_and_equal(
    monkeypatch, micro_batch_size, count_multiple, sizes
):
    """A probe of 4 rows at micro_batch_size 64 ran one micro-batch of 64 rows (60 of padding): 11x the work."""
    from roll_backend.strategies.megatron import cp

    monkeypatch.setattr(mb, "micro_batch_count_multiple", lambda: count_multiple)  # vpp: a multiple of pp
    monkeypatch.setattr(cp, "cp_group_and_size", lambda: (None, 1))
    batch = _batch()
    micro_batches, rows = mb.split(batch, mb.BatchingPlan(micro_batch_size), "cpu", "test")
    assert rows == len(batch) and [m.input_ids.shape[0] for m in micro_batches] == sizes
    ids, width = torch.cat([m.input_ids for m in micro_batches]), batch.batch[keys.INPUT_IDS].shape[1]
    assert torch.equal(ids[:rows, -width:], batch.batch[keys.INPUT_IDS])  # in order (left-padded to a multiple of 8)
    assert not ids[rows:].any() and not torch.cat([m.loss_mask for m in micro_batches])[rows:].any()


@pytest.mark.parametrize(
    "plan",
    [mb.BatchingPlan(4), mb.BatchingPlan(2, 32), mb.BatchingPlan(2, 40, packing=True)],
    ids=["fixed", "budget", "packing"],
)
def test_per_token_columns_follow_the_tokens_through_every_cut_and_back(monkeypatch, plan):
    """A whole-sequence per-token column ([B, T, L, k]: MoE routes) is cut with the tokens: each micro-batch
    position holds its own token's values (packing padding and trimmed columns shift nothing), -1 where the cut
    added padding; what a forward records per position goes back to its token's place in the batch."""
    from roll_backend.strategies.megatron import cp

    monkeypatch.setattr(mb, "micro_batch_count_multiple", lambda: 1)
    monkeypatch.setattr(cp, "cp_group_and_size", lambda: (None, 1))
    batch = _batch()
    ids = batch.batch[keys.INPUT_IDS]
    per_token = torch.stack([ids, ids * 7 % 5], dim=-1)[:, :, None, :].expand(-1, -1, 3, -1).to(torch.int16)
    micro_batches, _ = mb.split(batch, plan, "cpu", "test", routes=per_token)
    for micro in micro_batches:
        real = micro.token_mask
        assert torch.equal(micro.routes[real][..., 0, 0].long(), micro.input_ids[real])  # each token's own values
        assert (micro.routes[micro.source < 0] == -1).all()
    back = mb.place_per_token(micro_batches, [m.routes.cpu() for m in micro_batches], tuple(per_token.shape), -1)
    real = batch.batch[keys.ATTENTION_MASK].bool()
    assert torch.equal(back[real], per_token[real])


def test_budget_and_packing_need_valid_config():
    with pytest.raises(ValueError, match="use_sequence_packing=True packs sequences"):
        MegatronTrainConfig(model_path="m", use_sequence_packing=True)
    with pytest.raises(ValueError, match=r"max_tokens_per_microbatch=4 must be an integer >= 8"):
        MegatronInferConfig(model_path="m", max_tokens_per_microbatch=4)
    with pytest.raises(ValueError, match="MTP labels would cross packed sequences"):
        MegatronTrainConfig(model_path="m", max_tokens_per_microbatch=64, use_sequence_packing=True, mtp_num_layers=1)
    assert MegatronTrainConfig(
        model_path="m", max_tokens_per_microbatch=64, use_sequence_packing=True
    ).use_sequence_packing


@pytest.mark.parametrize("mode", AGG_MODE_NAMES)
def test_every_agg_mode_with_global_counts_is_independent_of_the_grouping(mode):
    gen = torch.Generator().manual_seed(1)
    loss_mat = torch.randn(9, 24, generator=gen, dtype=torch.float64)
    mask = _batch().batch[keys.RESPONSE_MASK].double()
    tokens, sequences = mask.sum(), (mask.sum(-1) > 0).sum()
    whole = agg_loss(loss_mat, mask, mode, batch_num_tokens=tokens, global_batch_size=sequences)
    for groups in ([[0, 1, 2, 3, 4, 5, 6, 7, 8]], [[1], [0, 2, 4], [3, 5, 6, 7, 8]], [[i] for i in range(9)]):
        summed = sum(
            agg_loss(loss_mat[g], mask[g], mode, batch_num_tokens=tokens, global_batch_size=sequences) for g in groups
        )
        assert float(summed) == pytest.approx(float(whole), rel=1e-6), groups


def test_balanced_partition_evens_token_totals_with_equal_row_counts():
    weights = [1000, 900, 800, 500, 20, 30, 60, 400]
    partition = balance.balanced_partition(weights, 2)
    assert [len(p) for p in partition] == [4, 4]
    assert balance.imbalance(weights, partition) < 1.05 < balance.imbalance(weights, [[0, 1, 2, 3], [4, 5, 6, 7]])


def _coords(dp_size: int, tp_size: int = 1) -> list[RankCoords]:
    return [
        RankCoords(
            rank=d * tp_size + t,
            world_size=dp_size * tp_size,
            dp=d,
            tp=t,
            pp=0,
            cp=0,
            dp_size=dp_size,
            tp_size=tp_size,
            pp_size=1,
            cp_size=1,
        )
        for d in range(dp_size)
        for t in range(tp_size)
    ]


@pytest.mark.parametrize("dp_size", [2, 4])
def test_balanced_dispatch_restores_the_input_order_with_uneven_splits_and_padding(dp_size):
    batch = _batch()  # 9 rows: 1 (dp2) or 3 (dp4) padding rows
    batch.batch["ids"] = torch.arange(len(batch))
    mode = Dispatch.DP_MP_COMPUTE_BALANCED
    coords = _coords(dp_size, tp_size=2)
    split = mode.split(coords, (batch,), {})
    chunks = [args[0] for args, _ in split.per_rank]
    totals = [float(c.batch[keys.ATTENTION_MASK].sum()) for c, co in zip(chunks, coords) if co.tp == 0]
    assert max(totals) / np.mean(totals) == pytest.approx(split.context["balance_metrics"][balance.IMBALANCE_AFTER])
    assert (
        split.context["balance_metrics"][balance.IMBALANCE_AFTER]
        <= split.context["balance_metrics"][balance.IMBALANCE_BEFORE]
    )
    assert (
        sum(int(c.batch[keys.DISPATCH_PADDING].sum()) for c, co in zip(chunks, coords) if co.tp == 0)
        == -len(batch) % dp_size
    )
    outputs = [
        DataProto.from_dict(tensors={"ids": c.batch["ids"] * 10, keys.DISPATCH_PADDING: c.batch[keys.DISPATCH_PADDING]})
        for c in chunks
    ]
    merged = mode.collect(coords, outputs, split.context)
    assert merged.batch["ids"].tolist() == [10 * i for i in range(len(batch))]
    assert keys.DISPATCH_PADDING not in merged.batch.keys()
    assert (
        merged.meta_info[keys.META_METRICS][balance.IMBALANCE_AFTER]
        == split.context["balance_metrics"][balance.IMBALANCE_AFTER]
    )
    # Metric dicts (train_step) get the imbalance figures; opting out leaves the plain DP split.
    assert balance.IMBALANCE_BEFORE in mode.collect(coords, [{"loss": 1.0}] * len(coords), split.context)[0]
    batch.meta_info[keys.META_BALANCE_DP] = False
    assert "balance_order" not in mode.split(coords, (batch,), {}).context


def test_mtp_depth_masks_cover_response_targets_predicted_from_real_positions_only():
    from roll_backend.strategies.megatron.mtp_loss import depth_mask

    batch = _batch()
    micro = mb.model_inputs(batch, "cpu", batch.batch[keys.INPUT_IDS].shape[1])
    prompt_end = batch.batch[keys.INPUT_IDS].shape[1] - batch.batch[keys.RESPONSES].shape[1]
    for depth in (1, 2, 3):
        mask = depth_mask(micro, depth)
        for row, (p, r) in enumerate(zip(PROMPT_LENS, RESPONSE_LENS)):
            # Position i of depth d predicts token i+d+1 from tokens i..i+d: all real, the target a response.
            expected = torch.zeros(mask.shape[1])
            for i in range(mask.shape[1]):
                target = i + depth + 1
                if i >= prompt_end - p and prompt_end <= target < prompt_end + r:
                    expected[i] = 1
            assert torch.equal(mask[row], expected), (row, depth)


@pytest.mark.parametrize(
    "plan",
    [mb.BatchingPlan(3, share_prompts=True), mb.BatchingPlan(2, 48, share_prompts=True)]
    + [mb.BatchingPlan(2, 40, packing=True, share_prompts=True)],
    ids=["fixed", "budget", "packing"],
)
def test_shared_prompt_micro_batches_carry_every_row_once_and_its_tokens_routes(monkeypatch, plan):
    """Prompt-shared micro-batches (rows 0-3 and 5-6 share their prompts; row 7 has no response token; row 8 no token
    at all): every row comes back exactly once, a budget bounds the positions forwarded, per-token columns (MoE
    routes) follow the tokens in (a shared prompt token takes its group's first row's) and go back out to every row
    of the group (R2's recorded routes)."""
    from roll_backend.strategies.megatron import cp
    from roll_backend.strategies.megatron.shared_micro_batches import split_shared

    monkeypatch.setattr(mb, "micro_batch_count_multiple", lambda: 1)
    monkeypatch.setattr(cp, "cp_group_and_size", lambda: (None, 1))
    batch = _batch()
    tensors = dict(batch.batch.items())
    for rows, first in (((1, 2, 3), 0), ((6,), 5)):
        for row in rows:  # the group's prompt, the row's own response
            tensors[keys.INPUT_IDS][row, :10] = tensors[keys.INPUT_IDS][first, :10]
            tensors[keys.ATTENTION_MASK][row, :10] = tensors[keys.ATTENTION_MASK][first, :10]
    tensors[keys.ATTENTION_MASK][8] = 0
    batch = DataProto.from_dict(tensors=tensors)
    ids = batch.batch[keys.INPUT_IDS]
    per_token = torch.stack([ids, ids * 7 % 5], dim=-1)[:, :, None, :].expand(-1, -1, 3, -1).to(torch.int16)
    micro_batches, rows = split_shared(batch, plan, "cpu", "test")
    mb.attach_routes(micro_batches, per_token, "cpu")
    assert rows == len(batch) and sorted(torch.cat([m.index for m in micro_batches]).tolist()) == list(range(rows))
    for micro in micro_batches:
        assert len(micro.proto) == len(micro.index) == micro.gather.rows.shape[0]
        real = micro.token_mask
        assert torch.equal(micro.routes[real][..., 0, 0].long(), micro.input_ids[real])
        if plan.max_tokens is not None and micro.input_ids.shape[1] > 10 + 24:  # (a longer segment is alone)
            assert micro.input_ids.numel() <= plan.max_tokens or micro.input_ids.shape[0] == 1
    forwarded = sum(m.token_counts()[keys.METRIC_TOKENS_FORWARDED] for m in micro_batches)
    held = int(batch.batch[keys.ATTENTION_MASK].sum())
    shared_prompt_tokens = 3 * PROMPT_LENS[0] + PROMPT_LENS[5]  # (the budget may cut a group: at most this saved)
    assert held - shared_prompt_tokens <= forwarded < held
    back = mb.place_per_token(micro_batches, [m.routes.cpu() for m in micro_batches], tuple(per_token.shape), -1)
    real = batch.batch[keys.ATTENTION_MASK].bool()
    assert torch.equal(back[real], per_token[real])
