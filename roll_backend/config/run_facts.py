"""What a run decides for each role's strategy (`RunFacts`), from the whole config: the one place the config layer
hands backend-neutral facts to the strategies, which check themselves against them (`problems`) and take their
run settings from them (`for_run`). Nothing here knows a strategy by name."""

from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import Any

from roll_backend import roles
from roll_backend.config.schema import PAIR_PIPELINES, PipelineConfig, RoleConfig
from roll_backend.strategies.base import RunFacts

TRAINED_ROLES = (roles.ACTOR_TRAIN, roles.CRITIC)
_TINY_FIELDS = (
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "num_experts",
    "num_experts_per_tok",
    "moe_intermediate_size",
    "shared_expert_intermediate_size",
)


def model_fields(config: PipelineConfig, model_path: str) -> dict[str, Any] | None:
    """A model's Hugging Face config fields: its config.json, or those of the tiny model the run builds there;
    None when neither is known (or config.json does not parse: the model-path check reports it)."""
    config_file = Path(model_path) / "config.json"
    if config_file.is_file():
        try:
            return json.loads(config_file.read_text())
        except (json.JSONDecodeError, UnicodeDecodeError):
            return None
    if config.build_tiny_model is not None and model_path == config.model_path:
        from roll_backend.models.tiny import TinyModelSpec

        known = TinyModelSpec.__dataclass_fields__
        spec = TinyModelSpec(**{k: v for k, v in config.build_tiny_model.items() if k in known})
        fields = {f: getattr(spec, f) for f in _TINY_FIELDS if getattr(spec, f, None) is not None}
        fields["model_type"] = spec.family
        fields["vocab_size"] = spec.model_vocab_size or _tokenizer_size(spec)
        fields["tie_word_embeddings"] = spec.tie_word_embeddings
        if not spec.family.endswith("_moe"):
            for name in (
                "num_experts",
                "num_experts_per_tok",
                "moe_intermediate_size",
                "shared_expert_intermediate_size",
            ):
                fields.pop(name, None)
        return fields
    return None


@functools.cache
def _char_tokenizer_size(alphabet: str) -> int:
    from roll_backend.models.tiny import build_char_tokenizer

    return len(build_char_tokenizer(alphabet))


def _tokenizer_size(spec) -> int:
    """The vocabulary of a tiny model's tokenizer: BPE's target size, or the characters of a char tokenizer."""
    return spec.vocab_size if spec.tokenizer == "bpe" else _char_tokenizer_size(spec.char_alphabet)


def responses_per_step(config: PipelineConfig) -> int:
    """Sequences the trainer sees per step: prompts x samples, examples (sft) or both rows of each pair."""
    if config.offline:
        return config.rollout_batch_size * (2 if config.pipeline in PAIR_PIPELINES else 1)
    return config.rollout_batch_size * config.num_return_sequences_in_group


def scores_values(config: PipelineConfig, name: str) -> bool:
    """The role's model ends in a value head: the critic, a reward model, and the model a reward_model run trains."""
    return name in (roles.CRITIC, roles.REWARD_MODEL) or (
        name == roles.ACTOR_TRAIN and config.pipeline == "reward_model"
    )


