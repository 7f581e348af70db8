"""MoE routing replay (issue #33) on the shared layout groups (TP1, TP2, PP2, TP2 x PP2, CP2, PP2 x vpp2, EP2, and EP2
with token-budget and packed micro-batches), a 4-layer Qwen3-MoE:

- R2 records: the old-log-prob forward returns each token's experts per layer, equal to transformers' top-k at every
  real token, and the same at every layout (gathered over sequence-parallel and context-parallel ranks, joined over
  pipeline stages and vpp chunks, put back through packing and token budgets);
- then the routers' weights are perturbed (the same noise everywhere) and the update replays the recorded experts
  (also at PP2 with activation recompute, where each layer routes again in backward, after other micro-batches'
  forwards: routes are keyed by micro-batch and chunk, not call order):
  the routers dispatch exactly them (no mismatched token), while their live choice agrees on fewer than all tokens
  (the agreement without replay), the same fraction at every layout; loss, grad norm, the routers' gradients and
  the log-probs after the step equal TP1's;
- prompt sharing (TP1, TP2 x PP2, EP2 packed): the same recorded routes at every row's prompt (routed once), no
  mismatched token, and the same step;
- with routes that agree, a replayed step's router gradients are non-zero and equal those of a live step;
- bad routes are errors naming the layer and position.
TP2 x EP2 and PP2 x EP2: test_moe_layouts.py runs the same check on its groups.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from megatron_batches import float32_bound, rl_batch_of_lengths
from reconfigurable_workers import ReconfigurableActor
from router_checks import hf_routes, replay_step, same_routes

from roll_backend import keys
from roll_backend.models.tiny import TinyModelSpec, build_tiny_model
from roll_backend.protocol import DataProto
from roll_backend.strategies.megatron.config import MegatronTrainConfig, OptimizerSettings
from roll_backend.workers.actor import ActorConfig, ActorLossConfig

# (layout, batch meta_info, micro_batch_size, recompute_activations, share_prompts): other cuts of the same batch,
# PP2's 1F1B schedule recomputing each layer in backward, after other micro-batches' forwards set their own routes,
# and prompt sharing (a shared prompt's tokens are routed once, their routes recorded for every row of the group).
BATCHING = {
    "tp1_mbs1": ("tp1", {}, 1, False, False),
    "ep2_budget": ("ep2", {keys.META_MAX_TOKENS_PER_MICROBATCH: 16}, 2, False, False),
    "ep2_packed": ("ep2", {keys.META_MAX_TOKENS_PER_MICROBATCH: 14, keys.META_SEQUENCE_PACKING: True}, 2, False, False),
    "pp2_recompute": ("pp2", {}, 1, True, False),
    "tp1_shared": ("tp1", {}, 2, False, True),
    "tp2pp2_shared": ("tp2pp2", {}, 2, False, True),
    "ep2_shared_packed": (
        "ep2",
        {keys.META_MAX_TOKENS_PER_MICROBATCH: 14, keys.META_SEQUENCE_PACKING: True},
        2,
        False,
        True,
    ),
}
PERTURBATION = 0.01  # router weights are ~N(0, 0.02): this flips some of the top-2 choices (agreement 0.7)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    spec = TinyModelSpec(
        family="qwen3_moe",
        hidden_size=64,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_hidden_layers=4,
        seed=11,
        router_aux_loss_coef=0.0,  # a per-micro-batch objective: another split moves it by design
    )
    return str(build_tiny_model(tmp_path_factory.mktemp("replay_moe"), spec))


@pytest.fixture(scope="module")
def tensors() -> dict[str, torch.Tensor]:
    """Rows of different lengths (packing puts them end to end), one nearly empty; rows 1 and 2, 3 and 4 are two
    samples of one prompt each."""
    gen = torch.Generator().manual_seed(7)
    return rl_batch_of_lengths([1, 6, 6, 5, 5], [1, 4, 6, 2, 5], 6, 6, 300, gen, groups=[0, 1, 1, 2, 2])


def config(
    model_dir: str, replay: str | None, micro_batch_size: int = 2, recompute: bool = False, share: bool = False
) -> ActorConfig:
    strategy = MegatronTrainConfig(
        model_path=model_dir,
        micro_batch_size=micro_batch_size,
        optimizer=OptimizerSettings(lr=1e-2),
        router_replay=replay,
        recompute_activations=recompute,
        share_prompts=share,
    )
    return ActorConfig(strategy=strategy, loss=ActorLossConfig(clip_low=0.2))


def load(group, model_dir: str, replay: str | None, micro_batch_size=2, recompute=False, share=False):
    group.call(ReconfigurableActor.init_model_with, config(model_dir, replay, micro_batch_size, recompute, share))
    return group


def test_r2_replays_the_recorded_experts_at_every_layout(layout_actors, model_dir, tensors):
    mask = tensors[keys.RESPONSE_MASK].float()
    expected_routes = hf_routes(model_dir, tensors)
    runs = {}
    for name, group in layout_actors.items():
        runs[name] = replay_step(load(group, model_dir, "R2"), tensors, PERTURBATION)
    for name, (layout, meta, micro, recompute, share) in BATCHING.items():
        group = load(layout_actors[layout], model_dir, "R2", micro, recompute, share)
        runs[name] = replay_step(group, tensors, PERTURBATION, meta)
    reference = runs["tp1"]
    assert same_routes(reference["recorded"], expected_routes, tensors[keys.ATTENTION_MASK])
    agreement = reference["metrics"]["moe/route_agreement"]
    assert 0.5 < agreement < 1.0, agreement  # the perturbed routers would have chosen otherwise for some tokens
    for name, run in runs.items():
        assert same_routes(run["recorded"], reference["recorded"], tensors[keys.ATTENTION_MASK]), name
        metrics = run["metrics"]
        assert metrics["moe/replay_mismatched_tokens"] == 0, name
        # (the perturbed routers' live choice may flip at a near-tie between layouts' roundings: a token or two;
        # shared prompts count their tokens once)
        if not name.endswith(("_shared", "_shared_packed")):
            assert metrics["moe/route_agreement"] == pytest.approx(agreement, abs=0.02), name
        for key in ("loss", "pg_loss", "grad_norm"):
            assert metrics[key] == pytest.approx(reference["metrics"][key], abs=1e-5), (name, key)
        for layer, grad in reference["router_grads"].items():
            assert torch.allclose(run["router_grads"][layer], grad, atol=1e-5), (name, layer)
        bound = float32_bound(reference["after"] * mask)
        assert float(((run["after"] - reference["after"]).abs() * mask).max()) <= max(bound, 1e-5), name


def test_replayed_router_gradients_equal_a_live_steps_when_routes_agree(layout_actors, model_dir, tensors):
    group = layout_actors["tp1"]
    replayed = replay_step(load(group, model_dir, "R2"), tensors, perturbation=0.0)
    live = replay_step(load(group, model_dir, None), tensors, perturbation=0.0)
    assert replayed["metrics"]["moe/route_agreement"] == 1.0
    assert "moe/route_agreement" not in live["metrics"]  # nothing recorded, nothing replayed or compared
    assert replayed["metrics"]["loss"] == pytest.approx(live["metrics"]["loss"], abs=1e-7)
    for layer, grad in live["router_grads"].items():
        assert float(grad.abs().max()) > 0, layer
        assert torch.allclose(replayed["router_grads"][layer], grad, atol=1e-7), layer


def test_replaying_a_bf16_rollouts_routes_brings_the_log_probs_closer_to_it(layout_actors, tmp_path):
    """The mismatch R3 is for: a rollout engine with other numerics (here transformers in bf16) routes some tokens
    to other experts than the float32 trainer at the same weights (16 experts, top-2: near-ties are common). Replaying
    its routes, the trainer's log-probs are closer to the rollout's than routing live."""
    spec = TinyModelSpec(family="qwen3_moe", hidden_size=64, num_attention_heads=4, num_key_value_heads=2, seed=5)
    model = str(build_tiny_model(tmp_path / "moe16", dataclasses.replace(spec, num_experts=16)))
    gen = torch.Generator().manual_seed(1)
    lengths = [torch.randint(low, high, (16,), generator=gen).tolist() for low, high in ((4, 13), (2, 9))]
    tensors = rl_batch_of_lengths(*lengths, 12, 8, 300, gen)
    routes, rollout_log_probs = hf_routes(model, tensors, torch.bfloat16)
    mask = tensors[keys.RESPONSE_MASK].float()
    gaps, agreement = {}, {}
    for replay in (None, "R3"):
        group = load(layout_actors["tp1"], model, replay, micro_batch_size=4)
        batch = DataProto.from_dict(tensors={**tensors, keys.ROUTED_EXPERTS: routes})
        out = group.call(ReconfigurableActor.compute_log_probs, batch)
        gaps[replay] = float(((out.batch[keys.LOG_PROBS] - rollout_log_probs).abs() * mask).sum() / mask.sum())
        (agreement[replay],) = out.meta_info[keys.META_METRICS]["moe/log_probs_route_agreement"]
    print(f"bf16 routes vs float32 live: agreement {agreement[None]:.4f}, gap {gaps[None]:.3g} -> {gaps['R3']:.3g}")
    assert agreement[None] == agreement["R3"] < 1.0  # the trainer's own choice, compared in both calls
    assert gaps["R3"] < gaps[None]


def test_r3_with_shared_prompts_replays_the_rollouts_routes(layout_actors, model_dir, tensors):
    """R3 with prompt sharing: a bf16 rollout's routes (a shared prompt's tokens routed as its group's first row, as an
    engine computes a cached prompt once) replayed with the prompts forwarded once give the unshared replay's
    log-probs, at TP1 and EP2 packed, with no mismatched token."""
    routes, _ = hf_routes(model_dir, tensors, torch.bfloat16)
    prompt = tensors[keys.INPUT_IDS].shape[1] - tensors[keys.RESPONSES].shape[1]
    routes[2, :prompt], routes[4, :prompt] = routes[1, :prompt], routes[3, :prompt]
    batch = {**tensors, keys.ROUTED_EXPERTS: routes}
    packed = {keys.META_MAX_TOKENS_PER_MICROBATCH: 14, keys.META_SEQUENCE_PACKING: True}
    runs = {}
    for name, layout, share, meta in (
        ("unshared", "tp1", False, {}),
        ("shared", "tp1", True, {}),
        ("ep2_shared_packed", "ep2", True, packed),
    ):
        group = load(layout_actors[layout], model_dir, "R3", share=share)
        out = group.call(ReconfigurableActor.compute_log_probs, DataProto.from_dict(tensors=batch, meta_info=meta))
        runs[name] = out.batch[keys.LOG_PROBS]
        assert sum(out.meta_info[keys.META_METRICS]["moe/log_probs_replay_mismatched_tokens"]) == 0, name
    mask = tensors[keys.RESPONSE_MASK].float()
    for name in ("shared", "ep2_shared_packed"):
        gap = float(((runs[name] - runs["unshared"]).abs() * mask).max())
        assert gap <= float32_bound(runs["unshared"] * mask), (name, gap)


def test_bad_routes_are_errors_naming_the_layer_and_position(layout_actors, model_dir, tensors):
    group = load(layout_actors["tp1"], model_dir, "R3")
    routes = hf_routes(model_dir, tensors)
    batch = dict(tensors)
    with pytest.raises(Exception, match="router_replay=R3 replays the rollout's routes"):
        group.call(ReconfigurableActor.compute_log_probs, DataProto.from_dict(tensors=batch))
    batch[keys.ROUTED_EXPERTS] = routes[:, :, :3]
    with pytest.raises(Exception, match=r"routes have shape \[5, 12, 3, 2\]; .* \[5, 12, 4, 2\]"):
        group.call(ReconfigurableActor.compute_log_probs, DataProto.from_dict(tensors=batch))
    out_of_range = routes.clone()
    out_of_range[1, 7, 2, 1] = 4  # 4 experts: ids 0..3
    batch[keys.ROUTED_EXPERTS] = out_of_range
    with pytest.raises(Exception, match=r"routes at layer 3, row 1, position 7: \[\d, 4\] \(not 2 distinct experts"):
        group.call(ReconfigurableActor.compute_log_probs, DataProto.from_dict(tensors=batch))
    missing = routes.clone()
    missing[2, 9, 0] = -1
    batch[keys.ROUTED_EXPERTS] = missing
    with pytest.raises(Exception, match=r"routes at layer 1, row 2, position 9: \[-1, -1\] \(missing\)"):
        group.call(ReconfigurableActor.compute_log_probs, DataProto.from_dict(tensors=batch))
    batch[keys.ROUTED_EXPERTS] = routes  # the rollout's routes replayed (R3): transformers' own choice, agreement 1
    out = group.call(ReconfigurableActor.compute_log_probs, DataProto.from_dict(tensors=batch))
    assert out.meta_info[keys.META_METRICS]["moe/log_probs_route_agreement"] == [1.0]
