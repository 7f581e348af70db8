"""Micro-batches cut by a token budget instead of a row count, and sequence packing.

RL batches are left-padded prompts followed by right-padded responses of long-tailed lengths. The fixed way
(`megatron_common.split_micro_batches`) pads every micro-batch to the whole batch's width. Here:

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

import logging
from dataclasses import dataclass

import torch

from roll_backend import keys
from roll_backend.protocol import DataProto
from roll_backend.strategies import megatron_common as common

logger = logging.getLogger(__name__)

# batch.meta_info keys that override the strategy's config for one call (benchmarks, A/B checks).
META_MAX_TOKENS_PER_MICROBATCH = "max_tokens_per_microbatch"  # int, or None for fixed micro-batches
META_SEQUENCE_PACKING = "use_sequence_packing"  # bool

_warned_over_budget = False


@dataclass(frozen=True)
class BatchingPlan:
    """How one call cuts its batch: fixed rows, a token budget, or packing (which needs a budget)."""

    micro_batch_size: int
    max_tokens: int | None = None
    packing: bool = False
    thd: bool = False  # packed rows in Megatron's THD format (TransformerEngine), else a block-diagonal mask
    # Micro-batch widths are rounded up to this (context parallelism needs a multiple of 2 x cp as well).
    width_multiple: int = common.SEQUENCE_MULTIPLE

    @classmethod
    def from_config(cls, config, meta_info: dict, thd: bool) -> BatchingPlan:
        max_tokens = meta_info.get(META_MAX_TOKENS_PER_MICROBATCH, config.max_tokens_per_microbatch)
        packing = bool(meta_info.get(META_SEQUENCE_PACKING, config.use_sequence_packing))
        if packing and max_tokens is None:
            raise ValueError("use_sequence_packing=True needs max_tokens_per_microbatch (the length of a packed row); set it")
        if packing and config.mtp_num_layers:
            raise ValueError("use_sequence_packing with mtp_num_layers > 0: MTP labels would cross packed sequences; "
                             "leave packing off for this model")
        if max_tokens is not None and int(max_tokens) < 1:
            raise ValueError(f"max_tokens_per_microbatch={max_tokens} must be >= 1 (or None for fixed micro-batches)")
        return cls(config.micro_batch_size, None if max_tokens is None else int(max_tokens), packing, thd and packing)


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


def round_up(value: int, multiple: int = common.SEQUENCE_MULTIPLE) -> int:
    return -(-value // multiple) * multiple


def sequence_extents(attention_mask: torch.Tensor, response_width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(prompt tokens used, response tokens used) per row of a left-padded prompt + right-padded response batch."""
    mask = attention_mask.bool()
    prompt, response = mask[:, : mask.shape[1] - response_width], mask[:, mask.shape[1] - response_width:]
    # Columns from the first used prompt column / up to the last used response column (holes count as used).
    prompt_used = torch.where(prompt.any(1), prompt.shape[1] - prompt.long().argmax(1), 0)
    last = response.shape[1] - 1 - response.flip(1).long().argmax(1)
    response_used = torch.where(response.any(1), last + 1, 0)
    return prompt_used, response_used


def _warn_over_budget(length: int, budget: int) -> None:
    global _warned_over_budget
    if not _warned_over_budget:
        _warned_over_budget = True
        logger.warning("a sequence of %d tokens exceeds max_tokens_per_microbatch=%d: it gets a micro-batch of its own "
                       "(warned once; raise the budget to keep micro-batches within it)", length, budget)


def group_by_token_budget(prompt_used: list[int], response_used: list[int], budget: int,
                          multiple: int = common.SEQUENCE_MULTIPLE) -> list[list[int]]:
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


def split(batch: DataProto, plan: BatchingPlan, device: str, what: str) -> tuple[list[common.MicroBatch], int]:
    """(micro-batches, real rows) by the plan; budget and packed micro-batches carry their input row indices."""
    if plan.max_tokens is None:
        return common.split_micro_batches(batch, plan.micro_batch_size, device, what)
    common.require_columns(batch, (keys.INPUT_IDS, keys.ATTENTION_MASK, keys.RESPONSES), what)
    response_width = batch.batch[keys.RESPONSES].shape[1]
    prompt_used, response_used = (t.tolist() for t in sequence_extents(batch.batch[keys.ATTENTION_MASK], response_width))
    if plan.packing:
        # A prompt needs at least one token: its last column predicts the first response token.
        lengths = [max(p, 1) + r for p, r in zip(prompt_used, response_used)]
        groups = pack_by_token_budget(lengths, plan.max_tokens)
        return [_packed(batch, g, [max(prompt_used[i], 1) for i in g], [response_used[i] for i in g], device, plan)
                for g in groups], len(batch)
    groups = group_by_token_budget(prompt_used, response_used, plan.max_tokens, plan.width_multiple)
    return [_trimmed(batch, g, max(prompt_used[i] for i in g), max(response_used[i] for i in g), device, plan.width_multiple)
            for g in groups], len(batch)


