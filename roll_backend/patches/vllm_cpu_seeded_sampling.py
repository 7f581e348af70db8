"""Seeded requests on vLLM's CPU sampler without a tensor round trip per request and step.

vLLM's CPU sampler (`TopKTopPSampler.forward_cpu`, Gumbel-max with per-token SplitMix64 noise from one seed per row)
gives each seeded row a seed drawn from the request's torch.Generator, one `torch.randint(..., generator=)` plus a
tensor element write per request and step: ~5 us each, 0.3 ms of a 9 ms decode step of 64 requests, all seeded in
a multi-turn rollout (roll_backend.agentic seeds every turn so that its samples do not depend on the order the
environments answered in). Here a seeded row's seed is a counter-based function of its generator's initial seed and
how many steps that generator has sampled: like vLLM's, the same stream for the same request whatever else is in the
batch and a fresh one per step, and different from vLLM's own numbers (statistically the same: the noise is vLLM's
SplitMix64 from the seed either way). Unseeded rows and the float64-Gumbel path stay vLLM's.

Applied by the vLLM strategy on CPU before its engine starts (`apply()`, idempotent); pinned to the vLLM versions
below, whose forward_cpu this mirrors.
"""

from __future__ import annotations

import logging
import weakref

import torch

logger = logging.getLogger(__name__)

TESTED_VLLM_VERSIONS = ("0.32.",)
_MASK64 = (1 << 64) - 1


def splitmix64(value: int) -> int:
    """One SplitMix64 output for `value` (Steele, Lea and Flood 2014): a well-mixed 64-bit integer."""
    value = (value + 0x9E3779B97F4A7C15) & _MASK64
    value = ((value ^ (value >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    value = ((value ^ (value >> 27)) * 0x94D049BB133111EB) & _MASK64
    return value ^ (value >> 31)


class RowSeeds:
    """Each seeded request's seed for its next sampling step: splitmix64(initial seed, steps so far) in [0, 2**31)."""

    def __init__(self):
        self.steps: weakref.WeakKeyDictionary[torch.Generator, int] = weakref.WeakKeyDictionary()

    def next(self, generator: torch.Generator) -> int:
        step = self.steps.get(generator, 0)
        self.steps[generator] = step + 1
        return splitmix64(generator.initial_seed() * 0x100000001B3 + step) & 0x7FFFFFFF

    def for_batch(self, batch_size: int, generators: dict[int, torch.Generator]) -> torch.Tensor:
        """[batch_size] int64: random seeds for unseeded rows (torch's global generator, as vLLM draws them), the
        counter-based ones for seeded rows."""
        if len(generators) == batch_size:
            seeds = torch.empty(batch_size, dtype=torch.long)
        else:
            seeds = torch.randint(0, 2**31, (batch_size,), dtype=torch.long)
        rows = list(generators)
        seeds[rows] = torch.tensor([self.next(generators[row]) for row in rows], dtype=torch.long)
        return seeds


def apply() -> None:
    import vllm
    from vllm.v1.sample.ops import topk_topp_sampler as sampler_module

    sampler = sampler_module.TopKTopPSampler
    if getattr(sampler, "counter_seeded_rows", None) is not None:
        return
    if not vllm.__version__.startswith(TESTED_VLLM_VERSIONS):
        logger.warning(
            "the CPU seeded-sampling patch is tested on vLLM %s, found %s", TESTED_VLLM_VERSIONS, vllm.__version__
        )
    stock = sampler.forward_cpu
    row_seeds = RowSeeds()

    def forward_cpu(self, logits, generators, k, p):
        if not generators or self.use_fp64_gumbel:
            return stock(self, logits, generators, k, p)
        logits = sampler_module.apply_top_k_top_p(logits, k, p)
        logits_to_return = None
        if self.logprobs_mode == "processed_logits":
            logits_to_return = logits
        elif self.logprobs_mode == "processed_logprobs":
            logits_to_return = logits.log_softmax(dim=-1, dtype=torch.float32)
        seeds = row_seeds.for_batch(logits.shape[0], generators)
        return torch.ops._C.fused_gumbel_argmax(logits.to(dtype=torch.float32), seeds), logits_to_return

    sampler.forward_cpu = forward_cpu
    sampler.counter_seeded_rows = row_seeds
