"""Micro-batches for the Megatron schedule: a batch cut into fixed rows, by a token budget, or packed, and the
per-token outputs put back in the batch's row order.

RL batches are left-padded prompts followed by right-padded responses of long-tailed lengths. The fixed way
(`split_micro_batches`) pads every micro-batch to the whole batch's width. By a token budget or packed:

- token budget: rows are sorted by length and grouped so that a micro-batch's padded token count
  (rows x its own width, prompt and response padding trimmed to what its rows use) stays within
  `max_tokens_per_microbatch`; a row longer than the budget gets a micro-batch of its own (warned once);
- packing: the used tokens of several rows are laid end to end in one row of at most the budget, each
  sequence attending only within itself (a block-diagonal causal mask on the local spec; Megatron's packed THD
  format with TransformerEngine).

Either way each micro-batch carries an `OutputGather` (where each response token's prediction sits in the
model's output) and the input row indices, so per-token outputs come back at full response width in the input
order, and the loss function sees the same rows and columns as with fixed micro-batches.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from roll_backend import keys
from roll_backend.protocol import DataProto
from roll_backend.strategies.megatron import cp
from roll_backend.strategies.megatron.builder import transformer_engine_for

logger = logging.getLogger(__name__)


_warned_over_budget = False


# ---- fixed micro-batches ---------------------------------------------------------------------------------

# The model sees each batch at a width of a multiple of this many tokens, from its first non-padding column:
# prompts arrive left-padded to max_prompt_length, and CPU GEMM/softmax kernels ran a Megatron train step ~20%
# slower at 169 tokens than at 168 or 176 (bf16, torch 2.13); GPU kernels also prefer aligned lengths.
SEQUENCE_MULTIPLE = 8


def model_width(attention_mask: torch.Tensor, multiple: int = SEQUENCE_MULTIPLE) -> int:
    """Columns the model needs for a left-padded [b, T] batch: from the first column any row uses, rounded up to
    SEQUENCE_MULTIPLE (one width for the whole batch: pipeline stages exchange activations of one shape)."""
    used = attention_mask.bool().any(dim=0).nonzero()
    first = int(used[0]) if len(used) else attention_mask.shape[1] - 1
    return -(-(attention_mask.shape[1] - first) // multiple) * multiple


def _left_fit(tensor: torch.Tensor, width: int, value) -> torch.Tensor:
    """The last `width` columns of `tensor`, left-padded with `value` where it has fewer."""
    if width <= tensor.shape[1]:
        return tensor[:, tensor.shape[1] - width :]
    return torch.nn.functional.pad(tensor, (width - tensor.shape[1], 0), value=value)


@dataclass
class OutputGather:
    """Where the prediction of response token j of the micro-batch's sequence i sits in the model's output:
    row `rows[i, j]`, column `cols[i, j]`; `valid[i, j]` is False past the columns the micro-batch kept
    (outputs there are 0, outside every loss mask)."""

    rows: torch.Tensor  # [n, T_resp] int64
    cols: torch.Tensor  # [n, T_resp] int64
    valid: torch.Tensor  # [n, T_resp] bool

    def take(self, output_bt: torch.Tensor) -> torch.Tensor:
        """output_bt [b, T, ...] -> [n, T_resp, ...] (invalid places hold an arbitrary in-range column)."""
        return output_bt[self.rows, self.cols]


@dataclass
class MicroBatch:
    """One micro-batch ready for GPTModel.forward. Padding rows (to fill the last micro-batch) are all zeros."""

    proto: DataProto  # the rows, for the loss function
    input_ids: torch.Tensor  # [b, T] int64
    position_ids: torch.Tensor  # [b, T] int64
    attention_mask: torch.Tensor  # [b, 1, T, T] bool, True = masked (causal + key padding)
    labels: torch.Tensor  # [b, T] int64, next token
    loss_mask: torch.Tensor  # [b, T] float, 1 where the next token is a response token
    responses: torch.Tensor  # [b, T_resp] int64
    token_mask: torch.Tensor  # [b, T] bool, True at real tokens (not padding)
    # Token-budget and packed micro-batches: where each response token's prediction sits in the output (None: the
    # last T_resp columns), the input rows they hold, and THD packing parameters.
    gather: OutputGather | None = None
    index: torch.Tensor | None = None
    packed_seq_params: Any = None
    # Where each position's token comes from: row * T + column in the batch's [B, T] tokens, -1 where the cut added
    # padding (CPU int64 [b, T]). Per-token columns over the whole sequence (MoE routes) are cut through it, and
    # what a forward records per position goes back through it.
    source: torch.Tensor | None = None
    routes: torch.Tensor | None = None  # [b, T, L, k] the routes replayed at each position (router_replay), or None
    # Prompt-shared micro-batches (shared_micro_batches.py): (batch position, stand-in position) pairs for what is
    # recorded once per shared prompt token, and RoPE at `position_ids` rather than at the columns.
    aliases: torch.Tensor | None = None
    rope_positions: bool = False

    @property
    def has_rows(self) -> bool:
        """False for an all-padding micro-batch (the interleaved schedule needs a multiple of PP of them)."""
        return bool(self.proto.batch[keys.ATTENTION_MASK].any())

    def token_counts(self) -> dict[str, float]:
        """The tokens this micro-batch forwards (padding aside) and those its rows hold (as forwarded unshared)."""
        held = self.proto.batch[keys.ATTENTION_MASK].sum() if len(self.proto) else 0
        return {keys.METRIC_TOKENS_FORWARDED: float(self.token_mask.sum()), keys.METRIC_TOKENS_HELD: float(held)}

    @property
    def response_slice(self) -> slice:
        """Positions whose output predicts the response tokens: [T - T_resp - 1, T - 1)."""
        total, resp = self.input_ids.shape[1], self.responses.shape[1]
        return slice(total - resp - 1, total - 1)


def require_columns(batch: DataProto, names: tuple[str, ...], what: str) -> None:
    present = set(batch.batch.keys()) if batch.batch is not None else set()
    missing = [n for n in names if n not in present]
    if missing:
        raise KeyError(f"{what} needs batch columns {missing}; the batch has {sorted(present)}")


def _pad_rows(value, rows: int):
    if rows == 0:
        return value
    if isinstance(value, torch.Tensor):
        return torch.cat([value, value.new_zeros(rows, *value.shape[1:])])
    return np.concatenate([value, np.full(rows, None, dtype=object)])


def micro_batch_count_multiple() -> int:
    """Megatron's interleaved schedule runs micro-batches in groups of PP: their count must be a multiple of it."""
    from megatron.core import parallel_state as mpu

    vpp = mpu.get_virtual_pipeline_model_parallel_world_size()
    return mpu.get_pipeline_model_parallel_world_size() if vpp and vpp > 1 else 1


