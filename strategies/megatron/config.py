"""Typed settings of the Megatron strategies and the backend's validation rules (stage splits: stage_splits.py).

The rules come in three kinds: a config's own settings (checked when it is built), what a model and a layout must
satisfy (shared with the ranks' own checks in builder.py and moe.py), and the checks of a config against the run
(`problems`, which the validator calls for every role before Ray starts). No Megatron import: the config layer
and the driver load this.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

from roll_backend.strategies.base import RunFacts
from roll_backend.strategies.megatron.stage_splits import stage_split, stage_split_problem

DECAY_STYLES = ("constant", "linear", "cosine", "inverse-square-root", "WSD")
TRANSFORMER_IMPLS = ("auto", "local", "transformer_engine")
PARAMS_DTYPES = ("float32", "bfloat16", "float16")
# Where a value head's weights come from: "fresh" (random, e.g. a critic started from the policy) or
# "score_head" (the trained `score` head of a Hugging Face *ForSequenceClassification reward model).
VALUE_HEAD_INITS = ("fresh", "score_head")
SUPPORTED_MODEL_TYPES = ("qwen2", "llama", "mistral", "qwen3", "qwen2_moe", "qwen3_moe")
MOE_MODEL_TYPES = ("qwen2_moe", "qwen3_moe")
ROUTER_REPLAY_MODES = (None, "R2", "R3")


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def hf_model_problems(fields: Mapping[str, Any]) -> list[str]:
    """Why the backend cannot build the Hugging Face model with these config fields ([] if it can); fields a
    partial config lacks are not judged."""
    problems = []
    model_type = fields.get("model_type")
    if model_type is not None and model_type not in SUPPORTED_MODEL_TYPES:
        problems.append(f"model_type={model_type!r} is not supported; known: {', '.join(SUPPORTED_MODEL_TYPES)}")
    hidden_act = fields.get("hidden_act", "silu")
    if hidden_act != "silu":
        problems.append(f"hidden_act={hidden_act!r} is not supported; only SwiGLU ('silu') models are")
    rope = fields.get("rope_parameters") or fields.get("rope_scaling") or {}
    rope_type = rope.get("rope_type", rope.get("type", "default")) if isinstance(rope, Mapping) else "default"
    if rope_type != "default":
        problems.append(f"rope_type={rope_type!r} is not supported; only the default RoPE is")
    if model_type in MOE_MODEL_TYPES:
        sparse_step = fields.get("decoder_sparse_step", 1)
        mlp_only = list(fields.get("mlp_only_layers") or [])
        if sparse_step != 1 or mlp_only:
            problems.append(
                f"{model_type}: decoder_sparse_step={sparse_step}, mlp_only_layers={mlp_only}; only models whose every "
                "layer is a MoE layer are supported (decoder_sparse_step=1, mlp_only_layers=[])"
            )
    return problems


def expert_layout_problems(
    num_experts: int, expert_ffn: int | None, shared_ffn: int | None, tp: int, ep: int, etp: int
) -> list[str]:
    """What megatron-core requires of (tp, ep, etp) for a model's routed experts; [] when the layout fits."""
    problems = []
    if num_experts % ep:
        problems.append(f"ep={ep} does not divide num_experts={num_experts}; choose one of {_divisors(num_experts)}")
    if expert_ffn and expert_ffn % etp:
        problems.append(f"etp={etp} does not divide moe_intermediate_size={expert_ffn}")
    if shared_ffn and shared_ffn % tp:
        problems.append(f"tp={tp} does not divide shared_expert_intermediate_size={shared_ffn}")
    return problems


def mtp_problem(moe: bool, mtp_num_layers: int) -> str | None:
    """Why MTP cannot be used with this model, or None. The MTP layer of a MoE model is a MoE layer, and the HF
    names of its experts are not mapped: they would neither load nor export, and would start from a layout-dependent
    initialisation (found by tests/strategies/megatron/test_layout_properties.py)."""
    if moe and mtp_num_layers:
        return (
            "MTP on a MoE model is not supported yet (its MTP layer's experts have no HF mapping); set mtp_num_layers=0"
        )
    return None


