"""LoRA on megatron-core's own parallel linears (`strategy.lora`): low-rank adapters beside the attention and MLP
projections of a frozen base (and of its MTP layers), correct at every TP / PP / vpp / CP / EP layout.

One adapter per Hugging Face module the user targets (PEFT's names: q_proj, k_proj, v_proj, o_proj, gate_proj,
up_proj, down_proj), with PEFT's math: y = W x + (alpha / r) * B A dropout(x) (dropout in training only). It sits on
the Megatron linear that holds the module (q/k/v on the fused `linear_qkv`, gate/up on `linear_fc1`) as a forward
hook that adds the low-rank branch to the linear's output, and as child parameters of the linear
(`<linear>.lora.<module>.A|B`), so they follow it through PP stages and vpp chunks. On a MoE model the MLP modules are
every routed expert's (named `mlp.experts.<global index>.<module>`, held by the expert's EP rank, expert-parallel like
its weights) and the shared expert's (`mlp.shared_expert.<module>`).
Tensor parallelism, as the base layer splits (over its own group: TP, or expert TP for a routed expert's linears):

- column-parallel bases (linear_qkv, linear_fc1): A [r, in] whole on every TP rank, B [out/TP, r] split like the
  base's rows (q/k/v per key-value group, gate and up each split). The branch's r-wide activation is summed over TP
  in backward (`copy_to_tensor_model_parallel_region`), so A's gradient is whole and the same on every TP rank;
- row-parallel bases (linear_proj, linear_fc2): A [r, in/TP] split like the base's columns, its partial products
  summed over TP in forward (`reduce_from_tensor_model_parallel_region`), B [out, r] whole.

The branch communicates as its base does (`Comm`). Under sequence parallelism (MoE models at tp > 1) a column
base's input is this rank's part of the sequence: the r-wide activation is gathered over the sequence, and A, which
then sees only that part, is marked `sequence_parallel` so finalize_model_grads sums its gradient over TP (as
Megatron's norms); a row base's r-wide partial sums are reduce-scattered to the sequence part, and B is marked so.
A routed expert's linears at expert TP > 1 communicate nothing (the token dispatcher gathers their input and adds up
their partial outputs): the branch's partial outputs and input gradients go the same way, and the whole parameter
(column: A, row: B), whose gradient each expert-TP rank holds a share of, is summed over expert TP after
finalize_model_grads (`finalize_grads`).

Every base parameter is frozen (no gradient, no optimizer state, not in the gradient norm); only adapters train.
Adapters start as PEFT starts them (B = 0, so the model is the base; A Kaiming-uniform or Gaussian), drawn on their
full Hugging Face shapes from a seed and the module's name, so every layout starts from the same adapters.
`merged_shard` gives a base weight's shard with its adapters' update added (float32 math), which the HF export and
the weight sync read: the base itself is never changed. `adapters_disabled` runs the frozen base (the reference).
"""

from __future__ import annotations

import contextlib
import enum
import math
import zlib

import torch

# The PEFT target modules each Megatron linear of a layer holds (attention under `self_attention`, the MLP's under
# `mlp`, each routed expert's under `mlp.experts.local_experts.<j>`, a shared expert's under `mlp.shared_experts`).
ATTENTION_LINEARS = {"linear_qkv": ("q_proj", "k_proj", "v_proj"), "linear_proj": ("o_proj",)}
MLP_LINEARS = {"linear_fc1": ("gate_proj", "up_proj"), "linear_fc2": ("down_proj",)}
ROW_PARALLEL = ("linear_proj", "linear_fc2")
MTP_HF_PREFIX = "model.mtp_layers."  # (mtp.py's naming of Megatron's `mtp.layers.<i>.transformer_layer`)


class Comm(enum.Enum):
    """How a base linear communicates over its TP group, and so its adapters' branch."""

    TENSOR = "tensor"  # column: input copied to every rank; row: partial outputs all-reduced
    SEQUENCE = "sequence"  # sequence parallelism: column gathers the input's sequence, row reduce-scatters
    EXPERT = "expert"  # a routed expert at expert TP / EP: none (the token dispatcher does it)


