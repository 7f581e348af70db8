"""`MegatronTrainStrategy`: megatron-core training (TP/PP/DP, optional MTP) with DDP, Megatron's optimizer and
LR scheduler, dist_checkpointing checkpoints, and full HF-named weights for export and rollout sync."""

from __future__ import annotations

import logging
import os
import queue
import random
from collections.abc import Iterator

import numpy as np
import torch
import torch.distributed as dist

from roll_backend import keys, roles
from roll_backend.distributed.layout import ParallelLayout
from roll_backend.protocol import DataProto
from roll_backend.strategies.base import LossFn, TrainStrategy
from roll_backend.strategies.megatron import hf_export, lora, mtp, schedule, weights
from roll_backend.strategies.megatron.builder import DTYPES, unwrap
from roll_backend.strategies.megatron.config import MegatronTrainConfig
from roll_backend.strategies.megatron.engine import MegatronEngine, measures_memory
from roll_backend.strategies.megatron.layers import ValueHead
from roll_backend.strategies.megatron.model_setup import MegatronStrategyBase, build_model_chunks, set_train_mode
from roll_backend.strategies.megatron.router_replay import route_call

logger = logging.getLogger(__name__)


class MegatronTrainStrategy(MegatronStrategyBase, TrainStrategy):
    """One rank of a Megatron-trained model (actor with an LM head, or critic with a value head).

    `train_step` runs Megatron's schedule (1F1B under PP) with the loss on the last stage; metrics come from
    the last PP stage (None elsewhere). Checkpoints use dist_checkpointing's torch_dist format, so a checkpoint
    saved at one TP/PP layout loads at another. megatron-core 0.16.1 cannot checkpoint the distributed optimizer's
    state with torch's Adam, its fallback without TransformerEngine or Apex (`flattened_range is not supported`; seen
    on CPU and on an H200 without them): checkpoint with use_distributed_optimizer=False there.
    """

    config_class = MegatronTrainConfig

    def __init__(self, config: MegatronTrainConfig, layout: ParallelLayout, device: str):
        super().__init__(config, layout, device)
        self.steps_done = 0

    # ---- set-up ------------------------------------------------------------------------------------------
    def initialize(self) -> None:
        from megatron.core.distributed import (
            DistributedDataParallel,
            DistributedDataParallelConfig,
            finalize_model_grads,
        )

        chunks, arch = build_model_chunks(self.config, self.layout, self.device)
        ddp_config = DistributedDataParallelConfig(
            grad_reduce_in_fp32=True,
            overlap_grad_reduce=False,
            use_distributed_optimizer=self.config.optimizer.use_distributed_optimizer,
            check_for_nan_in_grad=False,
        )
        # One DDP per model chunk (virtual pipeline stage); the first chunk's buckets sync first, as in Megatron.
        wrapped = [
            DistributedDataParallel(
                config=chunk.config, ddp_config=ddp_config, module=chunk, disable_bucketing=index > 0
            )
            for index, chunk in enumerate(chunks)
        ]
        model_config = chunks[0].config
        # (LoRA: then the expert-TP sum of routed experts' whole adapters' gradients)
        model_config.finalize_model_grads_func = (
            lora.finalize_grads(finalize_model_grads) if self.config.lora is not None else finalize_model_grads
        )
        no_sync = [model.no_sync for model in wrapped]
        model_config.no_sync_func = no_sync if len(no_sync) > 1 else no_sync[0]
        self.engine = MegatronEngine(self.config, self.layout, self.device, wrapped, arch)
        self.router_metrics = None
        if arch.moe is not None:
            from roll_backend.strategies.megatron.moe import RouterMetrics

            self.router_metrics = RouterMetrics(
                chunks, arch.num_layers, arch.moe.num_experts, arch.moe.aux_loss_coef, self.device
            )
        self.optimizer = self._build_optimizer()
        self.scheduler = self._build_scheduler()

    def _build_optimizer(self):
        from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

        opt = self.config.optimizer
        dtype = DTYPES[self.config.params_dtype]
        config = OptimizerConfig(
            optimizer="adam",
            lr=opt.lr,
            min_lr=opt.min_lr,
            weight_decay=opt.weight_decay,
            adam_beta1=opt.betas[0],
            adam_beta2=opt.betas[1],
            adam_eps=opt.eps,
            clip_grad=opt.clip_grad,
            use_distributed_optimizer=opt.use_distributed_optimizer,
            bf16=dtype == torch.bfloat16,
            fp16=dtype == torch.float16,
            params_dtype=dtype,
        )
        return get_megatron_optimizer(config, self.model)

    def _build_scheduler(self):
        from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

        opt, schedule = self.config.optimizer, self.config.lr_schedule
        decay_steps = schedule.decay_steps or max(self.config.total_steps, schedule.warmup_steps + 1)
        return OptimizerParamScheduler(
            self.optimizer,
            init_lr=0.0 if schedule.warmup_steps else opt.lr,
            max_lr=opt.lr,
            min_lr=opt.min_lr,
            lr_warmup_steps=schedule.warmup_steps,
            lr_decay_steps=decay_steps,
            lr_decay_style=schedule.decay_style,
            start_wd=opt.weight_decay,
            end_wd=opt.weight_decay,
            wd_incr_steps=decay_steps,
            wd_incr_style="constant",
        )

    def _check_ready(self, what: str) -> None:
        self.ready(what)

    # ---- forward only ------------------------------------------------------------------------------------
    def compute_log_probs(self, batch: DataProto) -> DataProto | None:
        return self.ready("compute_log_probs").forward(batch, value_head=False, what="compute_log_probs")

    def compute_values(self, batch: DataProto) -> DataProto | None:
        return self.ready("compute_values").forward(batch, value_head=True, what="compute_values")

    # ---- training ----------------------------------------------------------------------------------------
    def _global_counts(self, batch: DataProto) -> tuple[float, float]:
        """(loss tokens, sequences with a loss token) in the whole DP mini-batch: the batch's META_GLOBAL_TOKEN_COUNT /
        META_GLOBAL_SEQUENCE_COUNT, or summed over DP ranks. Losses normalised by these do not depend on how the
        rows were cut into micro-batches or spread over DP ranks."""
        from megatron.core import parallel_state as mpu

        if keys.RESPONSE_MASK in batch.batch.keys():
            mask = batch.batch[keys.RESPONSE_MASK]
        else:
            mask = batch.batch[keys.ATTENTION_MASK][:, -batch.batch[keys.RESPONSES].shape[1] :]
        counts = torch.stack([mask.sum(), (mask.sum(-1) > 0).sum()]).to(device=self.device, dtype=torch.float64)
        dist.all_reduce(counts, group=mpu.get_data_parallel_group())
        tokens = batch.meta_info.get(keys.META_GLOBAL_TOKEN_COUNT, float(counts[0]))
        sequences = batch.meta_info.get(keys.META_GLOBAL_SEQUENCE_COUNT, float(counts[1]))
        return float(tokens), float(sequences)

    def _with_global_counts(self, batch: DataProto) -> DataProto:
        """The batch with the dispatcher's padding rows out of the loss mask, and the DP mini-batch's loss token
        and sequence counts in its meta_info (what the loss function normalises by)."""
        padded = batch.padding_mask()
        tensors = dict(batch.without_padding(keep_rows=True).batch.items())
        if padded.any():
            # Rows the dispatcher repeated to split the batch evenly over DP: padding, like a micro-batch's zero rows
            # (out of the loss, the token count, MoE routing statistics and the MTP loss).
            keep = ~padded
            for name in (keys.RESPONSE_MASK, keys.ATTENTION_MASK):
                if name in tensors:
                    tensors[name] = tensors[name] * keep[:, None].to(tensors[name].device, tensors[name].dtype)
        batch = DataProto.from_dict(
            tensors=tensors, non_tensors=dict(batch.non_tensor_batch), meta_info=dict(batch.meta_info)
        )
        tokens, sequences = self._global_counts(batch)
        batch.meta_info[keys.META_GLOBAL_TOKEN_COUNT] = tokens
        batch.meta_info[keys.META_GLOBAL_SEQUENCE_COUNT] = sequences
        return batch

    def train_step(self, batch: DataProto, loss_fn: LossFn) -> dict[str, float] | None:
        """Forward/backward over micro-batches, then one optimizer and scheduler step.

        The loss function sees micro_batch.meta_info[META_GLOBAL_TOKEN_COUNT] (and META_GLOBAL_SEQUENCE_COUNT for
        sequence-mean modes) and must normalise by it. Micro-batches are fixed rows, token-budget or packed
        (config.max_tokens_per_microbatch, use_sequence_packing); the loss function always sees full-width rows.
        Megatron divides each micro-batch loss by the number of micro-batches and DDP averages gradients over DP; both
        are undone here so the gradient is that of the global token mean. Metrics (last stage): `loss` is the
        global loss and the loss_fn's other metrics (shares of the step's values, see LossFn), each summed over
        micro-batches and DP, plus `grad_norm`, `lr` and, with MTP, `mtp_loss` (the MTP cross-entropy's mean over
        the global batch's tokens, see mtp_loss.py), the tokens forwarded and those the rows hold
        (`tokens_forwarded_count`, `tokens_unshared_count`: fewer forwarded with share_prompts). MoE models add
        router metrics (`moe/aux_loss`, `moe/load_balancing_loss`, `moe/expert_load_min|max|imbalance`, see
        moe.py); the aux loss's gradient joins in backward as Megatron adds it, and is not in `loss`.
        """
        from megatron.core import parallel_state as mpu

        engine = self.ready("train_step")
        # The loss reads the batch's columns beside the model's outputs: on the model's device (a rank without an
        # in-actor broadcast, e.g. DP only, gets the batch as the driver sent it, on the CPU).
        batch = self._with_global_counts(batch.to(self.device))
        routes = route_call(engine, batch, training=True)
        micro_batches, _ = engine.split(batch, "train_step", routes)
        spec = engine.output_spec(batch, self.config.value_head)
        undo_scaling = len(micro_batches) * mpu.get_data_parallel_world_size()

        def loss_func(micro, head_output: torch.Tensor):
            loss, metrics = loss_fn(engine.outputs(micro, head_output, spec), micro.proto)
            reported = {name: float(value) for name, value in metrics.items()}
            reported["loss"] = float(loss.detach())
            reported.update(micro.token_counts())
            return loss * undo_scaling, reported

        self._zero_grads()
        stored = engine.forward_backward(
            micro_batches, loss_func, forward_only=False, routes=routes, measure=measures_memory(batch)
        )
        update_ok, grad_norm = self._optimizer_step()
        if update_ok:
            self.scheduler.step(increment=1)
        self.steps_done += 1
        real = sum(micro.has_rows for micro in micro_batches)
        mtp_loss = engine.mtp_loss.reported() if engine.mtp_loss is not None else None
        router = self.router_metrics.pop(max(1, real)) if self.router_metrics is not None else {}
        if routes is not None:
            router |= routes.replayer.pop_metrics()
        if not schedule.is_last_stage():
            return None
        metrics = self._reduce_metrics(stored)  # (an all-padding micro-batch's shares are 0)
        metrics.update(
            grad_norm=float(grad_norm) if grad_norm is not None else float("nan"),
            lr=float(self.optimizer.param_groups[0]["lr"]),
            update_ok=float(bool(update_ok)),
        )
        if mtp_loss is not None:
            metrics["mtp_loss"] = mtp_loss
        metrics.update(router)
        return metrics

    def _optimizer_step(self) -> tuple[bool, float | None]:
        """(whether the weights were updated, the grad norm): no update when a rank's gradient is not finite (a NaN
        or inf loss), as verl does, instead of NaN in every weight."""
        if not self._gradients_finite():
            return False, float("nan")
        update_ok, grad_norm, _ = self.optimizer.step()
        return update_ok, grad_norm

    def _gradients_finite(self) -> bool:
        """Whether every rank's gradients are finite (a sum per gradient buffer, the verdict agreed over the ranks)."""
        sums = [
            buffer.grad_data.sum()
            for chunk in self.model
            for buffer in [*chunk.buffers, *chunk.expert_parallel_buffers]
            if buffer.grad_data.numel()
        ]
        bad = torch.zeros((), dtype=torch.float32, device=self.device)
        if sums:
            bad += (~torch.isfinite(torch.stack(sums).float().sum())).float()
        dist.all_reduce(bad, op=dist.ReduceOp.MAX)
        return not bool(bad)

    def _zero_grads(self) -> None:
        set_train_mode(self.model, True)
        for chunk in self.model:
            chunk.zero_grad_buffer()
        self.optimizer.zero_grad()
        if self.router_metrics is not None:
            self.router_metrics.reset()

    def _reduce_metrics(self, stored: list[dict]) -> dict[str, float]:
        """The loss function's metrics summed over micro-batches and DP ranks: each is a share of the step's value
        (see LossFn), so the sums are the same numbers at every layout and micro-batch split."""
        from megatron.core import parallel_state as mpu

        names = sorted(stored[0])
        values = torch.tensor([sum(d[n] for d in stored) for n in names], dtype=torch.float64, device=self.device)
        dist.all_reduce(values, group=mpu.get_data_parallel_group())
        return {n: float(v) for n, v in zip(names, values)}

    def param_grad_norms(self, prefix: str = "") -> dict[str, float]:
        """L2 norm of each local parameter's gradient from the last train_step (diagnostics), by Megatron name."""
        self._check_ready("param_grad_norms")
        norms = {}
        for name, param in self._named_parameters():
            if name.startswith(prefix):
                grad = getattr(param, "main_grad", None)
                grad = param.grad if grad is None else grad
                norms[name] = float(grad.norm()) if grad is not None else float("nan")
        return norms

    def parameter_counts(self) -> dict[str, int]:
        """The whole model's parameters and those that train (LoRA: the adapters), each counted once over TP, PP, vpp
        and EP; every rank of the model takes part."""
        from megatron.core import parallel_state as mpu

        tp_rank, ep = mpu.get_tensor_model_parallel_rank(), mpu.get_expert_model_parallel_world_size()
        counts = torch.zeros(2, dtype=torch.float64, device=self.device)
        for _, param in self._named_parameters():
            if not (getattr(param, "tensor_model_parallel", False) or tp_rank == 0):
                continue  # a TP-replicated parameter: the first TP rank counts it
            numel = param.numel() * (ep if not getattr(param, "allreduce", True) else 1)  # experts: EP ranks alike
            counts += torch.tensor(
                [numel, numel if param.requires_grad else 0], dtype=torch.float64, device=self.device
            )
        dist.all_reduce(counts, group=mpu.get_model_parallel_group())
        return {"parameters": int(counts[0]), "trainable_parameters": int(counts[1])}

    def _named_parameters(self) -> Iterator[tuple[str, torch.nn.Parameter]]:
        """Parameters of every model chunk; with several chunks, names carry a `chunk{i}.` prefix."""
        for index, chunk in enumerate(self.model):
            prefix = f"chunk{index}." if len(self.model) > 1 else ""
            for name, param in unwrap(chunk).named_parameters():
                yield prefix + name, param

    # ---- weights out ----------------------------------------------------------------------------------------
    def iter_hf_weights(
        self, bucket_bytes: int = 512 << 20, measure_memory: bool = False, include_mtp: bool = False
    ) -> Iterator[list[tuple[str, torch.Tensor]]]:
        """Buckets of full HF-named tensors, yielded on every rank (all ranks must iterate: it communicates).

        Tensors stay on the training device; a tied output layer is left to the embedding. MTP layers
        (`model.mtp_layers.*`) come only with `include_mtp`: the rollout engine serves the main model alone.
        """
        engine = self.ready("iter_hf_weights")
        buckets = weights.bucketed(weights.iter_full_hf_tensors(self.model, self.arch, include_mtp), bucket_bytes)
        shape = {"bucket_bytes": bucket_bytes}
        yield from engine.memory.measure_iteration(roles.WEIGHT_SYNC, buckets, measure_memory, shape)

    def export_hf(
        self, out_dir: str, max_shard_bytes: int = hf_export.DEFAULT_MAX_SHARD_BYTES
    ) -> hf_export.WrittenWeights | None:
        """Write a Hugging Face checkpoint to `out_dir`: safetensors of at most `max_shard_bytes` each (one
        model.safetensors when the model fits, else model-0000i-of-0000N.safetensors and their index), the config
        and the tokenizer files. All ranks take part; global rank 0 writes each shard as its tensors are gathered,
        so it holds about one shard at a time, never the whole model. Returns what it wrote (None on other ranks).

        MTP layers go out as `model.mtp_layers.{i}.*` and the config records their number (mtp.py). A value-head
        model (critic, reward model) goes out as <Model>ForSequenceClassification with one label: the head's weight
        is `score.weight`, and there is no lm_head (hf_export.sequence_classification_config).
        """
        self._check_ready("export_hf")
        hf_config = self._export_config()  # on every rank: a config it cannot export raises before any gather
        if self.config.value_head:
            _warn_about_value_head_bias(self.model)
        named = weights.iter_full_hf_tensors(
            self.model, self.arch, include_mtp=True, include_value_head=self.config.value_head
        )
        written = None
        if dist.get_rank() == 0:
            writer = hf_export.ShardedSafetensorsWriter(out_dir, max_shard_bytes)
            for name, tensor in named:
                writer.add(name, tensor)
            written = writer.close()
            hf_config.save_pretrained(out_dir)
            hf_export.copy_tokenizer_and_generation_config(self.config.model_path, out_dir)
        else:
            for _ in named:  # every rank joins the gathers and broadcasts
                pass
        dist.barrier()
        return written

    def export_peft(self, out_dir: str) -> list[str] | None:
        """Write the LoRA adapters to `out_dir` as a PEFT adapter folder (adapter_config.json and
        adapter_model.safetensors) that `peft.PeftModel.from_pretrained(<the HF base>, out_dir)` loads. All ranks
        take part (gathers over TP, then over PP to global rank 0, which writes); returns the tensor names written
        (None on other ranks)."""
        from safetensors.torch import save_file

        tensors, written = self.adapter_tensors("export_peft"), None
        if tensors is not None:
            os.makedirs(out_dir, exist_ok=True)
            save_file(tensors, f"{out_dir}/adapter_model.safetensors")
            self.peft_config().save_pretrained(out_dir)
            written = sorted(tensors)
        dist.barrier()
        return written

    def adapter_tensors(self, what: str = "adapter_tensors") -> dict[str, torch.Tensor] | None:
        """Every LoRA adapter of the model on its full Hugging Face shape, PEFT-named, on global rank 0 (None on the
        others); all ranks take part (gathers over TP, then over PP)."""
        from megatron.core import parallel_state as mpu

        self._check_ready(what)
        if self.config.lora is None:
            raise ValueError(f"{what}: this strategy trains no LoRA adapters (strategy.lora is null)")
        tensors = lora.full_adapter_tensors(self.model, weights._all_gather_tp)
        pp_group = mpu.get_pipeline_model_parallel_group()
        first = dist.get_global_rank(pp_group, 0)
        stages = [None] * dist.get_world_size(pp_group) if dist.get_rank() == first else None
        dist.gather_object(tensors, stages, dst=first, group=pp_group)
        if dist.get_rank() != 0:
            return None
        return {name: stage[name].contiguous() for stage in stages for name in sorted(stage)}

    def peft_config(self):
        """The adapters' peft.LoraConfig."""
        return lora.peft_config(self.config.lora, self.config.model_path)

    def _export_config(self):
        """The HF config an export writes: the model's, with the MTP layer count, or as a sequence classifier."""
        from transformers import AutoConfig

        hf_config = AutoConfig.from_pretrained(self.config.model_path)
        if self.config.mtp_num_layers:
            setattr(hf_config, mtp.HF_CONFIG_KEY, self.config.mtp_num_layers)
        if self.config.value_head:
            hf_config = hf_export.sequence_classification_config(hf_config, self.config.model_path)
        return hf_config

    # ---- checkpoints ----------------------------------------------------------------------------------------
    def save_checkpoint(self, path: str) -> None:
        """Model, optimizer, scheduler and RNG state, in dist_checkpointing's torch_dist format. With LoRA, the
        model is the adapters alone (and the optimizer holds only theirs): the frozen base is the model folder's."""
        from megatron.core import dist_checkpointing

        self._check_ready("save_checkpoint")
        if dist.get_rank() == 0:
            os.makedirs(path, exist_ok=True)
        dist.barrier()
        model_state = self._model_sharded_state()
        state = {
            "model": model_state,
            "optimizer": self.optimizer.sharded_state_dict(model_state),
            "scheduler": self.scheduler.state_dict(),
            "rng": _rng_sharded_object(),
            "progress": {"steps_done": self.steps_done, **self._layout_record(), "lora": self._lora_record()},
        }
        _write_results_in_process()
        dist_checkpointing.save(state, path)
        dist.barrier()

    # Layout fields a checkpoint records (older checkpoints lack cp, vpp and ep: they were saved at 1, none, 1).
    _layout_defaults = {"tp": 1, "pp": 1, "cp": 1, "vpp": None, "ep": 1}

    def _layout_record(self) -> dict:
        return {
            "tp": self.layout.tp,
            "pp": self.layout.pp,
            "cp": self.layout.cp,
            "vpp": self.layout.vpp,
            "ep": self.layout.ep,
        }

    def _lora_record(self) -> dict | None:
        """What an adapter checkpoint must match (None: a full checkpoint)."""
        settings = self.config.lora
        if settings is None:
            return None
        return {"rank": settings.rank, "alpha": settings.alpha, "target_modules": sorted(settings.target_modules)}

    def _model_sharded_state(self) -> dict:
        """Every model chunk's sharded state under `chunk{i}`; tensors are keyed by global layer number, so a
        checkpoint loads at another TP/PP/CP/vpp/EP layout. The metadata is what megatron-core needs for the
        embedding copy an MTP stage keeps at PP > 1 (GPTModel.sharded_state_dict reads metadata['dp_cp_group'])."""
        from megatron.core import parallel_state as mpu

        if self.config.lora is not None:
            return {"adapters": lora.adapter_sharded_state(self.model)}
        metadata = {"dp_cp_group": mpu.get_data_parallel_group(with_context_parallel=True)}
        return {
            f"chunk{index}": unwrap(chunk).sharded_state_dict(metadata=metadata)
            for index, chunk in enumerate(self.model)
        }

    def load_checkpoint(self, path: str) -> None:
        """Restore a `save_checkpoint` folder, possibly written at another TP/PP layout.

        RNG states are restored only when the layout matches the saver's (they are per model-parallel rank).
        """
        from megatron.core import dist_checkpointing

        self._check_ready("load_checkpoint")
        common_state = dist_checkpointing.load_common_state_dict(path)
        progress = common_state["progress"]
        saved_lora = progress.get("lora")
        if saved_lora != self._lora_record():
            raise ValueError(
                f"load_checkpoint({path!r}): the checkpoint's LoRA settings are {saved_lora} and this strategy's "
                f"{self._lora_record()} (None: full fine-tuning); load it with the settings it was saved with"
            )
        saved_layout = {name: progress.get(name, default) for name, default in self._layout_defaults.items()}
        same_layout = saved_layout == self._layout_record()
        model_state = self._model_sharded_state()
        request = {"model": model_state, "optimizer": self.optimizer.sharded_state_dict(model_state, is_loading=True)}
        if same_layout:
            request["rng"] = _rng_sharded_object()
        else:
            logger.info(
                "checkpoint layout %s differs from ours %s: RNG state not restored", saved_layout, self._layout_record()
            )
        loaded = dist_checkpointing.load(request, path)
        if self.config.lora is not None:
            lora.load_adapters(self.model, loaded["model"]["adapters"])
        else:
            for index, chunk in enumerate(self.model):
                unwrap(chunk).load_state_dict(loaded["model"][f"chunk{index}"])
        self.optimizer.load_state_dict(loaded["optimizer"])
        self.scheduler.load_state_dict(common_state["scheduler"])
        self.steps_done = int(progress["steps_done"])
        if same_layout:
            _set_rng_state(loaded["rng"])


