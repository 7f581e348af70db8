"""Build a megatron-core GPTModel (one pipeline stage) from a Hugging Face Qwen2/Llama-family config.

Covers GQA, RoPE, SwiGLU, RMSNorm, optional qkv bias, tied or untied embeddings, multi-token prediction
(MTP) layers and a scalar value head for critics. Call after Megatron's parallel state is initialised.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
import torch.nn.functional as F

logger = logging.getLogger(__name__)

SUPPORTED_MODEL_TYPES = ("qwen2", "llama", "mistral", "qwen3")


@dataclass(frozen=True)
class HFArch:
    """The architecture facts of a Hugging Face decoder that the Megatron model and the converter need."""

    model_type: str
    vocab_size: int
    hidden_size: int
    ffn_hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope_theta: float
    norm_eps: float
    qkv_bias: bool
    tie_word_embeddings: bool
    max_position_embeddings: int

    @classmethod
    def from_hf_config(cls, hf_config) -> "HFArch":
        model_type = getattr(hf_config, "model_type", "")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(f"model_type={model_type!r} is not supported; known: {', '.join(SUPPORTED_MODEL_TYPES)}.")
        if getattr(hf_config, "hidden_act", "silu") != "silu":
            raise ValueError(f"hidden_act={hf_config.hidden_act!r} is not supported; only SwiGLU ('silu') models are.")
        rope_params = getattr(hf_config, "rope_parameters", None) or {}
        rope_theta = rope_params.get("rope_theta", getattr(hf_config, "rope_theta", 10000.0))
        if rope_params.get("rope_type", "default") != "default":
            raise ValueError(f"rope_type={rope_params['rope_type']!r} is not supported; only the default RoPE is.")
        num_heads = hf_config.num_attention_heads
        head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // num_heads
        qkv_bias = True if model_type == "qwen2" else bool(getattr(hf_config, "attention_bias", False))
        return cls(
            model_type=model_type,
            vocab_size=hf_config.vocab_size,
            hidden_size=hf_config.hidden_size,
            ffn_hidden_size=hf_config.intermediate_size,
            num_layers=hf_config.num_hidden_layers,
            num_heads=num_heads,
            num_kv_heads=getattr(hf_config, "num_key_value_heads", None) or num_heads,
            head_dim=head_dim,
            rope_theta=float(rope_theta),
            norm_eps=hf_config.rms_norm_eps,
            qkv_bias=qkv_bias,
            tie_word_embeddings=bool(getattr(hf_config, "tie_word_embeddings", False)),
            max_position_embeddings=hf_config.max_position_embeddings,
        )

    def padded_vocab_size(self, tp: int) -> int:
        """The vocabulary rounded up to a multiple of TP (VocabParallelEmbedding splits it evenly)."""
        return -(-self.vocab_size // tp) * tp

    def check_layout(self, tp: int, pp: int) -> None:
        problems = []
        if self.num_kv_heads % tp:
            divisors = [d for d in range(1, self.num_kv_heads + 1) if self.num_kv_heads % d == 0]
            problems.append(f"tp={tp} does not divide num_key_value_heads={self.num_kv_heads}; choose one of {divisors}")
        if self.ffn_hidden_size % tp:
            problems.append(f"tp={tp} does not divide intermediate_size={self.ffn_hidden_size}")
        if self.num_layers % pp:
            problems.append(f"pp={pp} does not divide num_hidden_layers={self.num_layers}")
        if problems:
            raise ValueError("; ".join(problems) + ".")


@dataclass(frozen=True)
class ModelBuildOptions:
    """How to build the Megatron model; everything but the architecture."""

    tp: int = 1
    pp: int = 1
    params_dtype: torch.dtype = torch.float32
    use_cpu_initialization: bool = True
    mtp_num_layers: int = 0
    mtp_loss_scaling_factor: float = 0.1
    value_head: bool = False  # critic: replace the LM head by a linear hidden -> 1
    use_transformer_engine: bool = False
    init_method_std: float = 0.02
    recompute_activations: bool = False


def transformer_config(arch: HFArch, options: ModelBuildOptions):
    """A TransformerConfig matching `arch`; fusions off so the same config runs on CPU and GPU."""
    from megatron.core.transformer import TransformerConfig

    fp = options.params_dtype
    return TransformerConfig(
        num_layers=arch.num_layers,
        hidden_size=arch.hidden_size,
        ffn_hidden_size=arch.ffn_hidden_size,
        num_attention_heads=arch.num_heads,
        num_query_groups=arch.num_kv_heads,
        kv_channels=arch.head_dim,
        normalization="RMSNorm",
        layernorm_epsilon=arch.norm_eps,
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        add_qkv_bias=arch.qkv_bias,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        init_method_std=options.init_method_std,
        tensor_model_parallel_size=options.tp,
        pipeline_model_parallel_size=options.pp,
        sequence_parallel=False,  # torch norms refuse it on CPU; keep one code path
        params_dtype=fp,
        pipeline_dtype=fp,
        bf16=fp == torch.bfloat16,
        fp16=fp == torch.float16,
        use_cpu_initialization=options.use_cpu_initialization,
        gradient_accumulation_fusion=False,
        bias_activation_fusion=False,
        bias_dropout_fusion=False,
        masked_softmax_fusion=False,
        persist_layer_norm=False,
        apply_rope_fusion=False,
        cross_entropy_loss_fusion=False,
        attention_softmax_in_fp32=True,
        mtp_num_layers=options.mtp_num_layers or None,
        mtp_loss_scaling_factor=options.mtp_loss_scaling_factor,
        recompute_granularity="full" if options.recompute_activations else None,
        recompute_method="uniform" if options.recompute_activations else None,
        recompute_num_layers=1 if options.recompute_activations else None,
    )


class ValueHead(torch.nn.Module):
    """A critic's head, standing in for GPTModel.output_layer: hidden [S, B, H] -> values [S, B, 1].

    Replicated across TP (its input is identical on every TP rank), so its gradients agree without a reduce.
    """

    def __init__(self, hidden_size: int, dtype: torch.dtype, init_std: float):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.empty(1, hidden_size, dtype=dtype))
        self.bias = torch.nn.Parameter(torch.zeros(1, dtype=dtype))
        torch.nn.init.normal_(self.weight, std=init_std)

    def forward(self, hidden_states, weight=None, runtime_gather_output=None):
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

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        normed = hidden_states.float()
        normed = normed * torch.rsqrt(normed.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * normed.to(hidden_states.dtype)


def layer_spec(config, use_transformer_engine: bool, vp_stage: int | None = None):
    """The decoder's spec: TransformerEngine's layers, or Megatron's local layers with `RMSNorm` as every norm."""
    from megatron.core.models.gpt.gpt_layer_specs import (
        get_gpt_layer_local_spec,
        get_gpt_layer_with_transformer_engine_spec,
    )
    from megatron.core.transformer.transformer_block import TransformerBlockSubmodules, get_num_layers_to_build

    if use_transformer_engine:
        return get_gpt_layer_with_transformer_engine_spec(qk_layernorm=False)
    layer = get_gpt_layer_local_spec(qk_layernorm=False, normalization="RMSNorm")
    layer.submodules.input_layernorm = RMSNorm
    layer.submodules.pre_mlp_layernorm = RMSNorm
    return TransformerBlockSubmodules(layer_specs=[layer] * get_num_layers_to_build(config, vp_stage), layer_norm=RMSNorm)


