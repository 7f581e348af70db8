"""Typed settings of the Megatron strategies (no Megatron import: the config layer and the driver load this)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

DECAY_STYLES = ("constant", "linear", "cosine", "inverse-square-root", "WSD")
TRANSFORMER_IMPLS = ("auto", "local", "transformer_engine")
PARAMS_DTYPES = ("float32", "bfloat16", "float16")
# Where a value head's weights come from: "fresh" (random, e.g. a critic started from the policy) or
# "score_head" (the trained `score` head of a Hugging Face *ForSequenceClassification reward model).
VALUE_HEAD_INITS = ("fresh", "score_head")


def stage_split_problem(num_layers: int, pp: int, vpp: int | None, first: int | None, last: int | None) -> str | None:
    """Why Megatron cannot split `num_layers` over `pp` stages (x `vpp` model chunks) this way, or None.

    `first`/`last` are Megatron's num_layers_in_first/last_pipeline_stage (None: an even share). Every stage
    needs at least one layer per model chunk, the first/last counts a multiple of vpp, and the layers left
    for the middle stages an equal multiple of vpp each.
    """
    chunks = vpp or 1
    if vpp is not None and (vpp < 2 or pp < 2):
        return f"vpp={vpp} needs pp >= 2 and vpp >= 2 (interleaved stages); set vpp=None or raise pp"
    if pp == 1:
        return None if first is None and last is None else "first/last_stage_layers need pp >= 2; remove them"
    middle_layers, middle_stages = num_layers, pp
    for name, count in (("first_stage_layers", first), ("last_stage_layers", last)):
        if count is None:
            continue
        if count < chunks or count % chunks:
            return f"{name}={count} must be a positive multiple of vpp={chunks} (one or more layers per model chunk)"
        middle_layers -= count
        middle_stages -= 1
    if middle_stages == 0:
        if middle_layers:
            return (f"first_stage_layers={first} + last_stage_layers={last} = {num_layers - middle_layers} differs from "
                    f"num_hidden_layers={num_layers} at pp=2")
        return None
    if middle_layers < middle_stages * chunks or middle_layers % (middle_stages * chunks):
        return (f"{num_layers} layers: after first_stage_layers={first} and last_stage_layers={last}, {middle_layers} "
                f"layers cannot be split evenly over {middle_stages} stage(s) x {chunks} model chunk(s); "
                f"set first_stage_layers/last_stage_layers so that they can")
    return None


def default_stage_split(num_layers: int, pp: int, vpp: int | None) -> tuple[int | None, int | None]:
    """(first_stage_layers, last_stage_layers) when the user set neither: None, None where the layers split evenly,
    else the feasible uneven split with the smallest largest stage, giving the last stage (which also holds
    the output layer and the loss) the fewer layers on ties. Raises ValueError when no split exists."""
    chunks = vpp or 1
    if pp == 1 or stage_split_problem(num_layers, pp, vpp, None, None) is None:
        return None, None
    best = None
    for first in range(chunks, num_layers + 1, chunks):
        for last in range(chunks, num_layers - first + 1, chunks):
            if stage_split_problem(num_layers, pp, vpp, first, last) is not None:
                continue
            middle = (num_layers - first - last) // (pp - 2) if pp > 2 else 0
            key = (max(first, last, middle), last, -first)
            if best is None or key < best[0]:
                best = (key, first, last)
    if best is None:
        raise ValueError(f"num_hidden_layers={num_layers} cannot be split over pp={pp} stages with vpp={vpp}: every "
                         f"stage needs at least {chunks} layer(s); lower pp or vpp")
    return best[1], best[2]


def _check_common(cfg, problems: list[str]) -> None:
    if not cfg.model_path:
        problems.append("model_path is empty; point it at a Hugging Face model folder")
    if cfg.micro_batch_size < 1:
        problems.append(f"micro_batch_size={cfg.micro_batch_size} must be >= 1")
    if not isinstance(cfg.mtp_num_layers, int) or cfg.mtp_num_layers < 0:
        problems.append(f"mtp_num_layers={cfg.mtp_num_layers!r} must be an integer >= 0 (0: no MTP)")
    if cfg.temperature <= 0:
        problems.append(f"temperature={cfg.temperature} must be > 0")
    if cfg.transformer_impl not in TRANSFORMER_IMPLS:
        problems.append(f"transformer_impl={cfg.transformer_impl!r}; choose one of {', '.join(TRANSFORMER_IMPLS)}")
    if cfg.params_dtype not in PARAMS_DTYPES:
        problems.append(f"params_dtype={cfg.params_dtype!r}; choose one of {', '.join(PARAMS_DTYPES)}")
    if cfg.value_head and cfg.mtp_num_layers:
        problems.append("value_head=True (a critic) cannot use MTP; set mtp_num_layers=0")
    budget = cfg.max_tokens_per_microbatch
    if budget is not None and (not isinstance(budget, int) or budget < 8):
        problems.append(f"max_tokens_per_microbatch={budget!r} must be an integer >= 8 (padded tokens per micro-batch "
                        "and rank), or null for micro-batches of micro_batch_size rows")
    if cfg.use_sequence_packing and budget is None:
        problems.append("use_sequence_packing=True packs sequences into rows of max_tokens_per_microbatch tokens; set "
                        "max_tokens_per_microbatch (e.g. the longest prompt + response) or turn packing off")
    if cfg.use_sequence_packing and cfg.mtp_num_layers:
        problems.append("use_sequence_packing=True with mtp_num_layers > 0: MTP labels would cross packed sequences; "
                        "turn one of them off")
    if cfg.value_head_init not in VALUE_HEAD_INITS:
        problems.append(f"value_head_init={cfg.value_head_init!r}; choose one of {', '.join(VALUE_HEAD_INITS)}")


def _raise(name: str, problems: list[str]) -> None:
    if problems:
        raise ValueError(f"invalid {name}: " + "; ".join(problems) + ".")


@dataclass(frozen=True)
class MegatronInferConfig:
    """Forward-only Megatron (reference log-probs, critic values without training). The layout comes from the worker."""

    model_path: str
    micro_batch_size: int = 1  # most sequences per forward pass on each data-parallel rank (fewer rows: equal smaller ones)
    # Token budget: rows are grouped into micro-batches of at most this many padded tokens per rank (a longer
    # sequence gets one of its own); None: micro-batches of micro_batch_size rows. See strategies.micro_batching.
    max_tokens_per_microbatch: int | None = None
    use_sequence_packing: bool = False  # several sequences per row of max_tokens_per_microbatch tokens
    temperature: float = 1.0  # log-probs use logits / temperature; batch.meta_info["temperature"] overrides it
    compute_entropy: bool = False  # also return per-token entropy
    value_head: bool = False  # critic: LM head replaced by a linear hidden -> 1
    value_head_init: str = "fresh"  # or "score_head": load a reward model's trained score head (VALUE_HEAD_INITS)
    mtp_num_layers: int = 0  # multi-token-prediction layers of the model (0: none)
    seed: int = 42  # Megatron's initialisation seed
    params_dtype: str = "float32"  # float32, bfloat16 or float16
    transformer_impl: str = "auto"  # auto: TransformerEngine on cuda when installed, the local spec otherwise
    # torch.compile the local spec's norms, core attention and SwiGLU: ~12% faster bf16 steps on CPU, after a
    # one-off compilation per rank process (seconds warm, ~20 s with a cold inductor cache); for long runs.
    use_torch_compile: bool = False
    # Uneven pipeline splits (Megatron's num_layers_in_first/last_pipeline_stage). None for both: an even
    # split where pp (x vpp) divides the layers, else default_stage_split's choice.
    first_stage_layers: int | None = None  # decoder layers of the first pipeline stage (None: Megatron's even split)
    last_stage_layers: int | None = None  # decoder layers of the last pipeline stage (None: Megatron's even split)
    # Testing only: load gate and up swapped, a deliberately wrong mapping that parity tests must catch.
    test_swap_gate_up: bool = False

    def __post_init__(self):
        problems: list[str] = []
        _check_common(self, problems)
        _raise("megatron_infer config", problems)


@dataclass(frozen=True)
class OptimizerSettings:
    """Adam with decoupled weight decay and global-norm gradient clipping."""

    lr: float = 1e-6  # peak learning rate
    min_lr: float = 0.0  # learning rate at the end of the decay
    betas: tuple[float, float] = (0.9, 0.999)  # Adam betas
    eps: float = 1e-8  # Adam epsilon
    weight_decay: float = 0.01  # decoupled weight decay
    clip_grad: float = 1.0  # global gradient-norm clip (0: off)
    # Shards optimizer state over DP. On CPU, megatron-core 0.16.1 cannot checkpoint its state
    # ("flattened_range is not supported"): keep it off where checkpoints are saved on CPU.
    use_distributed_optimizer: bool = False


@dataclass(frozen=True)
class LRSchedule:
    """Megatron's OptimizerParamScheduler: linear warm-up from 0 to `lr`, then decay to `min_lr`."""

    warmup_steps: int = 0  # optimizer steps of linear warm-up
    decay_steps: int | None = None  # default: the run's total steps, or no decay for "constant"
    decay_style: str = "constant"  # constant, linear or cosine


