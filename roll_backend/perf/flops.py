"""Model FLOPs of a decoder-only transformer from its Hugging Face config: the numerator of MFU.

Counts the matrix multiplies a forward pass must do for the real (unpadded) tokens, 2 FLOPs per multiply-add:
the q/k/v/o projections, causal attention (QK^T and AV over the positions a token attends to), the MLP (SwiGLU,
or the routed top-k experts plus shared expert and router of a MoE layer), multi-token-prediction layers, and the
output layer over the vocabulary. Norms, activations and softmax are left out, as in the usual MFU convention
(PaLM, Megatron). A training step is forward + backward = 3x the forward FLOPs.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class ModelFlops:
    """Per-token and per-sequence forward FLOPs of one model; build it with `from_hf_config`."""

    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    mlp_flops_per_token: float  # one layer's MLP (dense) or MoE (router + top-k experts + shared expert)
    mtp_layers: int = 0

    @classmethod
    def from_hf_config(cls, hf_config, mtp_layers: int = 0) -> ModelFlops:
        hidden = hf_config.hidden_size
        heads = hf_config.num_attention_heads
        return cls(
            hidden_size=hidden,
            num_layers=hf_config.num_hidden_layers,
            num_heads=heads,
            num_kv_heads=getattr(hf_config, "num_key_value_heads", None) or heads,
            head_dim=getattr(hf_config, "head_dim", None) or hidden // heads,
            vocab_size=hf_config.vocab_size,
            mlp_flops_per_token=_mlp_flops_per_token(hf_config),
            mtp_layers=mtp_layers,
        )

    @property
    def layer_linear_flops_per_token(self) -> float:
        """One decoder layer's projections and MLP for one token (attention over positions not included)."""
        q_and_o = 2 * 2 * self.hidden_size * self.num_heads * self.head_dim
        k_and_v = 2 * 2 * self.hidden_size * self.num_kv_heads * self.head_dim
        return q_and_o + k_and_v + self.mlp_flops_per_token

    @property
    def output_flops_per_token(self) -> float:
        return 2.0 * self.hidden_size * self.vocab_size

    def attention_flops(self, first_position: int, last_position: int) -> float:
        """QK^T and AV of one layer for the tokens at 1-based positions first..last of a causal sequence:
        the token at position p attends to p keys, 4 * heads * head_dim * p FLOPs."""
        if last_position < first_position:
            return 0.0
        positions = (first_position + last_position) * (last_position - first_position + 1) / 2
        return 4.0 * self.num_heads * self.head_dim * positions

    def span_flops(
        self, context: int, new_tokens: int, output_tokens: int | None = None, with_mtp: bool = False
    ) -> float:
        """Forward FLOPs of `new_tokens` tokens that follow `context` already-computed tokens of one sequence,
        with the output layer run on `output_tokens` of them (default: all)."""
        output_tokens = new_tokens if output_tokens is None else output_tokens
        per_layer = self.layer_linear_flops_per_token * new_tokens + self.attention_flops(
            context + 1, context + new_tokens
        )
        layers = self.num_layers + (self.mtp_layers if with_mtp else 0)
        flops = layers * per_layer + self.output_flops_per_token * output_tokens
        if with_mtp and self.mtp_layers:
            # each MTP layer projects [embedding; hidden] (2h -> h) and has its own pass through the output layer
            flops += (
                self.mtp_layers
                * (2.0 * 2 * self.hidden_size * self.hidden_size + self.output_flops_per_token)
                * new_tokens
            )
        return flops

    def forward_flops(self, sequence_lengths: Iterable[int], with_mtp: bool = False) -> float:
        """A forward pass over whole sequences (log-probs, values): every real token, padding excluded."""
        return float(sum(self.span_flops(0, int(n), with_mtp=with_mtp) for n in sequence_lengths))

    def train_flops(self, sequence_lengths: Iterable[int]) -> float:
        """Forward + backward (2x the forward) of one pass over the sequences, MTP layers included."""
        return 3.0 * self.forward_flops(sequence_lengths, with_mtp=True)

    def generation_flops(
        self,
        prompt_lengths: Sequence[int],
        response_lengths: Sequence[int],
        prompt_group: Sequence[object] | None = None,
    ) -> float:
        """Sampling: each prompt's prefill once per prompt group (its n samples share it; the output layer runs on
        its last token only), then each response token as a decode step attending to everything before it."""
        prompt_group = list(range(len(prompt_lengths))) if prompt_group is None else list(prompt_group)
        prefilled: set = set()
        flops = 0.0
        for prompt, response, group in zip(prompt_lengths, response_lengths, prompt_group):
            prompt, response = int(prompt), int(response)
            if group not in prefilled:
                prefilled.add(group)
                flops += self.span_flops(0, prompt, output_tokens=1)
            # the first response token came from the prefill's last position; the others are decode steps
            flops += self.span_flops(prompt, max(response - 1, 0))
        return flops


def _mlp_flops_per_token(hf_config) -> float:
    """SwiGLU MLP (gate, up, down: 3 matmuls) per layer, averaged over layers; a MoE layer runs its router, top-k
    experts and shared expert. Dense layers of MoE models (`mlp_only_layers`, `decoder_sparse_step`) count as dense."""
    hidden = hf_config.hidden_size
    dense = 3 * 2.0 * hidden * hf_config.intermediate_size
    num_experts = getattr(hf_config, "num_experts", None) or getattr(hf_config, "num_local_experts", None)
    if not num_experts:
        return dense
    expert_ffn = getattr(hf_config, "moe_intermediate_size", None) or hf_config.intermediate_size
    sparse = 2.0 * hidden * num_experts + getattr(hf_config, "num_experts_per_tok", 1) * 3 * 2.0 * hidden * expert_ffn
    shared_ffn = getattr(hf_config, "shared_expert_intermediate_size", 0) or 0
    if shared_ffn:
        sparse += 3 * 2.0 * hidden * shared_ffn + 2.0 * hidden  # the shared expert and its sigmoid gate
    layers = hf_config.num_hidden_layers
    dense_only = set(getattr(hf_config, "mlp_only_layers", None) or [])
    step = getattr(hf_config, "decoder_sparse_step", 1) or 1
    sparse_layers = sum(1 for i in range(layers) if i not in dense_only and (i + 1) % step == 0)
    return (sparse * sparse_layers + dense * (layers - sparse_layers)) / layers
