"""Build a megatron-core GPTModel (one pipeline stage) from a Hugging Face Qwen2/Qwen3/Llama-family config.

Covers GQA, RoPE, SwiGLU, RMSNorm, optional qkv bias, Qwen3's q/k RMSNorm, tied or untied embeddings,
mixture-of-experts layers (Qwen2-MoE, Qwen3-MoE: see moe.py), multi-token prediction (MTP) layers and a
scalar value head for critics. Call after Megatron's parallel state is initialised.
"""

from __future__ import annotations

import json
import logging
import types
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from roll_backend.models.hf_decoder import QK_NORM_MODEL_TYPES, has_qkv_bias
from roll_backend.strategies.megatron import moe as moe_lib
from roll_backend.strategies.megatron import mtp
from roll_backend.strategies.megatron.config import (
    hf_model_problems,
    mtp_problem,
    stage_split_problem,
    value_head_problem,
)
from roll_backend.strategies.megatron.layers import RMSNorm, ValueHead
from roll_backend.strategies.megatron.moe import MoEArch

logger = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}  # config.PARAMS_DTYPES
_CHECKED_FIELDS = ("hidden_act", "rope_parameters", "rope_scaling", "decoder_sparse_step", "mlp_only_layers")


def use_transformer_engine(transformer_impl: str, device: str) -> bool:
    """Whether the model takes TransformerEngine's layers: `transformer_impl` auto picks them on cuda when TE
    imports, local never does."""
    if transformer_impl == "local":
        return False
    try:
        import transformer_engine  # noqa: F401

        have_te = True
    except ImportError:
        have_te = False
    if transformer_impl == "transformer_engine" and not (have_te and device == "cuda"):
        raise ValueError(
            "transformer_impl='transformer_engine' needs TransformerEngine and a cuda device; use 'local' or 'auto'."
        )
    return have_te and device == "cuda"


def transformer_engine_for(config, device: str) -> bool:
    """Whether a Megatron role's model takes TransformerEngine's layers (never with share_prompts: its masks are
    explicit, which the local spec's attention takes)."""
    return not getattr(config, "share_prompts", False) and use_transformer_engine(config.transformer_impl, device)


def flex_attention_for(config, device: str) -> bool:
    """Whether a Megatron role's local spec attends through FlexAttention: prompt-shared segments (explicit masks) on
    a GPU; the dense local attention on CPU, where FlexAttention has no backward."""
    return bool(getattr(config, "share_prompts", False)) and device == "cuda"


