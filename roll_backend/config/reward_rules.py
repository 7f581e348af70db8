"""What the reward section needs of a config: known built-ins, loadable user functions, a routing by source that
names only rewards there are, and a data layout that gives the rewards what they read."""

from __future__ import annotations

from roll_backend.config.schema import DATA_FORMATS, PipelineConfig


def reward_problems(config: PipelineConfig) -> list[str]:
    from roll_backend.rewards.registry import REWARDS
    from roll_backend.rewards.user_functions import ON_ERROR_CHOICES, check_spec

    problems: list[str] = []
    reward = config.reward
    has_model = config.reward_model is not None
    builtins = reward.builtin_weights(config.other_rewards())
    for name in builtins:
        if name not in REWARDS:
            problems.append(f"reward.rewards.{name}: unknown reward; known: {', '.join(sorted(REWARDS))}")
    if not builtins and not reward.functions and not config.other_rewards() and reward.by_source is None:
        problems.append(
            "reward: no rewards; name a built-in in reward.rewards (e.g. {math_verify: 1.0}), add reward.functions, "
            "a reward_model: role or a distillation teacher:"
        )
    if reward.model_score_norm not in (None, "batch"):
        problems.append(f"reward.model_score_norm={reward.model_score_norm!r}; choose batch or null")
    if reward.model_score_clip is not None and not reward.model_score_clip > 0:
        problems.append(f"reward.model_score_clip={reward.model_score_clip} must be > 0 (or null: no clipping)")
    if not has_model and (reward.model_score_norm is not None or reward.model_score_clip is not None):
        problems.append(
            "reward.model_score_norm / model_score_clip act on a reward model's scores: add a `reward_model:` role "
            "block or drop them"
        )
    for index, spec in enumerate(reward.functions):
        problems.extend(check_spec(spec, f"reward.functions[{index}]"))
    if reward.on_function_error not in ON_ERROR_CHOICES:
        problems.append(
            f"reward.on_function_error={reward.on_function_error!r}; choose one of {', '.join(ON_ERROR_CHOICES)}"
        )
    if not reward.function_timeout_s > 0:
        problems.append(f"reward.function_timeout_s={reward.function_timeout_s} must be > 0")
    if reward.world_size < 1:
        problems.append(f"reward.world_size={reward.world_size} must be >= 1")
    problems.extend(_overlong_problems(config))
    problems.extend(_routing_problems(config, set(REWARDS)))
    problems.extend(_data_format_problems(config))
    return problems


def _overlong_problems(config: PipelineConfig) -> list[str]:
    overlong = config.reward.overlong_buffer
    if overlong is None:
        return []
    problems = []
    max_length = overlong.max_length if overlong.max_length is not None else config.response_length
    where = "reward.overlong_buffer"
    if overlong.max_length is not None and overlong.max_length < 1:
        problems.append(f"{where}.max_length={overlong.max_length} must be >= 1 (or null: response_length)")
    elif not 1 <= overlong.length <= max_length:
        problems.append(
            f"{where}.length={overlong.length} must be between 1 and the longest response ({max_length} tokens: "
            f"{where}.max_length, else response_length); DAPO used 4096 of 20480"
        )
    if not overlong.penalty_factor >= 0:
        problems.append(f"{where}.penalty_factor={overlong.penalty_factor} must be >= 0")
    if config.offline:
        problems.append(f"{where} shapes rollout rewards; pipeline {config.pipeline!r} samples none: remove it")
    return problems


def _routing_problems(config: PipelineConfig, builtins: set[str]) -> list[str]:
    from roll_backend.rewards.source_routing import SourceRouting

    reward = config.reward
    if reward.by_source is None:
        return []
    if reward.rewards:
        return [
            f"reward.rewards={reward.rewards} and reward.by_source are both set: with by_source each source's rewards "
            "are named there (a `default:` entry for the other sources); set reward.rewards=null"
        ]
    try:
        routing = SourceRouting.build(reward.by_source, reward.builtin_weights(config.other_rewards()))
    except ValueError as exc:
        return [f"reward.by_source: {exc}"]
    labels = {spec.label for spec in reward.functions}
    unknown = sorted(routing.names() - builtins - labels)
    if not unknown:
        return []
    return [
        f"reward.by_source names {', '.join(unknown)}: neither a built-in reward ({', '.join(sorted(builtins))}) nor "
        f"the label of one of reward.functions ({', '.join(sorted(labels)) or 'none given'})"
    ]


def _data_format_problems(config: PipelineConfig) -> list[str]:
    data = config.data
    problems = []
    if data.format not in DATA_FORMATS:
        problems.append(f"data.format={data.format!r}; choose one of {', '.join(DATA_FORMATS)}")
    if data.answer_key is None and config.needs_answers() and not config.offline:
        problems.append(
            "data.answer_key is null but a built-in reward compares responses with a reference answer; name the "
            "answer column, or use rewards that need none (a reward model, format rewards, functions)"
        )
    return problems
