"""MoE and Qwen3 pieces without Ray: architecture from HF configs, expert names across EP ranks, layout checks
(in the model builder and in the run config, before any actor starts)."""

from __future__ import annotations

import pytest
import torch

from roll_backend.distributed.layout import ParallelLayout
from roll_backend.models.tiny import TinyModelSpec, _hf_config, tokenizer_for
from roll_backend.strategies.megatron import moe_convert
from roll_backend.strategies.megatron.builder import HFArch
from roll_backend.strategies.megatron.convert import param_mapping


def _arch(family: str, **spec) -> HFArch:
    tiny = TinyModelSpec(family=family, tokenizer="char", **spec)
    return HFArch.from_hf_config(_hf_config(tiny, tokenizer_for(tiny)))


def test_architectures_from_hf_configs():
    qwen3, qwen2_moe, qwen3_moe = _arch("qwen3"), _arch("qwen2_moe"), _arch("qwen3_moe")
    assert qwen3.qk_norm and qwen3.moe is None and not qwen3.qkv_bias
    assert qwen2_moe.qkv_bias and not qwen2_moe.qk_norm
    assert qwen2_moe.moe.shared_expert_ffn_hidden_size == 64 and not qwen2_moe.moe.norm_topk_prob
    assert qwen3_moe.qk_norm and qwen3_moe.moe.shared_expert_ffn_hidden_size is None and qwen3_moe.moe.norm_topk_prob
    assert (qwen3_moe.moe.num_experts, qwen3_moe.moe.topk, qwen3_moe.moe.aux_loss_coef) == (4, 2, 0.01)


def test_dense_layers_between_moe_layers_are_refused():
    tiny = TinyModelSpec(family="qwen3_moe", tokenizer="char")
    config = _hf_config(tiny, tokenizer_for(tiny))
    config.mlp_only_layers = [1]
    with pytest.raises(ValueError, match="mlp_only_layers"):
        HFArch.from_hf_config(config)


def test_expert_names_follow_the_ep_rank():
    arch = _arch("qwen3_moe")
    fc1 = param_mapping(
        "decoder.layers.0.mlp.experts.local_experts.1.linear_fc1.weight", arch, layer_offset=1, first_local_expert=2
    )
    assert fc1.expert and fc1.kind == "gate_up"
    assert fc1.hf_names == (
        "model.layers.1.mlp.experts.3.gate_proj.weight",
        "model.layers.1.mlp.experts.3.up_proj.weight",
    )
    assert param_mapping("decoder.layers.0.mlp.router.weight", arch, 0).hf_names == ("model.layers.0.mlp.gate.weight",)
    assert param_mapping("decoder.layers.0.self_attention.k_layernorm.weight", arch, 0).hf_names == (
        "model.layers.0.self_attn.k_norm.weight",
    )


def test_expert_export_names_every_ep_rank_copy_of_a_local_slot():
    """Local expert 1 of 2 per rank, gathered over EP2: global experts 1 (rank 0) and 3 (rank 1)."""
    tensors = [torch.full((2,), 0.0), torch.full((2,), 1.0)]
    named = list(
        moe_convert.gather_expert_tensors(
            ("model.layers.0.mlp.experts.1.down_proj.weight",), [tensors[0]], 2, lambda tensor: tensors
        )
    )
    assert [name for name, _ in named] == [
        "model.layers.0.mlp.experts.1.down_proj.weight",
        "model.layers.0.mlp.experts.3.down_proj.weight",
    ]
    assert torch.equal(named[1][1], tensors[1])


def test_layout_problems_name_the_fix():
    arch = _arch("qwen3_moe")
    with pytest.raises(ValueError, match=r"ep=3 does not divide num_experts=4; choose one of \[1, 2, 4\]"):
        arch.check_layout(tp=1, pp=1, ep=3)
    with pytest.raises(ValueError, match="etp=3 does not divide moe_intermediate_size=32"):
        arch.check_layout(tp=1, pp=1, ep=1, etp=3)
    assert ParallelLayout(tp=2, ep=2).expert_problems(4) == []
    assert "etp*ep = 2*2 does not divide the 2 ranks" in ParallelLayout(tp=2, ep=2).expert_problems(2)[0]
    assert ParallelLayout(tp=2, ep=2, etp=1).expert_problems(2) == []


def test_run_config_refuses_an_impossible_ep_before_ray(tmp_path):
    from roll_backend.config.loader import ConfigError, load_config
    from roll_backend.models.tiny import build_tiny_model

    model = build_tiny_model(
        tmp_path / "moe", TinyModelSpec(family="qwen3_moe", tokenizer="char", hidden_size=64, num_attention_heads=2)
    )
    base = [
        f"model_path={model}",
        "build_tiny_model=null",
        "actor_train.strategy.tp=1",
        "actor_train.strategy.micro_batch_size=16",
    ]
    with pytest.raises(ConfigError, match="actor_train.strategy.ep=3 does not divide num_experts=4"):
        load_config(
            "configs/grpo_tiny_cpu.yaml",
            base
            + [
                "actor_train.world_size=3",
                "actor_train.strategy.ep=3",
                "actor_train.strategy.micro_batch_size=1",
                "algorithm.ppo_mini_batch_size=48",
            ],
        )
    with pytest.raises(ConfigError, match="etp\\*ep = 1\\*4 does not divide the 2 ranks"):
        load_config("configs/grpo_tiny_cpu.yaml", base + ["actor_train.strategy.ep=4"])
    assert (
        load_config("configs/grpo_tiny_cpu.yaml", base + ["actor_train.strategy.ep=2"]).actor_train.strategy.layout.ep
        == 2
    )
    with pytest.raises(ConfigError, match="MTP on a MoE model is not supported yet .*set mtp_num_layers=0"):
        load_config("configs/grpo_tiny_cpu.yaml", base + ["actor_train.strategy.mtp_num_layers=1"])