class LowRank(torch.nn.Module):
    """One target module's A [r, in(/TP)] and B [out(/TP), r]; `hf_name` is the module's Hugging Face name (global
    layer number), `row` says which of the two TP splits (row-parallel base: A by columns; column-parallel: B by
    rows), `shard` is (this rank's index, the number of shards) of that split."""

    def __init__(self, a: torch.Tensor, b: torch.Tensor, hf_name: str, row: bool, shard: tuple[int, int]):
        super().__init__()
        self.A = torch.nn.Parameter(a)
        self.B = torch.nn.Parameter(b)
        self.hf_name, self.row, self.shard = hf_name, row, shard

    @property
    def expert(self) -> bool:
        """A routed expert's adapter: expert-parallel like the expert's weights (megatron-core's `allreduce=False`)."""
        return not getattr(self.A, "allreduce", True)

    def split_parameter(self) -> tuple[torch.nn.Parameter, int]:
        """The TP-split parameter and the axis it is split on."""
        return (self.A, 1) if self.row else (self.B, 0)

    def whole_parameter(self) -> torch.nn.Parameter:
        """The parameter every TP rank holds whole."""
        return self.B if self.row else self.A


class LinearAdapters(torch.nn.Module):
    """The adapters of one Megatron linear (its `lora` child) and the branch its forward hook adds.

    `pieces`: a column-parallel base's output columns on this rank, in order, as (module, width) repeated `groups`
    times (q/k/v per local key-value group; gate then up once); None for a row-parallel base."""

    def __init__(
        self, modules: dict[str, LowRank], scaling: float, comm: Comm, group, pieces=None, groups: int = 1, dropout=0.0
    ):
        super().__init__()
        self.parts = torch.nn.ModuleDict(modules)
        self.scaling, self.pieces, self.groups, self.dropout = scaling, pieces, groups, dropout
        self.comm, self.group = comm, group  # the base linear's, which the branch mirrors
        self.enabled = True

    @property
    def row_parallel(self) -> bool:
        return self.pieces is None

    def branch(self, x: torch.Tensor) -> torch.Tensor:
        """(alpha / r) B A x for this rank's output columns, in the base layer's output layout."""
        names = list(self.parts)
        rank = self.parts[names[0]].A.shape[0]
        if self.dropout and self.training:  # PEFT's: on the branch's input, in training only
            with self._dropout_rng():
                x = torch.nn.functional.dropout(x, self.dropout, training=True)
        h = self._communicate(x @ torch.cat([self.parts[n].A for n in names]).to(x.dtype).t())  # [..., modules * r]
        outputs = {n: part @ self.parts[n].B.to(x.dtype).t() for n, part in zip(names, h.split(rank, -1))}
        return self.scaling * self._assemble(outputs)

    def _dropout_rng(self):
        """Megatron's rule: an input every rank of the group holds whole (a column base's, but under sequence
        parallelism) draws its mask from the default generator, the same on each; a split input (a row base's, a
        sequence part) from the model-parallel (expert-parallel) tracker, which differs between ranks."""
        from megatron.core import tensor_parallel as tpl

        if not self.row_parallel and self.comm is not Comm.SEQUENCE:
            return contextlib.nullcontext()
        if self.comm is Comm.EXPERT:
            return tpl.get_cuda_rng_tracker().fork(tpl.get_expert_parallel_rng_tracker_name())
        return tpl.get_cuda_rng_tracker().fork()

    def _communicate(self, h: torch.Tensor) -> torch.Tensor:
        """The r-wide activation as the base linear would communicate it (see the module's docstring)."""
        from megatron.core import tensor_parallel as tpl

        if self.comm is Comm.EXPERT:
            return h  # partial sums (row) / partial input gradients (column), added up by the token dispatcher
        if self.row_parallel:  # the partial sums over this rank's input columns
            if self.comm is Comm.SEQUENCE:
                return tpl.reduce_scatter_to_sequence_parallel_region(h, group=self.group)
            return tpl.reduce_from_tensor_model_parallel_region(h, group=self.group)
        if self.comm is Comm.SEQUENCE:  # backward: reduce-scatter, every rank's output columns' share
            return tpl.gather_from_sequence_parallel_region(h, group=self.group)
        return tpl.copy_to_tensor_model_parallel_region(h, group=self.group)  # backward: every rank's columns' share

    def delta(self) -> torch.Tensor:
        """This rank's shard of the update (alpha / r) B A, in the base weight's layout, float32."""
        updates = {n: (part.B.float() @ part.A.float()).t() for n, part in self.parts.items()}  # [in, out_n]
        return self.scaling * self._assemble(updates).t()

    def _assemble(self, outputs: dict[str, torch.Tensor]) -> torch.Tensor:
        """Per-module outputs [..., out_n] -> the base layer's output columns (untargeted modules: zeros)."""
        if self.row_parallel:
            (only,) = outputs.values()
            return only
        like = next(iter(outputs.values()))
        columns = []
        for name, width in self.pieces:
            out = outputs.get(name)
            if out is None:
                out = like.new_zeros(*like.shape[:-1], self.groups * width)
            columns.append(out.reshape(*out.shape[:-1], self.groups, width))
        width = self.groups * sum(width for _, width in self.pieces)  # (not -1: an expert may get no tokens)
        return torch.cat(columns, -1).reshape(*like.shape[:-1], width)