def value_head_problem(value_head: bool, mtp_num_layers: int) -> str | None:
    """Why a critic's value head cannot be built this way, or None."""
    if value_head and mtp_num_layers:
        return "a critic (value_head=True) cannot use MTP; set mtp_num_layers=0"
    return None


# ---- a config's own settings (checked when it is built) ---------------------------------------------------


def _settings_problems(cfg) -> list[str]:
    problems: list[str] = []
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
        problems.append(
            f"max_tokens_per_microbatch={budget!r} must be an integer >= 8 (padded tokens per micro-batch "
            "and rank), or null for micro-batches of micro_batch_size rows"
        )
    if cfg.use_sequence_packing and budget is None:
        problems.append(
            "use_sequence_packing=True packs sequences into rows of max_tokens_per_microbatch tokens; set "
            "max_tokens_per_microbatch (e.g. the longest prompt + response) or turn packing off"
        )
    if cfg.use_sequence_packing and cfg.mtp_num_layers:
        problems.append(
            "use_sequence_packing=True with mtp_num_layers > 0: MTP labels would cross packed sequences; "
            "turn one of them off"
        )
    problems += _share_prompts_problems(cfg)
    if cfg.value_head_init not in VALUE_HEAD_INITS:
        problems.append(f"value_head_init={cfg.value_head_init!r}; choose one of {', '.join(VALUE_HEAD_INITS)}")
    if cfg.router_replay not in ROUTER_REPLAY_MODES:
        problems.append(
            f"router_replay={cfg.router_replay!r}; choose R2 (replay the old-log-prob forward's routes in the "
            "updates), R3 (replay the rollout's routes) or null"
        )
    return problems


def _share_prompts_problems(cfg) -> list[str]:
    """Combinations prompt sharing cannot run (each with why)."""
    if not cfg.share_prompts:
        return []
    problems = []
    if cfg.transformer_impl == "transformer_engine":
        problems.append(
            "share_prompts with transformer_impl=transformer_engine: the TE layers here take causal or THD masks "
            "only, and a shared prompt needs the local spec's explicit mask; use transformer_impl: auto or local"
        )
    return problems


def _raise(name: str, problems: list[str]) -> None:
    if problems:
        raise ValueError(f"invalid {name}: " + "; ".join(problems) + ".")


@dataclass(frozen=True)
class MegatronModelConfig:
    """What every Megatron role declares (train and forward-only alike): the model, how a batch is cut into
    micro-batches, the numerics, and what a forward returns. The layout comes from the worker."""

    model_path: str
    # most sequences per forward(/backward) pass on each data-parallel rank (fewer rows: equal smaller ones)
    micro_batch_size: int = 1
    # Token budget: rows are grouped into micro-batches of at most this many padded tokens per rank (a longer
    # sequence gets one of its own); None: micro-batches of micro_batch_size rows. See
    # strategies/megatron/micro_batches.py.
    max_tokens_per_microbatch: int | None = None
    use_sequence_packing: bool = False  # several sequences per row of max_tokens_per_microbatch tokens
    # Rows holding the same prompt (a group's n samples) forward it once: the prompt, then each response attending to
    # it and to itself (strategies/megatron/shared_prompts.py); the same outputs and gradients, fewer tokens.
    share_prompts: bool = False
    # log-probs use logits / temperature (match the rollout's sampling temperature); batch.meta_info["temperature"]
    # overrides it
    temperature: float = 1.0
    # per-token entropy (vocab-parallel) as well; None: the role's default (training: yes, for the loss; forward-only
    # roles: no)
    compute_entropy: bool | None = None
    value_head: bool = False  # critic: LM head replaced by a linear hidden -> 1
    value_head_init: str = "fresh"  # or "score_head": load a reward model's trained score head (VALUE_HEAD_INITS)
    mtp_num_layers: int = 0  # multi-token-prediction layers of the model (0: none)
    seed: int = 42  # Megatron's initialisation seed
    params_dtype: str = "float32"  # float32, bfloat16 or float16
    transformer_impl: str = "auto"  # auto: TransformerEngine on cuda when installed, the local spec otherwise
    # Megatron's sequence parallelism at tp > 1: norms and the residual stream split over the TP ranks along the
    # sequence (activations outside attention and MLP / tp; the same numbers). null: on where the role's ranks take
    # GPUs (the device defaults), off on CPU; a MoE model at tp > 1 always uses it.
    sequence_parallel: bool | None = None
    # torch.compile the local spec's norms, core attention and SwiGLU: ~12% faster bf16 steps on CPU, after a
    # one-off compilation per rank process (seconds warm, ~20 s with a cold inductor cache); for long runs.
    use_torch_compile: bool = False
    # Uneven pipeline splits (Megatron's num_layers_in_first/last_pipeline_stage). None for both: an even
    # split where pp (x vpp) divides the layers, else default_stage_split's choice.
    first_stage_layers: int | None = None  # decoder layers of the first pipeline stage (None: Megatron's even split)
    last_stage_layers: int | None = None  # decoder layers of the last pipeline stage (None: Megatron's even split)
    # MoE routing replay (R2: the old-log-prob forward's routes replayed in the updates; R3: the rollout's routes
    # replayed in every forward); null: routers choose live. See strategies/megatron/router_replay.py.
    router_replay: str | None = None
    # The hybrid engine: move the parameters to host memory while another model of the process holds the device
    # (strategies/megatron/offload.py); training roles also offload_grads and offload_optimizer.
    offload_params: bool = False
    # Testing only: load gate and up swapped, a deliberately wrong mapping that parity tests must catch.
    test_swap_gate_up: bool = False

    ENTROPY_BY_DEFAULT: ClassVar[bool] = False

    @property
    def offloaded_parts(self) -> frozenset[str]:
        """The model-state parts this role moves to host memory while idle in the hybrid engine."""
        flags = {
            "params": self.offload_params,
            "grads": getattr(self, "offload_grads", False),  # (training configs only)
            "optimizer": getattr(self, "offload_optimizer", False),
        }
        return frozenset(part for part, on in flags.items() if on)

    def __post_init__(self):
        if self.compute_entropy is None:
            object.__setattr__(self, "compute_entropy", self.ENTROPY_BY_DEFAULT)


