"""verl's and ROLL's config keys, each with its key here (or why it has none): the one table `roll-backend convert`
(config.job_import) and the unknown-key hints (a verl or ROLL key typed here names its equivalent) read.

A rule's pattern is a dotted key where `*` stands for one part (a role of ROLL's, a reward domain). `target` is the
key here, `None` when there is none; `note` says what differs in meaning (the converter applies the change and reports
it) or why there is no equivalent. Keys the converter computes from several inputs (world sizes from GPU counts, the
mini-batch in responses) are marked `derived`.
"""

from __future__ import annotations

from dataclasses import dataclass
from fnmatch import fnmatchcase


@dataclass(frozen=True)
class KeyRule:
    pattern: str
    target: str | None  # the key here; None: no equivalent
    note: str = ""  # a difference in meaning (applied by the converter), or why there is no equivalent
    derived: bool = False  # the value is computed by the converter from this and other keys
    mapping: bool = False  # the value is a mapping, copied entry by entry under the target


def _renamed(prefix: str, target: str, names: dict[str, str]) -> list[KeyRule]:
    """One rule per name: `prefix.theirs` is `target.ours`."""
    return [KeyRule(f"{prefix}.{theirs}", f"{target}.{ours}") for theirs, ours in names.items()]


def _megatron(prefix: str, role: str) -> list[KeyRule]:
    """verl's and ROLL's megatron-core parallel sizes (one name each across both) under `prefix`."""
    names = {
        "tensor_model_parallel_size": "tp",
        "pipeline_model_parallel_size": "pp",
        "context_parallel_size": "cp",
        "virtual_pipeline_model_parallel_size": "vpp",
        "expert_model_parallel_size": "ep",
        "expert_tensor_parallel_size": "etp",
    }
    rules = _renamed(prefix, f"{role}.strategy", names)
    vpp_note = "1 (one model chunk per stage) is null here"
    return [KeyRule(r.pattern, r.target, vpp_note, True) if r.target.endswith(".vpp") else r for r in rules]


