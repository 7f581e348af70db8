"""Micro-batches of prompt-shared segments (`share_prompts: true`, see shared_prompts.py) under every batching plan,
and RoPE at the positions the segments give.

- fixed rows: segments of at most micro_batch_size rows, as many per micro-batch as fit micro_batch_size rows, one
  segment per packed row, every micro-batch at the batch's width (under vpp a multiple of pp micro-batches);
- a token budget: segments of at most max_tokens_per_microbatch positions, one per packed row, packed rows grouped
  so that rows x width stays within the budget (the budget counts the tokens forwarded);
- packing: segments laid end to end in rows of at most the budget, one row per micro-batch.

Each micro-batch carries its `OutputGather` and input rows, so the per-token outputs and the loss see the rows and
columns they see unshared. The attention is megatron-core's with an explicit mask (the local spec, on every device).
"""

from __future__ import annotations

import contextlib

import torch

from roll_backend import keys
from roll_backend.protocol import DataProto
from roll_backend.strategies.megatron import micro_batches as mb
from roll_backend.strategies.megatron.micro_batches import BatchingPlan, MicroBatch, OutputGather
from roll_backend.strategies.megatron.shared_prompts import Segment, lay_out, shared_segments


def split_shared(batch: DataProto, plan: BatchingPlan, device: str, what: str) -> tuple[list[MicroBatch], int]:
    """(micro-batches, rows) of the batch's prompt-shared segments by the plan."""
    mb.require_columns(batch, (keys.INPUT_IDS, keys.ATTENTION_MASK, keys.RESPONSES), what)
    ids, attention = batch.batch[keys.INPUT_IDS], batch.batch[keys.ATTENTION_MASK]
    response_width = batch.batch[keys.RESPONSES].shape[1]
    max_rows = plan.micro_batch_size if plan.max_tokens is None else None
    segments, empty = shared_segments(ids, attention, response_width, max_rows, plan.max_tokens, plan.prompt_tail)
    lengths = [segment.length for segment in segments]
    if plan.max_tokens is None:
        packed = [[[s] for s in micro] for micro in _by_rows(segments, plan.micro_batch_size)]
        packed += [[]] * (-len(packed) % mb.micro_batch_count_multiple())
        width = mb.round_up(max(lengths, default=1), plan.width_multiple)
        shapes = [(max(len(p) for p in packed), width)] * len(packed)
    elif plan.packing:
        bins = mb.pack_by_token_budget(lengths, plan.max_tokens)
        packed = [[[segments[i] for i in row]] for row in bins]
        shapes = [(1, mb.round_up(sum(lengths[i] for i in row), plan.width_multiple)) for row in bins]
    else:
        micro_groups = mb.group_by_token_budget(lengths, [0] * len(lengths), plan.max_tokens, plan.width_multiple)
        packed = [[[segments[i]] for i in group] for group in micro_groups]
        shapes = [(len(g), mb.round_up(max(lengths[i] for i in g), plan.width_multiple)) for g in micro_groups]
    if not packed:  # no row has a token: one micro-batch of padding carries them
        packed, shapes = [[]], [(1, plan.width_multiple)]
    shapes = mb.agreed_shapes(shapes, device)
    packed += [[]] * (len(shapes) - len(packed))
    micro_batches = [_micro_batch(batch, rows, device, shape) for rows, shape in zip(packed, shapes)]
    _carry_empty_rows(micro_batches[0], batch, empty, device)
    return micro_batches, len(batch)


def _by_rows(segments: list[Segment], max_rows: int) -> list[list[Segment]]:
    """Consecutive segments, as many per micro-batch as fit `max_rows` rows."""
    micro_batches: list[list[Segment]] = []
    rows = max_rows
    for segment in segments:
        if rows + len(segment.rows) > max_rows:
            micro_batches.append([])
            rows = 0
        micro_batches[-1].append(segment)
        rows += len(segment.rows)
    return micro_batches