@dataclass(frozen=True)
class MegatronInferConfig(MegatronModelConfig):
    """Forward-only Megatron (reference log-probs, critic values without training, reward model scores)."""

    def __post_init__(self):
        super().__post_init__()
        _raise("megatron_infer config", _settings_problems(self))

    def for_run(self, run: RunFacts) -> MegatronInferConfig:
        """This config with a value head where the role scores values (loaded from the folder's score head where
        the role is a trained reward model)."""
        return dataclasses.replace(self, **_value_head_updates(self, run))

    def problems(self, run: RunFacts) -> list[str]:
        """What this config cannot do in this run (the ranks' start-up rules), before Ray starts."""
        return _run_problems(self, run)


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


LORA_TARGET_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")  # PEFT's names
LORA_INITS = ("kaiming", "gaussian")
LORA_SYNC_MODES = ("merged", "adapter")


@dataclass(frozen=True)
class LoRASettings:
    """LoRA adapters on the base's projections (strategies/megatron/lora.py); the base is frozen."""

    rank: int = 16  # r
    alpha: float = 32.0  # the update is (alpha / r) B A
    dropout: float = 0.0  # on the adapters' input, in training steps only (PEFT's lora_dropout)
    target_modules: tuple[str, ...] = LORA_TARGET_MODULES  # PEFT's module names (all by default)
    init: str = "kaiming"  # A's start (B starts at 0): kaiming (PEFT's default, uniform) or gaussian (N(0, 1/r))
    # What the weight sync sends the rollout: "merged" (base + (alpha / r) B A, the full weights) or "adapter" (the
    # adapters alone, loaded by vLLM's LoRA support as a new adapter each step; the engine keeps the base).
    sync: str = "merged"


