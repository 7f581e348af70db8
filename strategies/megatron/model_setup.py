"""A Megatron strategy's model: this rank's chunks of the HF model, built and loaded with the HF weights."""

from __future__ import annotations

import torch

from roll_backend.distributed.layout import ParallelLayout
from roll_backend.strategies.megatron import convert, lora
from roll_backend.strategies.megatron.builder import (
    DTYPES,
    HFArch,
    ModelBuildOptions,
    build_gpt_stage,
    flex_attention_for,
    transformer_engine_for,
    unwrap,
)
from roll_backend.strategies.megatron.offload import ModelStateOffload
from roll_backend.strategies.megatron.stage_splits import stage_split


class MegatronStrategyBase:
    """Mixed into both Megatron strategies: their config, layout and device, their MegatronEngine (built by
    `initialize`), and the context their calls run in."""

    def __init__(self, config, layout: ParallelLayout, device: str):
        self.config, self.layout, self.device = config, layout, device
        self.engine = None  # MegatronEngine, once initialize() ran

    def ready(self, what: str):
        """The engine, or a clear error when `what` is called before initialize()."""
        if self.engine is None:
            raise RuntimeError(f"{what}: the strategy is not initialised; call initialize() first")
        return self.engine

    @property
    def offloaded_parts(self) -> frozenset[str]:
        return self.config.offloaded_parts

    def move_model_state(self, parts: frozenset[str], to_host: bool) -> int:
        """See InferStrategy.move_model_state. On a CPU rank the copies stay in host memory: the same moves run (so
        the suite checks them), nothing is freed overall."""
        offload = self._offload()
        return offload.to_host(sorted(parts)) if to_host else offload.to_device(sorted(parts))

    def model_state_bytes(self) -> dict[str, int]:
        return self._offload().device_bytes()

    def measured_memory(self) -> dict:
        memory = self.ready("measured_memory").memory
        return {
            "model_state": self._offload().sizes(),  # (a hybrid role's offloaded parts count as they are on the device)
            "phases": dict(memory.peaks),
            "micro_batches": dict(memory.shapes),
            "peak_tensors": dict(memory.peak_tensors),  # (empty unless perf.memory's TRACE_ENV is set)
        }

    def _offload(self) -> ModelStateOffload:
        if getattr(self, "_state_offload", None) is None:
            chunks = self.ready("move_model_state").chunks
            self._state_offload = ModelStateOffload(chunks, getattr(self, "optimizer", None))
        return self._state_offload

    @property
    def model(self) -> list | None:
        """The model chunks (one per virtual pipeline stage), None before initialize()."""
        return None if self.engine is None else self.engine.chunks

    @property
    def arch(self):
        return self.ready("arch").arch


def build_model_chunks(cfg, layout: ParallelLayout, device: str):
    """This rank's model chunks (one per virtual pipeline stage; one without vpp) of the model in
    `cfg.model_path`, with the HF weights loaded.

    Returns (chunks, arch). `cfg` is any MegatronModelConfig (train or forward-only).
    """
    from megatron.core import parallel_state as mpu
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    arch = HFArch.from_model_path(cfg.model_path)
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
        params_dtype=DTYPES[cfg.params_dtype],
        use_cpu_initialization=True,  # same initial values at every TP size; the weights are loaded after
        mtp_num_layers=cfg.mtp_num_layers,
        mtp_loss_scaling_factor=getattr(cfg, "mtp_loss_scaling_factor", 0.1),  # training only
        value_head=cfg.value_head,
        use_transformer_engine=transformer_engine_for(cfg, device),
        recompute_activations=getattr(cfg, "recompute_activations", False),
        use_torch_compile=cfg.use_torch_compile,
        sequence_parallel=bool(cfg.sequence_parallel),
        flex_attention=flex_attention_for(cfg, device),
    )
    torch.manual_seed(cfg.seed)
    model_parallel_cuda_manual_seed(cfg.seed)
    chunks = []
    for vp_stage in range(layout.vpp) if layout.vpp else [None]:
        model = build_gpt_stage(arch, options, vp_stage=vp_stage)
        model.to(device)
        convert.load_hf_weights(
            model,
            cfg.model_path,
            arch,
            mpu.get_tensor_model_parallel_rank(),
            mpu.get_tensor_model_parallel_world_size(),
            swap_gate_up=cfg.test_swap_gate_up,
            seed=cfg.seed,
            value_head_from_score=cfg.value_head and cfg.value_head_init == "score_head",
            etp_rank=mpu.get_expert_tensor_parallel_rank(),
            etp_size=mpu.get_expert_tensor_parallel_world_size(),
        )
        if getattr(cfg, "lora", None) is not None:  # the base frozen, adapters on its projections
            lora.inject(model, cfg.lora, arch, cfg.seed, value_head=cfg.value_head)
        chunks.append(model)
    return chunks, arch


def set_train_mode(chunks, training: bool) -> None:
    for chunk in chunks:
        unwrap(chunk).train(training)