def _full_a(lora, name: str, shape: tuple[int, int], seed: int) -> torch.Tensor:
    """A on its full HF shape [r, in], the same draw at every layout (seeded by the seed and the module's name)."""
    generator = torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))
    if lora.init == "gaussian":
        return torch.randn(shape, generator=generator) / lora.rank
    bound = 1.0 / math.sqrt(shape[1])  # kaiming_uniform_(a=sqrt(5)), PEFT's default
    return (torch.rand(shape, generator=generator) * 2 - 1) * bound


def inject(model, lora, arch, seed: int, value_head: bool = False) -> int:
    """Freeze every parameter of this stage `model` (an unwrapped GPTModel) and give its targeted linears adapters;
    returns how many adapter parameters (elements) this rank holds. `value_head`: a critic, whose value head (new,
    not the base's) trains beside the adapters, as PEFT's modules_to_save trains a classifier's head."""
    for param in model.parameters():
        param.requires_grad_(False)
    if value_head and model.post_process:
        for param in model.output_layer.parameters():
            param.requires_grad_(True)
    offset = model.decoder.layers[0].layer_number - 1 if len(model.decoder.layers) else 0
    layers = [(layer, f"model.layers.{offset + index}") for index, layer in enumerate(model.decoder.layers)]
    if getattr(model, "mtp_process", False):  # MTP layers' transformer layers, under their HF names (mtp.py)
        layers += [
            (mtp_layer.transformer_layer, f"{MTP_HF_PREFIX}{depth}") for depth, mtp_layer in enumerate(model.mtp.layers)
        ]
    count = 0
    for layer, hf_layer in layers:
        for linear, name, hf_prefix, ffn, expert in _sites(layer, arch, hf_layer):
            modules = [m for m in (ATTENTION_LINEARS | MLP_LINEARS)[name] if m in lora.target_modules]
            if modules:
                count += _adapt(linear, name, modules, hf_prefix, lora, arch, ffn, seed, expert=expert)
    if model.pre_process:
        # With a frozen embedding the first layer's input needs no gradient, and a recomputed (checkpointed) layer
        # would then give its adapters none: make the embedding's output ask for one.
        model.embedding.register_forward_hook(_needs_grad)
    return count