def split_micro_batches(
    batch: DataProto, micro_batch_size: int, device: str, what: str
) -> tuple[list[MicroBatch], int]:
    """Cut `batch` into as few equal micro-batches of at most `micro_batch_size` rows as it needs (under vpp a
    multiple of PP of them), padded with zero rows to the equal size; returns (micro-batches, real rows).
    Equal sizes rather than full ones: 4 rows are one micro-batch of 4, not 4 rows and 60 of padding."""
    require_columns(batch, (keys.INPUT_IDS, keys.ATTENTION_MASK, keys.RESPONSES), what)
    num_rows = len(batch)
    count_multiple = micro_batch_count_multiple()
    needed = -(-num_rows // micro_batch_size)  # ceil: micro-batches of at most micro_batch_size rows
    count = -(-needed // count_multiple) * count_multiple
    micro_batch_size = -(-num_rows // count) if count else micro_batch_size
    # CP cuts every sequence into 2 x CP equal chunks.
    multiple = math.lcm(SEQUENCE_MULTIPLE, 2 * cp.cp_group_and_size()[1])
    width = max(model_width(batch.batch[keys.ATTENTION_MASK], multiple), batch.batch[keys.RESPONSES].shape[1] + 1)
    width = -(-width // multiple) * multiple
    shapes = agreed_shapes([(micro_batch_size, width)] * count, device)
    count = len(shapes)
    micro_batch_size = max((rows for rows, _ in shapes), default=micro_batch_size)
    width = max((w for _, w in shapes), default=width)
    pad = count * micro_batch_size - num_rows
    tensors = {k: _pad_rows(v, pad) for k, v in batch.batch.items()}
    non_tensors = {k: _pad_rows(np.asarray(v, dtype=object), pad) for k, v in batch.non_tensor_batch.items()}
    sources = _pad_sources(_token_positions(batch, torch.arange(num_rows)), pad)
    micro_batches = []
    for start in range(0, num_rows + pad, micro_batch_size):
        rows = slice(start, start + micro_batch_size)
        proto = DataProto.from_dict(
            tensors={k: v[rows] for k, v in tensors.items()},
            non_tensors={k: v[rows] for k, v in non_tensors.items()},
            meta_info=dict(batch.meta_info),
        )
        micro = model_inputs(proto, device, width)
        micro.source = _left_fit(sources[rows], width, -1)
        micro_batches.append(micro)
    return micro_batches, num_rows


def _token_positions(batch: DataProto, rows: torch.Tensor) -> torch.Tensor:
    """[len(rows), T] the flat positions (row * T + column) of the rows' tokens in the batch."""
    total = batch.batch[keys.INPUT_IDS].shape[1]
    return rows.long()[:, None] * total + torch.arange(total)[None]


def _pad_sources(sources: torch.Tensor, rows: int) -> torch.Tensor:
    return torch.cat([sources, sources.new_full((rows, sources.shape[1]), -1)]) if rows else sources


def agreed_shapes(shapes: list[tuple[int, int]], device: str) -> list[tuple[int, int]]:
    """The (rows, width) of each micro-batch, raised to the largest any rank of the expert-parallel group has at
    that place, and as many micro-batches as the rank with the most; `shapes` itself without expert parallelism.

    Every MoE layer exchanges tokens over that group once per micro-batch, so its ranks (different DP ranks with
    their own rows) must run the same number of micro-batches; the allgather dispatcher (CPU) also gathers equal
    token counts. Added rows and columns are padding, outside every mask; added micro-batches hold no rows."""
    from megatron.core import parallel_state as mpu

    if not mpu.model_parallel_is_initialized() or mpu.get_expert_model_parallel_world_size() == 1:
        return shapes
    group = mpu.get_expert_model_parallel_group()
    count = torch.tensor([len(shapes)], device=device)
    torch.distributed.all_reduce(count, op=torch.distributed.ReduceOp.MAX, group=group)
    agreed = torch.zeros(int(count), 2, dtype=torch.long, device=device)
    agreed[: len(shapes)] = torch.tensor(shapes, dtype=torch.long, device=device).view(-1, 2)
    torch.distributed.all_reduce(agreed, op=torch.distributed.ReduceOp.MAX, group=group)
    return [(int(rows), int(width)) for rows, width in agreed.tolist()]


def model_inputs(proto: DataProto, device: str, width: int) -> MicroBatch:
    input_ids = _left_fit(proto.batch[keys.INPUT_IDS].to(device), width, 0)
    attention = _left_fit(proto.batch[keys.ATTENTION_MASK].to(device).bool(), width, False)  # [b, T]
    responses = proto.batch[keys.RESPONSES].to(device)
    if keys.POSITION_IDS in proto.batch.keys():
        position_ids = _left_fit(proto.batch[keys.POSITION_IDS].to(device), width, 0)
    else:
        position_ids = (attention.long().cumsum(-1) - 1).clamp(min=0)
    total, resp_len = input_ids.shape[1], responses.shape[1]
    # Megatron's RoPE uses positions 0..T-1 and ignores position_ids; with a left-padded prompt followed by
    # the response this is a per-row shift of every position, which RoPE attention is invariant to.
    causal = torch.ones(total, total, dtype=torch.bool, device=device).tril()
    visible = causal[None, None] & attention[:, None, None, :]
    if keys.RESPONSE_MASK in proto.batch.keys():
        response_mask = proto.batch[keys.RESPONSE_MASK].to(device)
    else:
        response_mask = attention[:, total - resp_len :]
    loss_mask = torch.zeros(input_ids.shape, dtype=torch.float32, device=device)
    loss_mask[:, total - resp_len - 1 : total - 1] = response_mask.float()
    labels = torch.roll(input_ids, shifts=-1, dims=1)
    labels[:, -1] = 0
    return MicroBatch(proto, input_ids, position_ids, ~visible, labels, loss_mask, responses, attention)


# ---- token budgets and packing -------------------------------------------------------------------------


@dataclass(frozen=True)
class BatchingPlan:
    """How one call cuts its batch: fixed rows, a token budget, or packing (which needs a budget)."""

    micro_batch_size: int
    max_tokens: int | None = None
    packing: bool = False
    thd: bool = False  # packed rows in Megatron's THD format (TransformerEngine), else a block-diagonal mask
    share_prompts: bool = False  # rows with one prompt forward it once (shared_micro_batches.py)
    prompt_tail: int = 1  # shared prompts: the last prompt tokens each response carries (1 + MTP depths)
    # Micro-batch widths are rounded up to this (context parallelism needs a multiple of 2 x cp as well).
    width_multiple: int = SEQUENCE_MULTIPLE

    @classmethod
    def from_config(cls, config, meta_info: dict, thd: bool) -> BatchingPlan:
        max_tokens = meta_info.get(keys.META_MAX_TOKENS_PER_MICROBATCH, config.max_tokens_per_microbatch)
        packing = bool(meta_info.get(keys.META_SEQUENCE_PACKING, config.use_sequence_packing))
        if packing and max_tokens is None:
            raise ValueError(
                "use_sequence_packing=True needs max_tokens_per_microbatch (the length of a packed row); set it"
            )
        share = bool(getattr(config, "share_prompts", False))
        if packing and config.mtp_num_layers and not share:  # (shared segments carry a tail that keeps them apart)
            raise ValueError(
                "use_sequence_packing with mtp_num_layers > 0: MTP labels would cross packed sequences; "
                "leave packing off for this model, or pack prompt-shared segments (share_prompts: true)"
            )
        if max_tokens is not None and int(max_tokens) < 1:
            raise ValueError(f"max_tokens_per_microbatch={max_tokens} must be >= 1 (or None for fixed micro-batches)")
        budget = None if max_tokens is None else int(max_tokens)
        tail = 1 + (getattr(config, "mtp_num_layers", 0) or 0)
        return cls(config.micro_batch_size, budget, packing, thd and packing and not share, share, tail)


def batching_plan(strategy, batch: DataProto) -> BatchingPlan:
    """A Megatron strategy's micro-batching for this call (its config, overridable through batch.meta_info)."""
    thd = transformer_engine_for(strategy.config, strategy.device)
    plan = BatchingPlan.from_config(strategy.config, batch.meta_info, thd)
    if plan.max_tokens is not None and micro_batch_count_multiple() > 1:
        raise ValueError(
            "max_tokens_per_microbatch with interleaved stages (vpp) is not supported yet: the "
            "interleaved schedule needs a multiple of pp micro-batches; set vpp=null or use "
            "micro_batch_size"
        )
    # CP cuts every sequence into 2 x CP equal chunks.
    return dataclasses.replace(plan, width_multiple=math.lcm(SEQUENCE_MULTIPLE, 2 * cp.cp_group_and_size()[1]))


def round_up(value: int, multiple: int = SEQUENCE_MULTIPLE) -> int:
    return -(-value // multiple) * multiple


def sequence_extents(attention_mask: torch.Tensor, response_width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(prompt tokens used, response tokens used) per row of a left-padded prompt + right-padded response batch."""
    mask = attention_mask.bool()
    prompt, response = mask[:, : mask.shape[1] - response_width], mask[:, mask.shape[1] - response_width :]
    # Columns from the first used prompt column / up to the last used response column (holes count as used).
    prompt_used = torch.where(prompt.any(1), prompt.shape[1] - prompt.long().argmax(1), 0)
    last = response.shape[1] - 1 - response.flip(1).long().argmax(1)
    response_used = torch.where(response.any(1), last + 1, 0)
    return prompt_used, response_used


def _warn_over_budget(length: int, budget: int) -> None:
    global _warned_over_budget
    if not _warned_over_budget:
        _warned_over_budget = True
        logger.warning(
            "a sequence of %d tokens exceeds max_tokens_per_microbatch=%d: it gets a micro-batch of its own "
            "(warned once; raise the budget to keep micro-batches within it)",
            length,
            budget,
        )


def group_by_token_budget(
    prompt_used: list[int], response_used: list[int], budget: int, multiple: int = SEQUENCE_MULTIPLE
) -> list[list[int]]:
    """Row indices per micro-batch, longest rows first, each group's rows x padded width within `budget`."""

    def width(prompt: int, response: int) -> int:  # as `_trimmed` builds it
        return round_up(max(prompt, 1) + response, multiple)

    order = sorted(range(len(prompt_used)), key=lambda i: -(prompt_used[i] + response_used[i]))
    groups: list[list[int]] = []
    current: list[int] = []
    max_prompt = max_response = 0
    for i in order:
        prompt, response = max(max_prompt, prompt_used[i]), max(max_response, response_used[i])
        if current and (len(current) + 1) * width(prompt, response) > budget:
            groups.append(current)
            current, prompt, response = [], prompt_used[i], response_used[i]
        if not current and width(prompt, response) > budget:
            _warn_over_budget(prompt + response, budget)
        current.append(i)
        max_prompt, max_response = prompt, response
    if current:
        groups.append(current)
    return groups


def pack_by_token_budget(lengths: list[int], budget: int) -> list[list[int]]:
    """Row indices per packed row: first-fit decreasing, each packed row's tokens within `budget`."""
    bins: list[list[int]] = []
    totals: list[int] = []
    for i in sorted(range(len(lengths)), key=lambda i: -lengths[i]):
        if lengths[i] > budget:
            _warn_over_budget(lengths[i], budget)
        for b, total in enumerate(totals):
            if total + lengths[i] <= budget:
                bins[b].append(i)
                totals[b] += lengths[i]
                break
        else:
            bins.append([i])
            totals.append(lengths[i])
    return bins


def split(
    batch: DataProto, plan: BatchingPlan, device: str, what: str, routes: torch.Tensor | None = None
) -> tuple[list[MicroBatch], int]:
    """(micro-batches, real rows) by the plan; budget and packed micro-batches carry their input row indices.
    `routes` ([B, T, L, k], per token of the batch): each micro-batch gets its own positions' (`MicroBatch.routes`,
    -1 at positions the cut added)."""
    micro_batches, num_rows = _split(batch, plan, device, what)
    attach_routes(micro_batches, routes, device)
    return micro_batches, num_rows


def attach_routes(micro_batches: list[MicroBatch], routes: torch.Tensor | None, device: str) -> None:
    """Each micro-batch's `routes` [b, T, L, k]: those of its positions' tokens in `routes` [B, T, L, k] (-1 at
    positions the cut added); nothing without routes."""
    if routes is None:
        return
    flat = routes.reshape(-1, *routes.shape[2:])
    for micro in micro_batches:
        source = micro.source.to(flat.device)
        picked = flat[source.clamp(min=0)]
        micro.routes = picked.masked_fill((source < 0)[..., None, None], -1).to(device)


def place_per_token(micro_batches: list[MicroBatch], values: list[torch.Tensor], shape: tuple, fill) -> torch.Tensor:
    """The inverse of the cut for per-position values ([b, T, ...] per micro-batch, CPU): a [B, T, ...] tensor of
    `shape` with each value at its token's place in the batch, `fill` where no micro-batch position maps."""
    out = torch.full((shape[0] * shape[1], *shape[2:]), fill, dtype=values[0].dtype)
    for micro, value in zip(micro_batches, values):
        kept = micro.source >= 0
        out[micro.source[kept]] = value[kept]
        if micro.aliases is not None and len(micro.aliases):
            out[micro.aliases[:, 0]] = out[micro.aliases[:, 1]]
    return out.view(shape)


def _split(batch: DataProto, plan: BatchingPlan, device: str, what: str) -> tuple[list[MicroBatch], int]:
    if plan.max_tokens is None:
        return split_micro_batches(batch, plan.micro_batch_size, device, what)
    require_columns(batch, (keys.INPUT_IDS, keys.ATTENTION_MASK, keys.RESPONSES), what)
    response_width = batch.batch[keys.RESPONSES].shape[1]
    extents = sequence_extents(batch.batch[keys.ATTENTION_MASK], response_width)
    prompt_used, response_used = (t.tolist() for t in extents)
    if plan.packing:
        # A prompt needs at least one token: its last column predicts the first response token.
        lengths = [max(p, 1) + r for p, r in zip(prompt_used, response_used)]
        groups = pack_by_token_budget(lengths, plan.max_tokens)
        widths = [round_up(sum(lengths[i] for i in g), plan.width_multiple) for g in groups]
        shapes = agreed_shapes([(1, w) for w in widths], device)
        groups += [[]] * (len(shapes) - len(groups))
        return [
            _packed(batch, g, [max(prompt_used[i], 1) for i in g], [response_used[i] for i in g], device, plan, w)
            for g, (_, w) in zip(groups, shapes)
        ], len(batch)
    groups = group_by_token_budget(prompt_used, response_used, plan.max_tokens, plan.width_multiple)
    extents = [(max(prompt_used[i] for i in g), max(response_used[i] for i in g)) for g in groups]
    widths = [round_up(max(p, 1) + r, plan.width_multiple) for p, r in extents]
    shapes = agreed_shapes([(len(g), w) for g, w in zip(groups, widths)], device)
    groups += [[]] * (len(shapes) - len(groups))
    extents += [(0, 0)] * (len(shapes) - len(extents))
    return [
        _trimmed(batch, g, prompt, response, device, shape)
        for g, (prompt, response), shape in zip(groups, extents, shapes)
    ], len(batch)


def _trimmed(
    batch: DataProto, rows: list[int], prompt_width: int, response_width: int, device: str, shape: tuple[int, int]
) -> MicroBatch:
    """The rows cut to the columns they use (prompt_width before the response, response_width of it), at
    `shape` (rows, width): zero rows below and padding columns on the left fill what they do not use."""
    proto = batch.select_idxs(rows)
    full = proto.batch[keys.RESPONSES].shape[1]
    prompt_width = max(prompt_width, 1)
    total = proto.batch[keys.INPUT_IDS].shape[1]
    columns = slice(total - full - prompt_width, total - full + response_width)
    inputs = {
        name: proto.batch[name][:, columns]
        for name in (keys.INPUT_IDS, keys.ATTENTION_MASK, keys.POSITION_IDS)
        if name in proto.batch.keys()
    }
    inputs[keys.RESPONSES] = proto.batch[keys.RESPONSES][:, :response_width]
    if keys.RESPONSE_MASK in proto.batch.keys():
        inputs[keys.RESPONSE_MASK] = proto.batch[keys.RESPONSE_MASK][:, :response_width]
    inputs = {name: _pad_rows(value, shape[0] - len(rows)) for name, value in inputs.items()}
    width = shape[1]
    micro = model_inputs(DataProto.from_dict(tensors=inputs), device, width)
    sources = _token_positions(batch, torch.tensor(rows, dtype=torch.long))[:, columns]
    micro.source = _left_fit(_pad_sources(sources, shape[0] - len(rows)), width, -1)
    n = len(rows)
    j = torch.arange(full, device=device)
    micro.proto = proto
    micro.responses = proto.batch[keys.RESPONSES].to(device)
    micro.gather = OutputGather(
        rows=torch.arange(n, device=device)[:, None].expand(n, full),
        cols=(width - response_width - 1 + j.clamp(max=max(response_width - 1, 0)))[None].expand(n, full),
        valid=(j < response_width)[None].expand(n, full),
    )
    micro.index = torch.tensor(rows, dtype=torch.long)
    return micro


def _packed(
    batch: DataProto,
    rows: list[int],
    prompt_used: list[int],
    response_used: list[int],
    device: str,
    plan: BatchingPlan,
    width: int,
) -> MicroBatch:
    """The rows' used tokens end to end in one row of `width`, each sequence with its own positions, attending
    only within itself."""
    proto = batch.select_idxs(rows)
    input_ids = proto.batch[keys.INPUT_IDS]
    full = proto.batch[keys.RESPONSES].shape[1]
    prompt_end = input_ids.shape[1] - full
    attention = proto.batch[keys.ATTENTION_MASK].bool()
    response_mask = (
        proto.batch[keys.RESPONSE_MASK] if keys.RESPONSE_MASK in proto.batch.keys() else attention[:, prompt_end:]
    )
    parts, cols, valid, offset = _pack_rows(
        input_ids, attention, response_mask, rows, prompt_used, response_used, prompt_end, full
    )
    tail = width - offset  # padding at the end: a segment of its own, never gathered
    for name, value, dtype in (
        ("tokens", 0, input_ids.dtype),
        ("sources", -1, torch.long),
        ("segments", len(rows), torch.long),
        ("loss_mask", 0, torch.float32),
        ("real", False, torch.bool),
    ):
        parts[name].append(torch.full((tail,), value, dtype=dtype))
    parts["positions"].append(torch.arange(tail))
    pieces, segments, positions = parts["tokens"], parts["segments"], parts["positions"]
    loss_mask, real, sources = parts["loss_mask"], parts["real"], parts["sources"]
    tokens = torch.cat(pieces)[None].to(device)
    segment = torch.cat(segments).to(device)
    labels = torch.roll(tokens, shifts=-1, dims=1)
    labels[0, -1] = 0
    micro = MicroBatch(
        proto=proto,
        input_ids=tokens,
        position_ids=torch.cat(positions)[None].to(device),
        attention_mask=None if plan.thd else _block_causal_mask(segment),
        labels=labels,
        loss_mask=torch.cat(loss_mask)[None].to(device),
        responses=proto.batch[keys.RESPONSES].to(device),
        token_mask=torch.cat(real)[None].to(device),
    )
    micro.gather = OutputGather(rows=torch.zeros_like(cols).to(device), cols=cols.to(device), valid=valid.to(device))
    micro.index = torch.tensor(rows, dtype=torch.long)
    micro.source = torch.cat(sources)[None]
    if plan.thd:
        micro.packed_seq_params = _thd_params([p + r for p, r in zip(prompt_used, response_used)] + [tail], device)
    return micro


def _pack_rows(input_ids, attention, response_mask, rows, prompt_used, response_used, prompt_end: int, full: int):
    """The rows' used tokens end to end: per position its token, batch position (`sources`), realness, segment,
    position and loss mask (lists of per-row pieces); where each response token's prediction sits (cols, valid);
    the packed length."""
    names = ("tokens", "sources", "real", "segments", "positions", "loss_mask")
    parts: dict[str, list[torch.Tensor]] = {name: [] for name in names}
    total = input_ids.shape[1]
    cols = torch.zeros(len(rows), full, dtype=torch.long)
    valid = torch.zeros(len(rows), full, dtype=torch.bool)
    offset = 0
    for i, (prompt, response) in enumerate(zip(prompt_used, response_used)):
        used = slice(prompt_end - prompt, prompt_end + response)
        length = prompt + response
        parts["tokens"].append(input_ids[i, used])
        parts["sources"].append(rows[i] * total + torch.arange(used.start, used.stop))
        parts["real"].append(attention[i, used])  # a row of padding keeps one token
        parts["segments"].append(torch.full((length,), i))
        parts["positions"].append(torch.arange(length))
        predicts = torch.zeros(length)  # 1 where the next token is a response token in the loss
        predicts[prompt - 1 : prompt - 1 + response] = response_mask[i, :response].float()
        parts["loss_mask"].append(predicts)
        cols[i] = offset + prompt - 1 + torch.arange(full).clamp(max=max(response - 1, 0))
        valid[i, :response] = True
        offset += length
    return parts, cols, valid, offset


def _block_causal_mask(segment: torch.Tensor) -> torch.Tensor:
    """[1, 1, W, W] bool, True = masked: a position sees earlier positions of its own segment only."""
    width = segment.shape[0]
    causal = torch.ones(width, width, dtype=torch.bool, device=segment.device).tril()
    visible = causal & (segment[:, None] == segment[None, :])
    return ~visible[None, None]


def _thd_params(lengths: list[int], device: str):
    """Megatron's PackedSeqParams for sequences of `lengths` laid end to end (THD, no CP)."""
    from megatron.core.packed_seq_params import PackedSeqParams

    lengths = [n for n in lengths if n > 0]
    cu_seqlens = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device=device)
    longest = max(lengths)
    return PackedSeqParams(
        qkv_format="thd", cu_seqlens_q=cu_seqlens, cu_seqlens_kv=cu_seqlens, max_seqlen_q=longest, max_seqlen_kv=longest
    )


def collect_rows(micro_batches: list[MicroBatch], stored: list[dict], num_rows: int) -> dict[str, torch.Tensor]:
    """The per-micro-batch output dicts as [num_rows, ...] CPU tensors in the input's row order."""
    tensors = {name: torch.cat([d[name] for d in stored]).cpu() for name in stored[0]}
    if micro_batches[0].index is None:  # fixed micro-batches: in order, zero rows padded at the end
        return {name: value[:num_rows] for name, value in tensors.items()}
    index = torch.cat([m.index for m in micro_batches])
    ordered = {}
    for name, value in tensors.items():
        ordered[name] = torch.empty_like(value)
        ordered[name][index] = value
    return ordered