def unwrap(model):
    """The GPTModel inside DDP / Float16Module wrappers."""
    while hasattr(model, "module"):
        model = model.module
    return model


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
    qk_norm: bool = False
    moe: MoEArch | None = None  # routed experts in every layer (None: dense MLPs)

    @classmethod
    def from_model_path(cls, model_path: str) -> HFArch:
        """The architecture of the model in `model_path`. A config.json that transformers' `save_pretrained` wrote
        (it carries `transformers_version`) holds every attribute its config class defines, so its fields are what
        AutoConfig would give, and are read as they are: a rank then never imports transformers (~1.7 s of a core
        per rank on a 2-core machine). Any other file, or one missing a field read here, goes through AutoConfig,
        which fills in its class's defaults."""
        fields = json.loads((Path(model_path) / "config.json").read_text())
        if "transformers_version" in fields:
            if "num_local_experts" in fields:  # (transformers 5's name for Qwen3-MoE's num_experts)
                fields.setdefault("num_experts", fields["num_local_experts"])
            try:
                return cls.from_hf_config(types.SimpleNamespace(**fields))
            except AttributeError:
                pass
        from transformers import AutoConfig

        return cls.from_hf_config(AutoConfig.from_pretrained(model_path))

    @classmethod
    def from_hf_config(cls, hf_config) -> HFArch:
        model_type = getattr(hf_config, "model_type", "")
        fields = {
            name: getattr(hf_config, name) for name in _CHECKED_FIELDS if getattr(hf_config, name, None) is not None
        }
        problems = hf_model_problems({"model_type": model_type, **fields})
        if problems:
            raise ValueError("; ".join(problems) + ".")
        rope_params = getattr(hf_config, "rope_parameters", None) or {}
        rope_theta = rope_params.get("rope_theta", getattr(hf_config, "rope_theta", 10000.0))
        num_heads = hf_config.num_attention_heads
        head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // num_heads
        bias_flags = {
            name: getattr(hf_config, name) for name in ("qkv_bias", "attention_bias") if hasattr(hf_config, name)
        }
        qkv_bias = has_qkv_bias(model_type, bias_flags)
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
            qk_norm=model_type in QK_NORM_MODEL_TYPES,
            moe=MoEArch.from_hf_config(hf_config),
        )

    def padded_vocab_size(self, tp: int) -> int:
        """The vocabulary rounded up to a multiple of TP (VocabParallelEmbedding splits it evenly)."""
        return -(-self.vocab_size // tp) * tp

    def check_layout(
        self,
        tp: int,
        pp: int,
        ep: int = 1,
        etp: int | None = None,
        vpp: int | None = None,
        first_stage_layers: int | None = None,
        last_stage_layers: int | None = None,
    ) -> None:
        # ep/etp only shape MoE layers: a dense model in an expert-parallel group ignores them.
        problems = self.moe.layout_problems(tp, ep, tp if etp is None else etp) if self.moe else []
        if self.num_kv_heads % tp:
            divisors = [d for d in range(1, self.num_kv_heads + 1) if self.num_kv_heads % d == 0]
            problems.append(
                f"tp={tp} does not divide num_key_value_heads={self.num_kv_heads}; choose one of {divisors}"
            )
        if self.ffn_hidden_size % tp and self.moe is None:
            problems.append(f"tp={tp} does not divide intermediate_size={self.ffn_hidden_size}")
        split_problem = stage_split_problem(self.num_layers, pp, vpp, first_stage_layers, last_stage_layers)
        if split_problem:
            problems.append(split_problem)
        if problems:
            raise ValueError("; ".join(problems) + ".")


@dataclass(frozen=True)
class ModelBuildOptions:
    """How to build the Megatron model; everything but the architecture."""

    tp: int = 1
    pp: int = 1
    ep: int = 1  # expert parallel (MoE models)
    etp: int | None = None  # expert tensor parallel; None = tp, as in megatron-core
    device: str = "cpu"  # picks the MoE token dispatcher
    cp: int = 1
    vpp: int | None = None  # virtual pipeline stages (model chunks) per rank
    first_stage_layers: int | None = None  # Megatron's num_layers_in_first_pipeline_stage (uneven splits)
    last_stage_layers: int | None = None  # Megatron's num_layers_in_last_pipeline_stage
    params_dtype: torch.dtype = torch.float32
    use_cpu_initialization: bool = True
    mtp_num_layers: int = 0
    mtp_loss_scaling_factor: float = 0.1
    value_head: bool = False  # critic: replace the LM head by a linear hidden -> 1
    use_transformer_engine: bool = False
    init_method_std: float = 0.02
    recompute_activations: bool = False
    use_torch_compile: bool = False  # local spec: compiled norms, core attention and SwiGLU (compiled_layers.py)
    sequence_parallel: bool = False  # Megatron's sequence parallelism at tp > 1 (MoE models always take it there)
    flex_attention: bool = False  # local spec: FlexAttention over an explicit mask (share_prompts on a GPU)


def transformer_config(arch: HFArch, options: ModelBuildOptions):
    """A TransformerConfig matching `arch`; fusions off so the same config runs on CPU and GPU."""
    from megatron.core.transformer import TransformerConfig

    fp = options.params_dtype
    moe_kwargs = {}
    if arch.moe is not None:
        moe_lib.allow_router_without_transformer_engine()
        etp = options.tp if options.etp is None else options.etp
        moe_kwargs = moe_lib.transformer_config_kwargs(arch.moe, options.tp, options.ep, etp, options.device)
    kwargs = dict(
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
        virtual_pipeline_model_parallel_size=options.vpp,
        num_layers_in_first_pipeline_stage=options.first_stage_layers,
        num_layers_in_last_pipeline_stage=options.last_stage_layers,
        context_parallel_size=options.cp,
        # Batched p2p with interleaved stages gives silently wrong gradients on gloo (STACK.md); separate
        # send/recv is exact everywhere.
        batch_p2p_comm=options.vpp is None,
        # Norms and the residual stream split over TP along the sequence (our RMSNorm marks its weight for the
        # gradient's sum over TP); a MoE model's settings below turn it on at tp > 1 in any case.
        sequence_parallel=options.sequence_parallel and options.tp > 1,
        params_dtype=fp,
        pipeline_dtype=fp,
        bf16=fp == torch.bfloat16,
        fp16=fp == torch.float16,
        use_cpu_initialization=options.use_cpu_initialization,
        gradient_accumulation_fusion=False,
        bias_activation_fusion=options.use_torch_compile,  # megatron-core's SwiGLU under torch.compile
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
        qk_layernorm=arch.qk_norm,
    )
    kwargs.update(moe_kwargs)
    return TransformerConfig(**kwargs)


def layer_spec(
    config,
    use_transformer_engine: bool,
    vp_stage: int | None = None,
    use_torch_compile: bool = False,
    flex_attention: bool = False,
):
    """The decoder's spec: TransformerEngine's layers (TE does CP itself), or Megatron's local layers with
    `RMSNorm` as every norm and, under CP, the CP-capable core attention of cp.py; with `use_torch_compile`,
    their compiled versions (compiled_layers.py); with `flex_attention`, FlexAttention as the core attention
    (masked_attention.py: prompt-shared segments on a GPU)."""
    from megatron.core.models.gpt.gpt_layer_specs import (
        get_gpt_layer_local_spec,
        get_gpt_layer_with_transformer_engine_spec,
    )
    from megatron.core.transformer.transformer_block import TransformerBlockSubmodules, get_num_layers_to_build

    moe = dict(num_experts=config.num_moe_experts, moe_grouped_gemm=False, qk_layernorm=config.qk_layernorm)
    if use_transformer_engine:
        return get_gpt_layer_with_transformer_engine_spec(**moe)
    layer = get_gpt_layer_local_spec(normalization="RMSNorm", **moe)
    norm, attention = RMSNorm, layer.submodules.self_attention.submodules.core_attention
    if use_torch_compile:
        from roll_backend.strategies.megatron.compiled_layers import CompiledRMSNorm, compiled_attention_class

        norm, attention = CompiledRMSNorm, compiled_attention_class()
    if flex_attention:
        from roll_backend.strategies.megatron.masked_attention import masked_attention_class

        attention = masked_attention_class()
    layer.submodules.input_layernorm = norm
    layer.submodules.pre_mlp_layernorm = norm
    if config.qk_layernorm:
        layer.submodules.self_attention.submodules.q_layernorm = norm
        layer.submodules.self_attention.submodules.k_layernorm = norm
    if config.context_parallel_size > 1:
        from roll_backend.strategies.megatron.cp import context_parallel_attention_class

        attention = context_parallel_attention_class(attention)
    layer.submodules.self_attention.submodules.core_attention = attention
    return TransformerBlockSubmodules(layer_specs=[layer] * get_num_layers_to_build(config, vp_stage), layer_norm=norm)


def build_gpt_stage(arch: HFArch, options: ModelBuildOptions, vp_stage: int | None = None):
    """This rank's pipeline stage of the model (a GPTModel), randomly initialised; load weights after."""
    from megatron.core import parallel_state as mpu
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_mtp_block_spec

    arch.check_layout(
        options.tp,
        options.pp,
        options.ep,
        options.etp,
        options.vpp,
        options.first_stage_layers,
        options.last_stage_layers,
    )
    for problem in (
        value_head_problem(options.value_head, options.mtp_num_layers),
        mtp_problem(arch.moe is not None, options.mtp_num_layers),
    ):
        if problem:
            raise ValueError(problem + ".")
    config = transformer_config(arch, options)
    spec = layer_spec(
        config, options.use_transformer_engine, vp_stage, options.use_torch_compile, options.flex_attention
    )
    pre_process = mpu.is_pipeline_first_stage(ignore_virtual=False, vp_stage=vp_stage)
    post_process = mpu.is_pipeline_last_stage(ignore_virtual=False, vp_stage=vp_stage)
    mtp_spec = None
    if options.mtp_num_layers:
        mtp_spec = get_gpt_mtp_block_spec(
            config, spec, use_transformer_engine=options.use_transformer_engine, vp_stage=vp_stage
        )
        if mtp_spec is not None and not options.use_transformer_engine:
            # The local MTP spec takes torch's norm, which refuses sequence parallelism (on with MoE at tp > 1):
            # give the MTP layers the decoder's norm, as the TE spec gives them TE's.
            for layer in mtp_spec.layer_specs:
                layer.submodules.enorm = layer.submodules.hnorm = layer.submodules.layer_norm = spec.layer_norm
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
    if options.mtp_num_layers:
        mtp.drop_unused_output_weight(model)
    if options.value_head and post_process:
        model.output_layer = ValueHead(
            arch.hidden_size, options.params_dtype, options.init_method_std, model.config.sequence_parallel
        )
    if arch.moe is not None:
        moe_lib.mark_expert_params(model)
    return model