_ACTOR = "actor_rollout_ref.actor"
_ROLLOUT = "actor_rollout_ref.rollout"
_MINI_BATCH_NOTE = "verl counts prompts, here responses: multiplied by rollout.n"
_TRACKERS_NOTE = (
    "console, wandb, tensorboard and mlflow carry over (console: the progress bar), after jsonl (metrics.jsonl, "
    "which roll-backend plot reads); other trackers have no backend here"
)
_RM_OFFLOAD = "the reward model keeps GPUs of its own here; offloading hands a device over on the hybrid engine"
_OVERLONG_ON = "reward.overlong_buffer is on when set (its length from overlong_buffer_cfg.len)"
_OVERLONG_LOG = "reward/overlong_penalty_mean and reward/overlong_fraction are logged every step"
VERL_KEYS: tuple[KeyRule, ...] = (
    KeyRule("data.train_files", "data.train_path", "a list becomes a mixture of files (equal weights)"),
    KeyRule("data.val_files", "data.val_path"),
    KeyRule("data.train_batch_size", "rollout_batch_size"),
    KeyRule("data.max_prompt_length", "data.max_prompt_length"),
    KeyRule("data.max_response_length", "response_length"),
    KeyRule("data.prompt_key", "data.prompt_key"),
    KeyRule("data.shuffle", "data.shuffle"),
    KeyRule("data.filter_overlong_prompts", None, "always on here: prompts over data.max_prompt_length are dropped"),
    KeyRule("data.truncation", None, "prompts are never truncated here; longer ones are dropped"),
    KeyRule("data.return_raw_chat", None, "the rollout always receives the chat messages"),
    KeyRule("actor_rollout_ref.model.path", "model_path"),
    KeyRule("actor_rollout_ref.model.enable_gradient_checkpointing", "actor_train.strategy.recompute_activations"),
    KeyRule("actor_rollout_ref.model.use_remove_padding", "actor_train.strategy.use_sequence_packing"),
    KeyRule("actor_rollout_ref.model.lora_rank", "actor_train.strategy.lora.rank"),
    KeyRule("actor_rollout_ref.model.lora_alpha", "actor_train.strategy.lora.alpha"),
    KeyRule(f"{_ACTOR}.optim.lr", "actor_train.strategy.optimizer.lr"),
    KeyRule(f"{_ACTOR}.optim.weight_decay", "actor_train.strategy.optimizer.weight_decay"),
    KeyRule(f"{_ACTOR}.optim.lr_warmup_steps", "actor_train.strategy.lr_schedule.warmup_steps"),
    KeyRule(f"{_ACTOR}.optim.lr_decay_style", "actor_train.strategy.lr_schedule.decay_style"),
    KeyRule(f"{_ACTOR}.optim.lr_decay_steps", "actor_train.strategy.lr_schedule.decay_steps"),
    KeyRule(f"{_ACTOR}.optim.min_lr", "actor_train.strategy.optimizer.min_lr"),
    KeyRule(
        f"{_ACTOR}.optim.override_optimizer_config",
        None,
        "megatron-core's CPU optimizer is not used; actor_train.strategy.offload_optimizer moves the optimizer state "
        "off the GPU between phases",
    ),
    KeyRule(f"{_ACTOR}.optim.clip_grad", "actor_train.strategy.optimizer.clip_grad"),
    KeyRule(f"{_ACTOR}.grad_clip", "actor_train.strategy.optimizer.clip_grad"),
    KeyRule(f"{_ACTOR}.ppo_mini_batch_size", "algorithm.ppo_mini_batch_size", _MINI_BATCH_NOTE, derived=True),
    KeyRule(f"{_ACTOR}.ppo_micro_batch_size_per_gpu", "actor_train.strategy.micro_batch_size"),
    KeyRule(f"{_ACTOR}.ppo_max_token_len_per_gpu", "actor_train.strategy.max_tokens_per_microbatch"),
    KeyRule(f"{_ACTOR}.use_dynamic_bsz", None, "a token budget is on when max_tokens_per_microbatch is set"),
    KeyRule(f"{_ACTOR}.ppo_epochs", "algorithm.ppo_epochs"),
    KeyRule(f"{_ACTOR}.clip_ratio_low", "algorithm.clip_ratio_low"),
    KeyRule(f"{_ACTOR}.clip_ratio_high", "algorithm.clip_ratio_high"),
    KeyRule(f"{_ACTOR}.clip_ratio", "algorithm.clip_ratio_low", "sets both clip_ratio_low and clip_ratio_high"),
    KeyRule(f"{_ACTOR}.clip_ratio_c", "algorithm.dual_clip_c"),
    KeyRule(f"{_ACTOR}.policy_loss.loss_mode", "algorithm.policy_loss", "vanilla is ppo here"),
    KeyRule(f"{_ACTOR}.tau_pos", "algorithm.sapo_tau_pos"),
    KeyRule(f"{_ACTOR}.tau_neg", "algorithm.sapo_tau_neg"),
    KeyRule(f"{_ACTOR}.loss_agg_mode", "algorithm.loss_agg_mode"),
    KeyRule(f"{_ACTOR}.entropy_coeff", "algorithm.entropy_coef"),
    KeyRule(f"{_ACTOR}.use_kl_loss", "algorithm.use_kl_loss"),
    KeyRule(f"{_ACTOR}.kl_loss_coef", "algorithm.kl_loss_coef"),
    KeyRule(f"{_ACTOR}.kl_loss_type", "algorithm.kl_estimator"),
    KeyRule(f"{_ACTOR}.megatron.param_offload", "actor_train.strategy.offload_params"),
    KeyRule(f"{_ACTOR}.megatron.grad_offload", "actor_train.strategy.offload_grads"),
    KeyRule(f"{_ACTOR}.megatron.optimizer_offload", "actor_train.strategy.offload_optimizer"),
    KeyRule(f"{_ACTOR}.megatron.use_distributed_optimizer", "actor_train.strategy.optimizer.use_distributed_optimizer"),
    *_megatron(f"{_ACTOR}.megatron", "actor_train"),
    *_megatron("actor_rollout_ref.ref.megatron", "reference"),
    KeyRule("actor_rollout_ref.ref.megatron.param_offload", "reference.strategy.offload_params"),
    # (FSDP's offload in verl's colocated layout is what the hybrid engine's does: host memory while another role runs)
    KeyRule(f"{_ACTOR}.fsdp_config.param_offload", "actor_train.strategy.offload_params"),
    KeyRule(f"{_ACTOR}.fsdp_config.optimizer_offload", "actor_train.strategy.offload_optimizer"),
    KeyRule("actor_rollout_ref.ref.fsdp_config.param_offload", "reference.strategy.offload_params"),
    KeyRule("actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu", "reference.strategy.micro_batch_size"),
    KeyRule("actor_rollout_ref.ref.log_prob_max_token_len_per_gpu", "reference.strategy.max_tokens_per_microbatch"),
    # verl's critic (PPO with GAE): a Megatron trainer with a value head here, on the hybrid engine like the rest
    KeyRule("critic.model.path", "critic.model_path"),
    KeyRule("critic.optim.lr", "critic.strategy.optimizer.lr"),
    KeyRule("critic.optim.weight_decay", "critic.strategy.optimizer.weight_decay"),
    KeyRule("critic.optim.lr_warmup_steps", "critic.strategy.lr_schedule.warmup_steps"),
    KeyRule("critic.optim.clip_grad", "critic.strategy.optimizer.clip_grad"),
    KeyRule("critic.grad_clip", "critic.strategy.optimizer.clip_grad"),
    KeyRule("critic.ppo_micro_batch_size_per_gpu", "critic.strategy.micro_batch_size"),
    KeyRule("critic.ppo_max_token_len_per_gpu", "critic.strategy.max_tokens_per_microbatch"),
    KeyRule("critic.model.enable_gradient_checkpointing", "critic.strategy.recompute_activations"),
    KeyRule("critic.model.use_remove_padding", "critic.strategy.use_sequence_packing"),
    KeyRule("critic.model.fsdp_config.param_offload", "critic.strategy.offload_params"),
    KeyRule("critic.model.fsdp_config.optimizer_offload", "critic.strategy.offload_optimizer"),
    KeyRule("critic.megatron.param_offload", "critic.strategy.offload_params"),
    KeyRule("critic.megatron.optimizer_offload", "critic.strategy.offload_optimizer"),
    *_megatron("critic.megatron", "critic"),
    KeyRule("critic.cliprange_value", "algorithm.value_clip"),
    KeyRule("critic.ppo_mini_batch_size", None, "the critic steps on the actor's mini-batches (ppo_mini_batch_size)"),
    KeyRule("critic.ppo_epochs", None, "the critic steps on the actor's epochs (algorithm.ppo_epochs)"),
    KeyRule(
        f"{_ROLLOUT}.log_prob_micro_batch_size_per_gpu",
        None,
        "old log-probs run on actor_train's ranks with actor_train.strategy.micro_batch_size",
    ),
    KeyRule(f"{_ROLLOUT}.log_prob_max_token_len_per_gpu", None, "old log-probs use actor_train's token budget"),
    KeyRule(
        f"{_ROLLOUT}.name",
        "actor_infer.strategy.name",
        "vllm is vllm_rollout; sglang and trtllm have no backend here: vLLM serves",
    ),
    KeyRule(f"{_ROLLOUT}.tensor_model_parallel_size", "actor_infer.strategy.tp"),
    KeyRule(f"{_ROLLOUT}.gpu_memory_utilization", "actor_infer.strategy.gpu_memory_utilization"),
    KeyRule(f"{_ROLLOUT}.n", "num_return_sequences_in_group"),
    KeyRule(f"{_ROLLOUT}.temperature", "actor_infer.strategy.sampling.temperature"),
    KeyRule(f"{_ROLLOUT}.top_p", "actor_infer.strategy.sampling.top_p"),
    KeyRule(f"{_ROLLOUT}.top_k", "actor_infer.strategy.sampling.top_k"),
    KeyRule(f"{_ROLLOUT}.enforce_eager", "actor_infer.strategy.enforce_eager"),
    KeyRule(f"{_ROLLOUT}.enable_chunked_prefill", "actor_infer.strategy.enable_chunked_prefill"),
    KeyRule(f"{_ROLLOUT}.enable_prefix_caching", "actor_infer.strategy.enable_prefix_caching"),
    KeyRule(f"{_ROLLOUT}.max_num_batched_tokens", "actor_infer.strategy.max_num_batched_tokens"),
    KeyRule(f"{_ROLLOUT}.max_num_seqs", "actor_infer.strategy.max_num_seqs"),
    KeyRule(f"{_ROLLOUT}.max_model_len", "actor_infer.strategy.max_model_len"),
    KeyRule(f"{_ROLLOUT}.free_cache_engine", None, "the hybrid engine sleeps between generations (sleep_level)"),
    KeyRule(f"{_ROLLOUT}.val_kwargs.n", "eval.n"),
    KeyRule(f"{_ROLLOUT}.val_kwargs.temperature", "eval.temperature"),
    KeyRule(f"{_ROLLOUT}.val_kwargs.top_p", "eval.top_p"),
    KeyRule(f"{_ROLLOUT}.val_kwargs.top_k", "actor_infer.strategy.validation.top_k"),
    KeyRule(f"{_ROLLOUT}.val_kwargs.do_sample", "eval.temperature", "do_sample: false is greedy (temperature 0)", True),
    KeyRule(f"{_ROLLOUT}.load_format", None, "the engine starts from model_path; later weights come from the trainer"),
    KeyRule(f"{_ROLLOUT}.layered_summon", None, "LoRA weights sync as actor_train.strategy.lora.sync says"),
    KeyRule("actor_rollout_ref.model.use_shm", None, "each rank reads model_path itself"),
    KeyRule("actor_rollout_ref.model.use_fused_kernels", None, "no switch here"),
    KeyRule("actor_rollout_ref.model.override_config", None, "the model's config.json is read as it is"),
    KeyRule(
        "actor_rollout_ref.*.megatron.override_transformer_config",
        None,
        "megatron-core's TransformerConfig is built from the model's config.json and the strategy's settings; its "
        "fusions follow the device",
    ),
    KeyRule("actor_rollout_ref.*.megatron.use_dist_checkpointing", None, "models load from Hugging Face weights"),
    KeyRule(f"{_ROLLOUT}.mode", None, "generation is synchronous unless async_generation is set"),
    KeyRule("algorithm.adv_estimator", "algorithm.adv_estimator"),
    KeyRule("algorithm.gamma", "algorithm.gamma"),
    KeyRule("algorithm.lam", "algorithm.lam"),
    KeyRule("algorithm.norm_adv_by_std_in_grpo", "algorithm.norm_adv_by_std"),
    KeyRule("algorithm.use_kl_in_reward", "algorithm.use_kl_in_reward"),
    KeyRule("algorithm.kl_penalty", "algorithm.kl_estimator"),
    # DAPO's dynamic sampling
    KeyRule("algorithm.filter_groups.enable", "algorithm.dynamic_sampling"),
    KeyRule(
        "algorithm.filter_groups.max_num_gen_batches",
        "algorithm.max_generation_rounds",
        "at the limit verl stops the run, here the step trains on the groups it has",
        True,
    ),
    KeyRule("algorithm.filter_groups.metric", None, "a group is kept when its responses' rewards differ"),
    KeyRule(
        "data.gen_batch_size",
        None,
        "a step's first round draws rollout_batch_size prompts; a refill draws algorithm.refill_oversample x the "
        "groups missing",
    ),
    KeyRule("algorithm.kl_ctrl.type", "algorithm.kl_ctrl.type"),
    KeyRule("algorithm.kl_ctrl.kl_coef", "algorithm.kl_ctrl.kl_coef"),
    KeyRule("algorithm.kl_ctrl.target_kl", "algorithm.kl_ctrl.target_kl"),
    KeyRule("algorithm.kl_ctrl.horizon", "algorithm.kl_ctrl.horizon"),
    KeyRule("custom_reward_function.path", "reward.functions", "a function file: reward.functions[0].path"),
    KeyRule("custom_reward_function.name", "reward.functions", "reward.functions[0].name"),
    KeyRule(
        "custom_reward_function.reward_kwargs",
        "reward.functions",
        "reward.functions[0].kwargs: passed on every call",
        True,
        mapping=True,
    ),
    KeyRule("reward_model.enable", None, "a `reward_model:` role block turns the reward model on"),
    KeyRule("reward_model.model.path", "reward_model.model_path"),
    KeyRule("reward_model.micro_batch_size_per_gpu", "reward_model.strategy.micro_batch_size"),
    KeyRule("reward_model.rollout.tensor_model_parallel_size", "reward_model.strategy.tp"),
    KeyRule("reward_model.num_workers", None, "the reward model's ranks are reward_model.world_size"),
    KeyRule("reward_model.model.fsdp_config.param_offload", None, _RM_OFFLOAD),
    KeyRule("reward_model.megatron.param_offload", None, _RM_OFFLOAD),
    *_megatron("reward_model.megatron", "reward_model"),
    KeyRule(
        "reward_model.model.input_tokenizer",
        None,
        "a reward model whose tokenizer is not the policy's scores the decoded responses in its own chat template",
    ),
    KeyRule(
        "reward_model.reward_manager",
        None,
        "rewards are reward.by_source (verl's default scorer per data source) or reward.functions; DAPO's overlong "
        "penalty is reward.overlong_buffer",
    ),
    KeyRule("reward.reward_manager.name", None, "as reward_model.reward_manager"),
    # DAPO's overlong penalty: reward_kwargs of verl's DAPO reward manager (reward_model. or reward. before), and the
    # recipe's own reward_model.overlong_buffer
    KeyRule("*.reward_kwargs.overlong_buffer_cfg.enable", None, _OVERLONG_ON),
    KeyRule("*.reward_kwargs.overlong_buffer_cfg.len", "reward.overlong_buffer.length"),
    KeyRule("*.reward_kwargs.overlong_buffer_cfg.penalty_factor", "reward.overlong_buffer.penalty_factor"),
    KeyRule("*.reward_kwargs.overlong_buffer_cfg.log", None, _OVERLONG_LOG),
    KeyRule("*.reward_kwargs.max_resp_len", "reward.overlong_buffer.max_length"),
    KeyRule("reward_model.overlong_buffer.enable", None, _OVERLONG_ON),
    KeyRule("reward_model.overlong_buffer.len", "reward.overlong_buffer.length"),
    KeyRule("reward_model.overlong_buffer.penalty_factor", "reward.overlong_buffer.penalty_factor"),
    KeyRule("reward_model.overlong_buffer.log", None, _OVERLONG_LOG),
    KeyRule("trainer.total_training_steps", "max_steps"),
    KeyRule("trainer.total_epochs", "max_steps", "epochs become steps: epochs x prompts / data.train_batch_size", True),
    KeyRule("trainer.save_freq", "checkpoint.save_steps"),
    KeyRule("trainer.test_freq", "eval.every_steps", "-1 (never during training) is 0 here"),
    KeyRule("trainer.val_before_train", "eval.before_train"),
    KeyRule("trainer.project_name", "logging.project"),
    KeyRule("trainer.experiment_name", "exp_name"),
    KeyRule("trainer.logger", "logging.backends", _TRACKERS_NOTE, True),
    KeyRule("trainer.default_local_dir", "output_dir"),
    KeyRule("trainer.resume_mode", "checkpoint.resume", "auto carries over; disable is null"),
    KeyRule("trainer.n_gpus_per_node", "actor_train.world_size", "GPUs x nodes become every role's world_size", True),
    KeyRule("trainer.nnodes", "actor_train.world_size", "GPUs x nodes become every role's world_size", True),
    KeyRule("trainer.critic_warmup", None, "the critic trains from the first step"),
    KeyRule("trainer.device", None, "the device comes from the ranks' resources (num_gpus_per_rank)"),
    KeyRule(
        "trainer.log_val_generations",
        None,
        "every validation writes all its generations to output_dir/validation.jsonl",
    ),
)

