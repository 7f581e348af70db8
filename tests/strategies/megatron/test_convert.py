"""HF <-> Megatron tensor conversion: sharding by TP and gathering back is lossless, and the layouts are Megatron's."""

from __future__ import annotations

import pytest
import torch

from roll_backend.strategies.megatron.builder import HFArch
from roll_backend.strategies.megatron.convert import hf_from_shards, param_mapping, shard_from_hf

ARCH = HFArch(
    model_type="qwen2",
    vocab_size=321,
    hidden_size=16,
    ffn_hidden_size=24,
    num_layers=4,
    num_heads=4,
    num_kv_heads=2,
    head_dim=4,
    rope_theta=1e4,
    norm_eps=1e-6,
    qkv_bias=True,
    tie_word_embeddings=False,
    max_position_embeddings=64,
)


def _hf_tensors(kind: str) -> list[torch.Tensor]:
    h, d, f = ARCH.hidden_size, ARCH.head_dim, ARCH.ffn_hidden_size
    shapes = {
        "qkv": [(ARCH.num_heads * d, h), (ARCH.num_kv_heads * d, h), (ARCH.num_kv_heads * d, h)],
        "row": [(h, f)],
        "gate_up": [(f, h), (f, h)],
        "vocab": [(ARCH.vocab_size, h)],
        "replicated": [(h,)],
        "mtp_input_proj": [(h, 2 * h)],
    }[kind]
    return [torch.randn(shape) for shape in shapes]


@pytest.mark.parametrize("tp", [1, 2])
@pytest.mark.parametrize("kind", ["qkv", "row", "gate_up", "vocab", "replicated", "mtp_input_proj"])
def test_shard_then_gather_round_trips(kind, tp):
    hf = _hf_tensors(kind)
    shards = [shard_from_hf(kind, hf, ARCH, rank, tp) for rank in range(tp)]
    back = hf_from_shards(kind, shards, ARCH)
    assert all(torch.equal(a, b) for a, b in zip(back, hf))


def test_qkv_is_grouped_per_kv_head_and_split_by_group():
    q, k, v = _hf_tensors("qkv")
    d = ARCH.head_dim
    shard1 = shard_from_hf("qkv", [q, k, v], ARCH, tp_rank=1, tp_size=2)  # kv group 1: q heads 2,3 then k1, v1
    assert torch.equal(shard1, torch.cat([q[2 * d : 4 * d], k[d : 2 * d], v[d : 2 * d]]))


def test_gate_and_up_split_separately_under_tp():
    gate, up = _hf_tensors("gate_up")
    shard0 = shard_from_hf("gate_up", [gate, up], ARCH, tp_rank=0, tp_size=2)
    assert torch.equal(shard0, torch.cat([gate[:12], up[:12]]))
    swapped = shard_from_hf("gate_up", [gate, up], ARCH, tp_rank=0, tp_size=2, swap_gate_up=True)
    assert not torch.equal(swapped, shard0)


def test_vocab_is_padded_to_tp_and_trimmed_back():
    (emb,) = _hf_tensors("vocab")
    shards = [shard_from_hf("vocab", [emb], ARCH, rank, 2) for rank in range(2)]
    assert shards[0].shape == (161, ARCH.hidden_size) and torch.all(shards[1][-1] == 0)


def test_names_follow_pipeline_offsets():
    mapping = param_mapping("decoder.layers.1.mlp.linear_fc1.weight", ARCH, layer_offset=2)
    assert mapping.hf_names == ("model.layers.3.mlp.gate_proj.weight", "model.layers.3.mlp.up_proj.weight")


def test_mtp_names_follow_mimo_and_ignore_pipeline_offsets():
    proj = param_mapping("mtp.layers.1.eh_proj.weight", ARCH, layer_offset=2)
    assert (proj.kind, proj.hf_names) == ("mtp_input_proj", ("model.mtp_layers.1.input_proj.weight",))
    qkv = param_mapping("mtp.layers.0.transformer_layer.self_attention.linear_qkv.weight", ARCH, layer_offset=2)
    assert qkv.kind == "qkv" and qkv.hf_names[0] == "model.mtp_layers.0.self_attn.q_proj.weight"
    assert param_mapping("mtp.layers.0.enorm.weight", ARCH, 0).hf_names == (
        "model.mtp_layers.0.token_layernorm.weight",
    )
    assert param_mapping("mtp.layers.0.hnorm.weight", ARCH, 0).hf_names == (
        "model.mtp_layers.0.hidden_layernorm.weight",
    )


def test_mtp_input_proj_swaps_the_embedding_and_hidden_halves():
    """Megatron's eh_proj reads cat(embedding, hidden); MiMo's input_proj reads cat(hidden, embedding)."""
    (hf,) = _hf_tensors("mtp_input_proj")
    h = ARCH.hidden_size
    megatron_rank0 = shard_from_hf("mtp_input_proj", [hf], ARCH, tp_rank=0, tp_size=2)
    assert torch.equal(megatron_rank0[:, :h], hf[: h // 2, h:]) and torch.equal(megatron_rank0[:, h:], hf[: h // 2, :h])


def test_fresh_mtp_tensor_depends_on_seed_and_name_only():
    from roll_backend.strategies.megatron.mtp import initial_hf_tensor

    draw = lambda name, seed: initial_hf_tensor(name, (8, 4), seed, init_std=0.02, num_layers=2)  # noqa: E731
    name = "model.mtp_layers.0.mlp.gate_proj.weight"
    assert torch.equal(draw(name, 1), draw(name, 1))
    assert not torch.equal(draw(name, 1), draw(name, 2))
    assert not torch.equal(draw(name, 1), draw("model.mtp_layers.0.mlp.up_proj.weight", 1))
    assert torch.equal(draw("model.mtp_layers.0.final_layernorm.weight", 1), torch.ones(8, 4))
    assert float(draw("model.mtp_layers.0.mlp.down_proj.weight", 1).std()) < 0.02 / 1.5  # scaled by 1/sqrt(2 L)
    tied = HFArch(**{**ARCH.__dict__, "tie_word_embeddings": True})
    assert param_mapping("output_layer.weight", tied, 0).hf_names == ("model.embed_tokens.weight",)
