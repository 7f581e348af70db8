"""The run config, as frozen dataclasses: top level, algorithm, data, checkpoints, logging, and one block per role.

The YAML shape follows ROLL/verl: a role block holds its model path, its resources and a `strategy` section
whose `name` picks the backend (strategies.registry) and whose other keys are that backend's typed config
plus the parallel layout (tp, pp, cp, vpp, ep, etp). Any key can be overridden as `actor_train.strategy.tp=2`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from roll_backend import roles
from roll_backend.agentic.config import AgenticConfig
from roll_backend.config.guard_rules import GuardConfig
from roll_backend.distributed.layout import ParallelLayout
from roll_backend.rewards.user_functions import RewardFunctionSpec

LAYOUT_KEYS = ("tp", "pp", "cp", "vpp", "ep", "etp")


@dataclass(frozen=True)
class StrategySection:
    """A role's backend: its registry name, parallel layout, and its own typed config (built by the loader)."""

    name: str
    layout: ParallelLayout
    config: Any  # e.g. MegatronTrainConfig, VllmRolloutConfig


@dataclass(frozen=True)
class RoleConfig:
    """One role: model, resources, and strategy. `colocate_with` names a role whose placement group it shares."""

    model_path: str  # Hugging Face model folder this role loads (usually ${model_path})
    strategy: StrategySection
    world_size: int = 1  # ranks (Ray actors) of this role; a multiple of tp*pp*cp
    num_cpus_per_rank: float = 0.5  # CPU share each rank reserves in its placement-group bundle
    num_gpus_per_rank: float = 0.0  # GPUs per rank (0: CPU with gloo; 1 on a GPU cluster)
    colocate_with: str | None = None  # another role's name: share its placement group, rank by rank
    # The hybrid engine (actor_infer, reference, critic): run in actor_train's processes, one per rank, on its
    # resources, taking the device in turn (workers/hybrid.py); world_size must equal actor_train's.
    hybrid: bool = False


@dataclass(frozen=True)
class OverlongBufferConfig:
    """DAPO's soft overlong punishment (verl's overlong_buffer_cfg): a response of L tokens, past
    max_length - length, gets min(-(L - (max_length - length)) / length * penalty_factor, 0) added to its reward,
    down to -penalty_factor at max_length."""

    length: int  # the buffer: the last tokens before max_length, over which the penalty grows
    penalty_factor: float = 1.0  # the penalty at max_length (a reward of 1 is a solved problem)
    max_length: int | None = None  # null: the run's response_length (verl's max_resp_len)


@dataclass(frozen=True)
class RewardConfig:
    """Rule-based rewards run over `world_size` actors, each scoring its share of the batch: built-in names
    (name -> weight, see roll_backend.rewards.registry) plus user functions, summed with their weights."""

    # reward name -> weight (roll_backend/rewards); None: {"math_verify": 1.0} without `functions`
    rewards: dict[str, float] | None = None
    # Each {path: my_rewards.py (or a module name), name: compute_score, weight: 1.0, batched: false}.
    functions: list[RewardFunctionSpec] = field(default_factory=list)
    on_function_error: str = "raise"  # "zero": a row whose function raised/returned a non-number/timed out scores 0
    function_timeout_s: float = 60.0  # per call of a user function (per row, or per batch when batched)
    world_size: int = 1  # reward actors; the batch is split between them
    num_cpus_per_rank: float = 0.25  # CPU share each reward actor reserves
    # Agentic runs: the weight of the environment's reward (agentic.env_reward) in the sum. There, rewards: null
    # means no built-in reward (the environment's alone, plus any functions).
    env_weight: float = 1.0
    # With a `reward_model:` role: the weight of its score in the sum. There (and with a distillation `teacher:`),
    # rewards: null means no built-in reward (the model's score alone, plus any functions); name built-ins to add them.
    model_weight: float = 1.0
    # "batch": standardise the reward model's scores over the step's batch (mean 0, std 1) before weighting; null: raw
    model_score_norm: str | None = None
    model_score_clip: float | None = None  # clip the (standardised) reward-model score to [-c, c]; null: no clipping
    # Rewards by each row's source (verl's data_source, ROLL's tag): {pattern: rewards}, patterns exact or globs in
    # the order written, `default` for the rest; rewards a name (built-in or a function's label), a list of names, a
    # mapping name -> weight, or `auto` (the built-in scorer of a known source: gsm8k, MATH, multiple choice ...).
    # `by_source: auto` does that for every row. Its weights replace `rewards` (then null) and the functions'
    # weights. null: every row gets `rewards` and every function.
    by_source: dict[str, Any] | str | None = None
    # DAPO's soft penalty for responses that reach into the last `length` tokens before the response length limit
    # (added to every training row's reward; validation scores the answers alone); null: none.
    overlong_buffer: OverlongBufferConfig | None = None

    def builtin_weights(self, other_rewards: bool = False) -> dict[str, float]:
        """The built-in rewards to compute; `other_rewards`: the run is rewarded otherwise too (an environment, a
        reward model or a distillation teacher), so rewards: null means none rather than math_verify."""
        from roll_backend.rewards.registry import builtin_weights

        return builtin_weights(self.rewards, bool(self.functions) or other_rewards or self.by_source is not None)


