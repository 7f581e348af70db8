"""Prompt-shared packing (`share_prompts: true`): the rows that hold the same prompt (a GRPO group's n samples) become
one segment, the prompt once and then each row's response, so a forward computes the prompt's tokens once instead of
n times.

In a segment a response's tokens take the positions that continue from the prompt (as in the row it came from) and
attend to the prompt and to their own response's earlier tokens only, never to another response. A row's per-token
outputs are read back at the positions that predict its response tokens: the prompt's last position predicts every
response's first token (one context, shared), response token t-1's position predicts token t. So the outputs equal
the unshared rows', and in backward the prompt's activations receive the sum of their responses' gradients, as the
loss over the unshared rows gives them.

Positions are those of the unshared row's columns (RoPE is relative: a left-padded row's shift changes nothing), so
holes in a row (padding inside the response) keep their columns, masked as keys, as the unshared forward has them.
Rows are grouped by their prompt's tokens (whatever their uid), and a group is cut into segments of at most
`max_rows` rows or `max_tokens` tokens. Multi-turn rows share their first prompt; the turns after it are part of the
response. Rows without any token are in no segment (their outputs are 0, as they are outside every mask).

Pure torch (no Megatron): the segments, their layout in packed rows, the mask and the read-back indices.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from roll_backend.strategies.megatron.micro_batches import sequence_extents


@dataclass(frozen=True)
class Segment:
    """Rows sharing one prompt: the `prompt_len` columns before the response of `rows[0]` (the same in every row),
    then each row's first `response_lens[i]` response columns."""

    rows: tuple[int, ...]
    prompt_len: int
    response_lens: tuple[int, ...]

    @property
    def length(self) -> int:
        """Positions the segment takes in a packed row."""
        return self.prompt_len + sum(self.response_lens)


def shared_segments(
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    response_width: int,
    max_rows: int | None = None,
    max_tokens: int | None = None,
) -> tuple[list[Segment], list[int]]:
    """(segments, rows without any token). Rows whose prompts are equal (tokens and mask) form a group, in the order
    of their first row; a group is cut into segments of at most `max_rows` rows and, where a budget is given, of at
    most `max_tokens` positions (a segment always holds at least one row)."""
    input_ids, mask = input_ids.cpu(), attention_mask.cpu().bool()
    prompt_end = input_ids.shape[1] - response_width
    prompt_used, response_used = (t.tolist() for t in sequence_extents(mask, response_width))
    groups: dict[tuple, list[int]] = {}
    empty = []
    for row in range(input_ids.shape[0]):
        if not mask[row].any():
            empty.append(row)
            continue
        width = max(prompt_used[row], 1)  # a prompt keeps a column: its output predicts the first response token
        columns = slice(prompt_end - width, prompt_end)
        key = (width, input_ids[row, columns].numpy().tobytes(), mask[row, columns].numpy().tobytes())
        groups.setdefault(key, []).append(row)
    segments = []
    for (width, _, _), rows in groups.items():
        current: list[int] = []
        tokens = width  # the segment's positions so far
        for row in rows:
            full = (max_rows is not None and len(current) >= max_rows) or (
                max_tokens is not None and tokens + response_used[row] > max_tokens
            )
            if current and full:
                segments.append(Segment(tuple(current), width, tuple(response_used[r] for r in current)))
                current, tokens = [], width
            current.append(row)
            tokens += response_used[row]
        segments.append(Segment(tuple(current), width, tuple(response_used[r] for r in current)))
    return segments, empty


@dataclass
class SharedLayout:
    """Packed rows [b, W] of segments laid end to end, and where each of `rows` (batch rows, in segment order) reads
    its response tokens' outputs: packed row `gather_rows[i, t]`, column `gather_cols[i, t]` where `gather_valid`."""

    input_ids: torch.Tensor  # [b, W]
    position_ids: torch.Tensor  # [b, W] the unshared row's positions (padding: 0)
    visible: torch.Tensor  # [b, W, W] bool: query i may attend to key j (padding attends to itself only)
    real: torch.Tensor  # [b, W] bool: a token of a row (not padding, not a hole)
    source: torch.Tensor  # [b, W] row * T + column of the position's token in the batch (-1: padding)
    rows: list[int]
    gather_rows: torch.Tensor  # [n, T_resp]
    gather_cols: torch.Tensor  # [n, T_resp]
    gather_valid: torch.Tensor  # [n, T_resp]
    # (batch position, stand-in position) for the prompt tokens of a segment's other rows: what a forward records per
    # position (MoE routes) is recorded once, at the first row's prompt, and holds for them all.
    aliases: torch.Tensor  # [k, 2]


def lay_out(
    input_ids: torch.Tensor, attention_mask: torch.Tensor, response_width: int, packed: list[list[Segment]], width: int
) -> SharedLayout:
    """The segments of each packed row (`packed[b]`) laid end to end in rows of `width` (CPU tensors)."""
    ids, mask = input_ids.cpu(), attention_mask.cpu().bool()
    total = ids.shape[1]
    prompt_end = total - response_width
    count = max(len(packed), 1)
    out_ids = torch.zeros(count, width, dtype=ids.dtype)
    positions = torch.zeros(count, width, dtype=torch.long)
    visible = torch.eye(width, dtype=torch.bool).repeat(count, 1, 1)
    real = torch.zeros(count, width, dtype=torch.bool)
    source = torch.full((count, width), -1, dtype=torch.long)
    rows, gathers, aliases = [], [], []
    for b, segments in enumerate(packed):
        offset = 0
        for segment in segments:
            first, p = segment.rows[0], segment.prompt_len
            prompt_cols = torch.arange(prompt_end - p, prompt_end)
            prompt = slice(offset, offset + p)
            out_ids[b, prompt], real[b, prompt] = ids[first, prompt_cols], mask[first, prompt_cols]
            positions[b, prompt] = torch.arange(p)
            source[b, prompt] = first * total + prompt_cols
            visible[b, prompt, prompt] = torch.ones(p, p, dtype=torch.bool).tril() & real[b, None, prompt]
            start = offset + p
            for row, length in zip(segment.rows, segment.response_lens):
                cols = torch.arange(prompt_end, prompt_end + length)
                span = slice(start, start + length)
                out_ids[b, span], real[b, span] = ids[row, cols], mask[row, cols]
                positions[b, span] = torch.arange(p, p + length)
                source[b, span] = row * total + cols
                visible[b, span, prompt] = real[b, None, prompt]
                visible[b, span, span] = torch.ones(length, length, dtype=torch.bool).tril() & real[b, None, span]
                # response token 0 is predicted at the prompt's last position, token t at response token t-1's
                predicts = torch.tensor([offset + p - 1, *range(start, start + length - 1)])[:length]
                gathers.append((b, predicts))
                rows.append(row)
                if row != first:
                    aliases.append(torch.stack([row * total + prompt_cols, first * total + prompt_cols], dim=1))
                start += length
            offset = start
    gather_rows = torch.zeros(len(rows), response_width, dtype=torch.long)
    gather_cols = torch.zeros(len(rows), response_width, dtype=torch.long)
    gather_valid = torch.zeros(len(rows), response_width, dtype=torch.bool)
    for i, (b, predicts) in enumerate(gathers):
        gather_rows[i] = b
        gather_cols[i, : len(predicts)] = predicts
        gather_valid[i, : len(predicts)] = True
    alias = torch.cat(aliases) if aliases else torch.zeros(0, 2, dtype=torch.long)
    return SharedLayout(out_ids, positions, visible, real, source, rows, gather_rows, gather_cols, gather_valid, alias)
