"""The rollout engine's memory beside its plan (issue #51): what each rank's vLLM worker holds, counted tensor by
tensor (VllmWeightSyncExtension.engine_memory: every parameter and buffer storage once, a CPU linear layer's packed
weight at the size of its matrix, the KV cache's storages), equals strategies/vllm/engine_memory.py's plan for
shapes drawn from ROLL_BACKEND_PROPERTY_SEED: every model family (q/k/v biases, q/k norms, routed experts with a
router, a gated shared expert), vocabularies vLLM pads (to a multiple of 64, then split by TP), tied or untied
output layers, key-value heads fewer than TP (replicated), float32 or bf16, TP1 or TP2, any max_position_embeddings
(the rotary cache's length). The KV cache is what the plan asked vLLM for, up to the rounding to whole blocks. The
activations of the engine's largest step (vLLM's profile run at its default max_num_batched_tokens, or a drawn one,
with and without chunked prefill, the sampler over vLLM's default max_num_seqs or a drawn one), counted tensor by
tensor, are the plan's within 15% on every rank (engine_memory.generate_activation_bytes)."""

from __future__ import annotations

import json
import os
import random
from pathlib import Path

import pytest

from roll_backend.distributed.layout import ParallelLayout
from roll_backend.distributed.worker_group import WorkerGroup
from roll_backend.models.tiny import TinyModelSpec, build_tiny_model
from roll_backend.strategies.base import RunFacts
from roll_backend.strategies.vllm import engine_memory
from roll_backend.strategies.vllm.config import VllmRolloutConfig
from roll_backend.workers.rollout import RolloutWorker, RolloutWorkerConfig

SEED = int(os.environ.get("ROLL_BACKEND_PROPERTY_SEED", "2811"))
FAMILIES = ("qwen2", "qwen3", "qwen2_moe", "qwen3_moe")
MAX_MODEL_LEN = 96
BLOCK_SIZE = 32


def drawn_shapes() -> list[dict]:
    """One shape per family (in a drawn order of TP and dtype), the rest drawn."""
    draw = random.Random(SEED)
    shapes, first_tp = [], draw.randint(0, 1)
    for index, family in enumerate(FAMILIES):
        heads = draw.choice((2, 4))
        shapes.append(
            {
                "spec": dict(
                    family=family,
                    hidden_size=32 * heads,  # vLLM's CPU attention takes head sizes of 32 and up
                    intermediate_size=draw.choice((64, 96, 128)),
                    num_hidden_layers=draw.randint(1, 3),
                    num_attention_heads=heads,
                    num_key_value_heads=draw.choice([kv for kv in (1, 2, 4) if heads % kv == 0]),
                    max_position_embeddings=draw.choice((128, 300, 1024)),
                    tie_word_embeddings=draw.random() < 0.5,
                    model_vocab_size=draw.choice((None, 333, 1001)),  # None: the tokenizer's (not a multiple of 64)
                    moe_intermediate_size=draw.choice((32, 48)),
                    seed=index,
                ),
                "tp": (1, 2)[(index + first_tp) % 2],  # two of each
                "dtype": draw.choice(("float32", "bfloat16")),
                # None: vLLM's default (4096 per TP rank on a CPU); a few hundred: the sampler's step is the peak
                "max_num_batched_tokens": draw.choice((None, draw.randint(MAX_MODEL_LEN, 600))),
                "enable_chunked_prefill": draw.choice((None, False)),
                "max_num_seqs": draw.choice((None, draw.randint(1, MAX_MODEL_LEN))),  # (the sampler's step)
            }
        )
    replicated = next(shape for shape in shapes if shape["tp"] == 2)
    replicated["spec"]["num_key_value_heads"] = 1  # fewer key-value heads than TP ranks: vLLM replicates them
    return shapes


SHAPES = drawn_shapes()


@pytest.mark.parametrize(
    "shape", SHAPES, ids=lambda shape: f"{shape['spec']['family']}-tp{shape['tp']}-{shape['dtype']}"
)
def test_each_engine_rank_holds_the_planned_weights_kv_cache_and_activations(ray_session, tmp_path, shape):
    model = build_tiny_model(tmp_path / "model", TinyModelSpec(**shape["spec"]))
    fields = json.loads((Path(model) / "config.json").read_text())
    tp = shape["tp"]
    strategy = VllmRolloutConfig(
        model_path=str(model),
        dtype=shape["dtype"],
        max_model_len=MAX_MODEL_LEN,
        block_size=BLOCK_SIZE,
        max_num_batched_tokens=shape["max_num_batched_tokens"],
        enable_chunked_prefill=shape["enable_chunked_prefill"],
        max_num_seqs=shape["max_num_seqs"],
    )
    group = WorkerGroup(
        RolloutWorker, "rollout", tp, ParallelLayout(tp=tp), worker_config=RolloutWorkerConfig(strategy=strategy)
    )
    try:
        group.call(RolloutWorker.init_model)
        reports = group.call(RolloutWorker.measured_memory)
    finally:
        group.shutdown()
    facts = RunFacts(role="actor_infer", layout=ParallelLayout(tp=tp), world_size=tp, model_config=fields)
    planned = engine_memory.planned_at(strategy, facts, reports[0])
    width = 4 if shape["dtype"] == "float32" else 2
    block = engine_memory.kv_bytes_per_token(fields, tp, width) * BLOCK_SIZE
    # vLLM's CPU kernel for small bf16 GEMMs on AMX machines keeps a linear layer's bias in float32
    # (vllm/model_executor/layers/utils.py, dispatch_cpu_unquantized_gemm); other kernels keep it in the model's dtype.
    biases = shape["spec"]["family"].startswith("qwen2") * fields["num_hidden_layers"] * _qkv_width(fields, tp)
    held = {planned["model_state"], planned["model_state"] + biases * (4 - width)}
    for report in reports:
        assert report["model_state"]["weights"] in held, (shape, report, planned)
        kv_cache = report["phases"]["kv_cache"]
        assert planned["kv_cache"] - block < kv_cache <= planned["kv_cache"], (shape, report, planned)
        activations = report["phases"]["activations"]
        assert abs(planned["activations"] / activations - 1) < 0.15, (shape, report, planned)


def _qkv_width(fields: dict, tp: int) -> int:
    """Query, key and value features on one TP rank (key-value heads replicated where TP exceeds them)."""
    head_dim = fields.get("head_dim") or fields["hidden_size"] // fields["num_attention_heads"]
    return (fields["num_attention_heads"] // tp + 2 * max(1, fields["num_key_value_heads"] // tp)) * head_dim