@dataclass(frozen=True)
class KLControlConfig:
    """KL coefficient when KL is in the reward: fixed, or adaptive towards `target_kl` over `horizon` steps."""

    type: str = "fixed"  # "fixed" or "adaptive"
    kl_coef: float = 0.001  # the (initial) coefficient of the KL penalty in the reward
    target_kl: float = 0.1  # adaptive: the KL the coefficient steers towards
    horizon: int = 10000  # adaptive: steps over which the coefficient adapts


@dataclass(frozen=True)
class RolloutCorrectionConfig:
    """Rollout-mismatch correction from rollout_log_probs and old_log_probs (algorithms.rollout_correction);
    off while both `is_level` and `rejection` are null."""

    is_level: str | None = None  # truncated importance sampling: "token" | "sequence" | None
    is_cap: float = 2.0  # C: weights above it are truncated to it
    rejection: str | None = None  # mask out of the policy loss: "sequence" (geometric mean) | "token" | None
    rejection_threshold: float = 2.0  # C_rs: keep ratios inside [1/C_rs, C_rs]

    @property
    def enabled(self) -> bool:
        return self.is_level is not None or self.rejection is not None


@dataclass(frozen=True)
class AlgorithmConfig:
    """Advantages, the policy loss and clipping, KL (as a loss or in the reward), aggregation, PPO epochs."""

    # grpo, rloo, reinforce_plus_plus(_baseline), gae (needs a critic), remax (greedy baseline, one extra response)
    adv_estimator: str = "grpo"
    norm_adv_by_std: bool = True  # False: Dr.GRPO
    gamma: float = 1.0  # discount factor of returns (GAE / REINFORCE++)
    lam: float = 1.0  # GAE lambda
    # the policy-gradient loss: ppo, gspo, cispo, sapo, gpg, geo_mean (GMPO) (roll_backend.algorithms.POLICY_LOSSES)
    policy_loss: str = "ppo"
    clip_ratio_low: float = 0.2  # PPO clip: ratio >= 1 - clip_ratio_low
    clip_ratio_high: float = 0.2  # PPO clip: ratio <= 1 + clip_ratio_high (DAPO clip-higher when larger)
    dual_clip_c: float = 3.0  # dual-clip PPO bound on negative advantages
    sapo_tau_pos: float = 1.0  # policy_loss=sapo: the soft gate's temperature for positive advantages
    sapo_tau_neg: float = 1.05  # ... and for the others (steeper: negative updates fade sooner)
    # how token losses average: token-mean, seq-mean-token-sum, seq-mean-token-mean, ...
    loss_agg_mode: str = "token-mean"
    entropy_coef: float = 0.0  # weight of the entropy bonus in the actor loss
    use_kl_loss: bool = True  # add KL(actor || reference) to the actor loss (needs a reference role)
    kl_loss_coef: float = 0.001  # weight of the KL loss
    kl_estimator: str = "low_var_kl"  # KL estimator: k1, k2, low_var_kl (k3), ...
    use_kl_in_reward: bool = False  # subtract a KL penalty from the reward instead (needs a reference role)
    kl_ctrl: KLControlConfig = field(default_factory=KLControlConfig)
    reward_clip: float | None = None  # clip scores to [-reward_clip, reward_clip]; null: no clipping
    reward_norm: str | None = None  # "batch" | "group" | None
    ppo_epochs: int = 1  # passes over each step's batch
    ppo_mini_batch_size: int | None = None  # responses per optimizer step; None: the whole step's batch
    value_clip: float | None = 0.5  # critic: clip of the value update (PPO value clipping); null: unclipped
    # Dynamic sampling (DAPO): train only on prompt groups whose rewards differ, generating more groups until the
    # step has rollout_batch_size of them or max_generation_rounds rounds ran (then it trains on what there is).
    dynamic_sampling: bool = False
    max_generation_rounds: int = 4  # dynamic sampling: generation rounds per step at most (1: drop, never refill)
    refill_oversample: float = 1.0  # dynamic sampling: a refill round draws this many prompts per group missing
    rollout_correction: RolloutCorrectionConfig = field(default_factory=RolloutCorrectionConfig)