def _micro_batch(batch: DataProto, packed: list[list[Segment]], device: str, shape: tuple[int, int]) -> MicroBatch:
    """One micro-batch of `shape` (packed rows, width) from the segments of each packed row."""
    response_width = batch.batch[keys.RESPONSES].shape[1]
    response_mask = batch.batch[keys.RESPONSE_MASK] if keys.RESPONSE_MASK in batch.batch.keys() else None
    ids, attention = batch.batch[keys.INPUT_IDS], batch.batch[keys.ATTENTION_MASK]
    layout = lay_out(ids, attention, response_width, packed, shape[1], response_mask)
    pad = shape[0] - layout.input_ids.shape[0]

    def rows_of(tensor: torch.Tensor, value) -> torch.Tensor:  # the micro-batch's rows, padding rows below
        filler = torch.full((pad, *tensor.shape[1:]), value, dtype=tensor.dtype)
        return torch.cat([tensor, filler]).to(device) if pad else tensor.to(device)

    visible = rows_of(layout.visible, False)
    if pad:
        visible[-pad:] = torch.eye(shape[1], dtype=torch.bool, device=device)
    input_ids = rows_of(layout.input_ids, 0)
    # Every position has its own next token (each response carries the prompt's tail): CP's per-position log-probs
    # and MTP's labels read them; a response's last position's (the next segment's first token) is outside every mask.
    labels = torch.roll(input_ids, shifts=-1, dims=1)
    labels[:, -1] = 0
    proto = batch.select_idxs(layout.rows)
    micro = MicroBatch(
        proto=proto,
        input_ids=input_ids,
        position_ids=rows_of(layout.position_ids, 0),
        attention_mask=~visible[:, None],
        labels=labels,
        loss_mask=rows_of(layout.predicts_response, 0.0),
        responses=proto.batch[keys.RESPONSES].to(device),
        token_mask=rows_of(layout.real, False),
        gather=OutputGather(
            rows=layout.gather_rows.to(device), cols=layout.gather_cols.to(device), valid=layout.gather_valid.to(device)
        ),
        index=torch.tensor(layout.rows, dtype=torch.long),
    )
    micro.source = rows_of(layout.source, -1).cpu()
    micro.aliases = layout.aliases
    micro.rope_positions = True
    return micro


def _carry_empty_rows(micro: MicroBatch, batch: DataProto, empty: list[int], device: str) -> None:
    """Rows without a token join `micro` with no output position (their outputs are 0; they are in no mask)."""
    if not empty:
        return
    micro.proto = (
        DataProto.concat([micro.proto, batch.select_idxs(empty)]) if len(micro.proto) else batch.select_idxs(empty)
    )
    micro.responses = micro.proto.batch[keys.RESPONSES].to(device)
    gather = micro.gather
    none = torch.zeros(len(empty), gather.rows.shape[1], dtype=torch.long, device=device)
    micro.gather = OutputGather(
        rows=torch.cat([gather.rows, none]),
        cols=torch.cat([gather.cols, none]),
        valid=torch.cat([gather.valid, none.bool()]),
    )
    micro.index = torch.cat([micro.index, torch.tensor(empty, dtype=torch.long)])


@contextlib.contextmanager
def rope_at_positions(model, position_ids: torch.Tensor):
    """Within the block, the model's rotary embedding rotates each token by its own position ([s, b, 1, d]
    frequencies from `position_ids` [b, s]) instead of by its column: a segment's responses continue from its
    prompt wherever they sit in the packed row."""
    rope = getattr(model, "rotary_pos_emb", None)
    if rope is None:  # (a stage that computes no attention, or no RoPE)
        yield
        return
    if getattr(model, "position_embedding_type", "rope") != "rope":
        raise ValueError(f"share_prompts needs plain RoPE; the model uses {model.position_embedding_type!r}")

    def at_positions(*args, **kwargs) -> torch.Tensor:
        table = rope.get_emb(int(position_ids.max()) + 1)[:, 0, 0]  # [P, d]
        return table[position_ids.t()].unsqueeze(2)  # [s, b, 1, d]

    rope.forward = at_positions
    try:
        yield
    finally:
        del rope.forward