@dataclass(frozen=True)
class MegatronTrainConfig(MegatronModelConfig):
    """Megatron training (actor or critic): DDP + Megatron optimizer + scheduler, on MegatronModelConfig's model."""

    optimizer: OptimizerSettings = field(default_factory=OptimizerSettings)
    lr_schedule: LRSchedule = field(default_factory=LRSchedule)
    total_steps: int = 1000  # used for the decay horizon when lr_schedule.decay_steps is None
    mtp_loss_scaling_factor: float = 0.1  # weight of the MTP loss
    recompute_activations: bool = False  # recompute each layer's activations in backward (less memory, more compute)
    lora: LoRASettings | None = None  # train LoRA adapters on a frozen base (None: every parameter trains)
    offload_grads: bool = False  # the hybrid engine: gradients to host memory while idle (see offload_params)
    offload_optimizer: bool = False  # the hybrid engine: optimizer state to host memory while idle

    ENTROPY_BY_DEFAULT: ClassVar[bool] = True  # the loss may use it (entropy bonus, metrics)

    def __post_init__(self):
        super().__post_init__()
        _raise(
            "megatron_train config",
            _settings_problems(self) + _training_settings_problems(self) + _lora_problems(self),
        )

    def for_run(self, run: RunFacts) -> MegatronTrainConfig:
        """This config with the run's optimizer steps as the decay horizon, and a value head where the role
        scores values."""
        updates: dict[str, Any] = {}
        if run.optimizer_steps is not None:
            updates["total_steps"] = run.optimizer_steps
        updates |= _value_head_updates(self, run)
        return dataclasses.replace(self, **updates) if updates else self

    def problems(self, run: RunFacts) -> list[str]:
        """What this config cannot do in this run (the ranks' start-up rules), before Ray starts."""
        return _run_problems(self, run) + _training_run_problems(self, run)


def _value_head_updates(cfg, run: RunFacts) -> dict[str, Any]:
    updates: dict[str, Any] = {}
    if run.value_head and not cfg.value_head:
        updates["value_head"] = True
    if run.score_head and cfg.value_head_init != "score_head":
        updates["value_head_init"] = "score_head"
    return updates


def lora_settings_problems(lora) -> list[str]:
    """What is wrong with a `lora:` section on its own ([] when nothing)."""
    problems = []
    if lora.rank < 1:
        problems.append(f"rank={lora.rank} must be >= 1")
    if lora.alpha <= 0:
        problems.append(f"alpha={lora.alpha} must be > 0")
    unknown = [name for name in lora.target_modules if name not in LORA_TARGET_MODULES]
    if unknown or not lora.target_modules:
        problems.append(
            f"target_modules={list(lora.target_modules)}: choose from {', '.join(LORA_TARGET_MODULES)} (PEFT's names)"
        )
    if lora.init not in LORA_INITS:
        problems.append(f"init={lora.init!r}; choose one of {', '.join(LORA_INITS)}")
    if lora.sync not in LORA_SYNC_MODES:
        problems.append(f"sync={lora.sync!r}; choose one of {', '.join(LORA_SYNC_MODES)}")
    if not 0.0 <= lora.dropout < 1.0:
        problems.append(f"dropout={lora.dropout} must be in [0, 1)")
    return problems


def _lora_problems(cfg) -> list[str]:
    """What LoRA cannot do yet with these settings."""
    if cfg.lora is None:
        return []
    problems = [f"lora.{problem}" for problem in lora_settings_problems(cfg.lora)]
    if cfg.transformer_impl == "te":
        problems.append(
            "lora with transformer_impl=te: TE fuses the norms into the projections; use local (not supported yet)"
        )
    return problems


def _training_settings_problems(cfg: MegatronTrainConfig) -> list[str]:
    """The optimizer's and the scheduler's own rules (torch's Adam and Megatron's OptimizerParamScheduler assert
    them on the ranks)."""
    problems = []
    opt, schedule = cfg.optimizer, cfg.lr_schedule
    if schedule.decay_style not in DECAY_STYLES:
        problems.append(f"lr_schedule.decay_style={schedule.decay_style!r}; choose one of {', '.join(DECAY_STYLES)}")
    elif schedule.decay_style == "WSD":
        problems.append(
            "lr_schedule.decay_style='WSD' needs a WSD decay length, which this backend does not pass to "
            "Megatron's scheduler; choose constant, linear, cosine or inverse-square-root"
        )
    for name, value in (("lr", opt.lr), ("min_lr", opt.min_lr), ("eps", opt.eps), ("weight_decay", opt.weight_decay)):
        if not value >= 0:
            problems.append(f"optimizer.{name}={value} must be >= 0")
    if opt.lr < opt.min_lr:
        problems.append(f"optimizer.lr={opt.lr} is below optimizer.min_lr={opt.min_lr}")
    if not all(0 <= beta < 1 for beta in opt.betas):
        problems.append(f"optimizer.betas={list(opt.betas)} must both be in [0, 1) (0.9, 0.999 is usual)")
    factor = cfg.mtp_loss_scaling_factor
    if cfg.mtp_num_layers and not (isinstance(factor, (int, float)) and math.isfinite(factor) and factor > 0):
        problems.append(
            f"mtp_loss_scaling_factor={factor!r} must be a finite number > 0 with MTP "
            "(the MTP loss is added to the main loss with this weight; 0.1 is usual); "
            "set mtp_num_layers=0 to turn MTP off"
        )
    if schedule.warmup_steps < 0:
        problems.append(f"lr_schedule.warmup_steps={schedule.warmup_steps} must be >= 0")
    if schedule.decay_steps and schedule.decay_steps <= schedule.warmup_steps:
        problems.append(
            f"lr_schedule.decay_steps={schedule.decay_steps} must be above lr_schedule.warmup_steps="
            f"{schedule.warmup_steps} (the decay ends after the warm-up); raise it or leave it null"
        )
    return problems


