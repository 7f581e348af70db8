"""The local spec's own layers: an RMSNorm with Hugging Face's rounding, and a critic's value head."""

from __future__ import annotations

import torch
import torch.nn.functional as F


class ValueHead(torch.nn.Module):
    """A critic's head, standing in for GPTModel.output_layer: hidden [S, B, H] -> values [S, B, 1].

    Replicated across TP (its input is identical on every TP rank), so its gradients agree without a reduce. Under
    sequence parallelism each TP rank holds a slice of the sequence: the head gathers the whole sequence first (as the
    LM head does), and its backward gives each rank its slice of the gradient, not a sum over ranks (every rank
    computed the same values and loss).
    """

    def __init__(self, hidden_size: int, dtype: torch.dtype, init_std: float, sequence_parallel: bool = False):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.empty(1, hidden_size, dtype=dtype))
        self.bias = torch.nn.Parameter(torch.zeros(1, dtype=dtype))
        self.sequence_parallel = sequence_parallel
        torch.nn.init.normal_(self.weight, std=init_std)

    def forward(self, hidden_states, weight=None, runtime_gather_output=None):
        if self.sequence_parallel:
            from megatron.core.tensor_parallel import gather_from_sequence_parallel_region

            hidden_states = gather_from_sequence_parallel_region(hidden_states, tensor_parallel_output_grad=False)
        return F.linear(hidden_states, self.weight, self.bias), None


class RMSNorm(torch.nn.Module):
    """RMSNorm computed as Hugging Face's Qwen2/Llama do: normalise in float32, cast back, then scale.

    Stands in for torch.nn.RMSNorm in the local (non-TransformerEngine) spec: in bf16 it matches HF's rounding,
    and on CPU its forward + backward is about twice as fast as torch's fused rms_norm (measured in torch 2.13).
    """

    def __init__(self, config, hidden_size: int, eps: float = 1e-6, **_):
        super().__init__()
        self.eps = eps
        self.weight = torch.nn.Parameter(torch.ones(hidden_size, dtype=config.params_dtype))
        # Under sequence parallelism each TP rank normalises its slice of the sequence: finalize_model_grads sums
        # the weight's gradient over TP for parameters marked like this (as Megatron's own norms mark theirs).
        self.weight.sequence_parallel = config.sequence_parallel

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return rms_norm(hidden_states, self.weight, self.eps)


def rms_norm(hidden_states: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    normed = hidden_states.float()
    normed = normed * torch.rsqrt(normed.pow(2).mean(-1, keepdim=True) + eps)
    return weight * normed.to(hidden_states.dtype)