@dataclass(frozen=True)
class PreferenceConfig:
    """The offline pipelines' objectives (pipeline: sft | reward_model | dpo; algorithms/preference.py). A reward
    model's Bradley-Terry loss takes each pair's margin from data.margin_key when the rows have it."""

    beta: float = 0.1  # dpo: the strength of the implicit KL to the reference (larger: closer to it)
    loss: str = "sigmoid"  # dpo: "sigmoid" (DPO) or "ipo" (squared, per-token log-ratios)
    label_smoothing: float = 0.0  # dpo sigmoid: the probability that a pair's label is wrong (conservative DPO)


DISTILL_MODES = ("reward", "loss")


@dataclass(frozen=True)
class DistillationConfig:
    """On-policy distillation with a `teacher:` role: the teacher scores the student's sampled tokens and the
    per-token reverse KL log pi_student - log pi_teacher is pushed down, as a dense reward or as a loss."""

    # "reward": subtract coef * (log pi - log pi_teacher) from each token's reward (it flows through the advantage);
    # "loss": add coef * KL(pi || pi_teacher) estimated per token (algorithm.kl_estimator) to the actor loss
    mode: str = "reward"
    coef: float = 1.0  # weight of the reverse KL to the teacher


@dataclass(frozen=True)
class ReasoningGymData:
    """Prompts from a reasoning-gym dataset (pipelines.procedural_tasks), scored by the library's own verifier
    (reward.functions: [{path: roll_backend.rewards.procedural, name: compute_score}])."""

    name: str  # the dataset, e.g. basic_arithmetic, chain_sum, leg_counting (reasoning_gym.factory.DATASETS)
    size: int = 500  # entries generated
    seed: int = 0  # seed of the generated entries
    config: dict[str, Any] = field(default_factory=dict)  # the generator's own settings (e.g. max_terms)


@dataclass(frozen=True)
class SyntheticDataConfig:
    """A generated prompt set (see roll_backend.pipelines.data.prompt_dataset): the demo's task, no files needed."""

    task: str = "copy_digit"  # the generated task (roll_backend/pipelines/data/synthetic_tasks.py)
    num_prompts: int = 512  # prompts generated
    seed: int = 0  # seed of the generated prompts