def build_gpt_stage(arch: HFArch, options: ModelBuildOptions, vp_stage: int | None = None):
    """This rank's pipeline stage of the model (a GPTModel), randomly initialised; load weights after."""
    from megatron.core import parallel_state as mpu
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_mtp_block_spec

    arch.check_layout(options.tp, options.pp)
    if options.value_head and options.mtp_num_layers:
        raise ValueError("a critic (value_head=True) cannot use MTP; set mtp_num_layers=0.")
    config = transformer_config(arch, options)
    spec = layer_spec(config, options.use_transformer_engine, vp_stage)
    pre_process = mpu.is_pipeline_first_stage(ignore_virtual=False, vp_stage=vp_stage)
    post_process = mpu.is_pipeline_last_stage(ignore_virtual=False, vp_stage=vp_stage)
    mtp_spec = None
    if options.mtp_num_layers:
        mtp_spec = get_gpt_mtp_block_spec(config, spec, use_transformer_engine=options.use_transformer_engine, vp_stage=vp_stage)
    model = GPTModel(
        config=config,
        transformer_layer_spec=spec,
        vocab_size=arch.padded_vocab_size(options.tp),
        max_sequence_length=arch.max_position_embeddings,
        pre_process=pre_process,
        post_process=post_process,
        parallel_output=True,
        share_embeddings_and_output_weights=arch.tie_word_embeddings and not options.value_head,
        position_embedding_type="rope",
        rotary_base=arch.rope_theta,
        mtp_block_spec=mtp_spec,
        vp_stage=vp_stage,
    )
    if options.value_head and post_process:
        model.output_layer = ValueHead(arch.hidden_size, options.params_dtype, options.init_method_std)
    return model
