"""The memory plan of a vLLM rollout rank: its shard of the weights and the KV cache it can hold.

On a GPU vLLM takes `gpu_memory_utilization` of the device whatever the model: weights, the peak of its profiling
run, and the KV cache in what is left, so the plan reserves that share and checks that the cache left over holds at
least one sequence of max_model_len (vLLM refuses to start otherwise) and how many full-length sequences run at
once. On a CPU the cache is `cpu_kvcache_space_gib` (or sized for the engine's concurrency) beside the weights.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from roll_backend.models.hf_decoder import QK_NORM_MODEL_TYPES, has_qkv_bias
from roll_backend.strategies.vllm.config import CPU_KV_BLOCK_SIZE

GIB = 1 << 30
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2, "auto": 2}
DEFAULT_MAX_NUM_SEQS = 256  # vLLM's default concurrency (on a CPU: per TP rank of the engine)
VOCAB_PADDING = 64  # vLLM's VocabParallelEmbedding pads the vocabulary to a multiple of this before splitting it
# vLLM's CPU MoE kernel (fused_moe/experts/cpu_moe.py, CPUUnquantizedExperts): hidden and per-rank expert
# intermediate sizes in multiples of this; it zero-pads the intermediate size up to one (where the hidden size is one)
CPU_MOE_ALIGNMENT = 32
ATTENTION_SCALES = 4  # float32 scalars each attention layer keeps (k, v, q and softmax scales of quantized KV)
CPU_KV_CACHE_CAP = GIB  # a CPU engine's default KV cache at most (what VLLM_CPU_KVCACHE_SPACE=1 gave every engine)
HINTS = {
    "weights": "tp shards them; dtype: bfloat16 halves them",
    "kv_cache": "gpu_memory_utilization (or cpu_kvcache_space_gib on CPU); max_model_len; tp shards it",
    "activations": "max_num_batched_tokens; max_num_seqs (the sampler's logits over the vocabulary)",
}


def _fields(fields: Mapping[str, Any]) -> dict[str, int]:
    heads = fields["num_attention_heads"]
    return {
        "h": fields["hidden_size"],
        "layers": fields["num_hidden_layers"],
        "nq": heads,
        "nkv": fields.get("num_key_value_heads") or heads,
        "d": fields.get("head_dim") or fields["hidden_size"] // heads,
        "ffn": fields.get("intermediate_size", 0),
        "vocab": fields.get("vocab_size", 32000),
        "experts": fields.get("num_experts") or fields.get("num_local_experts") or 0,
        "expert_ffn": fields.get("moe_intermediate_size") or 0,
        "shared_ffn": fields.get("shared_expert_intermediate_size") or 0,
        "positions": fields.get("max_position_embeddings") or 0,
    }


def _layer_elements(fields: Mapping[str, Any], tp: int, expert_ffn: int) -> int:
    """One decoder layer's parameters on a TP rank of vLLM's model: key-value heads replicated where TP exceeds them,
    q/k/v biases (Qwen2), per-head q/k norms (Qwen3), routed experts of `expert_ffn` each with their replicated
    router (and a shared expert with its gate), two norms."""
    m = _fields(fields)
    h, d = m["h"], m["d"]
    model_type = fields.get("model_type", "")
    qkv = (m["nq"] // tp + 2 * max(1, m["nkv"] // tp)) * d
    attention = h * qkv + m["nq"] // tp * d * h + (qkv if has_qkv_bias(model_type, fields) else 0)
    attention += 2 * d if model_type in QK_NORM_MODEL_TYPES else 0
    if m["experts"]:
        mlp = m["experts"] * (3 * h * expert_ffn + h)
        mlp += 3 * h * m["shared_ffn"] // tp + h if m["shared_ffn"] else 0
    else:
        mlp = 3 * h * m["ffn"] // tp
    return attention + mlp + 2 * h


def _heads(fields: Mapping[str, Any]) -> int:
    return 1 if fields.get("tie_word_embeddings") else 2  # the embedding, and an untied output layer


def hf_weight_elements(fields: Mapping[str, Any]) -> int:
    """Parameters of the model's checkpoint (what a weight sync sends): the engine's at TP1 without what vLLM adds
    (vocabulary padding, the rotary cache, attention scales)."""
    m = _fields(fields)
    return m["layers"] * _layer_elements(fields, 1, m["expert_ffn"]) + m["h"] + _heads(fields) * m["vocab"] * m["h"]


def engine_weight_bytes(fields: Mapping[str, Any], tp: int, width: int, device: str = "cuda") -> int:
    """What one TP rank of the engine holds, as vLLM builds the model: its decoder layers (`_layer_elements`), the
    vocabulary padded to a multiple of 64 and split by TP, each attention layer's four float32 quantization scales,
    and the rotary embedding's cos/sin cache (one for all layers, max_position_embeddings long). On a CPU, vLLM's
    grouped-GEMM MoE kernel pads each expert's intermediate size (per TP rank) to its alignment."""
    m = _fields(fields)
    expert_ffn = m["expert_ffn"] // tp
    if device == "cpu" and m["h"] % CPU_MOE_ALIGNMENT == 0:
        expert_ffn = -(-expert_ffn // CPU_MOE_ALIGNMENT) * CPU_MOE_ALIGNMENT
    vocab = -(-m["vocab"] // VOCAB_PADDING) * VOCAB_PADDING // tp
    rotary = int(m["d"] * fields.get("partial_rotary_factor", 1.0))
    elements = m["layers"] * _layer_elements(fields, tp, expert_ffn) + m["h"] + _heads(fields) * vocab * m["h"]
    elements += m["positions"] * rotary
    return elements * width + m["layers"] * ATTENTION_SCALES * 4


def kv_bytes_per_token(fields: Mapping[str, Any], tp: int, width: int) -> int:
    """Key and value of one token in every layer, on one TP rank (key-value heads replicate below TP)."""
    m = _fields(fields)
    return 2 * m["layers"] * max(1, m["nkv"] // tp) * m["d"] * width


def engine_batch(cfg, run) -> tuple[int, int]:
    """(tokens, sequences) of the engine's largest step: `max_num_batched_tokens` and `max_num_seqs`, else vLLM's
    defaults for an offline engine (vllm/engine/arg_utils.py, get_batch_defaults): on a CPU 4096 tokens and 256
    sequences per TP rank; on a GPU of 70 GiB or more 16384 and 1024 (vLLM gives an A100 8192: the plan errs high
    there), else 8192 and 256; an undeclared GPU as a large one. A default token budget takes at least one
    max_model_len prompt without chunked prefill and at most max_num_seqs of them."""
    if run.device == "cpu":
        tokens, seqs = 4096 * run.layout.tp, DEFAULT_MAX_NUM_SEQS * run.layout.tp
    elif run.device_memory is None or run.device_memory >= 70 * GIB:
        tokens, seqs = 16384, 1024
    else:
        tokens, seqs = 8192, DEFAULT_MAX_NUM_SEQS
    seqs = cfg.max_num_seqs or seqs
    if cfg.max_num_batched_tokens is not None:
        return cfg.max_num_batched_tokens, seqs
    if cfg.enable_chunked_prefill is False:
        tokens = max(tokens, cfg.max_model_len)
    return min(tokens, seqs * cfg.max_model_len), seqs


def generate_activation_bytes(
    fields: Mapping[str, Any], tp: int, width: int, tokens: int, seqs: int, device: str = "cuda"
) -> int:
    """The peak of vLLM's profile run on one TP rank (what it reserves for activations beside the KV cache): a
    forward of `tokens` tokens (its largest moment, `_layer_moments`), then the sampler over `seqs` sequences (at
    most one a token) beside the forward's output: the whole (padded) vocabulary's logits per sequence, a float32
    copy, its sort (values and int64 indices), softmax and two masks."""
    m = _fields(fields)
    seqs = min(seqs, tokens)
    vocab = m["vocab"]
    padded = -(-vocab // VOCAB_PADDING) * VOCAB_PADDING
    logits = seqs * (padded * width + vocab * (4 + 8 + 4 + 2 + (4 if width < 4 else 0)) + 2 * m["h"] * width)
    return max(tokens * max(_layer_moments(fields, tp, width, device)), tokens * m["h"] * width + logits)


def _layer_moments(fields: Mapping[str, Any], tp: int, width: int, device: str) -> list[int]:
    """Bytes a token holds at each moment of a decoder layer that can be the forward's peak, counted from the tensors
    alive in it (traced on CPU: tests/strategies/vllm/test_engine_memory.py). Attention: the fused qkv output, the
    queries and keys its q/k norms return, the attention output, and the residual stream's tensors (the norm's
    output, o_proj's, the residual; past the first layer also the previous fused add's two). The MLP: gate-up,
    activation and product (four intermediate widths) beside the stream's. A MoE block: its shared expert as an MLP
    beside the router's logits; then the routed experts beside the shared expert's output: their output and, on a
    CPU, the kernel's hidden-wide workspace, on a GPU the fused kernel's caches (top-k copies of three expert
    widths and the hidden one). On a CPU a 16-bit model's norms (vLLM's native norm computes in float32:
    two float32 copies of its input beside those of the model's width; a GPU's fused kernel makes none)."""
    m = _fields(fields)
    h, q, kv = m["h"], m["nq"] // tp * m["d"], max(1, m["nkv"] // tp) * m["d"]
    norms = fields.get("model_type", "") in QK_NORM_MODEL_TYPES
    stream = 2 if m["layers"] > 1 else 0  # (the first layer's input is the embedding alone)
    moments = [(2 * kv + 2 * q + (q + kv if norms else 0) + (3 + stream) * h) * width]
    if device == "cpu" and width < 4:
        moments.append((5 + stream) * h * width + 2 * h * 4)
        if norms:
            moments.append((q + 2 * kv + (2 + stream) * h) * width + q * (2 * width + 8))
    mlp_stream = (3 + stream // 2) * h
    if m["experts"]:
        topk, shared = fields.get("num_experts_per_tok") or 1, m["shared_ffn"] // tp
        kernel = topk * (3 * m["expert_ffn"] // tp + h) if device != "cpu" else h  # caches, or the CPU's workspace
        routing = m["experts"] * 4 + topk * 8  # float32 router logits, the chosen experts and their weights
        moments.append((mlp_stream + (h if shared else 0) + h + kernel) * width + routing)
        if shared:
            moments.append((4 * shared + mlp_stream) * width + m["experts"] * 4)
    else:
        moments.append((4 * m["ffn"] // tp + mlp_stream) * width)
    return moments


def cpu_kv_cache_bytes(cfg, fields: Mapping[str, Any], tp: int) -> int:
    """The KV cache one engine rank allocates on a CPU: `cpu_kvcache_space_gib`, or (None) room for `max_num_seqs`
    (vLLM's default concurrency when unset) full-length sequences in whole blocks, and the block vLLM keeps back (its
    null block), at most CPU_KV_CACHE_CAP."""
    if cfg.cpu_kvcache_space_gib is not None:
        return int(cfg.cpu_kvcache_space_gib * GIB)
    if not fields or "hidden_size" not in fields or "num_attention_heads" not in fields:
        return CPU_KV_CACHE_CAP  # (a config this plan cannot read, e.g. a vision model's nested text config)
    per_token = kv_bytes_per_token(fields, tp, DTYPE_BYTES.get(cfg.dtype, 2))
    block = cfg.block_size or CPU_KV_BLOCK_SIZE
    seqs = cfg.max_num_seqs or DEFAULT_MAX_NUM_SEQS * tp
    blocks = seqs * -(-cfg.max_model_len // block) + 1  # (and vLLM's null block)
    return min(CPU_KV_CACHE_CAP, blocks * block * per_token)


def plan(cfg, run) -> list:
    """The rollout config's memory plan in this run (MemoryPlanner.plan)."""
    from roll_backend.strategies.base import RankMemory, host_weight_copy_note

    fields = run.model_config
    if not fields or "hidden_size" not in fields:
        return []
    tp, width = run.layout.tp, DTYPE_BYTES.get(cfg.dtype, 2)
    weights = engine_weight_bytes(fields, tp, width, run.device)
    per_token = kv_bytes_per_token(fields, tp, width)
    activations = generate_activation_bytes(fields, tp, width, *engine_batch(cfg, run), run.device)
    # (HF tensors as the trainer sends them; the engine's dtype as a stand-in for theirs)
    copy_note = host_weight_copy_note(run, hf_weight_elements(fields) * width)
    notes = [copy_note] if copy_note else []
    # Asleep (the hybrid engine on a GPU) it keeps nothing on the device: level 1 moves the weights to host memory
    # and frees the cache, level 2 discards both. vLLM on CPU has no sleep mode.
    offloaded = frozenset({"weights"}) if run.hybrid and run.device == "cuda" and cfg.sleep_level >= 1 else frozenset()
    if run.device == "cuda" and run.device_memory is None:
        phases = {"generate": {"activations": activations}}
        notes.append("the KV cache takes gpu_memory_utilization of a device whose size is not declared")
        return [RankMemory("every rank", {"weights": weights}, phases, offloaded, hints=HINTS, notes=tuple(notes))]
    if run.device == "cuda":
        reserved = int(cfg.gpu_memory_utilization * run.device_memory)
        cache = max(0, reserved - weights - activations)
        notes.append(
            f"KV cache {cache / GIB:.1f} GiB: {cache // max(1, per_token)} tokens, "
            f"{cache // max(1, per_token * cfg.max_model_len)} sequences of max_model_len={cfg.max_model_len} at once"
        )
    else:
        reserved, cache = None, cpu_kv_cache_bytes(cfg, fields, tp)
    phases = {"generate": {"activations": activations, "kv_cache": cache}}
    memory = RankMemory(
        "every rank", {"weights": weights}, phases, offloaded, reserved=reserved, hints=HINTS, notes=tuple(notes)
    )
    return [memory]


def problems(cfg, run, planned: list) -> list[str]:
    """Why the engine would not start on the declared device: its KV cache cannot hold one max_model_len sequence."""
    if not planned or planned[0].reserved is None:
        return []
    per_token = kv_bytes_per_token(run.model_config, run.layout.tp, DTYPE_BYTES.get(cfg.dtype, 2))
    cache = planned[0].phases["generate"]["kv_cache"]
    if cache >= per_token * cfg.max_model_len:
        return []
    need = per_token * cfg.max_model_len + sum(planned[0].phases["generate"].values()) - cache
    weights = planned[0].state["weights"]
    need += weights
    return [
        f"{run.role}.strategy: the KV cache left in gpu_memory_utilization={cfg.gpu_memory_utilization} of "
        f"{run.device_memory / GIB:.0f} GiB ({cache / GIB:.2f} GiB after {weights / GIB:.1f} GiB of weights) "
        f"cannot hold one sequence of max_model_len={cfg.max_model_len} "
        f"({per_token * cfg.max_model_len / GIB:.2f} GiB); raise gpu_memory_utilization to at least "
        f"{math.ceil(100 * need / run.device_memory) / 100:g}, raise tp, or lower max_model_len"
    ]


def planned_at(cfg, run, measured) -> dict[str, int]:
    """The plan of what the engine reports holding (VllmRolloutStrategy.measured_memory): its weights, its KV cache
    where the plan knows its size (not a GPU's whose memory is undeclared) and the activations of its largest step;
    the same at any batch."""
    planned = plan(cfg, run)
    if not planned:
        return {}
    figures = {"model_state": sum(planned[0].state.values())}
    figures.update(planned[0].phases["generate"])  # the KV cache (where the plan knows it) and the activations
    return figures
