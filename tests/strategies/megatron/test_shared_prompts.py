"""The prompt-shared layout (strategies/megatron/shared_prompts.py) against the unshared rows, on a transformers
model: per-token log-probs and the gradients of a loss over them are the same when each group's prompt is forwarded
once, on random shapes (prompt lengths per group, response lengths per row including empty ones, group sizes,
padding, the prompt tail each response carries: 1 + MTP depths), within float32 rounding; and every label a
per-position loss reads (CP's log-probs, each MTP depth's) is the row's own next token."""

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


def shared_log_probs(
    model, prompts, prompt_mask, responses, present, packed: bool = False, **cuts
) -> tuple[torch.Tensor, int]:
    """(the rows' log-probs from their prompt-shared segments, one per packed row or all in one; tokens forwarded)."""
    ids, mask = torch.cat([prompts, responses], dim=1), torch.cat([prompt_mask, present], dim=1)
    segments, empty = shared_segments(ids, mask, responses.shape[1], **cuts)
    rows = [segments] if packed else [[s] for s in segments]
    layout = lay_out(ids, mask, responses.shape[1], rows, max(sum(s.length for s in row) for row in rows))
    blocked = torch.finfo(torch.float32).min
    additive = torch.where(layout.visible, 0.0, blocked).unsqueeze(1)  # [G, 1, L, L]
    logits = model(input_ids=layout.input_ids, attention_mask=additive, position_ids=layout.position_ids).logits
    log_probs = logits.log_softmax(-1)[layout.gather_rows, layout.gather_cols]  # [n, T_resp, V]
    picked = log_probs.gather(-1, responses[layout.rows].unsqueeze(-1)).squeeze(-1) * layout.gather_valid
    out = torch.zeros(responses.shape)
    out[layout.rows] = picked
    check_labels(layout, ids, cuts.get("tail", 1))
    return out * present, int(layout.real.sum())


def check_labels(layout, ids: torch.Tensor, tail: int) -> None:
    """What per-position losses read in the packed rows: the next packed token at every position that predicts a
    response token is that token, and every MTP depth k < tail whose rolled loss mask is on at position t reads a
    label (token t+k+1) of the same row as t: no loss crosses into another response."""
    total = ids.shape[1]
    next_token = torch.roll(layout.input_ids, -1, dims=1)
    valid = layout.gather_valid
    predicting = next_token[layout.gather_rows[valid], layout.gather_cols[valid]]
    responses = ids[:, total - layout.gather_rows.shape[1] :][layout.rows]
    assert torch.equal(predicting, responses[valid])
    row_of = torch.where(layout.source >= 0, layout.source // total, -1)
    width = layout.input_ids.shape[1]
    for depth in range(1, tail):
        on = layout.predicts_response[:, depth:].bool() & layout.real[:, : width - depth]
        here, label = row_of[:, : width - depth][on], row_of[:, depth + 1 :]
        label = torch.cat([label, torch.full((label.shape[0], 1), -1)], dim=1)[on]
        assert torch.equal(here, label), depth


def grads(model) -> dict[str, torch.Tensor]:
    out = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return out


group_shapes = st.lists(
    st.tuples(st.integers(1, 9), st.lists(st.integers(0, 6), min_size=1, max_size=4)), min_size=1, max_size=3
)


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    groups=group_shapes,
    seed=st.integers(0, 1000),
    max_rows=st.sampled_from([None, 1, 2, 3]),
    tail=st.sampled_from([1, 2, 3]),
    packed=st.booleans(),
)
@example(groups=[(1, [2, 4, 6]), (1, [0, 0, 0])], seed=15, max_rows=None, tail=1, packed=False)  # another sum order
@example(groups=[(1, [3, 1]), (2, [4, 4])], seed=3, max_rows=None, tail=3, packed=True)  # prompts shorter than tails
def test_shared_prompts_give_the_unshared_log_probs_and_gradients(model, groups, seed, max_rows, tail, packed):
    prompt_width = max(max(p for p, _ in groups), tail) + 1  # (at least one pad column)
    response_width = max(max(lengths) for _, lengths in groups) + 1
    prompts, prompt_mask, responses, present, _ = rows_of(groups, prompt_width, response_width, seed)
    weights = torch.randn(responses.shape, generator=torch.Generator().manual_seed(seed + 1))

    expected = unshared_log_probs(model, prompts, prompt_mask, responses, present)
    (expected * weights).sum().backward()
    expected_grads = grads(model)

    got, forwarded = shared_log_probs(
        model, prompts, prompt_mask, responses, present, packed, max_rows=max_rows, tail=tail
    )
    (got * weights).sum().backward()
    got_grads = grads(model)

    torch.testing.assert_close(got, expected, rtol=1e-5, atol=2e-6)
    for name, grad in expected_grads.items():
        # a gradient sums the rows' terms in another order: rounding of the largest magnitude, not of each element
        torch.testing.assert_close(got_grads[name], grad, rtol=1e-4, atol=float32_bound(grad), msg=name)
    # each segment forwards its prompt once but for the tail each row carries: a group of n rows in ceil(n /
    # max_rows) segments
    carried = sum(len(lengths) * min(p, tail) for p, lengths in groups)
    segments = sum(-(-len(lengths) // (max_rows or len(lengths))) * max(p - tail, 0) for p, lengths in groups)
    assert forwarded == segments + carried + int(present.sum())


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
    # a budget of 9 positions: 2 shared + (1 + 2) fits, + (1 + 4) does not; a row alone over the budget still gets a
    # segment
    assert [s.rows for s in shared_segments(ids, mask, 4, max_tokens=9)[0]] == [(0,), (1, 2), (3, 4)]
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
