"""Model FLOPs from a config: a hand count for a tiny model, torch's own FLOP counter on the HF model, MoE/MTP terms,
generation's shared prefill, and the GEMM probe's units."""

from __future__ import annotations

import types

import pytest
import torch

from roll_backend.perf.flops import ModelFlops
from roll_backend.perf.peak import gemm_shapes, measure_gemm_tflops


def tiny_config(**extra):
    fields = (
        dict(
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            vocab_size=100,
        )
        | extra
    )
    return types.SimpleNamespace(**fields)


def test_forward_flops_of_a_tiny_model_match_a_hand_count():
    model = ModelFlops.from_hf_config(tiny_config())
    # one layer, one token: q 64x64, k 64x32, v 64x32, o 64x64 -> 12288 multiply-adds; MLP 3 x 64x128 = 24576
    per_layer_token = 2 * (64 * 64 + 64 * 32 + 64 * 32 + 64 * 64 + 3 * 64 * 128)
    assert model.layer_linear_flops_per_token == per_layer_token == 73728
    # 3 tokens: attention scores + values at positions 1, 2, 3 over 4 heads of 16 dims: 2 * 2 * 64 * (1+2+3)
    attention = 2 * 2 * 4 * 16 * (1 + 2 + 3)
    output = 2 * 64 * 100 * 3
    assert model.forward_flops([3]) == 2 * (3 * per_layer_token + attention) + output
    assert model.forward_flops([3, 5]) == model.forward_flops([3]) + model.forward_flops([5])
    assert model.train_flops([3, 5]) == 3 * model.forward_flops([3, 5])


def test_linear_flops_equal_torch_flop_counter_on_the_transformers_model():
    """torch counts every matmul the HF model runs; its attention is the full square (causal masking happens
    after the product), so it exceeds our causal count by exactly the masked upper triangle."""
    from torch.utils.flop_counter import FlopCounterMode
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(**vars(tiny_config()), attn_implementation="eager")
    hf = Qwen2ForCausalLM(config).eval()
    tokens = 7
    with torch.no_grad(), FlopCounterMode(display=False) as counter:
        hf(torch.arange(tokens)[None])
    model = ModelFlops.from_hf_config(config)
    heads, head_dim, layers = 4, 16, 2
    full_square = 4 * heads * head_dim * tokens * tokens * layers
    causal = 4 * heads * head_dim * (tokens * (tokens + 1) / 2) * layers
    assert counter.get_total_flops() == model.forward_flops([tokens]) - causal + full_square


def test_moe_layers_count_routed_top_k_experts_shared_expert_and_router():
    config = tiny_config(
        num_experts=8,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        shared_expert_intermediate_size=48,
        decoder_sparse_step=1,
        mlp_only_layers=[1],
    )
    model = ModelFlops.from_hf_config(config)
    sparse = 2 * 64 * 8 + 2 * (3 * 2 * 64 * 32) + 3 * 2 * 64 * 48 + 2 * 64
    dense = 3 * 2 * 64 * 128  # layer 1 is in mlp_only_layers
    assert model.mlp_flops_per_token == (sparse + dense) / 2


def test_mtp_layers_join_training_flops_only():
    plain, mtp = ModelFlops.from_hf_config(tiny_config()), ModelFlops.from_hf_config(tiny_config(), mtp_layers=1)
    assert mtp.forward_flops([5]) == plain.forward_flops([5])
    # one more decoder layer, the 2h -> h projection and another pass through the output layer, for 5 tokens
    extra = 5 * plain.layer_linear_flops_per_token + plain.attention_flops(1, 5) + 5 * (2 * 128 * 64 + 2 * 64 * 100)
    assert mtp.train_flops([5]) == pytest.approx(plain.train_flops([5]) + 3 * extra)


def test_generation_prefills_a_shared_prompt_once_and_decodes_each_response():
    model = ModelFlops.from_hf_config(tiny_config())
    prefill = model.span_flops(0, 4, output_tokens=1)
    decode = model.span_flops(4, 2)  # responses of 3 tokens: the first came out of the prefill
    assert model.generation_flops([4, 4], [3, 3], ["a", "a"]) == prefill + 2 * decode
    assert model.generation_flops([4, 4], [3, 3], ["a", "b"]) == 2 * (prefill + decode)
    # one sample is a forward over its first 6 of 7 tokens (the last sampled token is never fed back) with the
    # output layer on 3 positions only: the prompt's last and the two decode steps
    assert model.generation_flops([4], [3]) == model.forward_flops([6]) - 3 * model.output_flops_per_token


def test_gemm_probe_reports_tflops_of_the_requested_shapes():
    shapes = gemm_shapes(64, 128, tokens=256)
    assert shapes == [(256, 64, 128), (256, 128, 64)]
    tflops = measure_gemm_tflops("float32", "cpu", shapes, seconds=0.02)
    assert 1e-4 < tflops < 100  # a CPU core does between 0.1 GFLOP/s and 100 TFLOP/s in float32
