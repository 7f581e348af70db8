"""Typed settings of the Megatron strategies (no Megatron import: the config layer and the driver load this)."""

from __future__ import annotations

from dataclasses import dataclass, field

DECAY_STYLES = ("constant", "linear", "cosine", "inverse-square-root", "WSD")
TRANSFORMER_IMPLS = ("auto", "local", "transformer_engine")
PARAMS_DTYPES = ("float32", "bfloat16", "float16")


def _check_common(cfg, problems: list[str]) -> None:
    if not cfg.model_path:
        problems.append("model_path is empty; point it at a Hugging Face model folder")
    if cfg.micro_batch_size < 1:
        problems.append(f"micro_batch_size={cfg.micro_batch_size} must be >= 1")
    if cfg.mtp_num_layers < 0:
        problems.append(f"mtp_num_layers={cfg.mtp_num_layers} must be >= 0")
    if cfg.temperature <= 0:
        problems.append(f"temperature={cfg.temperature} must be > 0")
    if cfg.transformer_impl not in TRANSFORMER_IMPLS:
        problems.append(f"transformer_impl={cfg.transformer_impl!r}; choose one of {', '.join(TRANSFORMER_IMPLS)}")
    if cfg.params_dtype not in PARAMS_DTYPES:
        problems.append(f"params_dtype={cfg.params_dtype!r}; choose one of {', '.join(PARAMS_DTYPES)}")
    if cfg.value_head and cfg.mtp_num_layers:
        problems.append("value_head=True (a critic) cannot use MTP; set mtp_num_layers=0")


def _raise(name: str, problems: list[str]) -> None:
    if problems:
        raise ValueError(f"invalid {name}: " + "; ".join(problems) + ".")


@dataclass(frozen=True)
class MegatronInferConfig:
    """Forward-only Megatron (reference log-probs, critic values without training). The layout comes from the worker."""

    model_path: str
    micro_batch_size: int = 1
    temperature: float = 1.0  # log-probs use logits / temperature; batch.meta_info["temperature"] overrides it
    compute_entropy: bool = False
    value_head: bool = False  # critic: LM head replaced by a linear hidden -> 1
    mtp_num_layers: int = 0
    seed: int = 42
    params_dtype: str = "float32"
    transformer_impl: str = "auto"  # auto: TransformerEngine on cuda when installed, the local spec otherwise
    # Testing only: load gate and up swapped, a deliberately wrong mapping that parity tests must catch.
    test_swap_gate_up: bool = False

    def __post_init__(self):
        problems: list[str] = []
        _check_common(self, problems)
        _raise("megatron_infer config", problems)


@dataclass(frozen=True)
class OptimizerSettings:
    """Adam with decoupled weight decay and global-norm gradient clipping."""

    lr: float = 1e-6
    min_lr: float = 0.0
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    weight_decay: float = 0.01
    clip_grad: float = 1.0
    # Shards optimizer state over DP. On CPU, megatron-core 0.16.1 cannot checkpoint its state
    # ("flattened_range is not supported"): keep it off where checkpoints are saved on CPU.
    use_distributed_optimizer: bool = False


@dataclass(frozen=True)
class LRSchedule:
    """Megatron's OptimizerParamScheduler: linear warm-up from 0 to `lr`, then decay to `min_lr`."""

    warmup_steps: int = 0
    decay_steps: int | None = None  # default: the run's total steps, or no decay for "constant"
    decay_style: str = "constant"


@dataclass(frozen=True)
class MegatronTrainConfig:
    """Megatron training (actor or critic): DDP + Megatron optimizer + scheduler; the layout comes from the worker."""

    model_path: str
    micro_batch_size: int = 1
    optimizer: OptimizerSettings = field(default_factory=OptimizerSettings)
    lr_schedule: LRSchedule = field(default_factory=LRSchedule)
    total_steps: int = 1000  # used for the decay horizon when lr_schedule.decay_steps is None
    temperature: float = 1.0
    compute_entropy: bool = True  # hand the loss function per-token entropy (vocab-parallel) as well
    value_head: bool = False
    mtp_num_layers: int = 0
    mtp_loss_scaling_factor: float = 0.1
    seed: int = 42
    params_dtype: str = "float32"
    transformer_impl: str = "auto"
    recompute_activations: bool = False

    def __post_init__(self):
        problems: list[str] = []
        _check_common(self, problems)
        if self.lr_schedule.decay_style not in DECAY_STYLES:
            problems.append(f"lr_schedule.decay_style={self.lr_schedule.decay_style!r}; choose one of {', '.join(DECAY_STYLES)}")
        if self.optimizer.lr < self.optimizer.min_lr:
            problems.append(f"optimizer.lr={self.optimizer.lr} is below optimizer.min_lr={self.optimizer.min_lr}")
        if self.lr_schedule.warmup_steps < 0:
            problems.append(f"lr_schedule.warmup_steps={self.lr_schedule.warmup_steps} must be >= 0")
        _raise("megatron_train config", problems)
