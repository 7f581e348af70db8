"""Prompt-shared packing (issue 49's layout): the rows of a group that share a prompt become one sequence, the prompt
once and then each row's response, so a forward computes the prompt's tokens once instead of n times.

In the packed sequence a response's tokens take the positions that continue from the prompt (as in the row it came
from) and attend to the prompt and to their own response's earlier tokens only, never to another response. A row's
per-token outputs are read back at the packed positions that predict its response tokens: the prompt's last position
predicts every response's first token (one context, shared), response token t-1's position predicts token t. So the
outputs equal the unshared rows', and in backward the prompt's activations receive the sum of their responses'
gradients, as the loss over the unshared rows gives them.

Pure torch (no Megatron): the layout, the mask and the read-back indices; the model runs on what this returns.
Multi-turn rows share their first prompt; the turns after it are part of the response (present tokens, by the
response's attention mask, whether or not the loss counts them).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class SharedPromptPack:
    """Groups packed one sequence each, right-padded to the longest; rows read back through `logit_index`."""

    input_ids: torch.Tensor  # [G, L] the prompt, then each response; pad 0 after the group's tokens
    position_ids: torch.Tensor  # [G, L] the prompt 0..P-1, each response P..P+R-1 (padding: 0)
    attention: torch.Tensor  # [G, L, L] bool: query i may attend to key j (padding attends to itself only)
    row_group: torch.Tensor  # [B] the packed sequence of each row
    logit_index: torch.Tensor  # [B, T_resp] the position whose output predicts the row's response token t (-1: none)
    tokens_forwarded: int  # tokens of the packed sequences without their padding
    tokens_unshared: int  # tokens the rows hold unshared (each row's prompt and response)

    def row_outputs(self, packed: torch.Tensor) -> torch.Tensor:
        """Per-row per-response-token values [B, T_resp, ...] from per-position values of the packed sequences
        [G, L, ...] (0 where a row has no token); differentiable, so gradients flow back to the shared positions."""
        index = self.logit_index.clamp(min=0)
        rows = packed[self.row_group.unsqueeze(1), index]
        present = (self.logit_index >= 0).reshape(*self.logit_index.shape, *([1] * (packed.dim() - 2)))
        return torch.where(present, rows, torch.zeros((), dtype=rows.dtype, device=rows.device))


def group_rows(group_ids: Sequence) -> list[list[int]]:
    """Row indices by group, groups in order of their first row."""
    groups: dict = {}
    for row, group in enumerate(group_ids):
        groups.setdefault(group, []).append(row)
    return list(groups.values())


def pack_shared_prompts(
    prompts: torch.Tensor,
    prompt_mask: torch.Tensor,
    responses: torch.Tensor,
    response_present: torch.Tensor,
    group_ids: Sequence,
) -> SharedPromptPack:
    """Pack rows in the rollout layout (left-padded prompts [B, T_p] with their mask, right-padded responses [B, T_r]
    with the mask of the tokens present) by `group_ids` (a row's group, e.g. its uid). Every row of a group must hold
    the same prompt: a ValueError names the group that does not."""
    batch, response_width = responses.shape
    groups = group_rows(group_ids)
    plans, tokens_unshared = [], 0
    for rows in groups:
        prompt = prompts[rows[0]][prompt_mask[rows[0]].bool()]
        for row in rows[1:]:
            other = prompts[row][prompt_mask[row].bool()]
            if other.shape != prompt.shape or not torch.equal(other, prompt):
                raise ValueError(
                    f"rows {rows[0]} and {row} of group {group_ids[rows[0]]!r} hold different prompts; prompt sharing "
                    "packs the rows of a group (the n samples of one prompt) only"
                )
        lengths = [int(response_present[row].sum()) for row in rows]
        plans.append((rows, prompt, lengths))
        tokens_unshared += sum(len(prompt) + length for length in lengths)
    width = max(len(prompt) + sum(lengths) for _, prompt, lengths in plans)
    input_ids = torch.zeros(len(groups), width, dtype=prompts.dtype)
    position_ids = torch.zeros(len(groups), width, dtype=torch.long)
    attention = torch.eye(width, dtype=torch.bool).repeat(len(groups), 1, 1)
    row_group = torch.zeros(batch, dtype=torch.long)
    logit_index = torch.full((batch, response_width), -1, dtype=torch.long)
    for g, (rows, prompt, lengths) in enumerate(plans):
        p = len(prompt)
        input_ids[g, :p] = prompt
        position_ids[g, :p] = torch.arange(p)
        attention[g, :p, :p] = torch.ones(p, p, dtype=torch.bool).tril()
        start = p
        for row, length in zip(rows, lengths):
            span = slice(start, start + length)
            input_ids[g, span] = responses[row][response_present[row].bool()]
            position_ids[g, span] = torch.arange(p, p + length)
            attention[g, span, :p] = True
            attention[g, span, span] = torch.ones(length, length, dtype=torch.bool).tril()
            row_group[row] = g
            columns = response_present[row].bool().nonzero().flatten()
            # token 0 is predicted at the prompt's last position, token t at response token t-1's
            logit_index[row, columns] = torch.tensor([p - 1] + list(range(start, start + length - 1)))[: len(columns)]
            start += length
    tokens_forwarded = sum(len(prompt) + sum(lengths) for _, prompt, lengths in plans)
    return SharedPromptPack(
        input_ids, position_ids, attention, row_group, logit_index, tokens_forwarded, tokens_unshared
    )