@dataclass(frozen=True)
class TrainSource:
    """One training prompt file of a mixture: each step draws about `weight / sum of weights` of its prompts here."""

    path: str  # prompt file: .jsonl, .json or .parquet, one row per prompt
    weight: float = 1.0  # relative share of each step's prompts (> 0)
    # The source's name in data/<source>/ metrics and the reward's data_source; null: each row's `data_source`
    # column, else the file's name without extension.
    data_source: str | None = None


DATA_FORMATS = ("auto", "verl", "roll", "plain")  # data.format (pipelines.data.row_formats)


@dataclass(frozen=True)
class DataConfig:
    """Prompts: a JSONL or parquet file, a weighted list of them, or a synthetic task. Rows need a prompt and an
    answer column."""

    # One prompt file (.jsonl, .json or .parquet, one row per prompt), or a mixture: a list of
    # {path, weight, data_source} entries (TrainSource), each step's prompts drawn from them by weight.
    train_path: str | tuple[TrainSource, ...] | None = None
    # Draw each step's prompts by data source instead of by file (ROLL's domain_interleave_probs): {source: weight},
    # every source of the train_path rows named (weight 0 leaves its rows out); the files' rows are pooled per source
    # and each source is read epoch by epoch in its own order. null: by file.
    source_weights: dict[str, float] | None = None
    synthetic: SyntheticDataConfig | None = None
    # Training prompts from a reasoning-gym dataset (when train_path is unset; it wins over synthetic).
    reasoning_gym: ReasoningGymData | None = None
    # How a file's columns are read: verl (prompt messages, data_source, reward_model.ground_truth, extra_info),
    # roll (messages as a JSON string, ground_truth, tag), plain (prompt, answer, data_source), or auto: detected per
    # file (verl when reward_model is a dict, roll when messages is a JSON conversation), said in the log.
    format: str = "auto"
    prompt_key: str = "prompt"  # column holding the prompt (text, or chat messages)
    # column holding the reference answer the reward compares with (a dotted path reads into a dict column, e.g.
    # reward_model.ground_truth; kept typed: a list stays a list); null: rows have none (rewards from a reward model).
    # sft: the response trained on (or, naming the prompt's column, conversations whose last assistant message is the
    # response); reward_model and dpo: the chosen response (e.g. answer_key: chosen). Default: the format's.
    answer_key: str | None = "answer"
    # column holding the conversation as a JSON string, parsed into the prompt's messages (ROLL's `messages`); null:
    # the format's (roll: messages)
    messages_key: str | None = None
    # column naming each row's source, for reward.by_source and per-source metrics; null: the format's (verl and
    # plain: data_source, roll: tag)
    source_key: str | None = None
    rejected_key: str = "rejected"  # reward_model and dpo: the column holding the rejected response
    margin_key: str = "margin"  # reward_model: a pair's margin in the Bradley-Terry loss, where rows have it
    apply_chat_template: bool = True  # wrap text prompts as one user message for the tokenizer's chat template
    max_prompt_length: int = 256  # longer prompts (in tokens) are filtered out
    shuffle: bool = True  # a new order every epoch (deterministic from the run's seed)
    # Rows that are not JSON objects or whose prompt/answer is missing or null: False stops the run naming them
    # (file:line); True skips them, logs the count and reports it as the metric data/skipped_rows.
    skip_invalid_rows: bool = False
    # Validation prompts (one file or a list; same formats and checks as train_path), used by the `eval` block.
    # A row's `data_source` column names its source in the val/ metrics, else the file's name without extension.
    val_path: str | tuple[str, ...] | None = None
    val_reasoning_gym: ReasoningGymData | None = None  # validation prompts from a reasoning-gym dataset (as well)
    # Validation prompts from a synthetic task (as well), e.g. held-out environment seeds: {task: episodes, seed: 1}.
    val_synthetic: SyntheticDataConfig | None = None

    def val_paths(self) -> tuple[str, ...]:
        return (self.val_path,) if isinstance(self.val_path, str) else tuple(self.val_path or ())

    def has_validation(self) -> bool:
        return bool(self.val_paths()) or self.val_reasoning_gym is not None or self.val_synthetic is not None