# ---- a config against the run (`problems`: the ranks' start-up rules, before Ray starts) ------------------


def _run_problems(cfg, run: RunFacts) -> list[str]:
    """The rules every Megatron strategy's ranks enforce at start-up, checked against what the run decides."""
    where = f"{run.role}.strategy"
    try:
        cfg = cfg.for_run(run)
    except ValueError as exc:
        return [f"{where}: {exc}"]
    problems = []
    if cfg.transformer_impl == "transformer_engine" and run.device != "cuda":
        problems.append(
            f"{where}.transformer_impl=transformer_engine needs TransformerEngine on a cuda device "
            f"(num_gpus_per_rank > 0); use 'local' or 'auto' on {run.device}"
        )
    if cfg.offloaded_parts and not run.hybrid:
        problems.append(
            f"{where}: offload_{'/'.join(sorted(cfg.offloaded_parts))} hand the device over in the hybrid engine "
            "only (actor_infer.hybrid: true); turn them off, or make the roles hybrid"
        )
    problems += _split_problems(cfg, run)
    if run.model_config:
        problems += _model_problems(cfg, run, run.model_config)
    if cfg.value_head_init == "score_head":
        problems += _score_head_problems(cfg, run)
    return problems


def _split_problems(cfg, run: RunFacts) -> list[str]:
    """Pipeline splits Megatron cannot build, and micro-batching the interleaved schedule cannot run."""
    layout, where = run.layout, f"{run.role}.strategy"
    problems = []
    if layout.vpp is not None and cfg.max_tokens_per_microbatch is not None:
        problems.append(
            f"{where}: max_tokens_per_microbatch with vpp={layout.vpp} is not supported yet (the "
            f"interleaved schedule needs a multiple of pp micro-batches); set vpp=null or use micro_batch_size"
        )
    num_layers = (run.model_config or {}).get("num_hidden_layers")
    if num_layers is None:
        if layout.vpp is not None and (layout.vpp < 2 or layout.pp < 2):
            problems.append(f"{where}.vpp={layout.vpp} needs pp >= 2 and vpp >= 2; set vpp=null or raise pp")
        return problems
    try:
        first, last = stage_split(cfg, num_layers, layout)
        problem = stage_split_problem(num_layers, layout.pp, layout.vpp, first, last)
    except ValueError as exc:
        problem = str(exc)
    if problem:
        problems.append(f"{where} (pp={layout.pp}, vpp={layout.vpp}): {problem}")
    return problems


