"""The memory plan's arithmetic without ranks (roll_backend/config/run_memory.py, the strategies' memory planners): the
parameters it counts are the Hugging Face model's, for every family the backend builds; the sharding rules move the
counts as the layouts do; roles sharing devices add up as they hand the device over (hybrid) or not (colocated); and
a rollout engine whose KV cache cannot hold one sequence is refused with the fraction that would. Measured against
real ranks in tests/strategies/megatron/test_memory_plan.py."""

from __future__ import annotations

import re

import pytest
import torch
import transformers

from roll_backend.config.loader import load_config
from roll_backend.config.run_memory import device_phases, memory_problems, role_plans
from roll_backend.config.typed import ConfigError
from roll_backend.distributed.layout import ParallelLayout
from roll_backend.strategies.megatron.config import LoRASettings
from roll_backend.strategies.megatron.memory_accounting import arch_of, model_state, stage_params

HF_CONFIGS = {
    "qwen2 GQA, qkv bias, untied": ("Qwen2Config", dict(num_key_value_heads=2, tie_word_embeddings=False)),
    "qwen3 q/k norms, tied": ("Qwen3Config", dict(num_key_value_heads=4, head_dim=24, tie_word_embeddings=True)),
    "llama": ("LlamaConfig", dict(num_key_value_heads=8, tie_word_embeddings=False)),
    "qwen2_moe shared expert": (
        "Qwen2MoeConfig",
        dict(num_experts=6, num_experts_per_tok=2, moe_intermediate_size=40, shared_expert_intermediate_size=56),
    ),
    "qwen3_moe": ("Qwen3MoeConfig", dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=48)),
}


def _hf_config(name: str):
    cls, extra = HF_CONFIGS[name]
    common = dict(vocab_size=1003, hidden_size=96, intermediate_size=160, num_hidden_layers=3, num_attention_heads=8)
    return getattr(transformers, cls)(**{**common, **extra})


@pytest.mark.parametrize("name", HF_CONFIGS)
def test_the_parameters_counted_are_the_hugging_face_models(name):
    hf = _hf_config(name)
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(hf)
    arch = arch_of(hf.to_dict())
    counted = stage_params(arch, ParallelLayout(), arch.num_layers, 0, False, 0, None)
    assert counted.total == sum(p.numel() for p in model.parameters())


def test_layouts_shard_the_state_as_megatron_does():
    arch = arch_of(_hf_config("qwen3_moe").to_dict())
    whole = stage_params(arch, ParallelLayout(), 3, 0, False, 0, None)
    experts = whole.expert_total
    at_ep2 = stage_params(arch, ParallelLayout(ep=2), 3, 0, False, 0, None)
    assert at_ep2.expert_total * 2 == experts and at_ep2.total - at_ep2.expert_total == whole.total - experts
    # the pipeline stages hold every layer once, and a tied embedding twice (the last stage's output copy)
    for name, copies in (("qwen3_moe", 0), ("qwen3 q/k norms, tied", 1)):
        model = arch_of(_hf_config(name).to_dict())
        one = stage_params(model, ParallelLayout(), 3, 0, False, 0, None).total
        stages = [stage_params(model, ParallelLayout(pp=2), n, s, False, 0, None) for s, n in ((0, 2), (1, 1))]
        assert sum(s.total for s in stages) == one + copies * model.vocab_size * model.hidden_size
    # LoRA: a frozen base, the adapters train; Adam keeps 2 float32 moments (+ a float32 copy of bf16 weights) of what
    # trains, 1/DP of it with the distributed optimizer, the experts' over expert data parallelism
    lora = stage_params(arch, ParallelLayout(), 3, 0, False, 0, LoRASettings(rank=4))
    assert 0 < lora.trainable < lora.total - whole.total + 1
    bf16 = model_state(whole, "bfloat16", True, False, ParallelLayout(), 4)
    assert bf16 == {"params": 2 * whole.total, "grads": 4 * whole.total, "optimizer": 12 * whole.total}
    sharded = model_state(whole, "bfloat16", True, True, ParallelLayout(ep=2), 4)
    dense = whole.total - whole.expert_total
    assert sharded["optimizer"] == 12 * dense // 4 + 12 * whole.expert_total // 2


@pytest.fixture(scope="module")
def hybrid():
    return load_config(
        "configs/gpu/qwen2.5-7b_grpo_hybrid_8gpu.yaml",
        ["model_path=configs/gpu/models/Qwen2.5-7B-Instruct", "device_memory_gib=80"],
        True,
    )


