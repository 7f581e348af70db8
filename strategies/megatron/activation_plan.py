"""Activation memory of a Megatron rank's largest micro-batch (see memory_accounting.py for what is counted and why).

Counts are elements per tensor kept for backward, by the module that keeps it; `local_layer` follows Megatron's local
spec with this backend's RMSNorm (what CPU ranks run and the suite measures), `te_layer` TransformerEngine's fused
layers with flash attention (what a GPU runs; an estimate until measured on one).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from roll_backend.distributed.layout import ParallelLayout
from roll_backend.strategies.megatron.builder import HFArch

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
FP32 = 4
SWIGLU_KEPT = 5  # fc1's output (2 x ffn), the activation, the product with the gate, and the product's input copy


@dataclass(frozen=True)
class MicroShape:
    """A micro-batch as the model sees it: `rows` sequences of `width` tokens (a packed row holds several), of which
    `response_width` columns per row are response positions whose log-probs the head computes."""

    rows: int
    width: int
    response_width: int
    packed: bool = False
    sequences: int | None = None  # sequences whose responses the head reads (a packed row holds several); None: rows
    gathered: bool = False  # the response positions are gathered out of the rows (token-budget or packed micro-batches)

    @property
    def response_rows(self) -> int:
        return self.rows if self.sequences is None else self.sequences

    @property
    def tokens(self) -> int:
        return self.rows * self.width


@dataclass(frozen=True)
class PlanOptions:
    """What of a Megatron config moves its activations."""

    params_dtype: str = "float32"
    lora: bool = False  # a frozen base: norms keep only the inputs adapters need, the output layer no gradient
    value_head: bool = False
    recompute: bool = False
    entropy: bool = True
    mtp_layers: int = 0
    transformer_engine: bool = False
    flex_attention: bool = False  # the local spec with FlexAttention (prompt sharing on a GPU): no scores kept
    sequence_parallel: bool = False
    # Under EP, the tokens a rank's experts compute relative to what its own tokens route (tokens x top-k): 1.0 is
    # balanced routing; a skewed router sends one rank's experts up to EP times that (ExpertLoad measures it).
    expert_load: float = 1.0
    # A rank's busiest local expert's tokens relative to its local experts' mean (routing is not known before the
    # start: a busy expert is allowed twice its share; the suite plans at the skew it measured)
    expert_skew: float = 2.0
    gathering_dispatcher: bool = False  # Megatron's allgather token dispatcher (moe.token_dispatcher_type: CPU ranks)

    @property
    def width(self) -> int:
        return DTYPE_BYTES[self.params_dtype]

    @property
    def keeps_scores(self) -> bool:
        """Whether attention materialises its [sq, sk] scores (Megatron's local DotProductAttention)."""
        return not (self.transformer_engine or self.flex_attention)


SCORES_BUFFER = "attention scores buffer"  # (Megatron's global buffer, which the allgather dispatcher shares)


def _heads(arch: HFArch, tp: int) -> tuple[int, int]:
    """Query and key-value heads on a TP rank (key-value heads replicate when fewer than TP)."""
    return arch.num_heads // tp, max(1, arch.num_kv_heads // tp)


def expert_tokens(arch: HFArch, layout: ParallelLayout, options: PlanOptions, tokens: int) -> int:
    """(token, expert) pairs this rank's experts compute for `tokens` of its own: every pair its tokens route when
    all experts are local; under EP what the other ranks' tokens route to its experts, at the planned load."""
    routed = tokens * arch.moe.topk
    return routed if layout.ep == 1 else math.ceil(routed * options.expert_load)


def _moe_elements(arch: HFArch, layout: ParallelLayout, options: PlanOptions, tokens: int, local_tokens: int) -> int:
    """A MoE layer's kept elements: the tokens permuted to their experts (and what EP's exchange brought), each
    expert's SwiGLU over its tokens, the router's float32 scores, the shared expert."""
    moe, h = arch.moe, arch.hidden_size
    routed, computed = tokens * moe.topk, expert_tokens(arch, layout, options, tokens)
    # the tokens this rank's experts compute, permuted (under EP: as the exchange brought them; what the rank sent is
    # not kept)
    kept = computed * h
    kept += computed * 6 * moe.expert_ffn_hidden_size // layout.expert_tp
    # the router's scores (and transposed copies) over this rank's tokens (its part of the sequence under sequence
    # parallelism), the top-k; the experts' combined output (and the shared expert's gated one)
    kept += 4 * local_tokens * moe.num_experts + 2 * routed
    kept += local_tokens * h * (2 if moe.shared_expert_ffn_hidden_size else 1)
    if moe.shared_expert_ffn_hidden_size:
        kept += SWIGLU_KEPT * tokens * moe.shared_expert_ffn_hidden_size // layout.tp + tokens
    return kept


def local_layer_parts(arch: HFArch, layout: ParallelLayout, micro: MicroShape, options: PlanOptions) -> dict[str, int]:
    """Bytes one decoder layer of the local spec keeps for backward over a micro-batch on this rank, by what keeps
    them (an attention backward's moment is reached with some of them gone: attention_backward_bytes)."""
    cp, tp, width = layout.cp, layout.tp, options.width
    tokens, seq = micro.tokens // cp, micro.width // cp
    h, d = arch.hidden_size, arch.head_dim
    nq, nkv = _heads(arch, tp)
    q, kv = nq * d, nkv * d
    norm_tokens = tokens // tp if options.sequence_parallel else tokens
    # RMSNorm (float32 math, layers.rms_norm): its output (the next projection's input), x * rsqrt for its weight's
    # gradient (a frozen base's norms have none), rsqrt; with 16-bit parameters also its input's float32 copy
    float_copies = width != FP32
    per_norm = h * width + (0 if options.lora else h * width) + (h * FP32 if float_copies else 0) + FP32
    norms = 2 * norm_tokens * per_norm
    residuals = 2 * norm_tokens * h * width
    # the row-parallel projections' outputs with their adapters' branch added (this rank's part of the sequence
    # under sequence parallelism, as their reduce-scatter left them)
    adapted = 2 * norm_tokens * h * width if options.lora else 0
    attention = 0
    keys = micro.tokens  # key positions: every position of the sequence (CP gathers them)
    if nq > nkv:
        attention += tokens * q + 2 * keys * q  # the query after RoPE; key and value repeated to every query head
    elif cp > 1:
        # the query after RoPE; key and value as CP gathered them, which the scores and the context read (so neither
        # the fused QKV output, whose view the value was, nor the local rotated key stays)
        attention += tokens * q + 2 * keys * kv
        attention += tokens * (q + 2 * kv) if arch.qk_norm else 0  # (the norms keep their input, QKV's output)
    else:
        attention += tokens * (q + 2 * kv) + tokens * (q + kv)  # the fused QKV output; query and key after RoPE
    if arch.qk_norm:
        # the normed query and key (their weights' gradient needs them; a frozen base's norms have none, but under CP
        # the gathered key is kept), their rsqrt
        attention += (0 if options.lora and cp == 1 else tokens * (q + kv)) + tokens * (nq + nkv)
        if nq > nkv:
            attention += tokens * (q + 2 * kv) + tokens * q  # the QKV output the norms read, the grouped query
    if arch.moe is None:
        mlp = SWIGLU_KEPT * tokens * arch.ffn_hidden_size // tp
    else:
        mlp = _moe_elements(arch, layout, options, tokens, norm_tokens)
    return {
        "norms": norms,
        "residuals": residuals,
        "adapted outputs": adapted,
        "attention": attention * width,
        "context": tokens * q * width,  # linear_proj's input
        "scores": micro.rows * nq * seq * micro.width * FP32 if options.keeps_scores else 0,  # the float32 softmax
        "rope": 4 * seq * d * FP32,
        "mlp": mlp * width,
    }


def local_layer(arch: HFArch, layout: ParallelLayout, micro: MicroShape, options: PlanOptions) -> int:
    """Bytes one decoder layer of the local spec keeps for backward over a micro-batch on this rank."""
    return sum(local_layer_parts(arch, layout, micro, options).values())


def attention_backward_bytes(arch: HFArch, layout: ParallelLayout, micro: MicroShape, options: PlanOptions) -> int:
    """What the local spec's core attention backward adds to the saved activations at its peak (negative: less than
    the layer kept). By then the layer's MLP, its second norm and the context have given back what they kept, and
    the softmax its output; the scores' gradient is alive as autograd's in-place softmax mask makes it: the
    probabilities' gradient, the softmax's, the masked copy's and the scores' base as a zeroed flat and a strided
    tensor (four float32 tensors of the scores' size, as float32 parameters run it; measured on CPU ranks). With LoRA,
    linear_proj's and fc2's outputs with their adapters' branch added are gone too."""
    if not options.keeps_scores:
        return 0
    parts = local_layer_parts(arch, layout, micro, options)
    gone = parts["mlp"] + parts["norms"] // 2 + parts["context"] + parts["scores"] + parts["adapted outputs"]
    return 4 * parts["scores"] - gone


def te_layer(arch: HFArch, layout: ParallelLayout, micro: MicroShape, options: PlanOptions) -> int:
    """Bytes one TransformerEngine layer keeps (fused norm + linear, flash attention keeping q, k, v, its output and
    the softmax statistics, no scores)."""
    cp, tp, width = layout.cp, layout.tp, options.width
    tokens = micro.tokens // cp
    h, d = arch.hidden_size, arch.head_dim
    nq, nkv = _heads(arch, tp)
    norm_tokens = tokens // tp if options.sequence_parallel else tokens
    norms = 2 * norm_tokens * h * (1 if options.lora else 2) * width + 2 * norm_tokens * FP32
    attention = tokens * (nq + 2 * nkv) * d + tokens * nq * d  # q, k, v after RoPE; the output
    stats = tokens * nq * FP32
    if arch.moe is None:
        mlp = SWIGLU_KEPT * tokens * arch.ffn_hidden_size // tp
    else:
        mlp = _moe_elements(arch, layout, options, tokens, norm_tokens)
    return norms + 2 * norm_tokens * h * width + (attention + mlp) * width + stats


def layer_bytes(arch: HFArch, layout: ParallelLayout, micro: MicroShape, options: PlanOptions) -> int:
    return (te_layer if options.transformer_engine else local_layer)(arch, layout, micro, options)


def head_bytes(arch: HFArch, layout: ParallelLayout, micro: MicroShape, options: PlanOptions, training: bool) -> int:
    """The last stage's head over a micro-batch at its peak: the logits and the float32 buffers of the log-prob /
    entropy of each response position (every local position under CP); in training the larger of that and the head's
    backward (the logits' gradient and the output layer's weight gradient)."""
    tp, cp, width = layout.tp, layout.cp, options.width
    tokens = micro.tokens // cp
    if options.value_head:  # (under SP the head gathers the sequence's hidden states first: kept for its backward)
        gathered = tokens * arch.hidden_size * width if options.sequence_parallel else 0
        return tokens * width + gathered + (arch.hidden_size * width if training else 0)
    vocab = arch.padded_vocab_size(tp) // tp
    positions = tokens if cp > 1 else micro.response_rows * micro.response_width
    # the logits /temperature (16-bit logits: its float32 copy, the 16-bit quotient gone by then), shifted, exp (,
    # *shifted for the entropy, the response positions gathered out of a token-budget or packed micro-batch)
    buffers = 3 + int(options.entropy) + int(micro.gathered)
    logits = tokens * vocab * width
    heads = 1 + options.mtp_layers  # each MTP depth has its logits too (in a forward without gradients as well)
    # The model's logits and their batch-first copy (with the final norm's output) while the copy is made, or the
    # logits with the response positions' float32 buffers, whichever is larger.
    # (one row is contiguous already, but with MTP the head's output is captured as a copy)
    copy = logits + 2 * tokens * arch.hidden_size * width if micro.rows > 1 or options.mtp_layers else 0
    forward_end = max(heads * (logits + copy), logits + buffers * positions * vocab * FP32)
    if not training:
        return forward_end
    # The backward reaches all the buffers' gradients before it adds them up: the saved exp and shifted logits, the
    # entropy product's two gradients, the label gather's (its zeros and their scatter), beside the layers' saved
    # activations (without entropy: exp, its gradient, the gather's two); under CP over every local position, with
    # the logits (without CP nothing keeps them: the response positions' float32 copy is what the backward reads).
    backward_start = (logits if cp > 1 else 0) + (6 if options.entropy else 4) * positions * vocab * FP32
    # The head's backward: the logits' gradient beside the output layer's weight gradient, or with MTP that weight
    # gradient once per head reading it and their sum (the logits' gradients gone by then).
    weight_grad = 0 if options.lora else vocab * arch.hidden_size * width
    backward = max(logits + weight_grad, (1 + 2 * options.mtp_layers) * weight_grad)
    return max(forward_end, backward_start, backward + tokens * arch.hidden_size * width)


def layer_backward_bytes(arch: HFArch, layout: ParallelLayout, micro: MicroShape, options: PlanOptions) -> int:
    """What a layer's backward adds to the saved activations at its peak: a weight gradient of the MLP (or an
    expert's) before DDP adds it to the gradient buffer, with that projection's input and output gradients (for fc1,
    less what the MLP has given back by then)."""
    tokens, h, width = micro.tokens // layout.cp, arch.hidden_size, options.width
    if arch.moe is None:
        ffn, ffn_tokens = arch.ffn_hidden_size // layout.tp, tokens
    else:
        ffn = arch.moe.expert_ffn_hidden_size // layout.expert_tp
        ffn_tokens = expert_tokens(arch, layout, options, tokens)
    weight = 0 if options.lora else ffn * h  # fc2's; fc1's is twice as large
    fc2 = weight + ffn_tokens * ffn + tokens * h  # its weight gradient, its input's and output's gradients
    # fc1's, by when the MLP has given back what it kept for its backward but fc1's input: its output's gradient
    # (2 x ffn) with its weight gradient and its input's. With dense LoRA adapters (a frozen base) the moment is
    # earlier, before any hidden-wide gradient: fc1's output gradient, its scaled copy for the adapters and the
    # adapters' gradient of that width, beside the SwiGLU's two input gradients (8 x ffn; the live set at the peak
    # of a one-layer stage at ffn = 5 x hidden, and the same count measured at 2 x)
    lora_dense = options.lora and arch.moe is None
    output_grads, hidden_wide = (8, 0) if lora_dense else (2, 3)
    kept = SWIGLU_KEPT if arch.moe is None else 6
    fc1 = 2 * weight + output_grads * ffn_tokens * ffn + hidden_wide * tokens * h - kept * ffn_tokens * ffn
    # a MoE layer's experts' outputs, concatenated over the routed tokens, beside them (the dispatcher's [routed, h])
    dispatched = ffn_tokens * h if arch.moe is not None else 0
    return (max(fc2, fc1, 0) + dispatched) * width


def mtp_bytes(arch: HFArch, layout: ParallelLayout, micro: MicroShape, options: PlanOptions) -> int:
    """What the MTP depths on the last stage keep for backward: each a layer and its input projection's input (their
    logits are in head_bytes)."""
    tokens = micro.tokens // layout.cp
    depth = layer_bytes(arch, layout, micro, options) + 2 * tokens * arch.hidden_size * options.width
    return options.mtp_layers * depth


def in_flight(layout: ParallelLayout, stage: int, micro_batches: int) -> float:
    """Micro-batches whose activations a pipeline stage holds at once in training, in units of the stage's layers:
    1F1B keeps pp - stage; the interleaved schedule keeps Megatron's warm-up count of chunks (each 1/vpp of them)."""
    pp, vpp = layout.pp, layout.vpp or 1
    if pp == 1:
        return 1
    if vpp == 1:
        return min(pp - stage, micro_batches)
    chunks = min((pp - stage - 1) * 2 + (vpp - 1) * pp + 1, micro_batches * vpp)
    return chunks / vpp


def activation_terms(
    arch: HFArch,
    layout: ParallelLayout,
    micro: MicroShape,
    options: PlanOptions,
    layers: int,
    stage: int,
    micro_batches: int,
    training: bool,
) -> dict[str, int]:
    """A pipeline rank's phase peak on top of its model state, by term, for micro-batches of `micro`'s shape."""
    last = stage == layout.pp - 1
    tokens = micro.tokens // layout.cp
    # the embedding's output, or the activation a stage receives (this rank's part of the sequence under SP)
    edge = (tokens // layout.tp if options.sequence_parallel else tokens) * arch.hidden_size * options.width
    terms: dict[str, int] = {}
    if options.keeps_scores:  # Megatron's global buffer for the scores' matmul, kept between calls
        nq = arch.num_heads // layout.tp
        terms[SCORES_BUFFER] = micro.rows * nq * (micro.width // layout.cp) * micro.width * options.width
    if training and options.gathering_dispatcher and layout.ep > 1:
        # the allgather dispatcher gathers every EP rank's tokens into the same global buffer, which grows to the
        # larger of the two (a forward's count of it is in its MLP's working set)
        gathered = layout.ep * tokens * arch.hidden_size * options.width
        terms[SCORES_BUFFER] = max(terms.get(SCORES_BUFFER, 0), gathered)
    if not training:
        return _forward_terms(arch, layout, micro, options, terms, edge, stage)
    one_layer = layer_bytes(arch, layout, micro, options)
    held = in_flight(layout, stage, micro_batches)
    head = head_bytes(arch, layout, micro, options, training) if last else 0
    # a layer's backward peaks in its MLP or, where scores are materialised, in its core attention
    backward = max(
        layer_backward_bytes(arch, layout, micro, options), attention_backward_bytes(arch, layout, micro, options)
    )
    if backward > head:
        terms["a layer's backward"] = backward
    if options.recompute:  # each layer keeps its input; in backward one layer at a time is recomputed (the head's
        # buffers are gone by then)
        terms["activations"] = int(held * (layers * edge + edge)) + max(0, one_layer - head)
    else:
        terms["activations"] = int(held * (layers * one_layer + edge))
    if last and head >= backward:
        terms["logits and log-prob buffers"] = head
    if last:
        if options.mtp_layers:
            terms["MTP heads"] = mtp_bytes(arch, layout, micro, options)
    if stage == 0 and not options.lora:
        # (the micro-batches still in flight when one's backward ends: 1F1B's warm-up ran them ahead)
        return _backward_end(arch, layout, options, terms, edge, terms["activations"] * (held - 1) / held)
    return terms


def _backward_end(
    arch: HFArch, layout: ParallelLayout, options: PlanOptions, terms: dict, edge: int, in_flight_bytes: float
) -> dict:
    """The first stage's last moment of a micro-batch's backward when it is its peak: the embedding's weight gradient,
    dense [vocab / TP, hidden] until DDP adds it to the gradient buffer, beside its output's gradient, when that
    micro-batch's saved activations are gone (a critic or a short micro-batch: nothing of the head hides it) but those
    of the micro-batches the pipeline ran ahead are not. A tied model on one stage holds three such tensors then: the
    output layer's weight gradient, the embedding's, and their sum (autograd adds the two gradients of the one
    shared weight)."""
    scores = {name: value for name, value in terms.items() if name == SCORES_BUFFER}
    others = sum(value for name, value in terms.items() if name != SCORES_BUFFER)
    shared_weight = arch.tie_word_embeddings and not options.value_head and layout.pp == 1
    embedding_grad = arch.padded_vocab_size(layout.tp) // layout.tp * arch.hidden_size * options.width
    end = (3 if shared_weight else 1) * embedding_grad + edge
    if end + in_flight_bytes <= others:
        return terms
    ahead = {"activations of the micro-batches ahead": int(in_flight_bytes)} if in_flight_bytes else {}
    return scores | {"the embedding's weight gradient": end} | ahead


def _forward_mlp_elements(arch: HFArch, layout: ParallelLayout, options: PlanOptions, tokens: int) -> int:
    """The MLP's working set in a forward without gradients: fc1's output (2 x ffn) and the SwiGLU's steps; with LoRA
    its branch beside fc1 (B's outputs, their concatenation and scaling, each as wide as fc1's output)."""
    ffn_factor = 8 if options.lora else 5
    moe = arch.moe
    if moe is None:
        return ffn_factor * tokens * arch.ffn_hidden_size // layout.tp
    # A MoE layer: the permuted tokens, the experts' outputs so far and one expert's SwiGLU at a time (its expert-TP
    # shard); then SequentialMLP's concatenation beside the list of outputs it joins (three copies of the routed
    # tokens); the shared expert runs first, and its output (and gated copy) waits for the routed experts' to be added.
    local = max(1, moe.num_experts // layout.ep)
    routed = expert_tokens(arch, layout, options, tokens)
    # (each token is routed to an expert at most once)
    every_token = tokens if layout.ep == 1 else min(layout.ep * tokens, routed)
    busiest = min(every_token, routed, math.ceil(options.expert_skew * routed / local))
    swiglu = ffn_factor * busiest * moe.expert_ffn_hidden_size // layout.expert_tp
    shared_ffn = moe.shared_expert_ffn_hidden_size or 0
    # (a row-parallel output: this rank's part of the sequence under sequence parallelism)
    local_tokens = tokens // layout.tp if layout.tp > 1 and options.sequence_parallel else tokens
    shared_output = 2 * local_tokens * arch.hidden_size if shared_ffn else 0
    h = arch.hidden_size
    permuted = max(3 * routed * h, 2 * routed * h + swiglu)
    if options.gathering_dispatcher and layout.ep > 1:
        # every EP rank's tokens, gathered and kept until the combine, whose buffer is as large
        gathered = layout.ep * tokens * h
        shared_output += gathered
        permuted = max(permuted, gathered + 2 * routed * h)
    mlp = shared_output + permuted
    return max(mlp, ffn_factor * tokens * shared_ffn // layout.tp)


def _forward_terms(
    arch: HFArch, layout: ParallelLayout, micro: MicroShape, options: PlanOptions, terms: dict, edge: int, stage: int
) -> dict[str, int]:
    """A forward without gradients frees each layer's tensors as it goes: its peak is the larger of one layer's
    working set and, on the last stage, the head's buffers. The attention's working set holds the layer's input and
    output, the QKV output, the query (normed, rotated), key and value repeated to every query head, the context,
    and on the local spec the scores and their float32 softmax; the MLP's its fc1 output, activation and product."""
    tokens, seq = micro.tokens // layout.cp, micro.width // layout.cp
    nq, nkv = _heads(arch, layout.tp)
    q, kv = nq * arch.head_dim, nkv * arch.head_dim
    scores = micro.rows * nq * seq * micro.width * (options.width + FP32) if options.keeps_scores else 0
    # QKV's output; the query and key rotated (and normed: qwen3); the context and its copy
    attention = tokens * (q + 2 * kv) + 3 * tokens * q + tokens * kv + (tokens * (q + kv) if arch.qk_norm else 0)
    if nq > nkv:
        attention += 2 * micro.tokens * q  # key and value repeated to every query head, at every key position
    if layout.cp > 1:  # key and value gathered over CP; and the all-gather's own buffers (each rank's part and the
        # input's copy), which the process group may still hold while the next layer starts
        attention += 2 * micro.tokens * kv + (layout.cp + 1) * tokens * kv
    # with LoRA, the moment its branch is added to QKV's output: that output, the adapters' assembled output, its scaled
    # copy and the sum
    qkv_with_adapters = 4 * tokens * (q + 2 * kv) * options.width if options.lora else 0
    attention_peak = max(attention * options.width + scores, qkv_with_adapters)
    mlp = _forward_mlp_elements(arch, layout, options, tokens)
    # The hidden states around a layer (its input, the norm's output, a projection's output; the MLP's residual
    # too; a MoE layer's norm output is gone once its tokens are permuted, but under sequence parallelism its
    # dispatcher holds the gathered sequence); under sequence parallelism a row-parallel output beside its
    # reduce-scatter's (a plain TP all-reduce is in place: nothing more); between pipeline stages the output being
    # sent, and with vpp the received inputs of the micro-batches the schedule runs ahead.
    reduce_scatter = layout.tp > 1 and options.sequence_parallel
    edges = reduce_scatter + (layout.pp > 1 and stage < layout.pp - 1) + ((layout.vpp or 1) - 1) * layout.pp
    if arch.moe is None:
        around_mlp = 4 * edge
    else:
        around_mlp = 2 * edge + (tokens * arch.hidden_size * options.width if reduce_scatter else 0)
    working = edges * edge + max(attention_peak + 3 * edge, mlp * options.width + around_mlp)
    last = stage == layout.pp - 1
    head = head_bytes(arch, layout, micro, options, training=False) if last else 0
    # (the head runs beside the last layer's output and the inputs the schedule received ahead)
    beside_head = (edges + 1) * edge
    if head + beside_head >= working:
        terms["logits and log-prob buffers"] = head
        terms["hidden states beside the head"] = beside_head
    else:
        terms["activations"] = working
    return terms