@dataclass(frozen=True)
class EvalConfig:
    """Validation on data.val_path: before training, every `every_steps` and after the last step. It never trains
    and never moves the training data order or sampling (each generation is seeded on its own)."""

    before_train: bool = True  # evaluate before the first step of a fresh run
    every_steps: int = 0  # also after every this many steps (0: never during training; the last step always)
    n: int = 1  # samples per prompt
    temperature: float | None = None  # None: greedy when n = 1, else the rollout's sampling temperature
    top_p: float | None = None  # None: the rollout's validation setting
    pass_k: tuple[int, ...] = ()  # report val/<source>/pass@k for each k (<= n), unbiased estimator
    maj_k: tuple[int, ...] = ()  # report val/<source>/maj@k for each k (<= n), majority vote over answers
    correct_threshold: float = 1.0  # a sample counts as correct when its reward is at least this
    prompts_per_call: int = 256  # validation prompts per generate call


@dataclass(frozen=True)
class CheckpointConfig:
    """Save every `save_steps` (0: never) under output_dir/checkpoints. `resume`: "auto" picks the newest complete
    checkpoint (its manifest, written last, matches its files), saying which it skipped and why; a folder resumes
    from that checkpoint, refused before any rank starts when it is incomplete."""

    save_steps: int = 0  # save every this many steps (0: never)
    keep_last: int = 2  # checkpoints kept; older ones are deleted
    resume: str | None = None  # None | "auto" | a checkpoint folder
    # After the last step, write the trained model (actor_train) to this folder as a Hugging Face checkpoint (sharded
    # safetensors, config, tokenizer): transformers and vLLM load it; a reward_model run's loads as
    # *ForSequenceClassification. null: no export.
    export_hf_dir: str | None = None
    # With LoRA (actor_train.strategy.lora): after the last step, also write the adapters to this folder as a PEFT
    # adapter (adapter_config.json, adapter_model.safetensors) for `peft.PeftModel.from_pretrained(base, folder)`;
    # export_hf_dir then gets the merged weights. null: no adapter export.
    export_peft_dir: str | None = None


@dataclass(frozen=True)
class PhaseTimeouts:
    """Seconds each phase may take, all its group calls together, before its ranks count as hung (the group is
    then broken and, with max_restarts, the run restarts). Generous for real models; lower them for small ones."""

    startup: float = 3600.0  # start every group and load the models
    # Reserving a role's CPUs/GPUs (Ray placement groups) at start and at each restart: a cluster that lost a
    # node stops here, with a PlacementError, once the run no longer fits on what is left.
    placement: float = 300.0
    generate: float = 3600.0  # the rollout's generation of one step's batch
    reward: float = 1800.0  # reward functions / reward model over one step's batch
    log_probs: float = 3600.0  # reference / old log-probs / critic values
    train: float = 7200.0  # actor and critic updates of one step
    weight_sync: float = 1800.0  # trainer -> rollout weights and the probe
    checkpoint: float = 3600.0  # saving or loading a checkpoint


@dataclass(frozen=True)
class FaultToleranceConfig:
    """Automatic restart and deadlines. A dead rank, a missed phase deadline or a lost node restarts the run from
    the latest complete checkpoint, at most `max_restarts` times; config, data and user-code errors never do.
    `inject`: fault injection for tests, `action:role:rank:phase:step`, several separated by `;` for successive
    attempts (see distributed/faults.py)."""

    # automatic restarts from the newest complete checkpoint before the run stops (needs checkpoint.save_steps)
    max_restarts: int = 0
    timeouts: PhaseTimeouts = field(default_factory=PhaseTimeouts)
    settle_s: float = 10.0  # after a rank raised, how long the others of the call get before the group is broken
    inject: str | None = None  # tests only: ACTION:ROLE:RANK:PHASE:STEP, e.g. kill:actor_train:1:train:3