def _sites(layer, arch, hf_layer: str):
    """(linear, its name, the HF prefix of its modules, the MLP's hidden width, whether a routed expert's) for each
    linear adapters may sit on: attention, then the dense MLP, or each routed expert of this rank and the shared
    expert."""
    for name in ATTENTION_LINEARS:
        yield layer.self_attention.get_submodule(name), name, f"{hf_layer}.self_attn", None, False
    mlps = [(layer.mlp, f"{hf_layer}.mlp", arch.ffn_hidden_size, False)]
    if arch.moe is not None:
        from roll_backend.strategies.megatron.moe_convert import first_local_expert

        first = first_local_expert(layer)
        experts = layer.mlp.experts.local_experts
        mlps = [
            (mlp, f"{hf_layer}.mlp.experts.{first + j}", arch.moe.expert_ffn_hidden_size, True)
            for j, mlp in enumerate(experts)
        ]
        if arch.moe.shared_expert_ffn_hidden_size:
            mlps.append(
                (
                    layer.mlp.shared_experts,
                    f"{hf_layer}.mlp.shared_expert",
                    arch.moe.shared_expert_ffn_hidden_size,
                    False,
                )
            )
    for mlp, hf_prefix, ffn, expert in mlps:
        for name in MLP_LINEARS:
            yield mlp.get_submodule(name), name, hf_prefix, ffn, expert


def _comm(linear, size: int) -> Comm:
    if getattr(linear, "explicit_expert_comm", False):
        return Comm.EXPERT
    return Comm.SEQUENCE if linear.sequence_parallel and size > 1 else Comm.TENSOR


