"""The memory a rank's weight sync allocates (train.iter_hf_weights), planned tensor by tensor before anything starts.

Every rank of the trainer walks the whole model in Hugging Face order (weights.iter_full_hf_tensors): its own pipeline
stage's parameters are gathered over TP (expert TP, then EP for routed experts) and cut into HF tensors, the other
stages' tensors arrive by broadcast into fresh ones, and `weights.bucketed` keeps them until a bucket is full. So the
peak is, over the parameters in order, the bucket held so far plus what making the next parameter's tensors takes:
the gathered shards, the concatenation a fused QKV weight is split from, a LoRA base merged with its update, and the
tensors themselves (copies, except a replicated norm or router, which is the parameter itself). Those counts are
what tests/strategies/megatron/test_memory_plan.py measures at every layout.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

from roll_backend.distributed.layout import ParallelLayout
from roll_backend.strategies.megatron.activation_plan import DTYPE_BYTES, FP32
from roll_backend.strategies.megatron.builder import HFArch

# merged_shard's float32 work for a LoRA base: the adapters' product per module, their concatenation, its scaling
LORA_MERGE_BUFFERS = 3


@dataclass(frozen=True)
class Made:
    """One Megatron parameter's HF tensors as a rank makes them: each tensor's (bytes as a bucket counts them, bytes
    of new storage), what making them allocates and frees before the first is handed on (`transient`), and what stays
    alive until the last is (`held`: a routed expert's own tensors while the EP ranks' copies go out)."""

    outputs: tuple[tuple[int, int], ...]
    transient: int = 0
    held: int = 0
    merging: int = 0  # a LoRA base's merge with its update, done (and its buffers freed) before the gather

    def peak(self) -> int:
        """The most this parameter's making holds at once, on top of the bucket so far."""
        return max(self.merging, self.transient + self.held + sum(new for _, new in self.outputs))


def _fused(sizes: list[int], tp: int, width: int, lora: bool, copies_of_concat: bool = False) -> Made:
    """A TP-split parameter whose full HF tensors have `sizes` elements: at TP > 1 its shards are gathered, then
    concatenated (new storage at every TP, also of one shard); QKV's split then copies each part unless there is one
    KV group; a LoRA base is first merged with its update (float32)."""
    total = sum(sizes)
    transient = total * width if tp > 1 else 0
    if copies_of_concat:
        transient += total * width
    # (a 16-bit base is copied to float32 first, and the copy stays while the update is made)
    merging = (LORA_MERGE_BUFFERS + (width != FP32)) * total // tp * FP32 if lora else 0
    if lora:
        transient += total // tp * width  # the merged base, kept until the tensors are made
    if copies_of_concat or len(sizes) > 1:
        outputs = tuple((size * width, size * width) for size in sizes)
    else:
        outputs = ((sizes[0] * width, total * width),)
    return Made(outputs, transient, merging=merging)


def _qkv(arch: HFArch, rows: int, tp: int, width: int, lora: bool) -> Made:
    q, kv = arch.num_heads * arch.head_dim * rows, arch.num_kv_heads * arch.head_dim * rows
    if arch.num_kv_heads > 1:
        return _fused([q, kv, kv], tp, width, lora, copies_of_concat=True)
    made = _fused([q + 2 * kv], tp, width, lora)  # one group: q, k and v are views of the concatenation
    outputs = ((q * width, (q + 2 * kv) * width), (kv * width, 0), (kv * width, 0))
    return Made(outputs, made.transient, merging=made.merging)


def _replicated(elements: int, width: int) -> Made:
    return Made(((elements * width, 0),))


def _expert(sizes: list[int], layout: ParallelLayout, width: int, lora: bool) -> Made:
    """A routed expert's weight: gathered over expert TP into its HF tensors, each then gathered over EP (every EP
    rank's expert in this slot) while its own stay alive."""
    own = _fused(sizes, layout.expert_tp, width, lora)
    if layout.ep == 1:
        return own
    made = sum(new for _, new in own.outputs)
    outputs = tuple((size * width, size * width) for size in sizes for _ in range(layout.ep))
    return Made(outputs, own.transient, held=made, merging=own.merging)