def test_hybrid_roles_hand_the_device_over_and_colocated_ones_keep_everything(hybrid):
    plans = role_plans(hybrid)
    phases = {(p.role, p.phase): p for p in device_phases(hybrid, plans)}
    assert {p.devices for p in phases.values()} == {"actor_train"}
    # the engine generates while the trainer and the reference wait in host memory (every part offloaded)
    generate = phases[("actor_infer", "generate")]
    assert [role for role, _, _ in generate.terms] == ["actor_infer"]
    assert generate.total == int(0.75 * 80 * 2**30)
    # the trainer trains beside nothing: the engine sleeps (level 1) and the reference offloads its weights
    train = phases[("actor_train", "train")]
    assert {role for role, _, _ in train.terms} == {"actor_train"}
    assert train.total == plans["actor_train"][0].phase_peak("train")
    # without offloading, the reference's weights stay beside the trainer
    kept = load_config(
        "configs/gpu/qwen2.5-7b_grpo_hybrid_8gpu.yaml",
        ["model_path=configs/gpu/models/Qwen2.5-7B-Instruct", "reference.strategy.offload_params=false"],
        True,
    )
    train_kept = next(p for p in device_phases(kept, role_plans(kept)) if (p.role, p.phase) == ("actor_train", "train"))
    assert train_kept.total - train.total == plans["reference"][0].state["params"]


def test_an_engine_whose_kv_cache_holds_no_sequence_is_refused_with_the_fraction_that_would(hybrid):
    with pytest.raises(ConfigError) as info:
        load_config(
            "configs/gpu/qwen2.5-7b_grpo_hybrid_8gpu.yaml",
            [
                "model_path=configs/gpu/models/Qwen2.5-7B-Instruct",
                "device_memory_gib=80",
                "actor_infer.strategy.gpu_memory_utilization=0.09",
            ],
            True,
        )
    message = str(info.value)
    assert "actor_infer.strategy: the KV cache left in gpu_memory_utilization=0.09 of 80 GiB" in message
    assert "raise gpu_memory_utilization to at least 0.1" in message
    assert memory_problems(hybrid) == []  # (no device memory declared: reported, not checked)


def test_a_refusal_gives_small_terms_in_units_that_show_them():
    """A tiny model over a tiny device: the refusal's sizes read in MiB or KiB, not "0.0 GiB"."""
    with pytest.raises(ConfigError) as info:
        load_config("configs/grpo_tiny_cpu.yaml", ["device_memory_gib=0.001"], True)
    refusals = [p for p in info.value.problems if p.startswith("memory: actor_infer generate needs")]
    assert refusals and "0.0 GiB" not in str(info.value), str(info.value)
    assert re.search(r"needs \d+\.\d+ MiB .* actor_infer kv_cache \d+\.\d+ MiB", refusals[0]), refusals[0]