def _trimmed(batch: DataProto, rows: list[int], prompt_width: int, response_width: int, device: str,
             multiple: int) -> common.MicroBatch:
    """The rows cut to the columns they use: prompt_width before the response, response_width of it."""
    proto = batch.select_idxs(rows)
    full = proto.batch[keys.RESPONSES].shape[1]
    prompt_width = max(prompt_width, 1)
    total = proto.batch[keys.INPUT_IDS].shape[1]
    columns = slice(total - full - prompt_width, total - full + response_width)
    inputs = {name: proto.batch[name][:, columns] for name in (keys.INPUT_IDS, keys.ATTENTION_MASK, keys.POSITION_IDS)
              if name in proto.batch.keys()}
    inputs[keys.RESPONSES] = proto.batch[keys.RESPONSES][:, :response_width]
    if keys.RESPONSE_MASK in proto.batch.keys():
        inputs[keys.RESPONSE_MASK] = proto.batch[keys.RESPONSE_MASK][:, :response_width]
    width = round_up(prompt_width + response_width, multiple)
    micro = common.model_inputs(DataProto.from_dict(tensors=inputs), device, width)
    n = len(rows)
    j = torch.arange(full, device=device)
    micro.proto = proto
    micro.responses = proto.batch[keys.RESPONSES].to(device)
    micro.gather = OutputGather(
        rows=torch.arange(n, device=device)[:, None].expand(n, full),
        cols=(width - response_width - 1 + j.clamp(max=max(response_width - 1, 0)))[None].expand(n, full),
        valid=(j < response_width)[None].expand(n, full),
    )
    micro.index = torch.tensor(rows)
    return micro


def _packed(batch: DataProto, rows: list[int], prompt_used: list[int], response_used: list[int], device: str,
            plan: BatchingPlan) -> common.MicroBatch:
    """The rows' used tokens end to end in one row, each sequence with its own positions, attending only within itself."""
    proto = batch.select_idxs(rows)
    input_ids = proto.batch[keys.INPUT_IDS]
    full = proto.batch[keys.RESPONSES].shape[1]
    prompt_end = input_ids.shape[1] - full
    if keys.RESPONSE_MASK in proto.batch.keys():
        response_mask = proto.batch[keys.RESPONSE_MASK]
    else:
        response_mask = proto.batch[keys.ATTENTION_MASK][:, prompt_end:]
    pieces, segments, positions, loss_mask = [], [], [], []
    cols = torch.zeros(len(rows), full, dtype=torch.long)
    valid = torch.zeros(len(rows), full, dtype=torch.bool)
    offset = 0
    for i, (prompt, response) in enumerate(zip(prompt_used, response_used)):
        length = prompt + response
        pieces.append(input_ids[i, prompt_end - prompt: prompt_end + response])
        segments.append(torch.full((length,), i))
        positions.append(torch.arange(length))
        predicts = torch.zeros(length)  # 1 where the next token is a response token in the loss
        predicts[prompt - 1: prompt - 1 + response] = response_mask[i, :response].float()
        loss_mask.append(predicts)
        cols[i] = offset + prompt - 1 + torch.arange(full).clamp(max=max(response - 1, 0))
        valid[i, :response] = True
        offset += length
    width = round_up(offset, plan.width_multiple)
    tail = width - offset  # padding at the end: a segment of its own, never gathered
    pieces.append(torch.zeros(tail, dtype=input_ids.dtype))
    segments.append(torch.full((tail,), len(rows)))
    positions.append(torch.arange(tail))
    loss_mask.append(torch.zeros(tail))
    tokens = torch.cat(pieces)[None].to(device)
    segment = torch.cat(segments).to(device)
    labels = torch.roll(tokens, shifts=-1, dims=1)
    labels[0, -1] = 0
    micro = common.MicroBatch(
        proto=proto,
        input_ids=tokens,
        position_ids=torch.cat(positions)[None].to(device),
        attention_mask=None if plan.thd else _block_causal_mask(segment),
        labels=labels,
        loss_mask=torch.cat(loss_mask)[None].to(device),
        responses=proto.batch[keys.RESPONSES].to(device),
    )
    micro.gather = OutputGather(rows=torch.zeros_like(cols).to(device), cols=cols.to(device), valid=valid.to(device))
    micro.index = torch.tensor(rows)
    if plan.thd:
        micro.packed_seq_params = _thd_params([p + r for p, r in zip(prompt_used, response_used)] + [tail], device)
    return micro


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
    return PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu_seqlens, cu_seqlens_kv=cu_seqlens,
                           max_seqlen_q=longest, max_seqlen_kv=longest)
