"""The prompt-shared layout (strategies/megatron/shared_prompts.py) against the unshared rows, on a transformers
model: per-token log-probs and the gradients of a loss over them are the same when each group's prompt is forwarded
once, on random shapes (prompt lengths per group, response lengths per row including empty ones, group sizes,
padding), within float32 rounding."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from megatron_batches import float32_bound

from roll_backend.models.tiny import TinyModelSpec, build_tiny_model
from roll_backend.strategies.megatron.shared_prompts import lay_out, shared_segments

VOCAB = 320


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    from transformers import AutoModelForCausalLM

    folder = build_tiny_model(tmp_path_factory.mktemp("tiny"), TinyModelSpec(hidden_size=64, num_hidden_layers=2))
    return AutoModelForCausalLM.from_pretrained(folder, attn_implementation="eager", dtype=torch.float32).eval()


def rows_of(groups: list[tuple[int, list[int]]], prompt_width: int, response_width: int, seed: int):
    """Left-padded prompts and right-padded responses: one random prompt per group (its length), its rows' responses
    of the given lengths; the group id of each row."""
    gen = torch.Generator().manual_seed(seed)
    prompts, prompt_mask, responses, present, group_ids = [], [], [], [], []
    for g, (prompt_len, response_lens) in enumerate(groups):
        prompt = torch.randint(3, VOCAB, (prompt_len,), generator=gen)
        for length in response_lens:
            row = torch.zeros(prompt_width, dtype=torch.long)
            row[prompt_width - prompt_len :] = prompt
            prompts.append(row)
            prompt_mask.append((torch.arange(prompt_width) >= prompt_width - prompt_len).long())
            response = torch.zeros(response_width, dtype=torch.long)
            response[:length] = torch.randint(3, VOCAB, (length,), generator=gen)
            responses.append(response)
            present.append((torch.arange(response_width) < length).long())
            group_ids.append(f"uid{g}")
    return torch.stack(prompts), torch.stack(prompt_mask), torch.stack(responses), torch.stack(present), group_ids


def unshared_log_probs(model, prompts, prompt_mask, responses, present) -> torch.Tensor:
    mask = torch.cat([prompt_mask, present], dim=1)
    ids = torch.cat([prompts, responses], dim=1)
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    logits = model(input_ids=ids, attention_mask=mask, position_ids=positions).logits
    width = responses.shape[1]
    log_probs = logits[:, prompts.shape[1] - 1 : -1].log_softmax(-1)
    assert log_probs.shape[1] == width
    return log_probs.gather(-1, responses.unsqueeze(-1)).squeeze(-1) * present


def shared_log_probs(model, prompts, prompt_mask, responses, present, **cuts) -> tuple[torch.Tensor, int]:
    """(the rows' log-probs from their prompt-shared segments, one per packed row; tokens forwarded)."""
    ids, mask = torch.cat([prompts, responses], dim=1), torch.cat([prompt_mask, present], dim=1)
    segments, empty = shared_segments(ids, mask, responses.shape[1], **cuts)
    layout = lay_out(ids, mask, responses.shape[1], [[s] for s in segments], max(s.length for s in segments))
    blocked = torch.finfo(torch.float32).min
    additive = torch.where(layout.visible, 0.0, blocked).unsqueeze(1)  # [G, 1, L, L]
    logits = model(input_ids=layout.input_ids, attention_mask=additive, position_ids=layout.position_ids).logits
    log_probs = logits.log_softmax(-1)[layout.gather_rows, layout.gather_cols]  # [n, T_resp, V]
    picked = log_probs.gather(-1, responses[layout.rows].unsqueeze(-1)).squeeze(-1) * layout.gather_valid
    out = torch.zeros(responses.shape)
    out[layout.rows] = picked
    return out * present, int(layout.real.sum())


def grads(model) -> dict[str, torch.Tensor]:
    out = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return out


group_shapes = st.lists(
    st.tuples(st.integers(1, 9), st.lists(st.integers(0, 6), min_size=1, max_size=4)), min_size=1, max_size=3
)


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(groups=group_shapes, seed=st.integers(0, 1000), max_rows=st.sampled_from([None, 1, 2, 3]))
@example(groups=[(1, [2, 4, 6]), (1, [0, 0, 0])], seed=15, max_rows=None)  # a gradient summed in another order
def test_shared_prompts_give_the_unshared_log_probs_and_gradients(model, groups, seed, max_rows):
    prompt_width = max(p for p, _ in groups) + 1  # (at least one pad column)
    response_width = max(max(lengths) for _, lengths in groups) + 1
    prompts, prompt_mask, responses, present, _ = rows_of(groups, prompt_width, response_width, seed)
    weights = torch.randn(responses.shape, generator=torch.Generator().manual_seed(seed + 1))

    expected = unshared_log_probs(model, prompts, prompt_mask, responses, present)
    (expected * weights).sum().backward()
    expected_grads = grads(model)

    got, forwarded = shared_log_probs(model, prompts, prompt_mask, responses, present, max_rows=max_rows)
    (got * weights).sum().backward()
    got_grads = grads(model)

    torch.testing.assert_close(got, expected, rtol=1e-5, atol=2e-6)
    for name, grad in expected_grads.items():
        # a gradient sums the rows' terms in another order: rounding of the largest magnitude, not of each element
        torch.testing.assert_close(got_grads[name], grad, rtol=1e-4, atol=float32_bound(grad), msg=name)
    # each segment forwards its prompt once: a group of n rows in ceil(n / max_rows) segments
    segments = sum(-(-len(lengths) // (max_rows or len(lengths))) * p for p, lengths in groups)
    assert forwarded == segments + int(present.sum())


def test_rows_are_grouped_by_their_prompt_and_cut_by_rows_and_tokens():
    # groups: (prompt 3, responses 2, 4, 1) and (prompt 4, responses 2, 2); rows 0, 1, 2 share, rows 3, 4 share
    prompts, prompt_mask, responses, present, _ = rows_of([(3, [2, 4, 1]), (4, [2, 2])], 5, 4, seed=0)
    ids, mask = torch.cat([prompts, responses], 1), torch.cat([prompt_mask, present], 1)
    segments, empty = shared_segments(ids, mask, 4)
    assert [(s.rows, s.prompt_len, s.response_lens) for s in segments] == [
        ((0, 1, 2), 3, (2, 4, 1)),
        ((3, 4), 4, (2, 2)),
    ]
    assert [s.rows for s in shared_segments(ids, mask, 4, max_rows=2)[0]] == [(0, 1), (2,), (3, 4)]
    # a budget of 8 positions: 3 + 2 fits, + 4 does not; a row alone over the budget still gets a segment
    assert [s.rows for s in shared_segments(ids, mask, 4, max_tokens=8)[0]] == [(0,), (1, 2), (3, 4)]
    assert [s.rows for s in shared_segments(ids, mask, 4, max_tokens=6)[0]] == [(0,), (1,), (2,), (3,), (4,)]
    mask[1] = 0  # a row without tokens (a dispatcher's padding row) is in no segment
    segments, empty = shared_segments(ids, mask, 4)
    assert empty == [1] and segments[0].rows == (0, 2)


@pytest.mark.gpu(1)
def test_shared_prompts_on_one_gpu():
    """bench/shared_prompts.py on a GPU rank (bf16): the shared phases' log-probs equal the unshared ones to bf16
    rounding (the same local attention with its explicit mask, on cuda), and sharing is faster."""
    import re
    import subprocess
    import sys

    done = subprocess.run(
        [sys.executable, "bench/shared_prompts.py", "--gpus", "1", "--dtype", "bfloat16", "--max-gap", "0.05"],
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    speedup = float(re.search(r"shared vs unshared prompts: ([0-9.]+)x", done.stdout).group(1))
    assert speedup > 1.0, done.stdout[-2000:]