def test_the_weight_sync_phase_holds_a_bucket_of_whole_tensors_and_the_hybrid_engine_s_weights(hybrid):
    plans = role_plans(hybrid)
    trainer, engine = plans["actor_train"][0], plans["actor_infer"][0]
    arch = arch_of(hybrid_model_fields(hybrid))
    embedding = arch.vocab_size * arch.hidden_size * 2  # bf16: the largest tensor, a bucket of its own
    assert hybrid.weight_sync_bucket_bytes < embedding and arch.vocab_size % 2 == 0  # (TP2 pads no row)
    # Gathering the output layer at TP2: its two shards and the full tensor, after at most a bucket of others.
    gather = trainer.phases["weight_sync"]["weight-sync bucket"]
    assert 2 * embedding < gather <= 2 * embedding + hybrid.weight_sync_bucket_bytes
    assert list(trainer.phases["weight_sync"]) == ["weight-sync bucket"]  # in-process: no comparison
    # The hybrid sync: the trainer's parameters (its grads and Adam state on the host) beside the engine's weights.
    sync = next(p for p in device_phases(hybrid, plans) if (p.role, p.phase) == ("actor_train", "weight_sync"))
    assert sorted(sync.terms) == sorted(
        [
            ("actor_train", "params", trainer.state["params"]),
            ("actor_train", "weight-sync bucket", gather),
            ("actor_infer", "weights, awake for the sync", engine.state["weights"]),
        ]
    )
    # A separate engine on GPUs: the minimal sync compares the largest tensor on the device (with a one-byte mask);
    # a bucket bigger than the model holds every tensor made (all but the norms, which are the parameters themselves)
    # when the last one, the output layer, is gathered beside them; an offline run sends nothing.
    split = load_config(
        "configs/gpu/qwen2.5-7b_grpo_8gpu.yaml",
        ["model_path=configs/gpu/models/Qwen2.5-7B-Instruct", f"weight_sync_bucket_bytes={1 << 40}"],
        True,
    )
    assert split.actor_train.strategy.layout.tp == 2 and not arch.tie_word_embeddings
    terms = role_plans(split)["actor_train"][0].phases["weight_sync"]
    whole = stage_params(arch, ParallelLayout(), arch.num_layers, 0, False, 0, None).total * 2
    norms = (2 * arch.num_layers + 1) * arch.hidden_size * 2
    assert terms == {"weight-sync bucket": whole - norms + embedding, "weight-sync comparison": embedding // 2 * 3}
    no_delta = load_config(
        "configs/gpu/qwen2.5-7b_grpo_8gpu.yaml",
        ["model_path=configs/gpu/models/Qwen2.5-7B-Instruct", "weight_sync_delta=false"],
        True,
    )
    assert role_plans(no_delta)["actor_train"][0].phases["weight_sync"] == {"weight-sync bucket": gather}
    # The host copies the sync keeps (host memory, outside the device plan: notes with their size): trainer rank 0
    # and every rollout rank for the minimal sync, every hybrid rank for the hybrid's, none without weight_sync_delta.
    copy = f"keeps a copy of the model's weights for the weight sync, {whole / 2**30:.2f} GiB"
    split_plans = role_plans(split)
    assert f"host memory: rank 0 {copy} (weight_sync_delta: false keeps none)" in split_plans["actor_train"][0].notes
    assert any(n.startswith("host memory: every rank keeps") for n in split_plans["actor_infer"][0].notes)
    assert f"host memory: every rank {copy} (weight_sync_delta: false keeps none)" in trainer.notes
    assert not [n for n in engine.notes if n.startswith("host memory")]  # (the hybrid's copy: counted once, above)
    assert not [n for plan in role_plans(no_delta).values() for n in plan[0].notes if n.startswith("host memory")]


def hybrid_model_fields(config) -> dict:
    from roll_backend.config.run_facts import model_fields

    return model_fields(config, config.model_path)


def test_experts_under_ep_are_planned_at_the_declared_load_and_a_load_below_balance_is_refused():
    """A rank's experts compute what every EP rank's tokens route to them: the plan takes balanced routing unless
    memory_plan_expert_load says more (a skewed router), says so in a note, and refuses a load below balance; the
    dense parts and the model state do not move (measured against ranks at the load they saw in test_memory_plan)."""
    recipe, model = "configs/gpu/qwen3-30b-a3b_grpo_ep_16gpu.yaml", "model_path=configs/gpu/models/Qwen3-30B-A3B"
    balanced = role_plans(load_config(recipe, [model], True))["actor_train"]
    skewed_config = load_config(recipe, [model, "memory_plan_expert_load=2", "device_memory_gib=null"], True)
    skewed = role_plans(skewed_config)["actor_train"]
    for even, busy in zip(balanced, skewed, strict=True):
        assert busy.state == even.state
        assert busy.phase_peak("train") >= even.phase_peak("train")  # (the last stage's head may hide the layers)
    first = {plan.ranks: plan for plan in balanced}["pp stage 0 of 2"], {p.ranks: p for p in skewed}["pp stage 0 of 2"]
    # (recomputed layers keep their inputs only: the experts' tokens weigh in a layer's backward)
    assert first[1].phases["train"]["a layer's backward"] > first[0].phases["train"]["a layer's backward"]
    assert first[1].phase_peak("forward") > first[0].phase_peak("forward")
    assert any(n.startswith("experts planned at 1x") for n in balanced[0].notes)
    assert any(n.startswith("experts planned at 2x") for n in skewed[0].notes)
    with pytest.raises(ConfigError, match=r"memory_plan_expert_load=0.5 must be >= 1"):
        load_config(recipe, [model, "memory_plan_expert_load=0.5", "device_memory_gib=80"], True)


@pytest.mark.parametrize("engine_tp", [1, 2])
def test_a_cpu_engine_s_kv_cache_holds_its_concurrency_of_full_sequences_unless_set(engine_tp):
    """Unset, a CPU engine's cache is vLLM's default concurrency (256 sequences per TP rank, or max_num_seqs) of
    max_model_len tokens in whole blocks, and the block vLLM keeps back: the demo's tiny model needs 16 MiB where
    every engine used to zero 1 GiB at its start. Set, it is the GiB given
    (fractions allowed); a large model's default stops at 1 GiB; 0 is refused. The engine allocates what the plan says
    (tests/strategies/vllm/test_rollout.py)."""
    tp = [f"actor_infer.world_size={engine_tp}", f"actor_infer.strategy.tp={engine_tp}"]
    config = load_config("configs/grpo_tiny_cpu.yaml", tp, True)
    spec, engine = config.build_tiny_model, config.actor_infer.strategy.config
    # K and V of one token in every layer, on one TP rank, in float32
    per_token = 2 * spec["num_hidden_layers"] * (spec["num_key_value_heads"] // engine_tp)
    per_token *= spec["hidden_size"] // spec["num_attention_heads"] * 4
    planned = role_plans(config)["actor_infer"][0].phases["generate"]["kv_cache"]
    blocks = -(-engine.max_model_len // 32)  # a sequence's blocks of 32 tokens (vLLM's CPU attention), and one more
    assert planned == (256 * engine_tp * blocks + 1) * 32 * per_token  # that vLLM keeps back (its null block)
    few = load_config("configs/grpo_tiny_cpu.yaml", [*tp, "actor_infer.strategy.max_num_seqs=3"], True)
    assert role_plans(few)["actor_infer"][0].phases["generate"]["kv_cache"] == (3 * blocks + 1) * 32 * per_token
    set_config = load_config(
        "configs/grpo_tiny_cpu.yaml", [*tp, "actor_infer.strategy.cpu_kvcache_space_gib=0.25"], True
    )
    assert role_plans(set_config)["actor_infer"][0].phases["generate"]["kv_cache"] == 1 << 28
    large = ["build_tiny_model.hidden_size=2048", "build_tiny_model.num_hidden_layers=24"]
    large = [*large, "actor_infer.strategy.max_model_len=4096"]
    large_config = load_config("configs/grpo_tiny_cpu.yaml", [*tp, *large], True)
    assert role_plans(large_config)["actor_infer"][0].phases["generate"]["kv_cache"] == 1 << 30
    with pytest.raises(ConfigError, match=r"cpu_kvcache_space_gib=0.0: set a size above 0 or null"):
        load_config("configs/grpo_tiny_cpu.yaml", [*tp, "actor_infer.strategy.cpu_kvcache_space_gib=0"], True)


@pytest.mark.parametrize(
    "device, memory_gib, tp, expected",
    [  # vLLM's offline defaults (vllm/engine/arg_utils.py, get_batch_defaults, LLM_CLASS): (tokens, sequences)
        ("cpu", None, 1, (4096, 256)),
        ("cpu", None, 2, (8192, 512)),  # per TP rank of the engine
        ("cuda", 40, 1, (8192, 256)),  # below 70 GiB
        ("cuda", 69.9, 2, (8192, 256)),
        ("cuda", 80, 1, (16384, 1024)),  # H100 / H200 class
        ("cuda", 192, 4, (16384, 1024)),  # B200 class
        ("cuda", None, 1, (16384, 1024)),  # undeclared: planned as a large GPU (the plan errs high)
    ],
)
def test_an_engine_s_default_batch_is_vllm_s_for_its_device(device, memory_gib, tp, expected):
    """What the engine's activations are planned for (engine_memory.engine_batch): vLLM's defaults for the device,
    a token budget of at least one max_model_len prompt without chunked prefill and at most max_num_seqs of them, and
    whatever is set taken as set."""
    from types import SimpleNamespace

    from roll_backend.strategies.vllm.engine_memory import engine_batch

    memory = int(memory_gib * 2**30) if memory_gib else None
    run = SimpleNamespace(device=device, device_memory=memory, layout=ParallelLayout(tp=tp))
    engine = dict(max_num_seqs=None, max_num_batched_tokens=None, enable_chunked_prefill=None, max_model_len=20000)
    assert engine_batch(SimpleNamespace(**engine), run) == expected
    tokens, seqs = expected
    unchunked = SimpleNamespace(**{**engine, "enable_chunked_prefill": False, "max_model_len": 2 * tokens})
    assert engine_batch(unchunked, run) == (2 * tokens, seqs)  # one whole prompt a step
    short = SimpleNamespace(**{**engine, "max_num_seqs": 3, "max_model_len": 100})
    assert engine_batch(short, run) == (300, 3)  # never more than max_num_seqs full sequences
    given = SimpleNamespace(**{**engine, "max_num_seqs": 7, "max_num_batched_tokens": 999})
    assert engine_batch(given, run) == (999, 7)
