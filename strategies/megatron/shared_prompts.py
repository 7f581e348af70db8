"""Prompt-shared packing (`share_prompts: true`): the rows that hold the same prompt (a GRPO group's n samples) become
one segment, the prompt once and then each row's response, so a forward computes the prompt's tokens once instead of
n times.

In a segment each response carries the prompt's last `tail` tokens with it (1 + the model's MTP depths) and follows
them: its tokens take the positions that continue from the prompt (as in the row it came from) and attend to the
shared part of the prompt, to its own copy of the tail and to their own response's earlier tokens only, never to
another response. So every position has one next token, its own, whatever reads it: a row's per-token outputs are
read back at the positions that predict its response tokens (the last tail token's predicts the first response
token), next-token labels are right wherever a loss reads them (CP's per-position log-probs), and the labels an MTP
depth k <= tail - 1 reads ahead never reach another response's tokens before that response's own tail. The outputs
equal the unshared rows', and in backward the prompt's activations receive the sum of their responses' gradients,
as the loss over the unshared rows gives them.

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
    """Rows sharing one prompt: the `prompt_len` columns before the response of `rows[0]` (the same in every row), all
    but the last `tail` once, then for each row those `tail` columns and its first `response_lens[i]` response
    columns."""

    rows: tuple[int, ...]
    prompt_len: int
    response_lens: tuple[int, ...]
    tail: int = 1

    @property
    def shared_len(self) -> int:
        """Prompt positions forwarded once."""
        return self.prompt_len - self.tail

    @property
    def length(self) -> int:
        """Positions the segment takes in a packed row."""
        return self.shared_len + sum(self.tail + length for length in self.response_lens)


def shared_segments(
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    response_width: int,
    max_rows: int | None = None,
    max_tokens: int | None = None,
    tail: int = 1,
) -> tuple[list[Segment], list[int]]:
    """(segments, rows without any token). Rows whose prompts are equal (tokens and mask) form a group, in the order
    of their first row; a group is cut into segments of at most `max_rows` rows and, where a budget is given, of at
    most `max_tokens` positions (a segment always holds at least one row). Each response carries the prompt's last
    `tail` columns."""
    input_ids, mask = input_ids.cpu(), attention_mask.cpu().bool()
    prompt_end = input_ids.shape[1] - response_width
    if prompt_end < tail:
        raise ValueError(
            f"share_prompts with {tail - 1} MTP depths needs prompt columns for a tail of {tail} tokens per response; "
            f"this batch has {prompt_end}: raise max_prompt_length or turn share_prompts off"
        )
    prompt_used, response_used = (t.tolist() for t in sequence_extents(mask, response_width))
    groups: dict[tuple, list[int]] = {}
    empty = []
    for row in range(input_ids.shape[0]):
        if not mask[row].any():
            empty.append(row)
            continue
        # A prompt keeps `tail` columns (left padding where it is shorter): the last one's output predicts the first
        # response token, and MTP's labels read ahead of a response's last position stay in the next one's tail.
        width = max(prompt_used[row], tail)
        columns = slice(prompt_end - width, prompt_end)
        key = (width, input_ids[row, columns].numpy().tobytes(), mask[row, columns].numpy().tobytes())
        groups.setdefault(key, []).append(row)
    segments = []
    for (width, _, _), rows in groups.items():
        segments += _cut(rows, width, tail, response_used, max_rows, max_tokens)
    return segments, empty


def _cut(
    rows: list[int], width: int, tail: int, response_used: list[int], max_rows: int | None, max_tokens: int | None
) -> list[Segment]:
    """One prompt's rows in segments of at most `max_rows` rows and `max_tokens` positions (at least one row each)."""
    segments, current = [], []
    tokens = width - tail  # the segment's positions so far
    for row in rows:
        full = (max_rows is not None and len(current) >= max_rows) or (
            max_tokens is not None and tokens + tail + response_used[row] > max_tokens
        )
        if current and full:
            segments.append(Segment(tuple(current), width, tuple(response_used[r] for r in current), tail))
            current, tokens = [], width - tail
        current.append(row)
        tokens += tail + response_used[row]
    segments.append(Segment(tuple(current), width, tuple(response_used[r] for r in current), tail))
    return segments


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
    # (batch position, stand-in position) for the shared prompt tokens of a segment's other rows: what a forward
    # records per position (MoE routes) is recorded once, at the first row's prompt, and holds for them all.
    aliases: torch.Tensor  # [k, 2]
    predicts_response: torch.Tensor  # [b, W] float: the response mask of the token each position predicts