def _rng_state() -> dict:
    """This rank's RNG state as plain tensors/numbers (loadable with torch.load(weights_only=True))."""
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

    np_state = np.random.get_state()
    version, py_state, gauss = random.getstate()
    state = {
        "python": [version, list(py_state), gauss],
        "numpy": [
            np_state[0],
            torch.from_numpy(np_state[1].astype(np.int64)),
            int(np_state[2]),
            int(np_state[3]),
            float(np_state[4]),
        ],
        "torch": torch.get_rng_state(),
        "tracker": {name: value.clone() for name, value in get_cuda_rng_tracker().get_states().items()},
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def _set_rng_state(state: dict) -> None:
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

    version, py_state, gauss = state["python"]
    random.setstate((version, tuple(py_state), gauss))
    name, keys_, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((name, keys_.numpy().astype(np.uint32), pos, has_gauss, cached))
    torch.set_rng_state(state["torch"])
    get_cuda_rng_tracker().set_states(state["tracker"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def _rng_sharded_object():
    from megatron.core import parallel_state as mpu
    from megatron.core.dist_checkpointing.mapping import ShardedObject

    return ShardedObject(
        "rng_state",
        _rng_state(),
        (
            mpu.get_pipeline_model_parallel_world_size(),
            mpu.get_tensor_model_parallel_world_size(),
            mpu.get_context_parallel_world_size(),
        ),
        (mpu.get_pipeline_model_parallel_rank(), mpu.get_tensor_model_parallel_rank(), mpu.get_context_parallel_rank()),
        replica_id=mpu.get_data_parallel_rank(),
    )


def _warn_about_value_head_bias(chunks) -> None:
    """Hugging Face's score head has no bias: a value head's trained bias is left out of an export. Logged once, by
    the first rank of the last stage, where the head lives."""
    from megatron.core import parallel_state as mpu

    head = getattr(unwrap(chunks[-1]), "output_layer", None)
    first_of_stage = (
        mpu.get_tensor_model_parallel_rank() == 0
        and mpu.get_data_parallel_rank() == 0
        and mpu.get_context_parallel_rank() == 0
    )
    if not isinstance(head, ValueHead) or not first_of_stage:
        return
    bias = float(head.bias.detach())
    if bias != 0.0:
        logger.warning(
            "the value head's bias (%.6g) is left out of the Hugging Face export: a *ForSequenceClassification score "
            "head has none, so the exported model scores this model's values minus that bias",
            bias,
        )


def _write_results_in_process() -> None:
    """megatron-core's checkpoint writer returns its results through a queue it makes on first use in a spawned
    multiprocessing Manager: a new interpreter that imports the rank's main module (Ray's worker), seconds of CPU per
    rank process. Our saves are synchronous (the writes finish inside `save`), so a queue within the process does."""
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    if getattr(filesystem_async, "_results_queue", None) is None:
        filesystem_async._results_queue = queue.Queue()
