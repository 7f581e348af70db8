"""Every batch column name, with its shape and dtype. Code uses these constants, never string literals.

Layout (verl's): a sequence is a left-padded prompt followed by a right-padded response,
`input_ids = cat(prompts, responses)`, so `T = T_prompt + T_resp`.
"""

# Prompt side, as read from data.
PROMPTS = "prompts"  # [B, T_prompt] int64, left-padded prompt ids
PROMPT_TEXT = "prompt"  # [B] object, the prompt as text (or chat messages)
ANSWER = "answer"  # [B] object, the reference answer a rule reward checks against
UID = "uid"  # [B] object, equal for the n samples of one prompt
DATA_SOURCE = "data_source"  # [B] object, the row's data source (verl's reward_fn_key), "" when the data has none
EXTRA_INFO = "extra_info"  # [B] object, dict: the row's other columns (and its own `extra_info` dict, verl's)

# Whole sequence.
INPUT_IDS = "input_ids"  # [B, T] int64
ATTENTION_MASK = "attention_mask"  # [B, T] int64, 1 = real token
POSITION_IDS = "position_ids"  # [B, T] int64
# MoE routes, whole sequence: the experts each token was routed to at each decoder layer, -1 where none was
# recorded (padding, a rollout's last sampled token, which the engine never forwards).
ROUTED_EXPERTS = "routed_experts"  # [B, T, L, top_k] int16, the rollout engine's (R3; router_replay)
RECORDED_ROUTES = "recorded_routes"  # [B, T, L, top_k] int16, the actor's old-log-prob forward's (R2)

# Response side (T_resp columns).
RESPONSES = "responses"  # [B, T_resp] int64, right-padded response ids
RESPONSE_MASK = "response_mask"  # [B, T_resp] int64, 1 up to and including EOS
RESPONSE_TEXT = "response_text"  # [B] object
ROLLOUT_LOG_PROBS = "rollout_log_probs"  # [B, T_resp] float32, the sampler's log-probs
OLD_LOG_PROBS = "old_log_probs"  # [B, T_resp] float32, the train actor's log-probs before the update
REF_LOG_PROBS = "ref_log_probs"  # [B, T_resp] float32, the reference model's log-probs
LOG_PROBS = "log_probs"  # [B, T_resp] float32, log-probs returned by a forward pass
ENTROPY = "entropy"  # [B, T_resp] float32
VALUES = "values"  # [B, T_resp] float32, critic values
TOKEN_LEVEL_SCORES = "token_level_scores"  # [B, T_resp] float32, reward score on the last response token
TOKEN_LEVEL_REWARDS = "token_level_rewards"  # [B, T_resp] float32, scores after the KL penalty
ADVANTAGES = "advantages"  # [B, T_resp] float32
RETURNS = "returns"  # [B, T_resp] float32
SEQUENCE_SCORES = "sequence_scores"  # [B] float32, one score per sequence (reward model)
REWARD_BASELINES = "reward_baselines"  # [B] float32, ReMax: the score of the greedy response to the row's prompt
ROLLOUT_CORRECTION_WEIGHTS = (
    "rollout_correction_weights"  # [B, T_resp] float32, detached policy-loss weights (0: rejected)
)
TEACHER_LOG_PROBS = "teacher_log_probs"  # [B, T_resp] float32, the distillation teacher's log-probs
# [B] float32, detached d(pair loss)/d(row's sequence log-prob or score): trains reward_model / dpo rows
# (algorithms.preference.pair_loss_row_weights)
ROW_LOSS_WEIGHTS = "row_loss_weights"
ENV_REWARDS = "env_rewards"  # [B] float32, the environment's reward of the row's trajectory (agentic rollouts)
# [B] int64, trainer updates applied to the weights that generated the row (its oldest sampled token's, when the
# row's tokens came from several: a partial rollout in streaming mode)
POLICY_VERSION = "policy_version"
# [B, T_resp] int64, the version that sampled each response token; -1 where no token was sampled (padding, tokens
# an environment or tool inserted)
TOKEN_POLICY_VERSION = "token_policy_version"
STREAM_POSITION = "stream_position"  # [B] int64, the prompt's position in the data stream (the prompt ledger's key)

# Added by dispatch when a batch does not divide by the DP size; removed again on collect.
DISPATCH_PADDING = "dispatch_padding"  # [B] bool, True on rows repeated only to make the split even

# meta_info keys.
META_METRICS = "metrics"  # dict[str, list[float] | float], merged by DataProto.concat
# Counts a model phase reports among its metrics: tokens it forwarded (padding aside), and those its rows hold (what
# it forwards without share_prompts); pipelines name them perf/<phase>_tokens_forwarded / _tokens_unshared.
METRIC_TOKENS_FORWARDED = "tokens_forwarded_count"
METRIC_TOKENS_HELD = "tokens_unshared_count"
META_TEMPERATURE = "temperature"  # float, the sampling temperature log-probs are computed at
META_PREPARED = (
    "prepared"  # dict, pipelines.rl_step.mark_prepared: a batch already scored and given reference log-probs
)
META_SAMPLING_SEED = "sampling_seed"  # int, reseeds the rollout engine's sampler before generate (resumable runs)
META_GLOBAL_TOKEN_COUNT = "global_token_count"  # int, loss tokens across the whole DP mini-batch
META_GLOBAL_SEQUENCE_COUNT = "global_sequence_count"  # int, sequences with a loss token across the DP mini-batch
META_BALANCE_DP = "balance_dp"  # bool, default True: the balanced DP modes order rows by tokens over DP ranks
META_VALIDATE = "validate"  # bool: a validation batch: sampled with the validation settings, scored without shaping
META_MAX_TOKENS_PER_MICROBATCH = "max_tokens_per_microbatch"  # int, or None for fixed-size micro-batches
META_SEQUENCE_PACKING = "use_sequence_packing"  # bool: micro-batches pack sequences without padding
META_BASE_MODEL = "base_model"  # bool: a LoRA strategy's forward runs the frozen base, adapters off (the reference)
# bool: the Megatron phases of this call count the memory they allocate (a CPU rank's count costs time; a GPU's is free)
META_MEASURE_MEMORY = "measure_memory"
META_LIVE_ROUTES = "live_routes"  # bool: a MoE forward routes live whatever router_replay says (weight-sync probe)