def _layer(arch: HFArch, layout: ParallelLayout, width: int, lora_targets: frozenset[str]) -> Iterator[Made]:
    h, tp = arch.hidden_size, layout.tp
    attention_lora = bool(lora_targets & {"q_proj", "k_proj", "v_proj"})
    # (in the order Megatron's layer lists its parameters, which the export follows: the output projection first)
    yield _replicated(h, width)  # input norm
    yield _fused([h * arch.num_heads * arch.head_dim], tp, width, "o_proj" in lora_targets)
    yield _qkv(arch, h, tp, width, attention_lora)
    if arch.qkv_bias:
        yield _qkv(arch, 1, tp, width, False)
    if arch.qk_norm:
        yield _replicated(arch.head_dim, width)
        yield _replicated(arch.head_dim, width)
    yield _replicated(h, width)  # pre-MLP norm
    up_lora, down_lora = bool(lora_targets & {"gate_proj", "up_proj"}), "down_proj" in lora_targets
    moe = arch.moe
    if moe is None:
        yield _fused([arch.ffn_hidden_size * h] * 2, tp, width, up_lora)
        yield _fused([arch.ffn_hidden_size * h], tp, width, down_lora)
        return
    yield _replicated(moe.num_experts * h, width)  # router
    for _ in range(moe.num_experts // layout.ep):
        yield _expert([moe.expert_ffn_hidden_size * h] * 2, layout, width, up_lora)
        yield _expert([moe.expert_ffn_hidden_size * h], layout, width, down_lora)
    if moe.shared_expert_ffn_hidden_size:
        yield _replicated(h, width)  # the shared expert's gate
        yield _fused([moe.shared_expert_ffn_hidden_size * h] * 2, tp, width, up_lora)
        yield _fused([moe.shared_expert_ffn_hidden_size * h], tp, width, down_lora)


def _stage(
    arch: HFArch, layout: ParallelLayout, layers: int, first: bool, last: bool, width: int, lora: frozenset[str]
) -> Iterator[Made]:
    vocab = _fused([arch.padded_vocab_size(layout.tp) * arch.hidden_size], layout.tp, width, False)
    vocab = Made(((arch.vocab_size * arch.hidden_size * width, vocab.outputs[0][1]),), vocab.transient)
    if first:
        yield vocab
    for _ in range(layers):
        yield from _layer(arch, layout, width, lora)
    if last:
        yield _replicated(arch.hidden_size, width)  # final norm
        if not arch.tie_word_embeddings:
            yield vocab


def _received(made: Made) -> Iterator[Made]:
    """Another stage's tensors on this rank: each broadcast into a fresh tensor of its size."""
    for nbytes, _ in made.outputs:
        yield Made(((nbytes, nbytes),))


def sync_sequence(
    arch: HFArch, layout: ParallelLayout, layers: list[int], stage: int, params_dtype: str, lora_targets=frozenset()
) -> list[Made]:
    """What pipeline rank `stage` makes, parameter by parameter, while it walks the model for a sync (`layers`: decoder
    layers per stage)."""
    width, out = DTYPE_BYTES[params_dtype], []
    for source, count in enumerate(layers):
        made = _stage(arch, layout, count, source == 0, source == layout.pp - 1, width, frozenset(lora_targets))
        for item in made:
            out += [item] if source == stage else list(_received(item))
    return out


def sync_peak(sequence: list[Made], bucket_bytes: int) -> int:
    """The most bytes alive at once while `sequence` goes out in buckets of `bucket_bytes` (weights.bucketed: a bucket
    goes when it is full or the next tensor would overflow it, a bigger tensor alone, and its storage is freed then)."""
    peak = live = size = 0
    for made in sequence:
        peak = max(peak, live + made.peak())
        # this parameter's tensors in buckets gone already (alive until it is done), and in the bucket now
        carried = added = 0
        for nbytes, new in made.outputs:
            if size and size + nbytes > bucket_bytes:
                carried, added = carried + added, 0
                live = size = 0
            size, live, added = size + nbytes, live + new, added + new
            peak = max(peak, live + carried + made.held)
            if size >= bucket_bytes:  # full: it goes before the next tensor is made
                carried, added = carried + added, 0
                live = size = 0
    return peak