@dataclass(frozen=True)
class MegatronTrainConfig:
    """Megatron training (actor or critic): DDP + Megatron optimizer + scheduler; the layout comes from the worker."""

    model_path: str
    micro_batch_size: int = 1  # most sequences per forward/backward pass on each data-parallel rank (fewer rows: equal smaller ones)
    # Token budget: rows are grouped into micro-batches of at most this many padded tokens per rank (a longer
    # sequence gets one of its own); None: micro-batches of micro_batch_size rows. See strategies.micro_batching.
    max_tokens_per_microbatch: int | None = None
    use_sequence_packing: bool = False  # several sequences per row of max_tokens_per_microbatch tokens
    optimizer: OptimizerSettings = field(default_factory=OptimizerSettings)
    lr_schedule: LRSchedule = field(default_factory=LRSchedule)
    total_steps: int = 1000  # used for the decay horizon when lr_schedule.decay_steps is None
    temperature: float = 1.0  # log-probs use logits / temperature (match the rollout's sampling temperature)
    compute_entropy: bool = True  # hand the loss function per-token entropy (vocab-parallel) as well
    value_head: bool = False  # critic: LM head replaced by a linear hidden -> 1
    value_head_init: str = "fresh"  # critic from a reward model: "score_head" (see VALUE_HEAD_INITS)
    mtp_num_layers: int = 0  # multi-token-prediction layers trained with the model (0: none)
    mtp_loss_scaling_factor: float = 0.1  # weight of the MTP loss
    seed: int = 42  # Megatron's initialisation seed
    params_dtype: str = "float32"  # float32, bfloat16 or float16
    transformer_impl: str = "auto"  # auto: TransformerEngine on cuda when installed, the local spec otherwise
    recompute_activations: bool = False  # recompute each layer's activations in backward (less memory, more compute)
    use_torch_compile: bool = False  # see MegatronInferConfig
    first_stage_layers: int | None = None  # see MegatronInferConfig
    last_stage_layers: int | None = None  # see MegatronInferConfig

    def __post_init__(self):
        problems: list[str] = []
        _check_common(self, problems)
        if self.lr_schedule.decay_style not in DECAY_STYLES:
            problems.append(f"lr_schedule.decay_style={self.lr_schedule.decay_style!r}; choose one of {', '.join(DECAY_STYLES)}")
        if self.optimizer.lr < self.optimizer.min_lr:
            problems.append(f"optimizer.lr={self.optimizer.lr} is below optimizer.min_lr={self.optimizer.min_lr}")
        factor = self.mtp_loss_scaling_factor
        if self.mtp_num_layers and not (isinstance(factor, (int, float)) and math.isfinite(factor) and factor > 0):
            problems.append(f"mtp_loss_scaling_factor={factor!r} must be a finite number > 0 with MTP "
                            "(the MTP loss is added to the main loss with this weight; 0.1 is usual); "
                            "set mtp_num_layers=0 to turn MTP off")
        if self.lr_schedule.warmup_steps < 0:
            problems.append(f"lr_schedule.warmup_steps={self.lr_schedule.warmup_steps} must be >= 0")
        _raise("megatron_train config", problems)