def lay_out(
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    response_width: int,
    packed: list[list[Segment]],
    width: int,
    response_mask: torch.Tensor | None = None,
) -> SharedLayout:
    """The segments of each packed row (`packed[b]`) laid end to end in rows of `width` (CPU tensors).
    `response_mask` [n, response_width]: the response tokens a loss reads (default: the attention mask's)."""
    ids, mask = input_ids.cpu(), attention_mask.cpu().bool()
    if response_mask is None:
        response_mask = mask[:, ids.shape[1] - response_width :]
    response_mask = response_mask.cpu().float()
    total = ids.shape[1]
    prompt_end = total - response_width
    count = max(len(packed), 1)
    out_ids = torch.zeros(count, width, dtype=ids.dtype)
    positions = torch.zeros(count, width, dtype=torch.long)
    visible = torch.eye(width, dtype=torch.bool).repeat(count, 1, 1)
    real = torch.zeros(count, width, dtype=torch.bool)
    source = torch.full((count, width), -1, dtype=torch.long)
    predicts_response = torch.zeros(count, width)
    rows, gathers, aliases = [], [], []
    for b, segments in enumerate(packed):
        offset = 0
        for segment in segments:
            first, p, shared = segment.rows[0], segment.prompt_len, segment.shared_len
            shared_cols = torch.arange(prompt_end - p, prompt_end - segment.tail)
            prompt = slice(offset, offset + shared)
            out_ids[b, prompt], real[b, prompt] = ids[first, shared_cols], mask[first, shared_cols]
            positions[b, prompt] = torch.arange(shared)
            source[b, prompt] = first * total + shared_cols
            visible[b, prompt, prompt] = torch.ones(shared, shared, dtype=torch.bool).tril() & real[b, None, prompt]
            start = offset + shared
            for row, length in zip(segment.rows, segment.response_lens):
                cols = torch.arange(prompt_end - segment.tail, prompt_end + length)  # the tail, then the response
                span = slice(start, start + len(cols))
                out_ids[b, span], real[b, span] = ids[row, cols], mask[row, cols]
                positions[b, span] = torch.arange(shared, p + length)
                source[b, span] = row * total + cols
                visible[b, span, prompt] = real[b, None, prompt]
                visible[b, span, span] = torch.ones(len(cols), len(cols), dtype=torch.bool).tril() & real[b, None, span]
                # response token t is predicted at the position before it: the last tail token's for token 0
                predicts = torch.arange(start + segment.tail - 1, start + segment.tail - 1 + length)
                predicts_response[b, predicts] = response_mask[row, :length]
                gathers.append((b, predicts))
                rows.append(row)
                if row != first:
                    aliases.append(torch.stack([row * total + shared_cols, first * total + shared_cols], dim=1))
                start += len(cols)
            offset = start
    alias = torch.cat(aliases) if aliases else torch.zeros(0, 2, dtype=torch.long)
    gathered = _gather_indices(gathers, response_width)
    return SharedLayout(out_ids, positions, visible, real, source, rows, *gathered, alias, predicts_response)


def _gather_indices(gathers: list[tuple[int, torch.Tensor]], response_width: int) -> tuple[torch.Tensor, ...]:
    """(rows, cols, valid) [n, response_width] of each row's (packed row, predicting positions)."""
    gather_rows = torch.zeros(len(gathers), response_width, dtype=torch.long)
    gather_cols = torch.zeros(len(gathers), response_width, dtype=torch.long)
    gather_valid = torch.zeros(len(gathers), response_width, dtype=torch.bool)
    for i, (b, predicts) in enumerate(gathers):
        gather_rows[i] = b
        gather_cols[i, : len(predicts)] = predicts
        gather_valid[i, : len(predicts)] = True
    return gather_rows, gather_cols, gather_valid