def _adapt(linear, name: str, modules: list[str], hf_prefix: str, lora, arch, ffn, seed: int, expert: bool) -> int:
    """Give `linear` adapters for `modules` and its forward hook; returns their parameter count on this rank.
    A routed expert's adapters are expert-parallel like its weights (`allreduce=False`: DDP reduces their gradients
    over the expert-data-parallel group)."""
    from megatron.core.tensor_parallel import set_tensor_model_parallel_attributes

    group = linear.tp_group  # TP, or expert TP for a routed expert's linears
    tp, tp_rank = torch.distributed.get_world_size(group), torch.distributed.get_rank(group)
    comm = _comm(linear, tp)
    full_in, full_out, pieces = _module_shapes(arch, tp, ffn or arch.ffn_hidden_size)
    row = name in ROW_PARALLEL
    parts, count = {}, 0
    for module in modules:
        hf_name = f"{hf_prefix}.{module}"
        a = _full_a(lora, hf_name, (lora.rank, full_in[module]), seed)
        if row:
            a = a.chunk(tp, dim=1)[tp_rank]
        b = torch.zeros(full_out[module] // (1 if row else tp), lora.rank)
        device, dtype = linear.weight.device, linear.weight.dtype
        part = LowRank(a.to(device, dtype), b.to(device, dtype), hf_name, row, (tp_rank, tp))
        split, axis = part.split_parameter()
        whole = part.whole_parameter()
        set_tensor_model_parallel_attributes(split, True, axis, 1)  # in the gradient norm on every TP rank
        if comm is Comm.SEQUENCE:
            whole.sequence_parallel = True  # its gradient, from this rank's part of the sequence, summed over TP
        if expert:
            part.A.allreduce = part.B.allreduce = False
            # The gradient norm of the expert optimizer counts its parameters over (expert TP, EP, PP): the whole one
            # once per expert-TP group (`shared` elsewhere: megatron-core's mark for "counted on another rank").
            whole.tensor_model_parallel = True
            whole.shared = tp_rank > 0
        parts[module] = part
        count += part.A.numel() + part.B.numel()
    layout, layout_groups = (None, 1) if row else pieces[name]
    linear.lora = LinearAdapters(parts, lora.alpha / lora.rank, comm, group, layout, layout_groups, lora.dropout)
    linear.register_forward_hook(_add_branch)
    return count


def _module_shapes(arch, tp: int, ffn: int):
    """(input width, output width) of each target module on its full HF shape (`ffn`: the MLP's hidden width), and
    how a column-parallel base's local output columns split into modules: {linear name: ([(module, width)],
    repeats)} (q/k/v per local key-value group)."""
    full_out = {
        "q_proj": arch.num_heads * arch.head_dim,
        "k_proj": arch.num_kv_heads * arch.head_dim,
        "v_proj": arch.num_kv_heads * arch.head_dim,
        "o_proj": arch.hidden_size,
        "gate_proj": ffn,
        "up_proj": ffn,
        "down_proj": arch.hidden_size,
    }
    full_in = {name: arch.hidden_size for name in full_out} | {
        "o_proj": arch.num_heads * arch.head_dim,
        "down_proj": ffn,
    }
    q_width = arch.num_heads // arch.num_kv_heads * arch.head_dim
    pieces = {
        "linear_qkv": (
            [("q_proj", q_width), ("k_proj", arch.head_dim), ("v_proj", arch.head_dim)],
            arch.num_kv_heads // tp,
        ),
        "linear_fc1": ([("gate_proj", ffn // tp), ("up_proj", ffn // tp)], 1),
    }
    return full_in, full_out, pieces


def _add_branch(linear, args, output):
    adapters = linear.lora
    if not adapters.enabled:
        return output
    out, bias = output
    return out + adapters.branch(args[0]).to(out.dtype), bias


def _needs_grad(module, args, output):
    if torch.is_grad_enabled() and not output.requires_grad:
        return output.detach().requires_grad_(True)
    return output


def adapted_linears(chunks) -> list[LinearAdapters]:
    from roll_backend.strategies.megatron.builder import unwrap

    return [m for chunk in chunks for m in unwrap(chunk).modules() if isinstance(m, LinearAdapters)]


@contextlib.contextmanager
def adapters_disabled(chunks):
    """The frozen base inside the block (every rank of the model must enter it alike)."""
    adapters = adapted_linears(chunks)
    for adapter in adapters:
        adapter.enabled = False
    try:
        yield
    finally:
        for adapter in adapters:
            adapter.enabled = True


def finalize_grads(finalize):
    """`finalize` (megatron-core's finalize_model_grads, which the schedule calls once per step after the backward
    passes), then the expert-TP sum of the gradients of routed experts' whole adapters (see the module's docstring)."""

    def finalize_with_expert_tp(model, *args, **kwargs):
        result = finalize(model, *args, **kwargs)
        _sum_expert_tp_grads(model)
        return result

    return finalize_with_expert_tp


def _sum_expert_tp_grads(chunks) -> None:
    from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

    by_group: dict = {}
    for adapters in adapted_linears(chunks):
        if adapters.comm is Comm.EXPERT and torch.distributed.get_world_size(adapters.group) > 1:
            for part in adapters.parts.values():
                param = part.whole_parameter()
                grad = param.main_grad if hasattr(param, "main_grad") else param.grad  # DDP's buffer, else autograd's
                if grad is not None:
                    by_group.setdefault(adapters.group, []).append(grad)
    for group, grads in by_group.items():
        coalesced = _flatten_dense_tensors(grads)
        torch.distributed.all_reduce(coalesced, group=group)
        for grad, summed in zip(grads, _unflatten_dense_tensors(coalesced, grads)):
            grad.copy_(summed)


def merged_shard(model, megatron_name: str, shard: torch.Tensor) -> torch.Tensor:
    """A base weight's shard plus its adapters' update (float32 math, cast back); the shard itself otherwise."""
    if not megatron_name.endswith(".weight"):
        return shard
    module = model.get_submodule(megatron_name[: -len(".weight")])
    adapters = getattr(module, "lora", None)
    if not isinstance(adapters, LinearAdapters) or not adapters.enabled:
        return shard
    return (shard.float() + adapters.delta().to(shard.device)).to(shard.dtype)


def _trained_heads(chunks) -> dict[str, torch.nn.Parameter]:
    """The parameters that train beside the adapters, by checkpoint key: a critic's value head (replicated over TP,
    on the last stage)."""
    from roll_backend.strategies.megatron.builder import unwrap
    from roll_backend.strategies.megatron.layers import ValueHead

    heads = {}
    for chunk in chunks:
        head = getattr(unwrap(chunk), "output_layer", None)
        if isinstance(head, ValueHead) and head.weight.requires_grad:
            heads.update({f"value_head.{name}": param for name, param in head.named_parameters()})
    return heads


def adapter_sharded_state(chunks) -> dict:
    """Every adapter parameter of this rank as a dist_checkpointing ShardedTensor keyed by its Hugging Face module
    name (`<module>.lora_A|lora_B`), split over TP as it is held, and a critic's value head: an adapter-only
    checkpoint (the frozen base comes from the model folder again) that loads at another TP / PP / vpp / DP layout.
    The tensors are the parameters themselves, which the optimizer's sharded state matches by identity."""
    from megatron.core import parallel_state as mpu
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    dp_rank = mpu.get_data_parallel_rank(with_context_parallel=True)
    state = {}
    for adapters in adapted_linears(chunks):
        for part in adapters.parts.values():
            split, axis = part.split_parameter()
            shard, shards = part.shard  # over TP, or expert TP
            # A routed expert's adapters live on one EP rank and repeat over the expert-data-parallel group.
            replica = mpu.get_expert_data_parallel_rank() if part.expert else dp_rank
            for label, param in (("lora_A", part.A), ("lora_B", part.B)):
                key = f"{part.hf_name}.{label}"
                if param is split:
                    state[key] = ShardedTensor.from_rank_offsets(
                        key, param, (axis, shard, shards), replica_id=(0, replica)
                    )
                else:
                    state[key] = ShardedTensor.from_rank_offsets(key, param, replica_id=(shard, replica))
    tp_rank = mpu.get_tensor_model_parallel_rank()
    for key, param in _trained_heads(chunks).items():
        state[key] = ShardedTensor.from_rank_offsets(key, param, replica_id=(tp_rank, dp_rank))
    return state


def load_adapters(chunks, loaded: dict) -> None:
    """Copy `adapter_sharded_state`'s loaded tensors into this rank's adapters."""
    with torch.no_grad():
        for adapters in adapted_linears(chunks):
            for part in adapters.parts.values():
                part.A.copy_(loaded[f"{part.hf_name}.lora_A"])
                part.B.copy_(loaded[f"{part.hf_name}.lora_B"])
        for key, param in _trained_heads(chunks).items():
            param.copy_(loaded[key])


def full_adapter_tensors(chunks, all_gather_tp) -> dict[str, torch.Tensor]:
    """This stage's adapters on their full Hugging Face shapes, keyed as PEFT saves them
    (`base_model.model.<module>.lora_A|lora_B.weight`), on the CPU; not the MTP layers'. `all_gather_tp(shard)`:
    every TP rank's shard (weights._all_gather_tp); every rank of the TP group must call it."""
    tensors = {}
    parts = [part for adapters in adapted_linears(chunks) for part in adapters.parts.values()]
    if any(part.expert for part in parts):
        raise ValueError(
            "adapters on MoE experts have no PEFT form here (transformers' Qwen MoE models fuse their experts into "
            "one parameter); export the merged model (checkpoint.export_hf_dir) and sync with lora.sync=merged"
        )
    for part in parts:
        if part.hf_name.startswith(MTP_HF_PREFIX):
            continue  # MTP layers are no module of transformers' or vLLM's model (the merged export has them)
        split, axis = part.split_parameter()
        for label, param in (("lora_A", part.A), ("lora_B", part.B)):
            full = torch.cat(all_gather_tp(param.detach()), axis) if param is split else param.detach()
            tensors[f"base_model.model.{part.hf_name}.{label}.weight"] = full.cpu().clone()
    return tensors


def peft_config(lora, base_model: str):
    """The adapters' `peft.LoraConfig` (what PEFT writes as adapter_config.json beside the weights)."""
    from peft import LoraConfig

    return LoraConfig(
        r=lora.rank,
        lora_alpha=lora.alpha,
        lora_dropout=lora.dropout,
        target_modules=sorted(lora.target_modules),
        bias="none",
        task_type="CAUSAL_LM",
        base_model_name_or_path=base_model,
        inference_mode=True,
    )
