"""Batches and Hugging Face reference numbers for the Megatron strategy tests (driver side only)."""

from __future__ import annotations

import torch

from roll_backend import keys
from roll_backend.protocol.sequences import sequence_columns

PROMPT_LEN = 7
RESPONSE_LEN = 5


def make_rl_batch_tensors(
    vocab_size: int, num_rows: int = 5, seed: int = 0, pad_id: int = 0
) -> dict[str, torch.Tensor]:
    """Left-padded prompts of uneven length, then right-padded responses of uneven length (verl's layout)."""
    gen = torch.Generator().manual_seed(seed)
    prompts = torch.full((num_rows, PROMPT_LEN), pad_id, dtype=torch.long)
    responses = torch.full((num_rows, RESPONSE_LEN), pad_id, dtype=torch.long)
    prompt_mask = torch.zeros(num_rows, PROMPT_LEN, dtype=torch.long)
    response_mask = torch.zeros(num_rows, RESPONSE_LEN, dtype=torch.long)
    for row in range(num_rows):
        p_len = PROMPT_LEN - (row % 4)  # 7, 6, 5, 4, 7, ...
        r_len = RESPONSE_LEN - (row * 2 % 5) if row else RESPONSE_LEN  # 5, 3, 1, 4, 2, ...
        prompts[row, PROMPT_LEN - p_len :] = torch.randint(3, vocab_size, (p_len,), generator=gen)
        prompt_mask[row, PROMPT_LEN - p_len :] = 1
        responses[row, :r_len] = torch.randint(3, vocab_size, (r_len,), generator=gen)
        response_mask[row, :r_len] = 1
    return {**sequence_columns(prompts, prompt_mask, responses, response_mask), keys.RESPONSE_MASK: response_mask}


def rl_batch_of_lengths(
    prompt_lens: list[int],
    response_lens: list[int],
    prompt_width: int,
    response_width: int,
    vocab_size: int,
    gen,
    groups: list[int] | None = None,
) -> dict[str, torch.Tensor]:
    """Left-padded prompts and right-padded responses of the given lengths, random tokens and advantages. `groups`
    (each row's group): the rows of a group hold its first row's prompt, as a GRPO group's n samples do."""
    rows = len(prompt_lens)
    prompts = torch.zeros(rows, prompt_width, dtype=torch.long)
    responses = torch.zeros(rows, response_width, dtype=torch.long)
    prompt_mask, response_mask = torch.zeros_like(prompts), torch.zeros_like(responses)
    first_of: dict[int, int] = {}
    for row, (p, r) in enumerate(zip(prompt_lens, response_lens)):
        first = first_of.setdefault(groups[row] if groups is not None else -1 - row, row)
        if first != row:
            prompts[row], prompt_mask[row] = prompts[first], prompt_mask[first]
        else:
            prompts[row, prompt_width - p :] = torch.randint(3, vocab_size, (p,), generator=gen)
            prompt_mask[row, prompt_width - p :] = 1
        responses[row, :r] = torch.randint(3, vocab_size, (r,), generator=gen)
        response_mask[row, :r] = 1
    return {
        **sequence_columns(prompts, prompt_mask, responses, response_mask),
        keys.RESPONSE_MASK: response_mask,
        keys.ADVANTAGES: torch.randn(rows, response_width, generator=gen),
    }


@torch.no_grad()
def hf_response_log_probs(model_dir: str, tensors: dict[str, torch.Tensor], temperature: float = 1.0):
    """(log_probs, entropy) [B, T_resp] of the responses under transformers' model, float32."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    return model_response_log_probs(model, tensors, temperature)


def model_response_log_probs(model, tensors: dict[str, torch.Tensor], temperature: float = 1.0):
    """(log_probs, entropy) [B, T_resp] of the responses under a transformers causal LM (differentiable)."""
    logits = model(
        input_ids=tensors[keys.INPUT_IDS],
        attention_mask=tensors[keys.ATTENTION_MASK],
        position_ids=tensors[keys.POSITION_IDS],
    ).logits
    resp_len = tensors[keys.RESPONSES].shape[1]
    resp_logits = logits[:, -resp_len - 1 : -1].float() / temperature
    log_softmax = resp_logits.log_softmax(-1)
    log_probs = log_softmax.gather(-1, tensors[keys.RESPONSES].unsqueeze(-1)).squeeze(-1)
    entropy = -(log_softmax.exp() * log_softmax).sum(-1)
    return log_probs, entropy


def max_masked_diff(a: torch.Tensor, b: torch.Tensor, mask: torch.Tensor) -> float:
    return float(((a.double() - b.double()).abs() * mask).max())


# Tolerances derived from float32 rounding: a value computed two ways (another layout, kernel or summation order)
# may differ by a few dozen units in the last place of the largest magnitude it went through.
EPS32 = torch.finfo(torch.float32).eps
ULPS = 64


def float32_bound(*references) -> float:
    """What float32 rounding may move a value whose computation went through magnitudes up to these."""
    scale = max(float(torch.as_tensor(r).abs().max()) for r in references)
    return ULPS * EPS32 * max(1.0, scale)


def after_step_bound(before: torch.Tensor, after: torch.Tensor, mask: torch.Tensor, layers: int) -> float:
    """For outputs after one optimizer step: the forward bound plus the update's rounding, ULPS * eps per layer (and
    the head) of what the step moved them (a relative error of the gradient becomes one of the update)."""
    moved = float(((after.double() - before.double()).abs() * mask).max())
    return float32_bound(after * mask) + ULPS * EPS32 * (layers + 1) * moved