def optimizer_steps(config: PipelineConfig) -> int:
    """Optimizer steps over the whole run: ppo_epochs x mini-batches per step x max_steps."""
    step = responses_per_step(config)
    if config.offline:
        return max(1, config.max_steps)  # one optimizer step per batch
    mini = config.algorithm.ppo_mini_batch_size or step
    return max(1, config.max_steps * config.algorithm.ppo_epochs * max(1, step // max(1, mini)))


def train_batch_size(config: PipelineConfig) -> int:
    """Sequences per optimizer step: the PPO mini-batch, else the step's batch (offline: always the step's)."""
    step = responses_per_step(config)
    return step if config.offline else (config.algorithm.ppo_mini_batch_size or step)


def run_facts(config: PipelineConfig, name: str, role: RoleConfig | None = None) -> RunFacts:
    """The facts the run decides for role `name` (its RoleConfig from `config` unless given)."""
    role = role if role is not None else getattr(config, name)
    trains = name in TRAINED_ROLES
    hosted = hybrid_roles(config)
    resources = getattr(config, roles.ACTOR_TRAIN) if name in hosted else role  # a hybrid role runs on the trainer's
    syncs = name == roles.ACTOR_TRAIN and getattr(config, roles.ACTOR_INFER, None) is not None and not config.offline
    return RunFacts(
        role=name,
        layout=role.strategy.layout,
        world_size=role.world_size,
        device="cuda" if resources.num_gpus_per_rank > 0 else "cpu",
        samples_per_prompt=1 if config.offline else config.num_return_sequences_in_group,
        max_prompt_length=config.data.max_prompt_length,
        response_length=config.response_length,
        train_batch_size=train_batch_size(config) if trains else None,
        optimizer_steps=optimizer_steps(config) if trains else None,
        saves_checkpoints=trains and config.checkpoint.save_steps > 0,
        value_head=scores_values(config, name),
        score_head=name == roles.REWARD_MODEL,
        model_config=model_fields(config, role.model_path),
        multi_turn=config.agentic is not None,
        routed_experts=name == roles.ACTOR_INFER and replays_rollout_routes(config),
        adapter_rank=synced_adapter_rank(config) if name == roles.ACTOR_INFER else None,
        exports_adapters=name == roles.ACTOR_TRAIN and bool(config.checkpoint.export_peft_dir),
        hybrid=name in hosted or (name == roles.ACTOR_TRAIN and bool(hosted)),
        device_memory=int(config.device_memory_gib * 2**30) if config.device_memory_gib else None,
        weight_sync_bucket=config.weight_sync_bucket_bytes if syncs else None,
        # (the hybrid engine syncs in its process, adapter sync sends adapters whole: neither compares)
        weight_sync_delta=syncs
        and config.weight_sync_delta
        and roles.ACTOR_INFER not in hosted
        and synced_adapter_rank(config) is None,
        host_weight_copy=_host_weight_copy(config, name, hosted),
        expert_load=config.memory_plan_expert_load,
    )


def _host_weight_copy(config: PipelineConfig, name: str, hosted: tuple[str, ...]) -> str | None:
    """Which ranks of role `name` keep a host copy of the model for the weight sync: trainer rank 0 (what it sent) and
    every rollout rank (what it serves) under the minimal sync; every hybrid rank (its engine's) with the same
    setting; none with weight_sync_delta: false, adapter sync, or no rollout engine."""
    if config.offline or getattr(config, roles.ACTOR_INFER, None) is None or not config.weight_sync_delta:
        return None
    if synced_adapter_rank(config) is not None:
        return None
    if name == roles.ACTOR_TRAIN:
        return "every rank" if roles.ACTOR_INFER in hosted else "rank 0"
    return "every rank" if name == roles.ACTOR_INFER and name not in hosted else None


def hybrid_roles(config: PipelineConfig) -> tuple[str, ...]:
    """The roles that run in actor_train's processes (the hybrid engine), in the order their facets start."""
    return tuple(
        name
        for name in (roles.ACTOR_INFER, roles.REFERENCE, roles.CRITIC)
        if getattr(getattr(config, name, None), "hybrid", False)
    )


def synced_adapter_rank(config: PipelineConfig) -> int | None:
    """The rank of the LoRA adapters the actor sends the rollout (its strategy's lora.sync: adapter), else None."""
    actor = getattr(config, roles.ACTOR_TRAIN, None)
    lora = getattr(getattr(getattr(actor, "strategy", None), "config", None), "lora", None)
    return lora.rank if lora is not None and getattr(lora, "sync", None) == "adapter" else None


def replays_rollout_routes(config: PipelineConfig) -> bool:
    """The training actor replays the rollout's routes (router_replay R3 on a Megatron strategy)."""
    actor = getattr(config, roles.ACTOR_TRAIN, None)
    strategy = getattr(getattr(actor, "strategy", None), "config", None)
    return getattr(strategy, "router_replay", None) == "R3"
