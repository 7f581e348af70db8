"""Megatron helpers shared by the infer and train strategies: model set-up, micro-batches, the pipelined
forward/backward, vocab-parallel log-probs and entropy, and gathering full HF-named weights."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
import math
from dataclasses import dataclass
from typing import Any, Callable, Iterator

import numpy as np
import torch
import torch.distributed as dist

from roll_backend import keys
from roll_backend.distributed.parallel import ParallelLayout
from roll_backend.models import hf_megatron_convert as convert
from roll_backend.models.megatron_builder import HFArch, ModelBuildOptions, build_gpt_stage
from roll_backend.protocol import DataProto

logger = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


# ---- model set-up ---------------------------------------------------------------------------------------

def use_transformer_engine(transformer_impl: str, device: str) -> bool:
    if transformer_impl == "local":
        return False
    try:
        import transformer_engine  # noqa: F401
        have_te = True
    except ImportError:
        have_te = False
    if transformer_impl == "transformer_engine" and not (have_te and device == "cuda"):
        raise ValueError("transformer_impl='transformer_engine' needs TransformerEngine and a cuda device; use 'local' or 'auto'.")
    return have_te and device == "cuda"


def load_hf_config(model_path: str):
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(model_path)


def stage_split(cfg, num_layers: int, layout: ParallelLayout) -> tuple[int | None, int | None]:
    """(first, last) stage layer counts: the config's, or default_stage_split's when it sets neither."""
    from roll_backend.strategies.megatron_config import default_stage_split

    if cfg.first_stage_layers is None and cfg.last_stage_layers is None:
        return default_stage_split(num_layers, layout.pp, layout.vpp)
    return cfg.first_stage_layers, cfg.last_stage_layers


def build_model_chunks(cfg, layout: ParallelLayout, device: str, swap_gate_up: bool = False):
    """This rank's model chunks (one per virtual pipeline stage; one without vpp) of the model in
    `cfg.model_path`, with the HF weights loaded.

    Returns (chunks, arch, hf_config). `cfg` is a MegatronInferConfig or MegatronTrainConfig.
    """
    from megatron.core import parallel_state as mpu
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    hf_config = load_hf_config(cfg.model_path)
    arch = HFArch.from_hf_config(hf_config)
    first_stage_layers, last_stage_layers = stage_split(cfg, arch.num_layers, layout)
    options = ModelBuildOptions(
        tp=layout.tp,
        pp=layout.pp,
        ep=layout.ep,
        etp=layout.etp,
        device=device,
        cp=layout.cp,
        vpp=layout.vpp,
        first_stage_layers=first_stage_layers,
        last_stage_layers=last_stage_layers,
        params_dtype=_DTYPES[cfg.params_dtype],
        use_cpu_initialization=True,  # same initial values at every TP size; the weights are loaded after
        mtp_num_layers=cfg.mtp_num_layers,
        mtp_loss_scaling_factor=getattr(cfg, "mtp_loss_scaling_factor", 0.1),
        value_head=cfg.value_head,
        use_transformer_engine=use_transformer_engine(cfg.transformer_impl, device),
        recompute_activations=getattr(cfg, "recompute_activations", False),
        use_torch_compile=cfg.use_torch_compile,
    )
    if cfg.mtp_num_layers:
        from roll_backend.patches import megatron_mtp

        megatron_mtp.apply()
    torch.manual_seed(cfg.seed)
    model_parallel_cuda_manual_seed(cfg.seed)
    chunks = []
    for vp_stage in (range(layout.vpp) if layout.vpp else [None]):
        model = build_gpt_stage(arch, options, vp_stage=vp_stage)
        model.to(device)
        convert.load_hf_weights(
            model, cfg.model_path, arch, mpu.get_tensor_model_parallel_rank(), mpu.get_tensor_model_parallel_world_size(),
            swap_gate_up=swap_gate_up, seed=cfg.seed,
            value_head_from_score=cfg.value_head and cfg.value_head_init == "score_head",
            etp_rank=mpu.get_expert_tensor_parallel_rank(), etp_size=mpu.get_expert_tensor_parallel_world_size(),
        )
        chunks.append(model)
    return chunks, arch, hf_config


def unwrap(model):
    """The GPTModel inside DDP / Float16Module wrappers."""
    while hasattr(model, "module"):
        model = model.module
    return model


def set_train_mode(chunks, training: bool) -> None:
    for chunk in chunks:
        unwrap(chunk).train(training)


class HeadCapture:
    """Holds the last output of the model's head (vocab-parallel logits [S, B, V/TP] or values [S, B, 1]).

    GPTModel returns a loss instead of logits whenever labels are passed, and with MTP labels must be passed
    (0.16.1 crashes on labels=None); a forward hook on the head gives the logits in both cases. The head is
    called for each MTP depth first and for the main logits last, so the last call wins. With labels, Megatron's
    vocab_parallel_cross_entropy then overwrites the logits in place (exp, normalise), so `copy=True` (needed
    with MTP) keeps a copy; the copy is part of the autograd graph (clone's backward is the identity).
    """

    def __init__(self, chunks: list, copy: bool = False):
        self.output: torch.Tensor | None = None
        self.copy = copy
        self.head_chunk = unwrap(chunks[-1])  # the head sits in the last model chunk of the last stage
        self.enabled = self.head_chunk.post_process
        if self.enabled:
            self.head_chunk.output_layer.register_forward_hook(self._hook)

    def applies_to(self, chunk) -> bool:
        return self.enabled and unwrap(chunk) is self.head_chunk

    def _hook(self, module, args, output):
        output = output[0] if isinstance(output, tuple) else output
        self.output = output.clone() if self.copy else output

    def pop(self) -> torch.Tensor:
        if self.output is None:
            raise RuntimeError("the model's head produced no output in this forward pass")
        output, self.output = self.output, None
        return output


# ---- micro-batches ----------------------------------------------------------------------------------------

@dataclass
class MicroBatch:
    """One micro-batch ready for GPTModel.forward. Padding rows (to fill the last micro-batch) are all zeros."""

    proto: DataProto  # the rows, for the loss function
    input_ids: torch.Tensor  # [b, T] int64
    position_ids: torch.Tensor  # [b, T] int64
    attention_mask: torch.Tensor  # [b, 1, T, T] bool, True = masked (causal + key padding)
    labels: torch.Tensor  # [b, T] int64, next token
    loss_mask: torch.Tensor  # [b, T] float, 1 where the next token is a response token
    responses: torch.Tensor  # [b, T_resp] int64
    # Token-budget and packed micro-batches (strategies.micro_batching): where each response token's prediction
    # sits in the output (None: the last T_resp columns), the input rows they hold, and THD packing parameters.
    gather: Any = None
    index: torch.Tensor | None = None
    packed_seq_params: Any = None

    @property
    def has_rows(self) -> bool:
        """False for an all-padding micro-batch (the interleaved schedule needs a multiple of PP of them)."""
        return bool(self.proto.batch[keys.ATTENTION_MASK].any())

    @property
    def response_slice(self) -> slice:
        """Positions whose output predicts the response tokens: [T - T_resp - 1, T - 1)."""
        total, resp = self.input_ids.shape[1], self.responses.shape[1]
        return slice(total - resp - 1, total - 1)


def require_columns(batch: DataProto, names: tuple[str, ...], what: str) -> None:
    present = set(batch.batch.keys()) if batch.batch is not None else set()
    missing = [n for n in names if n not in present]
    if missing:
        raise KeyError(f"{what} needs batch columns {missing}; the batch has {sorted(present)}")


def _pad_rows(value, rows: int):
    if rows == 0:
        return value
    if isinstance(value, torch.Tensor):
        return torch.cat([value, value.new_zeros(rows, *value.shape[1:])])
    return np.concatenate([value, np.full(rows, None, dtype=object)])


def micro_batch_count_multiple() -> int:
    """Megatron's interleaved schedule runs micro-batches in groups of PP: their count must be a multiple of it."""
    from megatron.core import parallel_state as mpu

    vpp = mpu.get_virtual_pipeline_model_parallel_world_size()
    return mpu.get_pipeline_model_parallel_world_size() if vpp and vpp > 1 else 1


def split_micro_batches(batch: DataProto, micro_batch_size: int, device: str, what: str) -> tuple[list[MicroBatch], int]:
    """Cut `batch` into as few equal micro-batches of at most `micro_batch_size` rows as it needs (under vpp a
    multiple of PP of them), padded with zero rows to the equal size; returns (micro-batches, real rows).
    Equal sizes rather than full ones: 4 rows are one micro-batch of 4, not 4 rows and 60 of padding."""
    from roll_backend.strategies.megatron_cp import cp_group_and_size

    require_columns(batch, (keys.INPUT_IDS, keys.ATTENTION_MASK, keys.RESPONSES), what)
    num_rows = len(batch)
    count_multiple = micro_batch_count_multiple()
    needed = -(-num_rows // micro_batch_size)  # ceil: micro-batches of at most micro_batch_size rows
    count = -(-needed // count_multiple) * count_multiple
    micro_batch_size = -(-num_rows // count) if count else micro_batch_size
    pad = count * micro_batch_size - num_rows
    tensors = {k: _pad_rows(v, pad) for k, v in batch.batch.items()}
    non_tensors = {k: _pad_rows(np.asarray(v, dtype=object), pad) for k, v in batch.non_tensor_batch.items()}
    # CP cuts every sequence into 2 x CP equal chunks.
    multiple = math.lcm(SEQUENCE_MULTIPLE, 2 * cp_group_and_size()[1])
    width = max(model_width(tensors[keys.ATTENTION_MASK], multiple), tensors[keys.RESPONSES].shape[1] + 1)
    width = -(-width // multiple) * multiple
    micro_batches = []
    for start in range(0, num_rows + pad, micro_batch_size):
        rows = slice(start, start + micro_batch_size)
        proto = DataProto.from_dict(
            tensors={k: v[rows] for k, v in tensors.items()},
            non_tensors={k: v[rows] for k, v in non_tensors.items()},
            meta_info=dict(batch.meta_info),
        )
        micro_batches.append(model_inputs(proto, device, width))
    return micro_batches, num_rows


# The model sees each batch at a width of a multiple of this many tokens, from its first non-padding column:
# prompts arrive left-padded to max_prompt_length, and CPU GEMM/softmax kernels ran a Megatron train step ~20%
# slower at 169 tokens than at 168 or 176 (bf16, torch 2.13); GPU kernels also prefer aligned lengths.
SEQUENCE_MULTIPLE = 8


def model_width(attention_mask: torch.Tensor, multiple: int = SEQUENCE_MULTIPLE) -> int:
    """Columns the model needs for a left-padded [b, T] batch: from the first column any row uses, rounded up to
    SEQUENCE_MULTIPLE (one width for the whole batch: pipeline stages exchange activations of one shape)."""
    used = attention_mask.bool().any(dim=0).nonzero()
    first = int(used[0]) if len(used) else attention_mask.shape[1] - 1
    return -(-(attention_mask.shape[1] - first) // multiple) * multiple


def _left_fit(tensor: torch.Tensor, width: int, value) -> torch.Tensor:
    """The last `width` columns of `tensor`, left-padded with `value` where it has fewer."""
    if width <= tensor.shape[1]:
        return tensor[:, tensor.shape[1] - width:]
    return torch.nn.functional.pad(tensor, (width - tensor.shape[1], 0), value=value)


def model_inputs(proto: DataProto, device: str, width: int) -> MicroBatch:
    input_ids = _left_fit(proto.batch[keys.INPUT_IDS].to(device), width, 0)
    attention = _left_fit(proto.batch[keys.ATTENTION_MASK].to(device).bool(), width, False)  # [b, T]
    responses = proto.batch[keys.RESPONSES].to(device)
    if keys.POSITION_IDS in proto.batch.keys():
        position_ids = _left_fit(proto.batch[keys.POSITION_IDS].to(device), width, 0)
    else:
        position_ids = (attention.long().cumsum(-1) - 1).clamp(min=0)
    total, resp_len = input_ids.shape[1], responses.shape[1]
    # Megatron's RoPE uses positions 0..T-1 and ignores position_ids; with a left-padded prompt followed by
    # the response this is a per-row shift of every position, which RoPE attention is invariant to.
    causal = torch.ones(total, total, dtype=torch.bool, device=device).tril()
    visible = causal[None, None] & attention[:, None, None, :]
    if keys.RESPONSE_MASK in proto.batch.keys():
        response_mask = proto.batch[keys.RESPONSE_MASK].to(device)
    else:
        response_mask = attention[:, total - resp_len:]
    loss_mask = torch.zeros(input_ids.shape, dtype=torch.float32, device=device)
    loss_mask[:, total - resp_len - 1: total - 1] = response_mask.float()
    labels = torch.roll(input_ids, shifts=-1, dims=1)
    labels[:, -1] = 0
    return MicroBatch(proto, input_ids, position_ids, ~visible, labels, loss_mask, responses)


# ---- vocab-parallel log-probs and entropy ---------------------------------------------------------------------

def vocab_parallel_log_probs(logits: torch.Tensor, labels: torch.Tensor, vocab_size: int, with_entropy: bool
                             ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """log softmax(logits)[label] and the entropy of softmax(logits), without gathering the vocabulary.

    logits: [b, t, V/TP] this rank's vocabulary slice (columns past `vocab_size` are padding and ignored);
    labels: [b, t] int64 global token ids. Returns float32 [b, t] tensors, differentiable w.r.t. logits.
    Max is all-reduced without gradient (it only stabilises); sums use Megatron's reduce (identity backward).
    """
    from megatron.core import parallel_state as mpu
    from megatron.core.tensor_parallel.mappings import reduce_from_tensor_model_parallel_region

    tp_rank = mpu.get_tensor_model_parallel_rank()
    local_vocab = logits.shape[-1]
    start = tp_rank * local_vocab
    valid = max(0, min(local_vocab, vocab_size - start))
    logits = logits[..., :valid].float()
    with torch.no_grad():
        if valid:
            row_max = logits.max(dim=-1).values
        else:
            row_max = torch.full(logits.shape[:-1], float("-inf"), device=logits.device)
        dist.all_reduce(row_max, op=dist.ReduceOp.MAX, group=mpu.get_tensor_model_parallel_group())
    shifted = logits - row_max.unsqueeze(-1)
    exp = shifted.exp()
    sum_exp = reduce_from_tensor_model_parallel_region(exp.sum(dim=-1))
    log_sum_exp = sum_exp.log()
    local_label = labels - start
    in_range = (local_label >= 0) & (local_label < valid)
    index = local_label.clamp(0, max(valid - 1, 0)).unsqueeze(-1)
    picked = shifted.gather(-1, index).squeeze(-1) if valid else torch.zeros_like(row_max)
    picked = reduce_from_tensor_model_parallel_region(picked * in_range)
    log_probs = picked - log_sum_exp
    entropy = None
    if with_entropy:
        # H = log Z - sum_v p_v z_v, with z shifted by the max (H is shift-invariant).
        expected_logit = reduce_from_tensor_model_parallel_region((exp * shifted).sum(dim=-1)) / sum_exp
        entropy = log_sum_exp - expected_logit
    return log_probs, entropy


def per_token_outputs(micro: MicroBatch, head_output: torch.Tensor, arch: HFArch, temperature: float,
                      value_head: bool, with_entropy: bool) -> dict[str, torch.Tensor]:
    """Response-side tensors from the head's output [T, b, ...] (under CP: this rank's [T/CP, b, ...] in
    Megatron's chunk order): {LOG_PROBS, ENTROPY} or {VALUES}, each [b, T_resp] in token order on every CP rank.
    Token-budget and packed micro-batches (`micro.gather`) pick each response token's output position."""
    from roll_backend.strategies import megatron_cp

    cp = megatron_cp.cp_group_and_size()[1]
    if cp == 1:
        if micro.gather is None:
            positions = head_output[micro.response_slice].transpose(0, 1)  # [b, T_resp, V/TP] or [b, T_resp, 1]
        else:
            positions = micro.gather.take(head_output.transpose(0, 1))
        labels = micro.responses
    else:  # every local position, gathered into token order after the per-token reduction
        positions = head_output.transpose(0, 1)
        labels = megatron_cp.slice_for_this_cp_rank({"labels": micro.labels})["labels"]

    def to_responses(per_position: torch.Tensor) -> torch.Tensor:  # -> [b, T_resp]
        if cp == 1:
            return per_position
        full = megatron_cp.gather_sequence(per_position, dim=1)  # [b, T] in token order
        return full[:, micro.response_slice] if micro.gather is None else micro.gather.take(full)

    if value_head:
        out = {keys.VALUES: to_responses(positions[..., 0].float())}
    else:
        log_probs, entropy = vocab_parallel_log_probs(positions / temperature, labels, arch.vocab_size, with_entropy)
        out = {keys.LOG_PROBS: to_responses(log_probs)}
        if entropy is not None:
            out[keys.ENTROPY] = to_responses(entropy)
    if micro.gather is not None:  # columns the micro-batch did not keep: 0, as they are outside every loss mask
        out = {name: torch.where(micro.gather.valid, value, torch.zeros_like(value)) for name, value in out.items()}
    return out


# ---- the pipelined forward / backward ---------------------------------------------------------------------

def run_pipeline(chunks: list, capture: HeadCapture, micro_batches: list[MicroBatch], forward_only: bool, mtp: bool,
                 loss_func: Callable[[MicroBatch, torch.Tensor], tuple[torch.Tensor, dict]]) -> list[dict]:
    """Run Megatron's schedule (interleaved with several model chunks) over the micro-batches; returns the
    loss_func dicts (last PP stage only, else []). Under CP each rank feeds the model its chunks of the sequence."""
    from megatron.core.pipeline_parallel import get_forward_backward_func

    from roll_backend.strategies.megatron_cp import slice_for_this_cp_rank

    def forward_step(data_iterator, chunk):
        micro = next(data_iterator)
        inputs = {"input_ids": micro.input_ids, "position_ids": micro.position_ids, "attention_mask": micro.attention_mask}
        if mtp:
            inputs.update(labels=micro.labels, loss_mask=micro.loss_mask)
        extra = {"packed_seq_params": micro.packed_seq_params} if micro.packed_seq_params is not None else {}
        output = chunk(**slice_for_this_cp_rank(inputs), **extra)
        if capture.applies_to(chunk):
            output = capture.pop()
        return output, functools.partial(loss_func, micro)

    first = micro_batches[0]
    iterators = [iter(micro_batches) for _ in chunks]  # the interleaved schedule reads one per model chunk
    if len({tuple(m.input_ids.shape) for m in micro_batches}) > 1:
        # Token-budget / packed micro-batches differ in shape: pipeline stages then exchange shapes before
        # activations (the schedule's seq_length and micro_batch_size only size fixed-shape receives).
        for chunk in chunks:
            unwrap(chunk).config.variable_seq_lengths = True
    real = sum(micro.has_rows for micro in micro_batches)
    with mtp_loss_averaged_over(real, len(micro_batches)) if mtp and not forward_only else contextlib.nullcontext():
        return get_forward_backward_func()(
            forward_step_func=forward_step,
            data_iterator=iterators if len(chunks) > 1 else iterators[0],
            model=list(chunks),
            num_microbatches=len(micro_batches),
            seq_length=first.input_ids.shape[1],
            micro_batch_size=first.input_ids.shape[0],
            forward_only=forward_only,
        )


@contextlib.contextmanager
def mtp_loss_averaged_over(real_micro_batches: int, all_micro_batches: int):
    """Megatron scales each micro-batch's MTP loss gradient by 1 / num_microbatches, which counts the all-padding
    micro-batches the interleaved schedule needs: the MTP gradient would shrink with vpp. This rescales it to
    1 / (micro-batches with rows), as the main loss and the reported `mtp_loss` are."""
    from megatron.core.transformer.multi_token_prediction import MTPLossAutoScaler

    factor = all_micro_batches / max(1, real_micro_batches)
    original = MTPLossAutoScaler.__dict__["set_loss_scale"]
    MTPLossAutoScaler.set_loss_scale = staticmethod(lambda scale: original.__func__(scale * factor))
    try:
        yield
    finally:
        MTPLossAutoScaler.set_loss_scale = original


def is_last_stage() -> bool:
    from megatron.core import parallel_state as mpu

    return mpu.is_pipeline_last_stage(ignore_virtual=True)


def forward_per_token(model, capture: HeadCapture, batch: DataProto, arch: HFArch, plan, device: str,
                      temperature: float, value_head: bool, with_entropy: bool, mtp: bool, what: str) -> DataProto | None:
    """Forward-only per-token outputs of the batch's responses, in its row order; a DataProto on the last PP
    stage, else None. `plan`: a micro_batching.BatchingPlan (fixed rows, token budget or packing)."""
    from roll_backend.strategies import micro_batching  # builds on this module

    micro_batches, num_rows = micro_batching.split(batch, plan, device, what)
    temperature = float(batch.meta_info.get(keys.META_TEMPERATURE, temperature))

    def collect(micro: MicroBatch, head_output: torch.Tensor):
        outputs = per_token_outputs(micro, head_output, arch, temperature, value_head, with_entropy)
        return torch.zeros((), device=head_output.device), {k: v.detach() for k, v in outputs.items()}

    set_train_mode(model, False)
    with torch.no_grad():
        stored = run_pipeline(model, capture, micro_batches, forward_only=True, mtp=mtp, loss_func=collect)
    if not is_last_stage():
        return None
    return DataProto.from_dict(tensors=collect_rows(micro_batches, stored, num_rows))


def collect_rows(micro_batches: list[MicroBatch], stored: list[dict], num_rows: int) -> dict[str, torch.Tensor]:
    """The per-micro-batch output dicts as [num_rows, ...] CPU tensors in the input's row order."""
    tensors = {name: torch.cat([d[name] for d in stored]).cpu() for name in stored[0]}
    if micro_batches[0].index is None:  # fixed micro-batches: in order, zero rows padded at the end
        return {name: value[:num_rows] for name, value in tensors.items()}
    index = torch.cat([m.index for m in micro_batches])
    ordered = {}
    for name, value in tensors.items():
        ordered[name] = torch.empty_like(value)
        ordered[name][index] = value
    return ordered


def batching_plan(strategy, batch: DataProto):
    """The strategy's micro-batching for this call (its config, overridable through batch.meta_info)."""
    from roll_backend.strategies import micro_batching

    from roll_backend.strategies.megatron_cp import cp_group_and_size

    thd = use_transformer_engine(strategy.config.transformer_impl, strategy.device)
    plan = micro_batching.BatchingPlan.from_config(strategy.config, batch.meta_info, thd)
    if plan.max_tokens is not None and micro_batch_count_multiple() > 1:
        raise ValueError("max_tokens_per_microbatch with interleaved stages (vpp) is not supported yet: the interleaved "
                         "schedule needs a multiple of pp micro-batches; set vpp=null or use micro_batch_size")
    # CP cuts every sequence into 2 x CP equal chunks.
    return dataclasses.replace(plan, width_multiple=math.lcm(SEQUENCE_MULTIPLE, 2 * cp_group_and_size()[1]))


# ---- full HF-named weights ------------------------------------------------------------------------------------

def _all_gather_tp(shard: torch.Tensor) -> list[torch.Tensor]:
    from megatron.core import parallel_state as mpu

    return _all_gather(shard, mpu.get_tensor_model_parallel_group())


def _expert_gathers() -> dict:
    """iter_stage_hf_tensors' gathers over the expert-tensor-parallel and expert-parallel groups."""
    from megatron.core import parallel_state as mpu

    return dict(
        all_gather_etp=functools.partial(_all_gather, group=mpu.get_expert_tensor_parallel_group()),
        all_gather_ep=functools.partial(_all_gather, group=mpu.get_expert_model_parallel_group()),
        ep_size=mpu.get_expert_model_parallel_world_size(),
    )


def _all_gather(shard: torch.Tensor, group) -> list[torch.Tensor]:
    size = dist.get_world_size(group)
    if size == 1:
        return [shard]
    shards = [torch.empty_like(shard) for _ in range(size)]
    dist.all_gather(shards, shard.contiguous(), group=group)
    return shards


def iter_full_hf_tensors(chunks: list, arch: HFArch, include_mtp: bool = False) -> Iterator[tuple[str, torch.Tensor]]:
    """Every HF-named tensor of the whole model, in HF layer order, on every rank (gathered over TP, broadcast
    over PP); MTP layers (`model.mtp_layers.*`) only with `include_mtp`. With interleaved stages layers run
    virtual stage by virtual stage: chunk 0 of every PP rank, then chunk 1 of every PP rank, and so on."""
    from megatron.core import parallel_state as mpu

    chunks = [unwrap(chunk) for chunk in chunks]
    pp_group = mpu.get_pipeline_model_parallel_group()
    pp_size, pp_rank = mpu.get_pipeline_model_parallel_world_size(), mpu.get_pipeline_model_parallel_rank()
    tp_size = mpu.get_tensor_model_parallel_world_size()
    experts = _expert_gathers()
    if pp_size == 1:
        for chunk in chunks:
            yield from convert.iter_stage_hf_tensors(chunk, arch, _all_gather_tp, **experts, include_mtp=include_mtp)
        return
    metadata = [None] * pp_size
    local_meta = [convert.stage_hf_metadata(chunk, arch, tp_size, mpu.get_expert_tensor_parallel_world_size(),
                                            experts["ep_size"], include_mtp) for chunk in chunks]
    dist.all_gather_object(metadata, local_meta, group=pp_group)
    device = next(chunks[0].parameters()).device
    for vp_stage, stage in ((v, s) for v in range(len(chunks)) for s in range(pp_size)):
        stage_meta = metadata[stage][vp_stage]
        source = dist.get_global_rank(pp_group, stage)
        local = (convert.iter_stage_hf_tensors(chunks[vp_stage], arch, _all_gather_tp, **experts, include_mtp=include_mtp)
                 if stage == pp_rank else None)
        for name, shape, dtype in stage_meta:
            if local is not None:
                local_name, tensor = next(local)
                assert local_name == name, (local_name, name)
                tensor = tensor.contiguous()
            else:
                tensor = torch.empty(shape, dtype=dtype, device=device)
            dist.broadcast(tensor, src=source, group=pp_group)
            yield name, tensor


def bucketed(named_tensors: Iterator[tuple[str, torch.Tensor]], bucket_bytes: int) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """Group (name, tensor) pairs into lists of at most `bucket_bytes` (a larger tensor is a bucket alone)."""
    bucket, size = [], 0
    for name, tensor in named_tensors:
        nbytes = tensor.numel() * tensor.element_size()
        if bucket and size + nbytes > bucket_bytes:
            yield bucket
            bucket, size = [], 0
        bucket.append((name, tensor))
        size += nbytes
    if bucket:
        yield bucket


def strategy_forward(strategy, batch: DataProto, value_head: bool, what: str) -> DataProto | None:
    """Forward-only per-token outputs for a Megatron strategy (infer or train): log-probs or values."""
    if strategy.model is None:
        raise RuntimeError(f"{what}: the strategy is not initialised; call initialize() first")
    config = strategy.config
    if value_head != config.value_head:
        kind = "a value head" if value_head else "an LM head"
        raise ValueError(f"{what} needs {kind}; this strategy has value_head={config.value_head}")
    return forward_per_token(
        strategy.model, strategy.capture, batch, strategy.arch, batching_plan(strategy, batch), strategy.device,
        config.temperature, value_head, config.compute_entropy, config.mtp_num_layers > 0, what,
    )
