"""The run config, as frozen dataclasses: top level, algorithm, data, checkpoints, logging, and one block per role.

The YAML shape follows ROLL/verl: a role block holds its model path, its resources and a `strategy` section
whose `name` picks the backend (strategies.registry) and whose other keys are that backend's typed config
plus the parallel layout (tp, pp, cp, vpp). Any key can be overridden as `actor_train.strategy.tp=2`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from roll_backend.distributed.parallel import ParallelLayout

LAYOUT_KEYS = ("tp", "pp", "cp", "vpp")


@dataclass(frozen=True)
class StrategySection:
    """A role's backend: its registry name, parallel layout, and its own typed config (built by the loader)."""

    name: str
    layout: ParallelLayout
    config: Any  # e.g. MegatronTrainConfig, VllmRolloutConfig


@dataclass(frozen=True)
class RoleConfig:
    """One role: model, resources, and strategy. `colocate_with` names a role whose placement group it shares."""

    model_path: str
    strategy: StrategySection
    world_size: int = 1
    num_cpus_per_rank: float = 0.5
    num_gpus_per_rank: float = 0.0
    colocate_with: str | None = None


@dataclass(frozen=True)
class RewardConfig:
    """Rule-based rewards (name -> weight, see roll_backend.rewards) run over `world_size` actors."""

    rewards: dict[str, float] = field(default_factory=lambda: {"math_verify": 1.0})
    world_size: int = 1
    num_cpus_per_rank: float = 0.25


@dataclass(frozen=True)
class KLControlConfig:
    """KL coefficient when KL is in the reward: fixed, or adaptive towards `target_kl` over `horizon` steps."""

    type: str = "fixed"
    kl_coef: float = 0.001
    target_kl: float = 0.1
    horizon: int = 10000


@dataclass(frozen=True)
class AlgorithmConfig:
    """Advantages, the policy loss and clipping, KL (as a loss or in the reward), aggregation, PPO epochs."""

    adv_estimator: str = "grpo"
    norm_adv_by_std: bool = True  # False: Dr.GRPO
    gamma: float = 1.0
    lam: float = 1.0
    policy_loss: str = "ppo"
    clip_ratio_low: float = 0.2
    clip_ratio_high: float = 0.2
    dual_clip_c: float = 3.0
    loss_agg_mode: str = "token-mean"
    entropy_coef: float = 0.0
    use_kl_loss: bool = True
    kl_loss_coef: float = 0.001
    kl_estimator: str = "low_var_kl"
    use_kl_in_reward: bool = False
    kl_ctrl: KLControlConfig = field(default_factory=KLControlConfig)
    reward_clip: float | None = None
    reward_norm: str | None = None  # "batch" | "group" | None
    ppo_epochs: int = 1
    ppo_mini_batch_size: int | None = None  # responses per optimizer step; None: the whole step's batch
    value_clip: float = 0.5
    dynamic_sampling: bool = False  # drop prompt groups whose rewards are all equal (DAPO)


@dataclass(frozen=True)
class SyntheticDataConfig:
    """A generated prompt set (see roll_backend.pipelines.data): the demo's task, no files needed."""

    task: str = "copy_digit"
    num_prompts: int = 512
    seed: int = 0


@dataclass(frozen=True)
class DataConfig:
    """Prompts: a JSONL or parquet file, or a synthetic task. Rows need a prompt and an answer column."""

    train_path: str | None = None
    synthetic: SyntheticDataConfig | None = None
    prompt_key: str = "prompt"
    answer_key: str = "answer"
    apply_chat_template: bool = True
    max_prompt_length: int = 256  # longer prompts (in tokens) are filtered out
    shuffle: bool = True


@dataclass(frozen=True)
class CheckpointConfig:
    """Save every `save_steps` (0: never) under output_dir/checkpoints; `resume`: "auto" picks the latest."""

    save_steps: int = 0
    keep_last: int = 2
    resume: str | None = None  # None | "auto" | a checkpoint folder


@dataclass(frozen=True)
class LoggingConfig:
    jsonl: bool = True
    tensorboard: bool = True
    progress_bar: bool = True


@dataclass(frozen=True)
class PipelineConfig:
    """A whole run. `pipeline` picks the control loop: grpo (no critic) or ppo (critic + GAE)."""

    pipeline: str
    model_path: str
    actor_train: RoleConfig
    actor_infer: RoleConfig
    exp_name: str = "run"
    seed: int = 42
    output_dir: str = "runs/run"
    max_steps: int = 10
    rollout_batch_size: int = 8  # prompts per step
    num_return_sequences_in_group: int = 4  # samples per prompt (n)
    response_length: int = 64
    build_tiny_model: dict[str, Any] | None = None  # TinyModelSpec fields: write a tiny model to model_path first
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    data: DataConfig = field(default_factory=DataConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    reference: RoleConfig | None = None
    critic: RoleConfig | None = None
    reward: RewardConfig = field(default_factory=RewardConfig)
    weight_sync_bucket_bytes: int = 256 * 2**20  # trainer -> rollout weights travel in buckets of about this size
    # The post-sync probe fails the run past this mean |log-prob gap|; None: by precision (see logprob_gap_limit).
    weight_sync_max_logprob_gap: float | None = None
    ray_num_cpus: int = 16  # CPUs a local Ray declares (actor groups take shares, not whole cores)

    def logprob_gap_limit(self) -> float:
        """The post-sync probe's limit: as configured, else 1e-3 when trainer and rollout both compute in float32
        and 3e-2 when either uses a 16-bit dtype (bf16 kernels differ between engines by ~1e-3 to 1e-2 per token)."""
        if self.weight_sync_max_logprob_gap is not None:
            return self.weight_sync_max_logprob_gap
        dtypes = {_compute_dtype(self.actor_train), _compute_dtype(self.actor_infer)}
        return FULL_PRECISION_LOGPROB_GAP if dtypes == {"float32"} else HALF_PRECISION_LOGPROB_GAP


FULL_PRECISION_LOGPROB_GAP = 1e-3
HALF_PRECISION_LOGPROB_GAP = 3e-2


def _compute_dtype(role: RoleConfig) -> str:
    """A role's compute dtype: Megatron's params_dtype or vLLM's dtype."""
    config = role.strategy.config
    return str(getattr(config, "params_dtype", None) or getattr(config, "dtype", "float32"))
