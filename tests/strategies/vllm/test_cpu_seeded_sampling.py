"""roll_backend/patches/vllm_cpu_seeded_sampling.py on vLLM's own CPU sampler (its fused Gumbel-max kernel): a seeded
row's token depends on its seed and step only, every step draws anew, and the draws follow the softmax."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from roll_backend.patches import vllm_cpu_seeded_sampling

VOCAB = 8


@pytest.fixture(scope="module")
def sampler():
    from vllm.platforms import current_platform
    from vllm.v1.sample.ops.topk_topp_sampler import TopKTopPSampler

    current_platform.import_kernels()
    vllm_cpu_seeded_sampling.apply()
    vllm_cpu_seeded_sampling.apply()  # idempotent
    return TopKTopPSampler("processed_logprobs")


def _draw(sampler, logits: torch.Tensor, generators: dict[int, torch.Generator]) -> list[int]:
    tokens, _ = sampler.forward(logits.clone(), generators, None, None)
    return tokens.view(-1).tolist()


def test_a_seeded_row_samples_the_same_whatever_else_is_in_the_batch(sampler):
    logits = torch.randn(5, VOCAB, generator=torch.Generator().manual_seed(0))
    alone_gen, crowded_gen = torch.Generator().manual_seed(11), torch.Generator().manual_seed(11)
    others = {0: torch.Generator().manual_seed(7), 3: torch.Generator().manual_seed(8)}  # rows 1 and 4: unseeded
    alone, crowded = [], []
    for _ in range(20):
        alone.append(_draw(sampler, logits[2:3], {0: alone_gen})[0])
        crowded.append(_draw(sampler, logits, {**others, 2: crowded_gen})[2])
    assert alone == crowded
    assert len(set(alone)) > 1  # each step draws anew (the counter advances)
    again = torch.Generator().manual_seed(11)
    assert [_draw(sampler, logits[2:3], {0: again})[0] for _ in range(20)] == alone  # a new request, same seed


def test_seeded_draws_follow_the_softmax(sampler):
    """4000 requests of distinct seeds, one step each, over a fixed 8-token distribution: a chi-square test at
    p = 1e-4 (the seeds are fixed, so the outcome is too; a biased mapping fails it)."""
    logits = torch.tensor([[2.0, 1.0, 0.5, 0.0, -0.5, -1.0, 0.3, 1.5]])
    probs = torch.softmax(logits, dim=-1)[0].numpy()
    rows = 4000
    generators = {row: torch.Generator().manual_seed(1000 + row) for row in range(rows)}
    tokens = _draw(sampler, logits.expand(rows, VOCAB), generators)
    counts = np.bincount(tokens, minlength=VOCAB)
    expected = probs * rows
    chi_square = float(((counts - expected) ** 2 / expected).sum())
    assert chi_square < 33.1  # the 99.99th percentile of chi-square with 7 degrees of freedom


def test_unseeded_batches_keep_vllm_own_path(sampler):
    logits = torch.randn(3, VOCAB)
    torch.manual_seed(5)
    first = _draw(sampler, logits, {})
    torch.manual_seed(5)
    assert _draw(sampler, logits, {}) == first  # vLLM's draw from torch's global generator, as before