def _model_problems(cfg, run: RunFacts, fields: Mapping[str, Any]) -> list[str]:
    """The model's own rules (supported family, TP over the MLP, experts over EP/ETP, a value head's layout)."""
    layout, where = run.layout, f"{run.role}.strategy"
    problems = [f"{where}: {problem}" for problem in hf_model_problems(fields)]
    model_type = fields.get("model_type")
    moe = model_type in MOE_MODEL_TYPES
    heads = [fields.get(name) or 0 for name in ("num_attention_heads", "num_key_value_heads")]
    ffn = fields.get("intermediate_size")
    # Only once TP divides the heads (the validator's own check): one tp problem at a time.
    if not moe and ffn and ffn % layout.tp and not any(n % layout.tp for n in heads):
        choices = ", ".join(map(str, _divisors(math.gcd(ffn, *heads))))
        problems.append(f"{where}.tp={layout.tp} does not divide intermediate_size={ffn}; choose one of {choices}")
    experts = fields.get("num_experts") or fields.get("num_local_experts") or 0
    if not experts and (layout.ep != 1 or layout.etp is not None):
        problems.append(f"{where}.ep={layout.ep}: the model ({model_type}) has no experts; set ep=1 and drop etp")
    elif experts and moe:
        shared = fields.get("shared_expert_intermediate_size") if model_type == "qwen2_moe" else None
        expert_problems = expert_layout_problems(
            experts, fields.get("moe_intermediate_size"), shared, layout.tp, layout.ep, layout.expert_tp
        )
        problems += [f"{where}.{problem}" for problem in expert_problems]
    if cfg.router_replay is not None and not moe:
        problems.append(
            f"{where}.router_replay={cfg.router_replay}: the model ({model_type}) has no routed experts; set it to null"
        )
    moe_mtp_problem = mtp_problem(moe, cfg.mtp_num_layers)
    if moe_mtp_problem:
        problems.append(f"{where}: {moe_mtp_problem}")
    return problems


def _score_head_problems(cfg, run: RunFacts) -> list[str]:
    """value_head_init=score_head: only a value head can take it, from a checkpoint that has one."""
    from roll_backend.strategies.megatron.hf_files import score_head_problem

    where = f"{run.role}.strategy.value_head_init=score_head"
    if not cfg.value_head:
        return [f"{where}: only the critic has a value head; remove it here"]
    problem = score_head_problem(cfg.model_path) if Path(cfg.model_path).is_dir() else None
    return [f"{where}: {problem}"] if problem else []


def _moe_lora_problems(cfg: MegatronTrainConfig, run: RunFacts) -> list[str]:
    """LoRA on a MoE model (adapters on attention and on every routed and shared expert) runs at every layout; the
    rollout takes the merged weights."""
    problems = []
    if cfg.lora.sync == "adapter":
        problems.append(
            f"{run.role}.strategy.lora.sync=adapter on a MoE model: vLLM's CPU build serves no adapters on fused "
            "experts; use lora.sync=merged"
        )
    if run.exports_adapters:
        problems.append(
            "checkpoint.export_peft_dir on a MoE model: adapters on experts have no PEFT form here (transformers' "
            "Qwen MoE models fuse their experts into one parameter); use checkpoint.export_hf_dir (merged weights)"
        )
    return problems


def _training_run_problems(cfg: MegatronTrainConfig, run: RunFacts) -> list[str]:
    """A training role's mini-batches must split into micro-batches on every DP rank; the distributed optimizer
    cannot checkpoint on CPU."""
    problems = []
    model_parallel = run.layout.model_parallel_size
    mini = run.train_batch_size
    if mini and cfg.max_tokens_per_microbatch is None and run.world_size >= 1 and run.world_size % model_parallel == 0:
        dp, micro = run.world_size // model_parallel, cfg.micro_batch_size
        if mini % (dp * micro):
            choices = ", ".join(map(str, _divisors(max(1, mini // dp))))
            problems.append(
                f"{run.role}: a mini-batch of {mini} responses cannot be split into micro-batches of "
                f"{run.role}.strategy.micro_batch_size={micro} on each of {dp} data-parallel ranks; make "
                f"the mini-batch (algorithm.ppo_mini_batch_size; offline pipelines: the step's rows) a multiple of "
                f"{dp * micro} or change micro_batch_size to one of {choices}"
            )
    if cfg.lora is not None and (run.model_config or {}).get("model_type") in MOE_MODEL_TYPES:
        problems += _moe_lora_problems(cfg, run)
    if run.saves_checkpoints and cfg.optimizer.use_distributed_optimizer and run.device == "cpu":
        problems.append(
            "checkpoint.save_steps > 0 with the distributed optimizer on CPU: megatron-core 0.16.1 cannot "
            f"save its state there; set {run.role}.strategy.optimizer.use_distributed_optimizer=false"
        )
    return problems