LOGGER_NAMES = ("console", "jsonl", "mlflow", "tensorboard", "wandb")  # logging.backends (pipelines.loggers)
WANDB_MODES = ("offline", "online")


@dataclass(frozen=True)
class LoggingConfig:
    """Where step metrics go besides the returned history: every backend gets the same scalars at the same step.
    `backends` names them (LOGGER_NAMES); left null, the three switches below pick them."""

    # any of tensorboard, jsonl, wandb, mlflow, console (the progress bar); null: the switches below
    backends: tuple[str, ...] | None = None
    jsonl: bool = True  # write output_dir/metrics.jsonl (when backends is null)
    tensorboard: bool = True  # write TensorBoard events under output_dir (when backends is null)
    progress_bar: bool = True  # show a progress bar on the console (when backends is null)
    project: str = "roll-backend"  # W&B project and MLflow experiment
    run_name: str | None = None  # the run's name in W&B and MLflow; null: the output_dir's folder name
    # offline: the W&B run is written under output_dir/wandb (upload it later with `wandb sync`); online: sent live
    wandb_mode: str = "offline"

    def enabled_backends(self) -> tuple[str, ...]:
        """The backends to write, in order and each once: `backends`, else those the switches turn on."""
        if self.backends is not None:
            return tuple(dict.fromkeys(self.backends))
        switches = {"jsonl": self.jsonl, "tensorboard": self.tensorboard, "console": self.progress_bar}
        return tuple(name for name, on in switches.items() if on)


@dataclass(frozen=True)
class AsyncGenerationConfig:
    """Generation overlapped with training; needs actor_infer on resources disjoint from actor_train's. one_step: the
    rollout group generates step k+1's batch while the actor trains on step k (pipelines.async_loop). streaming:
    prompts are admitted continuously, finished groups go to a buffer the trainer takes its batches from, and weight
    updates land while requests are in flight (partial rollouts; pipelines.streaming)."""

    enabled: bool = False  # true: generate while the actor trains (mode says how)
    mode: str = "one_step"  # one_step (a whole batch one update behind) | streaming (groups as they finish)
    # one_step: the run fails if a batch's policy version lags the trainer's by more. streaming: per sample, the
    # most updates its oldest token may lag when trained on (0: exactly the synchronous run)
    max_staleness: int = 1
    # Also score each batch and compute its reference log-probs as soon as it is generated, while the actor trains
    # on the previous one (the same numbers, earlier). Put the reference on devices the actor does not use (its
    # own, or the rollout's: colocate_with: actor_infer), or it competes with training. one_step only.
    prepare_ahead: bool = False
    # streaming: requests in flight at a weight update are kept (their KV cache as computed; the next tokens come
    # from the new weights), recomputed (prompt and tokens so far prefilled again with the new weights) or
    # resubmitted (aborted and added again with the tokens so far as prompt). Seeded requests
    # (sampling.seed) need enable_chunked_prefill: false for recompute and resubmit on CPU.
    partial_rollout: str = "keep"
    on_stale: str = "drop"  # streaming: a group older than max_staleness when taken is dropped | regenerate(d)
    steps_per_call: int = 16  # streaming: engine steps per call of the driver's pump (fewer: updates land sooner)


@dataclass(frozen=True)
class PerfConfig:
    """Model-FLOPs utilisation (`perf/<phase>_mfu`): against `peak_tflops` per rank (a GPU's datasheet value), or
    against a GEMM peak each rank measures at start-up in its compute dtype for `probe_seconds` per shape."""

    peak_tflops: float | None = None  # a rank's peak TFLOP/s (e.g. the GPU's datasheet bf16 value); None: measure it
    measure_peak: bool = True  # False and no peak_tflops: report perf/<phase>_tflops only
    probe_seconds: float = 0.2  # how long the start-up GEMM probe runs per matrix shape