_TRAIN_ARGS = "actor_train.training_args"


def _training_args(role: str) -> list[KeyRule]:
    """A ROLL role's optimizer settings (the actor's and the critic's alike)."""
    names = {
        "learning_rate": "optimizer.lr",
        "weight_decay": "optimizer.weight_decay",
        "warmup_steps": "lr_schedule.warmup_steps",
        "per_device_train_batch_size": "micro_batch_size",
        "max_grad_norm": "optimizer.clip_grad",
    }
    return _renamed(f"{role}.training_args", f"{role}.strategy", names)


_CRITIC_STEPS = "the critic steps on the actor's mini-batches (algorithm.ppo_mini_batch_size)"


ROLL_KEYS: tuple[KeyRule, ...] = (
    KeyRule("exp_name", "exp_name"),
    KeyRule("seed", "seed"),
    KeyRule("output_dir", "output_dir"),
    KeyRule("max_steps", "max_steps"),
    KeyRule("rollout_batch_size", "rollout_batch_size"),
    KeyRule("num_return_sequences_in_group", "num_return_sequences_in_group"),
    KeyRule("response_length", "response_length"),
    KeyRule("prompt_length", "data.max_prompt_length"),
    KeyRule("ppo_epochs", "algorithm.ppo_epochs"),
    KeyRule(
        "adv_estimator",
        "algorithm.adv_estimator",
        "reinforce (discounted returns, whitened) is reinforce_plus_plus here; with norm_mean_type: group, grpo",
    ),
    KeyRule("gamma", "algorithm.gamma"),
    KeyRule("lambd", "algorithm.lam"),
    KeyRule("norm_mean_type", None, "read with adv_estimator (group: a group baseline, GRPO here)"),
    KeyRule("save_steps", "checkpoint.save_steps"),
    KeyRule("eval_steps", "eval.every_steps"),
    KeyRule("pretrain", "model_path"),
    KeyRule("reward_pretrain", None, "ROLL's rule rewards load no model; a reward model is a `reward_model:` role"),
    KeyRule("use_kl_loss", "algorithm.use_kl_loss"),
    KeyRule("kl_loss_coef", "algorithm.kl_loss_coef"),
    KeyRule("init_kl_coef", "algorithm.kl_ctrl.kl_coef"),
    KeyRule("add_token_level_kl", "algorithm.use_kl_in_reward"),
    KeyRule("reward_clip", "algorithm.reward_clip"),
    KeyRule("value_clip", "algorithm.value_clip"),
    KeyRule("entropy_loss_coef", "algorithm.entropy_coef"),
    KeyRule("pg_clip", "algorithm.clip_ratio_low", "sets both clip_ratio_low and clip_ratio_high"),
    KeyRule("logging_steps", None, "every step is logged"),
    KeyRule("logging_dir", None, "logs go to output_dir"),
    KeyRule("track_with", "logging.backends", _TRACKERS_NOTE, True),
    KeyRule("tracker_kwargs.project", "logging.project"),
    KeyRule(
        "tracker_kwargs.api_key", None, "trackers read their own credentials (WANDB_API_KEY): keep keys out of configs"
    ),
    KeyRule("tracker_kwargs.*", None, "tracker settings of ROLL's own"),
    KeyRule("num_gpus_per_node", None, "each role's world_size comes from its device_mapping"),
    KeyRule("defaults", None, "Hydra's defaults list: the files it names are not read; convert their settings too"),
    KeyRule("system_envs.*", None, "environment variables: set them in the shell that runs roll-backend"),
    KeyRule("num_nodes", None, "each role's world_size comes from its device_mapping"),
    KeyRule("checkpoint_config.*", None, "checkpoints go under output_dir/checkpoints"),
    KeyRule("max_grad_norm", "actor_train.strategy.optimizer.clip_grad"),
    # ROLL's SFT and DPO pipelines (config.roll_jobs): their data columns, DPO's loss, their batch and length
    KeyRule("prompt_key", "data.prompt_key"),
    KeyRule("response_key", "data.answer_key", "SFT's target response is read from the answer column", True),
    KeyRule("chosen_key", "data.answer_key", "a pair's chosen response is read from the answer column", True),
    KeyRule("rejected_key", "data.rejected_key"),
    KeyRule("beta", "preference.beta"),
    KeyRule("label_smoothing", "preference.label_smoothing"),
    KeyRule("ipo", "preference.loss", "true is the ipo loss, false the sigmoid (DPO) one", True),
    KeyRule("train_batch_size", "rollout_batch_size", "examples per step"),
    KeyRule("val_batch_size", None, "validation runs over the whole validation file"),
    KeyRule(
        "sequence_length",
        "response_length",
        "one limit for prompt + response there, one each here: half each (adjust to the data)",
        True,
    ),
    KeyRule("hydra.*", None, "Hydra's own settings"),
    KeyRule("hydra.*.*", None, "Hydra's own settings"),
    KeyRule("resume_from_checkpoint", "checkpoint.resume", "a folder or false; auto finds the latest"),
    KeyRule("whiten_advantages", None, "advantages follow algorithm.adv_estimator (GRPO normalises per group)"),
    *_training_args("actor_train"),
    KeyRule(
        f"{_TRAIN_ARGS}.gradient_accumulation_steps",
        "algorithm.ppo_mini_batch_size",
        "a mini-batch is micro-batch x accumulation x data-parallel ranks here",
        derived=True,
    ),
    KeyRule(
        f"{_TRAIN_ARGS}.num_train_epochs",
        None,
        "max_steps bounds the run (an SFT or DPO job without max_steps: epochs become steps, its files counted)",
    ),
    *_training_args("critic"),
    KeyRule("critic.training_args.gradient_accumulation_steps", None, _CRITIC_STEPS),
    KeyRule(
        f"{_TRAIN_ARGS}.lr_scheduler_type",
        "actor_train.strategy.lr_schedule.decay_style",
        "Hugging Face's constant_with_warmup is constant (warm-up is lr_schedule.warmup_steps)",
        True,
    ),
    KeyRule("actor_train.data_args.file_name", "data.train_path", "a list becomes a mixture of files (equal weights)"),
    KeyRule("actor_train.data_args.messages", "data.messages_key"),
    KeyRule("actor_train.data_args.domain_interleave_probs", "data.source_weights", mapping=True),
    KeyRule("validation.data_args.file_name", "data.val_path"),
    KeyRule("*.data_args.template", None, "the model's own chat template applies"),
    KeyRule("*.data_args.*", None, "data loading settings of ROLL's own"),
    KeyRule("*.model_args.dtype", "{role}.strategy.params_dtype", "bf16 is bfloat16, fp16 float16"),
    *(
        KeyRule(f"{role}.{key}", None, "an inference role has no backward: nothing to recompute")
        for role in ("actor_infer", "reference", "teacher")
        for key in ("model_args.disable_gradient_checkpointing", "strategy_args.strategy_config.recompute_granularity")
    ),
    KeyRule("*.model_args.disable_gradient_checkpointing", "{role}.strategy.recompute_activations", "negated"),
    KeyRule("*.model_args.model_name_or_path", "{role}.model_path"),
    KeyRule("*.model_args.*", None, "model settings of ROLL's own"),
    KeyRule("*.sequence_packing_args.*", None, "packing fills rows up to {role}.strategy.max_tokens_per_microbatch"),
    KeyRule(
        "*.strategy_args.strategy_name",
        "{role}.strategy.name",
        "vllm is vllm_rollout; megatron_* keep names; FSDP2, DeepSpeed and HF strategies run on Megatron here, sglang"
        " on vLLM",
    ),
    *_megatron("*.strategy_args.strategy_config", "{role}"),
    KeyRule(
        "*.strategy_args.strategy_config.use_distributed_optimizer",
        "{role}.strategy.optimizer.use_distributed_optimizer",
    ),
    KeyRule(
        "*.strategy_args.strategy_config.recompute_granularity", "{role}.strategy.recompute_activations", "full is true"
    ),
    KeyRule("*.strategy_args.strategy_config.gpu_memory_utilization", "{role}.strategy.gpu_memory_utilization"),
    KeyRule("*.strategy_args.strategy_config.block_size", "{role}.strategy.block_size"),
    KeyRule("*.strategy_args.strategy_config.max_model_len", "{role}.strategy.max_model_len"),
    KeyRule("*.strategy_args.strategy_config.max_num_batched_tokens", "{role}.strategy.max_num_batched_tokens"),
    KeyRule("*.strategy_args.strategy_config.max_num_seqs", "{role}.strategy.max_num_seqs"),
    KeyRule(
        "*.strategy_args.strategy_config.mem_fraction_static",
        "{role}.strategy.gpu_memory_utilization",
        "SGLang's share of GPU memory for weights and KV cache is vLLM's gpu_memory_utilization",
        True,
    ),
    KeyRule("*.strategy_args.strategy_config.sequence_parallel", "{role}.strategy.sequence_parallel"),
    KeyRule("*.strategy_args.strategy_config.*", None, "engine settings of ROLL's own"),
    KeyRule("*.use_sequence_packing", "{role}.strategy.use_sequence_packing"),
    KeyRule("*.num_gpus_per_worker", None, "one GPU per rank; an engine's TP spans that many ranks"),
    KeyRule("*.device_mapping", "{role}.world_size", "one rank per listed GPU", derived=True),
    KeyRule("actor_infer.infer_batch_size", None, "the engine batches its requests itself"),
    KeyRule("actor_train.infer_batch_size", None, "old log-probs run with actor_train.strategy.micro_batch_size"),
    KeyRule("critic.infer_batch_size", None, "values are computed with critic.strategy.micro_batch_size"),
    KeyRule("*.infer_batch_size", "{role}.strategy.micro_batch_size"),
    KeyRule("actor_infer.generating_args.temperature", "actor_infer.strategy.sampling.temperature"),
    KeyRule("actor_infer.generating_args.top_p", "actor_infer.strategy.sampling.top_p"),
    KeyRule("actor_infer.generating_args.top_k", "actor_infer.strategy.sampling.top_k"),
    KeyRule("actor_infer.generating_args.max_new_tokens", "response_length"),
    KeyRule("actor_infer.generating_args.num_return_sequences", "num_return_sequences_in_group"),
    KeyRule("validation.generating_args.temperature", "eval.temperature"),
    KeyRule("validation.generating_args.top_p", "eval.top_p"),
    KeyRule("validation.generating_args.top_k", "actor_infer.strategy.validation.top_k"),
    KeyRule("validation.generating_args.num_return_sequences", "eval.n"),
    KeyRule("validation.generating_args.max_new_tokens", None, "validation answers up to response_length tokens"),
    KeyRule("*.generating_args.*", None, "sampling settings of ROLL's own"),
    KeyRule("validation.eval_steps", "eval.every_steps"),
    KeyRule("validation.*", None, "validation samples greedily unless eval.temperature is set"),
    KeyRule("rewards.*.worker_cls", "reward.by_source", "each domain's built-in scorer where one is known", True),
    KeyRule("rewards.*.tag_included", "reward.by_source", "each tag routes to its domain's scorer", True),
    KeyRule("rewards.*.*", None, "reward worker settings of ROLL's own"),
)

