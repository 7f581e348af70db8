"""A reward model with its own tokenizer and chat template scores what the policy wrote as text: each response is
decoded (the rollout's RESPONSE_TEXT), placed after its prompt's messages as the assistant's turn, rendered with the
reward model's chat template and tokenized by its tokenizer (verl's behaviour for such reward models). The rows come
back in the rollout layout (left-padded prompts, right-padded responses), one per policy row, in order."""

from __future__ import annotations

import numpy as np

from roll_backend import keys
from roll_backend.protocol import DataProto
from roll_backend.protocol.sequences import left_pad, right_pad, sequence_columns


def as_messages(prompt) -> list[dict]:
    """The prompt's conversation: its messages, or text as one user message."""
    if isinstance(prompt, (list, tuple, np.ndarray)) and len(prompt) and isinstance(prompt[0], dict):
        return [{"role": str(m["role"]), "content": str(m["content"])} for m in prompt]
    return [{"role": "user", "content": str(prompt)}]


def _ids(encoded) -> list[int]:
    return list(encoded["input_ids"] if hasattr(encoded, "keys") else encoded)


def templated_ids(tokenizer, prompt, response_text: str) -> tuple[list[int], list[int]]:
    """(prompt ids, response ids) of one row under the tokenizer's chat template; their concatenation is the whole
    conversation as the template renders it (the reward model's score is read at its last token)."""
    messages = as_messages(prompt)
    if not getattr(tokenizer, "chat_template", None):  # a plain-text reward model: prompt text, then the response
        head = tokenizer.encode("\n".join(m["content"] for m in messages), add_special_tokens=False)
        tail = tokenizer.encode(response_text, add_special_tokens=False)
        return head, tail + ([tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else [])
    head = _ids(tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True))
    full = _ids(
        tokenizer.apply_chat_template([*messages, {"role": "assistant", "content": response_text}], tokenize=True)
    )
    # The response is what the whole conversation adds after the generation prompt; a template that renders the
    # assistant's turn differently (e.g. drops an earlier turn's reasoning) splits where the two first differ.
    cut = next((i for i, (a, b) in enumerate(zip(head, full)) if a != b), min(len(head), len(full)))
    cut = min(cut, len(full) - 1)  # at least one response token to read the score at
    return full[:cut], full[cut:]


def retemplated(batch: DataProto, tokenizer) -> DataProto:
    """The batch's rows as the reward model reads them: sequence columns and RESPONSE_MASK from PROMPT_TEXT and
    RESPONSE_TEXT under the reward model's tokenizer and template."""
    columns = batch.non_tensor_batch
    for name in (keys.PROMPT_TEXT, keys.RESPONSE_TEXT):
        if name not in columns:
            raise KeyError(f"a reward model with its own tokenizer reads the text column '{name}'")
    pairs = [
        templated_ids(tokenizer, p, str(t)) for p, t in zip(columns[keys.PROMPT_TEXT], columns[keys.RESPONSE_TEXT])
    ]
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else (tokenizer.eos_token_id or 0)
    prompts, prompt_mask = left_pad([p for p, _ in pairs], pad_id)
    responses, response_mask = right_pad([r for _, r in pairs], pad_id)
    tensors = sequence_columns(prompts, prompt_mask, responses, response_mask)
    tensors[keys.RESPONSE_MASK] = response_mask
    return DataProto.from_dict(tensors=tensors, meta_info=dict(batch.meta_info))