@dataclass(frozen=True)
class PipelineConfig:
    """A whole run. `pipeline` picks the control loop: grpo (no critic) or ppo (critic + GAE); `agentic` (GRPO's loop
    over multi-turn trajectories) needs the `agentic` section, which grpo and ppo also take. The offline pipelines
    (sft, reward_model, dpo; pipelines/loops/offline.py) train actor_train on a dataset, without a rollout."""

    # "grpo" (no critic), "ppo" (critic + GAE), "agentic" (grpo with the `agentic` section); offline: "sft",
    # "reward_model" (actor_train learns a value head from preference pairs) or "dpo" (with a reference role)
    pipeline: str
    model_path: str  # the model folder (config.json, weights, tokenizer) the roles start from
    actor_train: RoleConfig
    actor_infer: RoleConfig | None = None  # the rollout engine (required by grpo, ppo and agentic)
    exp_name: str = "run"  # the run's name in logs and metrics
    seed: int = 42  # seed of the data order, sampling and initialisation
    output_dir: str = "runs/run"  # where metrics, the resolved config and checkpoints go
    max_steps: int = 10  # RL steps to run (>= 1)
    rollout_batch_size: int = 8  # prompts per step (sft: examples per step; reward_model and dpo: pairs per step)
    num_return_sequences_in_group: int = 4  # samples per prompt (n)
    response_length: int = 64  # most tokens a response may have
    build_tiny_model: dict[str, Any] | None = None  # TinyModelSpec fields: write a tiny model to model_path first
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    data: DataConfig = field(default_factory=DataConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    fault_tolerance: FaultToleranceConfig = field(default_factory=FaultToleranceConfig)
    perf: PerfConfig = field(default_factory=PerfConfig)
    reference: RoleConfig | None = None
    # Set by `reference: {from_actor_base: true}`: the reference log-probs are the actor's with its LoRA adapters
    # switched off, computed on the actor's ranks (no reference role, no second copy of the weights).
    reference_from_actor_base: bool = False
    critic: RoleConfig | None = None
    # A trained reward model (a *ForSequenceClassification folder; strategy megatron_infer) scoring every response;
    # its score joins the rule rewards with reward.model_weight.
    reward_model: RoleConfig | None = None
    # On-policy distillation: a teacher model (strategy megatron_infer) scoring the student's samples (`distillation`).
    teacher: RoleConfig | None = None
    reward: RewardConfig = field(default_factory=RewardConfig)
    preference: PreferenceConfig = field(default_factory=PreferenceConfig)  # sft, reward_model and dpo objectives
    distillation: DistillationConfig = field(default_factory=DistillationConfig)  # used with a `teacher:` role
    async_generation: AsyncGenerationConfig = field(default_factory=AsyncGenerationConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)  # validation on data.val_path
    # Multi-turn rollouts: an environment, tools or an agent function (roll_backend.agentic); null: single-turn.
    agentic: AgenticConfig | None = None
    weight_sync_bucket_bytes: int = 256 * 2**20  # trainer -> rollout weights travel in buckets of about this size
    # Minimal, all-or-nothing syncs into a rollout engine: per tensor only what changed since the engine's
    # version travels (nothing, the changed elements or the whole tensor, whichever is fewer bytes), the engine
    # switches once every bucket landed and was checked. Costs a host copy of the weights on trainer rank 0 and on
    # each rollout rank (the hybrid engine: on each of its ranks, which load only the tensors that changed, all or
    # nothing). false: whole tensors, loaded bucket by bucket (a failure part-way restarts the run).
    weight_sync_delta: bool = True
    # The post-sync probe fails the run past this mean |log-prob gap|; None: by precision (see logprob_gap_limit).
    weight_sync_max_logprob_gap: float | None = None
    ray_num_cpus: int = 16  # CPUs a local Ray declares (actor groups take shares, not whole cores)
    # Run guards: a threshold on a step metric with an action (warn | stop with a checkpoint | skip the update), e.g.
    # [{metric: actor/grad_norm, action: stop}, {metric: actor/rollout_logprob_gap, above: 0.05, action: skip}]
    guards: list[GuardConfig] = field(default_factory=list)
    # GiB of memory on each device the roles take (80 for an H100 80GB): validation then refuses a run whose memory
    # plan (`roll-backend plan`) does not fit; null: the plan is reported, not checked.
    device_memory_gib: float | None = None
    # The memory plan's routing assumption for MoE models under expert parallelism: a rank's experts compute this many
    # times the tokens its own tokens route (1.0: balanced). A skewed router (early training, no load-balancing loss)
    # sends one rank's experts up to EP times that; the run logs the load each rank measured at step 1.
    memory_plan_expert_load: float = 1.0

    @property
    def uses_gpus(self) -> bool:
        """Some role's ranks take GPUs."""
        model_roles = [getattr(self, name) for name in roles.MODEL_ROLES]
        return any(role is not None and role.num_gpus_per_rank > 0 for role in model_roles)

    @property
    def has_reference(self) -> bool:
        """Reference log-probs are computed: by a reference role or by the actor's base (adapters off)."""
        return self.reference is not None or self.reference_from_actor_base

    def needs_answers(self) -> bool:
        """Prompt rows need a reference answer: a built-in reward compares with it (routed by source or not), or user
        functions receive it (unless data.answer_key is null)."""
        from roll_backend.rewards.registry import ANSWER_FREE
        from roll_backend.rewards.source_routing import SourceRouting

        if self.offline:
            return True
        try:
            names = SourceRouting.build(
                self.reward.by_source, self.reward.builtin_weights(self.other_rewards())
            ).names()
        except ValueError:  # a malformed by_source: the config check reports it
            names = set(self.reward.builtin_weights(self.other_rewards()))
        labels = {spec.label for spec in self.reward.functions}
        compared = names - ANSWER_FREE - labels
        return bool(compared) or (bool(self.reward.functions) and self.data.answer_key is not None)

    def other_rewards(self) -> bool:
        """The run is rewarded by more than rule rewards and functions: an environment, a reward model, a teacher."""
        return any(part is not None for part in (self.agentic, self.reward_model, self.teacher))

    @property
    def offline(self) -> bool:
        """An offline pipeline (sft, reward_model, dpo): it trains on a dataset, with no rollout or reward."""
        return self.pipeline in OFFLINE_PIPELINES

    def logprob_gap_limit(self) -> float:
        """The post-sync probe's limit: as configured, else 1e-3 when trainer and rollout both compute in float32
        and 3e-2 when either uses a 16-bit dtype (bf16 kernels differ between engines by ~1e-3 to 1e-2 per token)."""
        if self.weight_sync_max_logprob_gap is not None:
            return self.weight_sync_max_logprob_gap
        sides = [role for role in (self.actor_train, self.actor_infer) if role is not None]
        dtypes = {compute_dtype(role) for role in sides}
        return FULL_PRECISION_LOGPROB_GAP if dtypes == {"float32"} else HALF_PRECISION_LOGPROB_GAP


RL_PIPELINES = ("grpo", "ppo", "agentic")
ASYNC_MODES = ("one_step", "streaming")
OFFLINE_PIPELINES = ("sft", "reward_model", "dpo")
PAIR_PIPELINES = ("reward_model", "dpo")  # rows come in (chosen, rejected) pairs
FULL_PRECISION_LOGPROB_GAP = 1e-3
HALF_PRECISION_LOGPROB_GAP = 3e-2


def compute_dtype(role: RoleConfig) -> str:
    """A role's compute dtype: Megatron's params_dtype or vLLM's dtype."""
    config = role.strategy.config
    return str(getattr(config, "params_dtype", None) or getattr(config, "dtype", "float32"))