FRAMEWORKS = {"verl": VERL_KEYS, "roll": ROLL_KEYS}


KEY_MAP_DOC = "docs/coming_from_verl_roll.md"  # its key map: the tables below (scripts/gen_key_map.py writes them)


def key_map(framework: str) -> str:
    """`framework`'s rules as the Markdown table of the key map."""
    rows = ["| their key | here | what differs |", "| --- | --- | --- |"]
    for rule in FRAMEWORKS[framework]:
        here = f"`{rule.target}`" if rule.target else "no equivalent"
        rows.append(f"| `{rule.pattern}` | {here} | {rule.note} |")
    return "\n".join(rows)


def rule_for(framework: str, key: str) -> KeyRule | None:
    """The first rule of `framework` whose pattern matches `key` (one `*` per dotted part)."""
    parts = key.split(".")
    for rule in FRAMEWORKS[framework]:
        pattern = rule.pattern.split(".")
        if len(pattern) == len(parts) and all(fnmatchcase(p, q) for p, q in zip(parts, pattern)):
            return rule
    return None


def equivalent_hint(path: str) -> str | None:
    """For an unknown key that is verl's or ROLL's: what to write here, or why there is nothing (None otherwise)."""
    for framework, rules in FRAMEWORKS.items():
        if any(rule.pattern.startswith(f"{path}.") and "*" not in rule.pattern.split(".")[0] for rule in rules):
            return (
                f"that is a section of {framework}'s config; `roll-backend convert {framework}` writes its equivalent"
            )
    for framework in FRAMEWORKS:
        rule = rule_for(framework, path)
        if rule is not None and "*" not in rule.pattern.split(".")[0]:
            if rule.target is None:
                return f"that is {framework}'s key; it has no equivalent here ({rule.note})"
            note = f" ({rule.note})" if rule.note else ""
            return f"that is {framework}'s key; write {rule.target} instead{note} (or roll-backend convert)"
    return None
